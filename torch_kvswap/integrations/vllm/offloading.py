"""vLLM's ``OffloadingConnector`` path: an ``OffloadingSpec`` whose worker is a :class:`~torch_kvswap.KVCacheOffloader`.

Select it in ``vllm serve`` with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVSwapOffloadingSpec",
        "spec_module_path": "torch_kvswap.integrations.vllm", "cpu_bytes_to_use": 8000000000}}'

or size it with vLLM's ``--kv-offloading-size GiB`` and name only the spec in
``kv_connector_extra_config``.

vLLM's own ``OffloadingConnector`` drives it. The scheduler side is vLLM's
CPU offloading (``CPUOffloadingSpec``: chunk allocation, eviction, sizing
from ``cpu_bytes_to_use``); only the worker side is replaced: the KV caches
vLLM registers are copied to and from page-aligned host mirrors by
``torch_kvswap.swap_blocks`` (CUDA, Ascend NPU, or the host engine on CPU).

What vLLM calls here, per release (``compat.py`` checks it): the spec is
built with an ``OffloadingConfig`` and asked for ``get_manager()`` and
``get_worker(kv_caches)``; the worker gets ``submit_store(job_id, src, dst)``,
``submit_load(job_id, src, dst[, expedited])`` (``expedited`` from 0.33 on),
``get_finished()``, ``wait(job_ids)`` and ``shutdown()``.
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import CHECK_KEY, apply_check_option, check_vllm

__all__ = ["build", "TransferFailed", "SUPPORTED_EXTRA_CONFIG", "SUPPORTED_TIERING_EXTRA_CONFIG"]

#: ``kv_connector_extra_config`` keys the spec accepts: vLLM's
#: ``OffloadingConnector`` and CPU offloading keys that leave the worker's
#: host layout alone. Any other key is refused when the spec is built.
SUPPORTED_EXTRA_CONFIG = frozenset({
    "spec_name", "spec_module_path", "cpu_bytes_to_use", "block_size", "blocks_per_chunk",
    "eviction_policy", "cache_policy_module_path", "store_threshold", "max_tracker_size",
    "offload_prompt_only", "backpressure", "enable_telemetry", "self_describing_kv_events",
    "sync_load_budget_bytes", "tier_poll_interval_s", CHECK_KEY,
})

#: ``kv_connector_extra_config`` keys ``KVSwapTieringOffloadingSpec`` accepts:
#: those of :data:`SUPPORTED_EXTRA_CONFIG` and vLLM's ``secondary_tiers``,
#: less ``kvswap_check`` (refused with its own error: chunks promoted from a
#: secondary tier are written by vLLM's scheduler, not by a store this
#: package saw, and checked mode would refuse to load them).
SUPPORTED_TIERING_EXTRA_CONFIG = (SUPPORTED_EXTRA_CONFIG - {CHECK_KEY}) | {"secondary_tiers"}


class TransferFailed(RuntimeError):
    """An offloading job failed: vLLM must not use the blocks it was to fill."""


def _ids(ids: Any) -> str:
    v = [int(i) for i in ids]
    return str(v) if len(v) <= 8 else f"[{', '.join(map(str, v[:8]))}, ... {len(v)} ids]"


def _shared_region_offloader() -> type:
    from ...offloader import KVCacheOffloader

    class SharedRegionOffloader(KVCacheOffloader):
        """A :class:`KVCacheOffloader` whose mirrors are carved from ``host_buffer``,
        back to back, instead of a private allocation: with vLLM's replicated
        layout every worker maps the same shared region and writes the same
        bytes to it (MLA's latent cache is identical on every TP rank), so the
        host memory holds one copy. The buffer is neither zeroed (a new shared
        region is zero) nor freed here; it is pinned in place on an
        accelerator and unpinned at shutdown."""

        def __init__(self, *args: Any, host_buffer: torch.Tensor, **kw: Any) -> None:
            self._host_buffer = host_buffer
            super().__init__(*args, **kw)

        def _allocate_mirrors(self, pin: bool):
            rows = self.num_host_blocks * self.factor
            need = rows * sum(self._block_bytes)
            region = self._host_buffer.view(torch.uint8).reshape(-1)
            self._host_buffer = None  # vLLM's region closes its mapping once no view is left
            if region.numel() < need:
                raise ValueError(f"the shared host region has {region.numel()} bytes; "
                                 f"{self.num_host_blocks} chunks of this worker need {need}")
            if pin:
                torch.ops.kvswap._host_register(region, self.device, True)
                self._registered = True
                self.pinned = True
            mirrors, off = [], 0
            for t, bb in zip(self.device_tensors, self._block_bytes):
                mirrors.append(region[off:off + rows * bb].view(t.dtype).view(rows, *t.shape[1:]))
                off += rows * bb
            return region, region, mirrors

    return SharedRegionOffloader


def _chunk_major_offloader() -> type:
    from ...offloader import KVCacheOffloader

    class ChunkMajorOffloader(KVCacheOffloader):
        """A :class:`KVCacheOffloader` whose mirrors are this rank's slot of
        vLLM's ``SharedOffloadRegion`` in vLLM's own chunk-major layout: row
        ``c`` of the region is host chunk ``c``; in it, this rank's slot
        starts at ``rank * cpu_page_size`` and holds every cache tensor's
        page back to back (``region.create_next_worker_view(page)`` per
        tensor, as vLLM's CPU worker takes them). Each mirror is the first
        ``width`` bytes of its tensor's page, with the region's row stride,
        so chunk ``c`` of every mirror lies inside ``primary_kv_view[c]``,
        the bytes vLLM's secondary tiers read and write. One device block
        per chunk only (``factor`` 1): a mirror row is then a chunk row."""

        def __init__(self, *args: Any, region: Any, pages: list[int], slot_bytes: int,
                     **kw: Any) -> None:
            self._region, self._pages, self._slot_bytes = region, pages, slot_bytes
            super().__init__(*args, **kw)

        def _allocate_mirrors(self, pin: bool):
            region, self._region = self._region, None  # the region's views are held by its owner
            if self.factor != 1:
                raise ValueError(f"the chunk-major host layout holds one device block per chunk, "
                                 f"got {self.factor} blocks per chunk")
            if sum(self._pages) > self._slot_bytes:
                raise ValueError(f"this rank's slot of the shared host region has {self._slot_bytes} "
                                 f"bytes per chunk; the cache tensors' pages need {sum(self._pages)}")
            mirrors = []
            for t, page in zip(self.device_tensors, self._pages):
                view = region.create_next_worker_view(page)
                if view.shape[0] < self.num_host_blocks or page < t.shape[1]:
                    raise ValueError(f"the shared host region's view is {tuple(view.shape)}; "
                                     f"{self.num_host_blocks} chunks of {t.shape[1]} bytes are needed")
                mirrors.append(view[:self.num_host_blocks, :t.shape[1]].view(t.dtype))
            base = region.base_tensor.view(torch.uint8)
            if pin:
                torch.ops.kvswap._host_register(base, self.device, True)
                self._registered = True
                self.pinned = True
            return base, base, mirrors

    return ChunkMajorOffloader


def _tiering_region(spec: Any) -> Any:
    """This worker's map of vLLM's shared host region, made as vLLM's
    TieringOffloadingSpec.create_worker makes it: no barrier (the file must
    outlive the workers' maps, for the scheduler's ``rank=None`` map of the
    same ``engine_id``), one segment, the rank's own slot (slot 0 under the
    replicated layout). The parameter names are the release's."""
    parallel = getattr(spec.config, "parallel", None)
    if parallel is None:
        import vllm

        from .compat import UnsupportedVLLM
        raise UnsupportedVLLM(f"KVSwapTieringOffloadingSpec needs the worker's rank in vLLM's "
                              f"OffloadingConfig (config.parallel.rank, vLLM 0.32 and 0.33); "
                              f"vLLM {vllm.__version__} here has no config.parallel")
    rank = 0 if getattr(spec, "replicated_layout", False) else int(parallel.rank)
    region_cls, _, kw = _region_arguments(spec, rank)
    return region_cls(**kw)


def _refuse_unknown(name: str, config: Any, extra: dict, supported: frozenset) -> None:
    """Refuses ``canonical_layout`` (on the config or in the extra keys) and
    every extra key outside ``supported``, naming them."""
    if getattr(config, "canonical_layout", False) or extra.get("canonical_layout"):
        raise ValueError(f"{name} does not support canonical_layout; "
                         "remove it from kv_connector_extra_config")
    unknown = sorted(set(extra) - supported - {"canonical_layout"})
    if unknown:
        raise ValueError(f"{name} does not support kv_connector_extra_config "
                         f"keys {unknown}; supported: {sorted(supported)}")


def _host_chunks(spec: Any) -> int:
    """The host chunk count vLLM's CPUOffloadingSpec computed: ``num_chunks``
    from vLLM 0.30 on, ``num_blocks`` (the same count) in 0.27 to 0.29."""
    for name in ("num_chunks", "num_blocks"):
        if isinstance(getattr(spec, name, None), int):
            return getattr(spec, name)
    raise TypeError(f"{type(spec).__name__}: vLLM's CPUOffloadingSpec set neither num_chunks "
                    "(vLLM 0.30+) nor num_blocks (vLLM 0.27-0.29)")


def _capacity_source() -> str:
    """What sized the host memory, for an error about it: vLLM's
    ``--kv-offloading-size`` when the engine's config has it (vLLM then
    writes ``cpu_bytes_to_use`` itself), else ``kv_connector_extra_config``."""
    try:
        from vllm.config import get_current_vllm_config
        size = get_current_vllm_config().cache_config.kv_offloading_size
    except Exception:  # noqa: BLE001 (no vLLM config here: the extra config sized it)
        size = None
    if size is not None:
        return f"--kv-offloading-size {size} (GiB)"
    return "cpu_bytes_to_use in kv_connector_extra_config"


def _shared_region(spec: Any) -> Any:
    """vLLM's shared host region for the replicated layout, made as vLLM's
    CPUOffloadingSpec.create_worker makes it: every worker maps the one-copy
    slot (rank 0), after a barrier over the worker group where the release
    has one."""
    from vllm.v1.kv_offload.cpu import spec as cpu_spec

    region_cls, accepted, kw = _region_arguments(spec, 0)
    if "barrier" in accepted:
        kw["barrier"] = cpu_spec._all_workers_barrier
    # 0.33 also splits the region into files and pre-faults one share per worker.
    if "num_segments" in accepted:
        kw["num_segments"] = getattr(cpu_spec, "_REGION_SEGMENTS", 1)
    if "populate_shard" in accepted:
        kw["populate_shard"] = (spec.config.parallel.rank, spec.config.parallel.world_size)
    return region_cls(**kw)


def _region_arguments(spec: Any, rank: int) -> tuple[type, Any, dict[str, Any]]:
    """vLLM's ``SharedOffloadRegion``, the parameters its constructor
    accepts, and the arguments every release takes, for ``rank``'s slot,
    under the release's names (0.27 to 0.29 count blocks, 0.30 on chunks)."""
    import inspect

    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    accepted = inspect.signature(SharedOffloadRegion.__init__).parameters
    count = "num_chunks" if "num_chunks" in accepted else "num_blocks"
    row = "kv_bytes_per_chunk" if "kv_bytes_per_chunk" in accepted else "kv_bytes_per_block"
    return SharedOffloadRegion, accepted, {
        "engine_id": spec.config.engine_id, count: _host_chunks(spec), "rank": rank,
        row: spec.kv_bytes_per_chunk, "cpu_page_size": spec.cpu_page_size_per_worker}


_classes: dict[str, type] = {}


def build() -> dict[str, type]:
    """The plug-in classes, built on the installed vLLM on first use."""
    if _classes:
        return _classes
    base = check_vllm("offloading")
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from ...offloader import KVCacheOffloader

    class KVSwapOffloadingWorker(base.OffloadingWorker):
        """vLLM ``OffloadingWorker`` backed by a :class:`KVCacheOffloader`.

        Args:
            kv_caches: vLLM's ``CanonicalKVCaches``: tensors of shape
                ``(num_blocks, ...)`` (any dtype, one device: CUDA, NPU or CPU)
                with their page size in bytes, and per KV-cache group the
                tensors the group's layers live in.
            blocks_per_chunk: device blocks per host chunk (vLLM's CPU chunk).
            num_chunks: host chunks to allocate (vLLM's ``num_chunks``, 0.27 to
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

        def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int,
                     shared_region: Any = None,
                     capacity_source: str = "cpu_bytes_to_use in kv_connector_extra_config",
                     *, tiering_region: Any = None, slot_bytes: int = 0) -> None:
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
                raise ValueError(f"{capacity_source} holds no chunk of this model's KV cache "
                                 f"({blocks_per_chunk} blocks of every cache tensor): raise it")
            if tiering_region is not None:
                if shared_region is not None:
                    raise ValueError("give shared_region or tiering_region, not both")
                pages = [int(ck.page_size_bytes) * blocks_per_chunk for ck in kv_caches.tensors]
                self.offloader = _chunk_major_offloader()(
                    tensors, 1, blocks_per_chunk, num_chunks, kv_stacked=False, groups=groups,
                    check=False, region=tiering_region, pages=pages, slot_bytes=slot_bytes)
                shared_region = tiering_region
            elif shared_region is None:
                self.offloader = KVCacheOffloader(tensors, 1, blocks_per_chunk, num_chunks,
                                                  kv_stacked=False, groups=groups)
            else:
                self.offloader = _shared_region_offloader()(
                    tensors, 1, blocks_per_chunk, num_chunks, kv_stacked=False, groups=groups,
                    host_buffer=shared_region.base_tensor)
            #: vLLM's SharedOffloadRegion (replicated layout, or tiering), else None
            self.shared_region = shared_region
            self.blocks_per_chunk = blocks_per_chunk
            # job id -> (kind, device spec, host spec) until reported, to name a failed copy
            self._jobs: dict[int, tuple[str, Any, Any]] = {}

        def _offsets(self, gpu_spec: Any) -> list[int]:
            return [int(b) % self.blocks_per_chunk for b in gpu_spec.block_indices]

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            """Device blocks ``src_spec`` (GPULoadStoreSpec) -> host chunks ``dst_spec``."""
            ok = self.offloader.store(job_id, src_spec.block_ids, dst_spec.block_ids,
                                      offsets=self._offsets(src_spec),
                                      group_sizes=src_spec.group_sizes)
            self._jobs[job_id] = ("store", src_spec, dst_spec)
            return ok

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any,
                        expedited: bool = False) -> bool:
            """Host chunks ``src_spec`` -> device blocks ``dst_spec`` (GPULoadStoreSpec);
            ``expedited`` loads (vLLM 0.33's sync loads) run on their own lane."""
            ok = self.offloader.load(job_id, src_spec.block_ids, dst_spec.block_ids,
                                     offsets=self._offsets(dst_spec),
                                     group_sizes=dst_spec.group_sizes, expedited=expedited)
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
                    copy = (f"{kind} of device blocks {_ids(dev.block_ids)} "
                            f"{'->' if kind == 'store' else '<-'} host chunks {_ids(host.block_ids)}"
                            if dev is not None else kind)
                    raise TransferFailed(f"kvswap: vLLM offloading job {r.job_id} failed: {copy}: "
                                         f"{r.error}")
                out.append(base.TransferResult(job_id=r.job_id, success=True,
                                               transfer_size=r.transfer_size,
                                               transfer_time=r.transfer_time))
            return out

        def wait(self, job_ids: set[int]) -> None:
            self.offloader.wait(job_ids)

        def shutdown(self) -> None:
            self.offloader.shutdown()
            if self.shared_region is not None:
                self.shared_region.cleanup()
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

        def __init__(self, config: Any) -> None:
            extra = dict(getattr(config, "extra_config", None) or {})
            _refuse_unknown("KVSwapOffloadingSpec", config, extra, SUPPORTED_EXTRA_CONFIG)
            apply_check_option(extra)
            super().__init__(config)
            # Read while the engine's config is current (the spec is built in
            # the worker's connector), for the error of a too small capacity.
            self._capacity_source = _capacity_source()

        def get_worker(self, kv_caches: Any) -> Any:
            if self._worker is None:
                chunks = _host_chunks(self)
                region = (_shared_region(self) if getattr(self, "replicated_layout", False)
                          and chunks > 0 else None)
                try:
                    self._worker = KVSwapOffloadingWorker(kv_caches, self.blocks_per_chunk,
                                                          chunks, region, self._capacity_source)
                except Exception:
                    if region is not None:
                        region.cleanup()
                    raise
            return self._worker

    classes = [KVSwapOffloadingWorker, KVSwapOffloadingSpec]
    try:
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    except ImportError:  # every supported release has it (0.27 on); a build without it has no tiering
        TieringOffloadingSpec = None
    if TieringOffloadingSpec is not None:
        classes.append(_tiering_spec(TieringOffloadingSpec, KVSwapOffloadingWorker))
    for cls in classes:
        cls.__qualname__ = cls.__name__
        cls.__module__ = "torch_kvswap.integrations.vllm"
        _classes[cls.__name__] = cls
    return _classes


def _tiering_spec(tiering_base: type, worker_cls: type) -> type:
    class KVSwapTieringOffloadingSpec(tiering_base):
        """vLLM's ``TieringOffloadingSpec`` (its manager, its secondary tiers:
        ``fs``, ``obj``, ``p2p``, ``kvcr`` or a ``module_path`` tier) over a
        torch_kvswap worker.

        ``kv_connector_extra_config``: :data:`SUPPORTED_TIERING_EXTRA_CONFIG`
        (``cpu_bytes_to_use`` and ``secondary_tiers`` as for vLLM's spec).
        Refused when the spec is built: any other key, ``canonical_layout``,
        ``kvswap_check`` (checked mode) and more than one device block per
        chunk (``blocks_per_chunk``/``block_size``).

        The worker maps the same ``/dev/shm`` region (one file per engine)
        as vLLM's scheduler, whose secondary tiers read and write it through
        ``primary_kv_view``; its host mirrors are laid out in that region as
        vLLM's own CPU worker lays out its copies (chunk-major, this rank's
        slot), so a chunk stored here is the chunk a tier writes to disk, and
        a chunk a tier promotes is the chunk loaded here. The manager is
        vLLM's, inherited.
        """

        def __init__(self, config: Any) -> None:
            extra = dict(getattr(config, "extra_config", None) or {})
            if CHECK_KEY in extra:
                raise ValueError(
                    f"KVSwapTieringOffloadingSpec does not support kv_connector_extra_config key "
                    f"{CHECK_KEY!r} (checked mode): chunks promoted from a secondary tier are "
                    f"written by vLLM's scheduler, not by a store this package saw, so checked "
                    f"mode would refuse to load them; remove it")
            _refuse_unknown("KVSwapTieringOffloadingSpec", config, extra, SUPPORTED_TIERING_EXTRA_CONFIG)
            super().__init__(config)
            if self.blocks_per_chunk != 1:
                given = ", ".join(f"{k}={extra[k]!r}" for k in ("block_size", "blocks_per_chunk")
                                  if k in extra) or "the default"
                raise ValueError(
                    f"KVSwapTieringOffloadingSpec supports one device block per chunk only "
                    f"(blocks_per_chunk 1, or block_size equal to the engine's block size); "
                    f"kv_connector_extra_config {given} gives {self.blocks_per_chunk}")
            self._capacity_source = _capacity_source()

        def get_worker(self, kv_caches: Any) -> Any:
            """The torch_kvswap worker over this rank's slot of the shared
            region (vLLM's own ``get_worker`` refuses CPU and NPU
            platforms)."""
            if self._worker is None:
                chunks = _host_chunks(self)
                if chunks < 1:
                    raise ValueError(f"{self._capacity_source} holds no chunk of this model's KV "
                                     "cache (1 block of every cache tensor): raise it")
                region = _tiering_region(self)
                try:
                    self._worker = worker_cls(kv_caches, 1, chunks,
                                              capacity_source=self._capacity_source,
                                              tiering_region=region,
                                              slot_bytes=self.cpu_page_size_per_worker)
                except Exception:
                    region.cleanup()
                    raise
            return self._worker

    return KVSwapTieringOffloadingSpec
