"""``KVSwapOffloadingSpec`` and its worker: the classes vLLM's ``OffloadingConnector`` builds.

They subclass vLLM's ``OffloadingWorker`` and ``CPUOffloadingSpec``, so
importing this module imports vLLM, after :func:`~.compat.check_vllm` has
accepted its release's interface (an :class:`~.compat.UnsupportedVLLM`
otherwise). Users name the classes through the package
(``spec_module_path: "torch_kvswap.integrations.vllm"``), which imports this
module on first lookup; :mod:`.offloading` holds the vLLM-free parts and the
release differences the classes read.
"""

from __future__ import annotations

import weakref
from typing import Any

from .compat import apply_check_option, check_vllm
from .host_layouts import ChunkMajorOffloader, SharedRegionOffloader, region_base
from .offloading import (
    SUPPORTED_EXTRA_CONFIG,
    TransferFailed,
    _blocks_per_chunk,
    _cache_views,
    _capacity_source,
    _host_chunks,
    _ids,
    _refuse_unknown,
    _shared_region,
    extra_config_of,
)

_offload_base = check_vllm("offloading")  # vllm.v1.kv_offload.base

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402 - after the interface check

from torch_kvswap import KVCacheOffloader  # noqa: E402

__all__ = ["KVSwapOffloadingWorker", "KVSwapOffloadingSpec"]


