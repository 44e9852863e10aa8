"""vLLM's ``OffloadingConnector`` path: an ``OffloadingSpec`` whose worker is a
:class:`~torch_kvswap.KVCacheOffloader`.

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

This module needs no vLLM: it holds what the classes share (the extra-config
keys, the views of vLLM's caches, the shared host regions) and the release
differences they read (the host chunk count's name, the region's parameter
names). The classes that subclass vLLM's live in :mod:`.offloading_spec`
(``KVSwapOffloadingSpec``, ``KVSwapOffloadingWorker``) and
:mod:`.tiering_spec` (``KVSwapTieringOffloadingSpec``), imported by
:func:`build` when the package is asked for one; the worker's host mirrors in
vLLM's regions in :mod:`.host_layouts`.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .compat import CHECK_KEY, chunk_count_names
from .p2p import LOOKUP_TIMEOUT_KEY

__all__ = ["build", "TransferFailed", "SUPPORTED_EXTRA_CONFIG", "SUPPORTED_TIERING_EXTRA_CONFIG"]

#: ``kv_connector_extra_config`` keys the spec accepts: vLLM's
#: ``OffloadingConnector`` and CPU offloading keys that leave the worker's
#: host layout alone. Any other key is refused when the spec is built.
SUPPORTED_EXTRA_CONFIG = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "cpu_bytes_to_use",
        "block_size",
        "blocks_per_chunk",
        "eviction_policy",
        "cache_policy_module_path",
        "store_threshold",
        "max_tracker_size",
        "offload_prompt_only",
        "backpressure",
        "enable_telemetry",
        "self_describing_kv_events",
        "sync_load_budget_bytes",
        "tier_poll_interval_s",
        CHECK_KEY,
    }
)

#: ``kv_connector_extra_config`` keys ``KVSwapTieringOffloadingSpec`` accepts:
#: those of :data:`SUPPORTED_EXTRA_CONFIG`, vLLM's ``secondary_tiers`` and
#: ``p2p_lookup_timeout_s`` (:mod:`.p2p`),
#: less ``kvswap_check`` (refused with its own error: chunks promoted from a
#: secondary tier are written by vLLM's scheduler, not by a store this
#: package saw, and checked mode would refuse to load them).
SUPPORTED_TIERING_EXTRA_CONFIG = (SUPPORTED_EXTRA_CONFIG - {CHECK_KEY}) | {
    "secondary_tiers",
    LOOKUP_TIMEOUT_KEY,
}


class TransferFailed(RuntimeError):
    """An offloading job failed: vLLM must not use the blocks it was to fill."""


def _ids(ids: Any) -> str:
    v = [int(i) for i in ids]
    return str(v) if len(v) <= 8 else f"[{', '.join(map(str, v[:8]))}, ... {len(v)} ids]"


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

        raise UnsupportedVLLM(
            f"KVSwapTieringOffloadingSpec needs the worker's rank in vLLM's "
            f"OffloadingConfig (config.parallel.rank, vLLM 0.26 on); "
            f"vLLM {vllm.__version__} here has no config.parallel"
        )
    rank = 0 if getattr(spec, "replicated_layout", False) else int(parallel.rank)
    region_cls, _, kw = _region_arguments(spec, rank)
    return region_cls(**kw)


def _refuse_unknown(name: str, config: Any, extra: dict, supported: frozenset) -> None:
    """Refuses ``canonical_layout`` (on the config or in the extra keys) and
    every extra key outside ``supported``, naming them."""
    if getattr(config, "canonical_layout", False) or extra.get("canonical_layout"):
        raise ValueError(
            f"{name} does not support canonical_layout; remove it from kv_connector_extra_config"
        )
    unknown = sorted(set(extra) - supported - {"canonical_layout"})
    if unknown:
        raise ValueError(
            f"{name} does not support kv_connector_extra_config "
            f"keys {unknown}; supported: {sorted(supported)}"
        )


def _host_chunks(spec: Any) -> int:
    """The host chunk count vLLM's CPUOffloadingSpec computed: ``num_chunks``
    from vLLM 0.30 on, ``num_blocks`` (the same count) in 0.25 to 0.29
    (:func:`~.compat.chunk_count_names`)."""
    names = chunk_count_names()
    for name, _ in names:
        if isinstance(getattr(spec, name, None), int):
            return getattr(spec, name)
    raise TypeError(
        f"{type(spec).__name__}: vLLM's CPUOffloadingSpec set neither "
        + " nor ".join(f"{name} (vLLM {releases})" for name, releases in names)
    )


def _blocks_per_chunk(spec: Any) -> int:
    """Device blocks per host chunk as vLLM's CPUOffloadingSpec computed it:
    ``blocks_per_chunk`` from vLLM 0.26 on, ``block_size_factor`` in 0.25."""
    for name in ("blocks_per_chunk", "block_size_factor"):
        if isinstance(getattr(spec, name, None), int):
            return getattr(spec, name)
    raise TypeError(
        f"{type(spec).__name__}: vLLM's CPUOffloadingSpec set neither blocks_per_chunk "
        "(vLLM 0.26+) nor block_size_factor (vLLM 0.25)"
    )


def extra_config_of(config: Any) -> dict:
    """``kv_connector_extra_config`` of what vLLM builds a spec from: its
    ``OffloadingConfig`` (0.26 on) or its ``VllmConfig`` (0.25)."""
    if hasattr(config, "kv_transfer_config"):
        return dict(config.kv_transfer_config.kv_connector_extra_config or {})
    return dict(getattr(config, "extra_config", None) or {})


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
    under the release's names (0.25 to 0.29 count blocks, 0.30 on chunks)."""
    import inspect

    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    accepted = inspect.signature(SharedOffloadRegion.__init__).parameters
    count = "num_chunks" if "num_chunks" in accepted else "num_blocks"
    row = "kv_bytes_per_chunk" if "kv_bytes_per_chunk" in accepted else "kv_bytes_per_block"
    return (
        SharedOffloadRegion,
        accepted,
        {
            "engine_id": spec.config.engine_id,
            count: _host_chunks(spec),
            "rank": rank,
            row: spec.kv_bytes_per_chunk,
            "cpu_page_size": spec.cpu_page_size_per_worker,
        },
    )


