"""vLLM plug-in: an ``OffloadingSpec`` whose worker is a :class:`~torch_kvswap.KVCacheOffloader`.

Select it in ``vllm serve`` with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVSwapOffloadingSpec",
        "spec_module_path": "torch_kvswap.integrations.vllm", "cpu_bytes_to_use": 8000000000}}'

vLLM's own ``OffloadingConnector`` drives it. The scheduler side is vLLM's
CPU offloading (``CPUOffloadingSpec``: chunk allocation, eviction, sizing
from ``cpu_bytes_to_use``); only the worker side is replaced: the KV caches
vLLM registers are copied to and from page-aligned host mirrors by
``torch_kvswap.swap_blocks`` (CUDA, Ascend NPU, or the host engine on CPU).

vLLM is imported only when ``KVSwapOffloadingSpec`` or
``KVSwapOffloadingWorker`` is first looked up, and the interface this module
needs is checked then: a vLLM without it raises ``ImportError`` naming what
is missing. Supported: vLLM 0.33.x (see docs/vllm.md).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

__all__ = ["KVSwapOffloadingSpec", "KVSwapOffloadingWorker", "SUPPORTED_VLLM", "check_vllm"]

logger = logging.getLogger("torch_kvswap")

#: vLLM releases this plug-in is tested with (``major.minor``).
SUPPORTED_VLLM = ("0.33",)

_classes: dict[str, type] = {}


def check_vllm() -> Any:
    """Import vLLM's offloading interface and check the parts this plug-in uses.

    Returns the ``vllm.v1.kv_offload.base`` module. Raises ``ImportError``
    when vLLM is missing or lacks the interface (with what is missing).
    """
    try:
        import vllm
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.cpu import spec as cpu_spec
    except ImportError as exc:
        raise ImportError(
            "torch_kvswap.integrations.vllm needs vLLM's KV offloading interface "
            f"(vllm.v1.kv_offload, vLLM {' / '.join(v + '.x' for v in SUPPORTED_VLLM)}); "
            f"importing it failed: {exc}") from exc
    version = getattr(vllm, "__version__", "unknown")
    problems = []
    for name in ("OffloadingSpec", "OffloadingWorker", "GPULoadStoreSpec", "TransferResult",
                 "CanonicalKVCaches"):
        if not hasattr(base, name):
            problems.append(f"vllm.v1.kv_offload.base.{name} is missing")
    if not hasattr(cpu_spec, "CPUOffloadingSpec"):
        problems.append("vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec is missing")
    if not problems:
        worker = base.OffloadingWorker
        for meth, params in (("submit_store", ["job_id", "src_spec", "dst_spec"]),
                             ("submit_load", ["job_id", "src_spec", "dst_spec", "expedited"]),
                             ("get_finished", []), ("wait", ["job_ids"])):
            fn = getattr(worker, meth, None)
            got = list(inspect.signature(fn).parameters)[1:] if fn else None
            if got != params:
                problems.append(f"OffloadingWorker.{meth} takes {got}, expected {params}")
        gpu = list(inspect.signature(base.GPULoadStoreSpec.__init__).parameters)[1:]
        if gpu != ["block_ids", "group_sizes", "block_indices"]:
            problems.append(f"GPULoadStoreSpec takes {gpu}, expected "
                            "[block_ids, group_sizes, block_indices]")
        fields = set(getattr(base.TransferResult, "__dataclass_fields__", {}))
        if not {"job_id", "success", "transfer_size", "transfer_time"} <= fields:
            problems.append(f"TransferResult has fields {sorted(fields)}")
    if problems:
        raise ImportError(
            f"vLLM {version} does not have the offloading interface torch_kvswap.integrations.vllm "
            f"supports (vLLM {' / '.join(v + '.x' for v in SUPPORTED_VLLM)}): " + "; ".join(problems))
    if not any(version.startswith(v + ".") for v in SUPPORTED_VLLM):
        logger.warning("torch_kvswap.integrations.vllm is tested with vLLM %s.x, this is %s",
                       " / ".join(SUPPORTED_VLLM), version)
    return base


def _build() -> None:
    base = check_vllm()
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from ..handler import KVCacheOffloader

    class KVSwapOffloadingWorker(base.OffloadingWorker):
        """vLLM ``OffloadingWorker`` backed by a :class:`KVCacheOffloader`.

        Args:
            kv_caches: vLLM's ``CanonicalKVCaches``: tensors of shape
                ``(num_blocks, ...)`` (any dtype, one device: CUDA, NPU or CPU)
                with their page size in bytes, and per KV-cache group the
                tensors the group's layers live in.
            blocks_per_chunk: device blocks per host chunk (vLLM's CPU chunk).
            num_chunks: host chunks to allocate (vLLM's ``num_chunks``, from
                ``cpu_bytes_to_use``).

        Every cache tensor gets a host mirror of ``num_chunks`` chunks; a
        group's block ids move only its own tensors, and only the un-padded
        bytes of each page (the largest un-padded size among the layers that
        share the tensor). Stores, loads and expedited loads each have their
        own lane, in submission order.
        """

        def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int) -> None:
            widths = [0] * len(kv_caches.tensors)
            groups = []
            for refs in kv_caches.group_data_refs:
                members: list[int] = []
                for ref in refs:
                    widths[ref.tensor_idx] = max(widths[ref.tensor_idx], int(ref.page_size_bytes))
                    if ref.tensor_idx not in members:
                        members.append(ref.tensor_idx)
                groups.append(members)
            tensors = []
            for i, ck in enumerate(kv_caches.tensors):
                t = ck.tensor
                page = int(ck.page_size_bytes)
                if t.dtype != torch.int8:
                    t = t.view(torch.int8)
                t = t.view(t.shape[0], -1) if t.dim() != 2 else t  # a view: never a copy
                if t.shape[1] < page:
                    raise ValueError(f"kv_caches.tensors[{i}] has {t.shape[1]} bytes per block, "
                                     f"its page_size_bytes is {page}")
                tensors.append(t[:, :widths[i] or page])
            if num_chunks < 1:
                raise ValueError("cpu_bytes_to_use holds no chunk of this model's KV cache: "
                                 "raise it in kv_connector_extra_config")
            self.offloader = KVCacheOffloader(tensors, 1, blocks_per_chunk, num_chunks,
                                              kv_stacked=False, groups=groups)
            self.blocks_per_chunk = blocks_per_chunk

        def _offsets(self, gpu_spec: Any) -> list[int]:
            return [int(b) % self.blocks_per_chunk for b in gpu_spec.block_indices]

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            """Device blocks ``src_spec`` (GPULoadStoreSpec) -> host chunks ``dst_spec``."""
            return self.offloader.store(job_id, src_spec.block_ids, dst_spec.block_ids,
                                        offsets=self._offsets(src_spec),
                                        group_sizes=src_spec.group_sizes)

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any,
                        expedited: bool = False) -> bool:
            """Host chunks ``src_spec`` -> device blocks ``dst_spec`` (GPULoadStoreSpec);
            ``expedited`` loads run on their own lane."""
            return self.offloader.load(job_id, src_spec.block_ids, dst_spec.block_ids,
                                       offsets=self._offsets(dst_spec),
                                       group_sizes=dst_spec.group_sizes, expedited=expedited)

        def get_finished(self) -> list[Any]:
            """Finished jobs as vLLM ``TransferResult``s; never blocks. A failed
            job is reported with ``success=False`` (vLLM 0.33 then raises)."""
            out = []
            for r in self.offloader.get_finished():
                if not r.success:
                    logger.error("kvswap: vLLM job %d failed: %s", r.job_id, r.error)
                out.append(base.TransferResult(job_id=r.job_id, success=r.success,
                                               transfer_size=r.transfer_size,
                                               transfer_time=r.transfer_time))
            return out

        def wait(self, job_ids: set[int]) -> None:
            self.offloader.wait(job_ids)

        def shutdown(self) -> None:
            self.offloader.shutdown()

    class KVSwapOffloadingSpec(CPUOffloadingSpec):
        """vLLM ``OffloadingSpec``: vLLM's CPU manager, a torch_kvswap worker.

        ``kv_connector_extra_config`` keys are those of vLLM's CPU offloading
        (``cpu_bytes_to_use`` required; ``blocks_per_chunk`` or ``block_size``;
        ``eviction_policy``) plus ``spec_name`` / ``spec_module_path``. The
        host buffer is private to each worker (no shared region, so no
        replicated layout); ``canonical_layout`` is not supported.
        """

        def _uses_shared_region(self) -> bool:
            return False

        def get_worker(self, kv_caches: Any) -> Any:
            if self.config.canonical_layout:
                raise ValueError("KVSwapOffloadingSpec does not support canonical_layout; "
                                 "remove it from kv_connector_extra_config")
            if self._worker is None:
                self._worker = KVSwapOffloadingWorker(kv_caches, self.blocks_per_chunk,
                                                      self.num_chunks)
            return self._worker

    for cls in (KVSwapOffloadingWorker, KVSwapOffloadingSpec):
        cls.__qualname__ = cls.__name__
        _classes[cls.__name__] = cls


def __getattr__(name: str) -> type:
    if name in ("KVSwapOffloadingSpec", "KVSwapOffloadingWorker"):
        if not _classes:
            _build()
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