class KVSwapOffloadingWorker(_offload_base.OffloadingWorker):
    """vLLM ``OffloadingWorker`` backed by a :class:`KVCacheOffloader`.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches``: tensors of shape
            ``(num_blocks, ...)`` (any dtype, one device: CUDA, NPU or CPU)
            with their page size in bytes, and per KV-cache group the
            tensors the group's layers live in.
        blocks_per_chunk: device blocks per host chunk (vLLM's CPU chunk).
        num_chunks: host chunks to allocate (vLLM's ``num_chunks``, 0.25 to
            0.29's ``num_blocks``, from ``cpu_bytes_to_use``).

    Every cache tensor gets a host mirror of ``num_chunks`` chunks; a
    group's block ids move only its own tensors, and only the un-padded
    bytes of each page (the largest un-padded size among the layers that
    share the tensor). Stores, loads and expedited loads each have their
    own lane, in submission order.

    A job that fails raises :class:`TransferFailed` from
    :meth:`get_finished`, naming the job, its copy and the cause: vLLM
    stops the engine step there, with or without ``python -O`` (vLLM
    itself only ``assert``\\ s a result's ``success``).

    ``capacity_source`` names what sized the host memory in the error
    raised when it holds no chunk.

    ``tiering_region`` (``KVSwapTieringOffloadingSpec``): vLLM's shared
    region of this rank, whose slot holds the mirrors in vLLM's
    chunk-major layout (one device block per chunk), so that vLLM's
    secondary tiers read and write the same bytes; ``slot_bytes`` is the
    slot's size per chunk (``cpu_page_size_per_worker``). Checked mode's
    tracker is off for it (chunks promoted from a tier were never stored
    here).
    """

    def __init__(
        self,
        kv_caches: Any,
        blocks_per_chunk: int,
        num_chunks: int,
        shared_region: Any = None,
        capacity_source: str = "cpu_bytes_to_use in kv_connector_extra_config",
        *,
        tiering_region: Any = None,
        slot_bytes: int = 0,
    ) -> None:
        tensors, groups = _cache_views(kv_caches)
        if num_chunks < 1:
            raise ValueError(
                f"{capacity_source} holds no chunk of this model's KV cache "
                f"({blocks_per_chunk} blocks of every cache tensor): raise it"
            )
        if tiering_region is not None:
            if shared_region is not None:
                raise ValueError("give shared_region or tiering_region, not both")
            pages = [int(ck.page_size_bytes) * blocks_per_chunk for ck in kv_caches.tensors]
            self.offloader = ChunkMajorOffloader(
                tensors,
                1,
                blocks_per_chunk,
                num_chunks,
                kv_stacked=False,
                groups=groups,
                check=False,
                region=tiering_region,
                pages=pages,
                slot_bytes=slot_bytes,
            )
            shared_region = tiering_region
        elif shared_region is None:
            self.offloader = KVCacheOffloader(
                tensors, 1, blocks_per_chunk, num_chunks, kv_stacked=False, groups=groups
            )
        else:
            self.offloader = SharedRegionOffloader(
                tensors,
                1,
                blocks_per_chunk,
                num_chunks,
                kv_stacked=False,
                groups=groups,
                host_buffer=region_base(shared_region),
            )
        #: vLLM's SharedOffloadRegion (replicated layout, or tiering), else None
        self.shared_region = shared_region
        # The region's map (and its /dev/shm file, where this map created it)
        # is released at shutdown, or when the process exits without one.
        self._release_region = (
            weakref.finalize(self, shared_region.cleanup) if shared_region is not None else None
        )
        self.blocks_per_chunk = blocks_per_chunk
        # job id -> (kind, device spec, host spec) until reported, to name a failed copy
        self._jobs: dict[int, tuple[str, Any, Any]] = {}

    def _offsets(self, gpu_spec: Any) -> list[int]:
        return [int(b) % self.blocks_per_chunk for b in gpu_spec.block_indices]

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Device blocks ``src_spec`` (GPULoadStoreSpec) -> host chunks ``dst_spec``."""
        ok = self.offloader.store(
            job_id,
            src_spec.block_ids,
            dst_spec.block_ids,
            offsets=self._offsets(src_spec),
            group_sizes=src_spec.group_sizes,
        )
        self._jobs[job_id] = ("store", src_spec, dst_spec)
        return ok

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        """Host chunks ``src_spec`` -> device blocks ``dst_spec`` (GPULoadStoreSpec);
        ``expedited`` loads (vLLM 0.33's sync loads) run on their own lane."""
        ok = self.offloader.load(
            job_id,
            src_spec.block_ids,
            dst_spec.block_ids,
            offsets=self._offsets(dst_spec),
            group_sizes=dst_spec.group_sizes,
            expedited=expedited,
        )
        self._jobs[job_id] = ("expedited load" if expedited else "load", dst_spec, src_spec)
        return ok

    def get_finished(self) -> list[Any]:
        """Finished jobs as vLLM ``TransferResult``s; never blocks.

        Raises :class:`TransferFailed` for a failed job (after the jobs
        finished before it were handed over in earlier calls)."""
        out = []
        for r in self.offloader.get_finished():
            kind, dev, host = self._jobs.pop(r.job_id, ("job", None, None))
            if not r.success:
                copy = (
                    f"{kind} of device blocks {_ids(dev.block_ids)} "
                    f"{'->' if kind == 'store' else '<-'} host chunks {_ids(host.block_ids)}"
                    if dev is not None
                    else kind
                )
                raise TransferFailed(f"kvswap: vLLM offloading job {r.job_id} failed: {copy}: {r.error}")
            out.append(
                _offload_base.TransferResult(
                    job_id=r.job_id,
                    success=True,
                    transfer_size=r.transfer_size,
                    transfer_time=r.transfer_time,
                )
            )
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.offloader.wait(job_ids)

    def shutdown(self) -> None:
        self.offloader.shutdown()
        if self._release_region is not None:
            self._release_region()
            self.shared_region = None


class KVSwapOffloadingSpec(CPUOffloadingSpec):
    """vLLM ``OffloadingSpec``: vLLM's CPU manager, a torch_kvswap worker.

    ``kv_connector_extra_config`` keys are those of vLLM's CPU offloading
    (``cpu_bytes_to_use`` required, or vLLM's ``--kv-offloading-size``;
    ``blocks_per_chunk`` or ``block_size``; ``eviction_policy``, ...; see
    :data:`SUPPORTED_EXTRA_CONFIG`) plus ``spec_name`` /
    ``spec_module_path``. Any other key, and ``canonical_layout``, is
    refused here, when the spec is built. ``"kvswap_check": true`` turns
    checked mode on (docs/checked.md).

    Host memory: where vLLM's own spec uses its replicated layout (MLA
    under tensor parallelism on CUDA: every rank's KV is the same), the
    workers share vLLM's one-copy host region and the spec holds as many
    chunks as vLLM's; otherwise each worker has a private buffer of its
    share of ``cpu_bytes_to_use``, again as many chunks as vLLM's.
    """

    def __init__(self, config: Any, *kv_cache_config: Any) -> None:
        # vLLM 0.26 on builds the spec from one OffloadingConfig; 0.25 from
        # (vllm_config, kv_cache_config).
        extra = extra_config_of(config)
        _refuse_unknown("KVSwapOffloadingSpec", config, extra, SUPPORTED_EXTRA_CONFIG)
        apply_check_option(extra)
        super().__init__(config, *kv_cache_config)
        # Read while the engine's config is current (the spec is built in
        # the worker's connector), for the error of a too small capacity.
        self._capacity_source = _capacity_source()

    def get_worker(self, kv_caches: Any) -> Any:
        if self._worker is None:
            chunks = _host_chunks(self)
            region = (
                _shared_region(self) if getattr(self, "replicated_layout", False) and chunks > 0 else None
            )
            try:
                self._worker = KVSwapOffloadingWorker(
                    kv_caches, _blocks_per_chunk(self), chunks, region, self._capacity_source
                )
            except Exception:
                if region is not None:
                    region.cleanup()
                raise
        return self._worker
