"""``KVSwapTieringOffloadingSpec``: vLLM's tiered offloading over the torch_kvswap worker.

It subclasses vLLM's ``TieringOffloadingSpec`` (``vllm.v1.kv_offload.tiering``),
so importing this module imports vLLM (checked first, through
:mod:`.offloading_spec`, then :func:`~.compat.check_tiering_vllm`) and fails
with ``ImportError`` naming the release on a vLLM build without tiered
offloading or whose shared host region differs, when the spec is looked up.
"""

from __future__ import annotations

from typing import Any

from .compat import CHECK_KEY, _major_minor, check_tiering_vllm
from .offloading import (
    SUPPORTED_TIERING_EXTRA_CONFIG,
    _capacity_source,
    _host_chunks,
    _refuse_unknown,
    _tiering_region,
)
from .offloading_spec import KVSwapOffloadingWorker  # checks vLLM's interface first
from .p2p import bound_p2p_tiers, lookup_timeout

TieringOffloadingSpec = check_tiering_vllm().TieringOffloadingSpec

__all__ = ["KVSwapTieringOffloadingSpec"]


class KVSwapTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` (its manager, its secondary tiers:
    ``fs``, ``obj``, ``p2p``, ``kvcr`` or a ``module_path`` tier) over a
    torch_kvswap worker.

    ``kv_connector_extra_config``: :data:`SUPPORTED_TIERING_EXTRA_CONFIG`
    (``cpu_bytes_to_use`` and ``secondary_tiers`` as for vLLM's spec, and
    ``p2p_lookup_timeout_s``: see :mod:`.p2p`). Refused when the spec is
    built: any other key, ``canonical_layout``, ``kvswap_check`` (checked
    mode), more than one device block per chunk
    (``blocks_per_chunk``/``block_size``), and a tier that needs NIXL
    (``p2p``, ``obj``, ``kvcr``) where NIXL is not installed.

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
                f"mode would refuse to load them; remove it"
            )
        _refuse_unknown("KVSwapTieringOffloadingSpec", config, extra, SUPPORTED_TIERING_EXTRA_CONFIG)
        self._p2p_lookup_timeout_s = lookup_timeout(extra)
        _refuse_missing_packages(extra.get("secondary_tiers") or [])
        super().__init__(config)
        if self.blocks_per_chunk != 1:
            given = (
                ", ".join(f"{k}={extra[k]!r}" for k in ("block_size", "blocks_per_chunk") if k in extra)
                or "the default"
            )
            raise ValueError(
                f"KVSwapTieringOffloadingSpec supports one device block per chunk only "
                f"(blocks_per_chunk 1, or block_size equal to the engine's block size); "
                f"kv_connector_extra_config {given} gives {self.blocks_per_chunk}"
            )
        self._capacity_source = _capacity_source()

    def get_manager(self) -> Any:
        """vLLM's tiering manager (scheduler side), its ``p2p`` tiers bounded
        (:func:`.p2p.bound_p2p_tiers`): a lookup toward a peer that does not
        answer ends as a miss after ``p2p_lookup_timeout_s``, and shutdown
        does not wait on a gone peer."""
        if getattr(self, "_manager", None):
            return self._manager
        try:
            manager = super().get_manager()
        except Exception as exc:
            # vLLM up to 0.31 keeps the scheduler's region when a tier fails
            # to build (0.32 releases it): release it, or its /dev/shm file stays
            region = getattr(self, "_scheduler_mmap", None)
            if region is not None:
                self._scheduler_mmap = None
                region.cleanup()
            if _address_in_use(exc):
                raise RuntimeError(
                    f"a p2p tier of kv_connector_extra_config 'secondary_tiers' could not bind its "
                    f"control port ({exc}): another process listens there; give each instance "
                    f"its own 'port'"
                ) from exc
            raise
        try:
            bound_p2p_tiers(manager, self._p2p_lookup_timeout_s)
        except Exception:
            # vLLM cached the manager: a later call must not get it unbounded
            self._manager = None
            manager.shutdown()
            raise
        return manager

    def get_worker(self, kv_caches: Any) -> Any:
        """The torch_kvswap worker over this rank's slot of the shared
        region (vLLM's own ``get_worker`` refuses CPU and NPU
        platforms)."""
        if self._worker is None:
            chunks = _host_chunks(self)
            if chunks < 1:
                raise ValueError(
                    f"{self._capacity_source} holds no chunk of this model's KV "
                    "cache (1 block of every cache tensor): raise it"
                )
            region = _tiering_region(self)
            try:
                self._worker = KVSwapOffloadingWorker(
                    kv_caches,
                    1,
                    chunks,
                    capacity_source=self._capacity_source,
                    tiering_region=region,
                    slot_bytes=self.cpu_page_size_per_worker,
                )
            except Exception:
                region.cleanup()
                raise
        return self._worker


#: Secondary tier types whose data moves through NIXL (vLLM imports it when
#: the tier is built, or at the first session).
NIXL_TIERS = ("p2p", "obj", "kvcr")


#: The ``kvcr`` release each vLLM release's kvcr tier imports (its
#: ``tiering/kvcr/manager.py``; the two are not interchangeable).
KVCR_RELEASES = {(0, 30): "0.1.0", (0, 31): "0.1.0", (0, 32): "0.1.1"}


def _refuse_missing_packages(tiers: list) -> None:
    """Refuses, when the spec is built, a secondary tier whose package is not
    installed, naming what to install (vLLM would fail later, inside the
    engine's start, with a bare ``ModuleNotFoundError``)."""
    kinds = {t.get("type") for t in tiers if isinstance(t, dict)}
    needing = sorted(kinds & set(NIXL_TIERS))
    if needing:
        try:
            import nixl  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                f"secondary tier(s) {needing} of kv_connector_extra_config 'secondary_tiers' move data "
                f"through NIXL, which is not installed here: pip install nixl==1.5.1, then "
                f"pip install --no-deps nixl-cu13==1.5.1 (nixl-cu12 for CUDA 12; the UCX backend in "
                f"it also serves CPU-only hosts)"
            ) from exc
    if "kvcr" in kinds:
        try:
            import kvcr  # noqa: F401
        except ImportError as exc:
            import vllm

            wanted = KVCR_RELEASES.get(_major_minor(vllm.__version__))
            how = f"pip install --no-deps kvcr=={wanted}" if wanted else "the kvcr release it imports"
            raise ImportError(
                f"secondary tier 'kvcr' of kv_connector_extra_config 'secondary_tiers' needs NVIDIA's "
                f"kvcr package, which is not installed here: {how} (vLLM {vllm.__version__}'s kvcr "
                f"tier imports that release; it runs over NIXL 1.5.1)"
            ) from exc


def _address_in_use(exc: BaseException) -> bool:
    import errno

    return getattr(exc, "errno", None) == errno.EADDRINUSE or "Address already in use" in str(exc)
