"""vLLM 0.23's ``OffloadingHandler`` interface over a :class:`~torch_kvswap.KVCacheOffloader`.

vLLM 0.23 (and 0.24) route offloading jobs through
``vllm.v1.kv_offload.worker.worker.OffloadingWorker``: an offloading spec
yields ``(src_spec_cls, dst_spec_cls, handler)`` triples, the worker registers
each with ``register_handler`` and sends every job to the handler of its
``(src.medium(), dst.medium())`` pair. :class:`KVSwapOffloadingHandler` is
such a handler for both directions, built as the reference handler is::

    handler = KVSwapOffloadingHandler(gpu_block_size=16, cpu_block_size=32,
                                      num_cpu_blocks=1024, gpu_caches=kv_caches)
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)  # stores
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handler)  # loads

What vLLM calls here: ``transfer_async(job_id, (src, dst))``,
``get_finished()``, ``wait(job_ids)`` (every handler gets the worker's whole
set) and ``shutdown()``. From vLLM 0.25 on the interface is gone; use
``KVSwapOffloadingSpec`` (:mod:`.offloading_spec`) there.

The class subclasses vLLM's ``OffloadingHandler``, so it lives in
:mod:`.handler_class`, which imports vLLM; this module holds the vLLM-free
parts and imports that one on first use (:func:`build`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["build", "STORE", "LOAD"]

#: The ``(src.medium(), dst.medium())`` pairs the handler serves.
STORE = ("GPU", "CPU")
LOAD = ("CPU", "GPU")


def build() -> dict[str, type]:
    """``{"KVSwapOffloadingHandler": cls}`` on the installed vLLM: importing
    :mod:`.handler_class` checks vLLM's handler interface (once, as any import)."""
    module = importlib.import_module(f"{__package__}.handler_class")
    return {"KVSwapOffloadingHandler": module.KVSwapOffloadingHandler}


def _medium(spec: Any, name: str) -> str:
    medium = getattr(spec, "medium", None)
    if not callable(medium):
        raise TypeError(
            f"spec's {name} must be a vLLM LoadStoreSpec (with medium()), got {type(spec).__name__}"
        )
    return str(medium())
