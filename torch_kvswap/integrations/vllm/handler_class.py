"""``KVSwapOffloadingHandler``: vLLM 0.23's ``OffloadingHandler`` over a
:class:`~torch_kvswap.KVCacheOffloader`.

It subclasses vLLM's ``OffloadingHandler``, so importing this module imports
vLLM, after :func:`~.compat.check_handler_vllm` has accepted its release's
handler interface (an :class:`~.compat.UnsupportedVLLM` otherwise). Users
reach the class through the package (``torch_kvswap.integrations.vllm.
KVSwapOffloadingHandler``), which imports this module on first lookup;
:mod:`.offloading_handler` holds the vLLM-free parts and the usage.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .compat import check_handler_vllm
from .offloading_handler import LOAD, STORE, _medium

_worker = check_handler_vllm()  # vllm.v1.kv_offload.worker.worker

from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402 - after the interface check
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from ...offloader import KVCacheOffloader  # noqa: E402
from ...offloader.planning import as_job_id as _as_job_id  # noqa: E402

logger = logging.getLogger("torch_kvswap")

__all__ = ["KVSwapOffloadingHandler"]


class KVSwapOffloadingHandler(_worker.OffloadingHandler):
    """vLLM ``OffloadingHandler`` for GPU->CPU stores and CPU->GPU loads.

    Args:
        gpu_block_size: tokens per device block.
        cpu_block_size: tokens per host block, a multiple of
            ``gpu_block_size`` (``factor = cpu_block_size // gpu_block_size``).
        num_cpu_blocks: host blocks to allocate.
        gpu_caches: the KV cache per layer, ``{name: (key, value)}`` or
            ``{name: kv}`` with ``kv[0]``/``kv[1]`` the key and value caches
            (dim 0 of each indexes blocks); CUDA, NPU or, with no
            accelerator, CPU tensors.
        attn_backends: accepted for the reference handler's signature;
            the layout is read from the tensors, so it is not used.
        groups: KV-cache groups as indices into the flattened
            ``[layer0 K, layer0 V, layer1 K, ...]`` tensors
            (:class:`KVCacheOffloader`'s ``groups``); default one group.
        strict: refuse loads of host blocks no store has written.

    Every layer's key and value cache get a host mirror of
    ``num_cpu_blocks * factor`` device-block rows. A job's device spec
    is a ``GPULoadStoreSpec``: ``group_sizes`` splits its ids by group
    and ``block_indices[g] % factor`` is the sub-block of the first host
    block where group ``g`` starts, as in vLLM's own CPU handler; for the
    reference handler's jobs (a store that ends on a host-block boundary,
    a load of whole host blocks) that is the sub-block it skips too.

    :meth:`get_finished` reports vLLM's ``TransferResult`` with the
    job's spec media as ``transfer_type``; a job whose copy failed is
    reported with ``success=False`` (and logged with its cause).
    """

    def __init__(
        self,
        gpu_block_size: int,
        cpu_block_size: int,
        num_cpu_blocks: int,
        gpu_caches: Mapping[str, Any],
        attn_backends: Mapping[str, Any] | None = None,
        *,
        groups: Sequence[Sequence[int]] | None = None,
        strict: bool = False,
    ) -> None:
        if not isinstance(gpu_caches, Mapping):
            raise TypeError(
                "gpu_caches must be a mapping of layer name to its (key, value) "
                f"caches, got {type(gpu_caches).__name__}"
            )
        for name, kv in gpu_caches.items():
            if isinstance(kv, torch.Tensor) and (kv.dim() < 2 or kv.shape[0] != 2):
                raise ValueError(
                    f"gpu_caches[{name!r}] must be a (key, value) pair or a tensor "
                    f"whose dim 0 (of size 2) picks key and value, got shape "
                    f"{tuple(kv.shape)}"
                )
        self.offloader = KVCacheOffloader(
            gpu_caches,
            gpu_block_size,
            cpu_block_size,
            num_cpu_blocks,
            kv_stacked=True,
            groups=groups,
            strict=strict,
        )
        #: device blocks per host block
        self.block_size_factor = self.offloader.factor
        self._media: dict[int, tuple[str, str]] = {}

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        """Queue one job: ``spec = (src, dst)``, a ``(GPULoadStoreSpec,
        CPULoadStoreSpec)`` store or a ``(CPULoadStoreSpec,
        GPULoadStoreSpec)`` load. Returns True once queued; raises before
        any copy on a bad spec (vLLM's worker then reports the job as not
        submitted)."""
        if not isinstance(spec, tuple) or len(spec) != 2:
            raise TypeError(f"spec must be a (src, dst) tuple, got {spec!r}")
        src, dst = spec
        media = (_medium(src, "src"), _medium(dst, "dst"))
        if media == STORE:
            device, host = src, dst
        elif media == LOAD:
            host, device = src, dst
        else:
            raise ValueError(f"spec media must be {STORE} (a store) or {LOAD} (a load), got {media}")
        if not isinstance(device, GPULoadStoreSpec) or not isinstance(host, CPULoadStoreSpec):
            raise TypeError(
                "spec must pair vLLM's GPULoadStoreSpec with its CPULoadStoreSpec, "
                f"got {type(src).__name__} -> {type(dst).__name__}"
            )
        offsets = [int(b) % self.block_size_factor for b in device.block_indices]
        job_id = _as_job_id(job_id)
        if job_id in self._media:
            raise ValueError(f"job id {job_id} is already in flight or not yet reported")
        # Recorded first: on another thread the job may finish before submission returns.
        self._media[job_id] = media
        try:
            if media == STORE:
                self.offloader.store(
                    job_id, device.block_ids, host.block_ids, offsets=offsets, group_sizes=device.group_sizes
                )
            else:
                self.offloader.load(
                    job_id, host.block_ids, device.block_ids, offsets=offsets, group_sizes=device.group_sizes
                )
        except BaseException:
            del self._media[job_id]
            raise
        return True

    def get_finished(self) -> list[Any]:
        """vLLM ``TransferResult``s of the jobs finished since the last
        call (stores, then loads, each in submission order); never blocks."""
        results = []
        for r in self.offloader.get_finished():
            media = self._media.pop(r.job_id)
            if not r.success:
                logger.error("kvswap: %s job %d failed: %s", "->".join(media), r.job_id, r.error)
            results.append(
                _worker.TransferResult(
                    job_id=r.job_id,
                    success=r.success,
                    transfer_size=r.transfer_size,
                    transfer_time=r.transfer_time,
                    transfer_type=media,
                )
            )
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Block until the listed jobs of this handler finish. vLLM's
        worker gives every handler the whole set, so ids this handler does
        not hold are ignored, with or without ``strict``."""
        self.offloader.wait(job_ids, strict=False)

    def shutdown(self) -> None:
        """Finish the jobs in flight and release the host mirrors; idempotent."""
        self.offloader.shutdown()