def _cache_views(kv_caches: Any) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The offloader's view of vLLM's ``CanonicalKVCaches``: per cache tensor
    an int8 ``[num_blocks, width]`` view (never a copy) of the un-padded bytes
    of each page (the largest page size among the layers that share it), and
    per KV-cache group the indices of the tensors its layers live in."""
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
            raise ValueError(
                f"kv_caches.tensors[{i}] has {t.shape[1]} bytes per block, its page_size_bytes is {page}"
            )
        tensors.append(t[:, : widths[i] or page])
    return tensors, groups


def build() -> dict[str, type]:
    """The plug-in classes by name, on the installed vLLM: importing their
    modules checks vLLM's interface (:mod:`.offloading_spec`; once, as any
    import). Where ``KVSwapTieringOffloadingSpec``'s module is refused
    (:func:`~.compat.check_tiering_vllm`), its entry is that ``ImportError``,
    raised when the class is looked up."""
    spec = importlib.import_module(f"{__package__}.offloading_spec")
    classes = {
        "KVSwapOffloadingWorker": spec.KVSwapOffloadingWorker,
        "KVSwapOffloadingSpec": spec.KVSwapOffloadingSpec,
    }
    try:
        tiering = importlib.import_module(f"{__package__}.tiering_spec")
    except ImportError as exc:  # refused at lookup, with its cause
        classes["KVSwapTieringOffloadingSpec"] = exc
        return classes
    classes["KVSwapTieringOffloadingSpec"] = tiering.KVSwapTieringOffloadingSpec
    return classes
