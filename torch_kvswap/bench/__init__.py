"""Benchmarks and the demo, each runnable with ``python -m``.

- ``python -m torch_kvswap.bench``: block-copy throughput against a
  contiguous copy and the usual alternatives (:mod:`.throughput`);
- ``python -m torch_kvswap.bench.demo``: the offloader storing and loading a
  KV cache, every byte verified (:mod:`.demo`; ``bash scripts/demo.sh``);
- ``python -m torch_kvswap.bench.polling``: a worker polling
  ``get_finished`` against one waiting for the same jobs (:mod:`.polling`);
- ``python -m torch_kvswap.bench.vllm_backend``: vLLM's simple-offload copy
  backends side by side on CPU (:mod:`.vllm_backend`).

Nothing here is imported by ``import torch_kvswap``.
"""
