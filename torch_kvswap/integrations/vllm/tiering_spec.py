"""``KVSwapTieringOffloadingSpec``: vLLM's tiered offloading over the torch_kvswap worker.

It subclasses vLLM's ``TieringOffloadingSpec`` (``vllm.v1.kv_offload.tiering``),
so importing this module imports vLLM (checked first, through
:mod:`.offloading_spec`, then :func:`~.compat.check_tiering_vllm`) and fails
with ``ImportError`` naming the release on a vLLM build without tiered
offloading or whose shared host region differs, when the spec is looked up.
"""

from __future__ import annotations

from typing import Any

from .compat import CHECK_KEY, check_tiering_vllm
from .offloading import (
    SUPPORTED_TIERING_EXTRA_CONFIG,
    _capacity_source,
    _host_chunks,
    _refuse_unknown,
    _tiering_region,
)
from .offloading_spec import KVSwapOffloadingWorker  # checks vLLM's interface first

TieringOffloadingSpec = check_tiering_vllm().TieringOffloadingSpec

__all__ = ["KVSwapTieringOffloadingSpec"]


class KVSwapTieringOffloadingSpec(TieringOffloadingSpec):
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
                f"mode would refuse to load them; remove it"
            )
        _refuse_unknown("KVSwapTieringOffloadingSpec", config, extra, SUPPORTED_TIERING_EXTRA_CONFIG)
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
