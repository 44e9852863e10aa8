"""The offloading worker's host mirrors inside vLLM's ``SharedOffloadRegion``.

Two :class:`~torch_kvswap.KVCacheOffloader` subclasses that take their
mirrors from a host region vLLM allocated instead of a private buffer: the
replicated layout's one-copy region (:class:`SharedRegionOffloader`) and
this rank's slot of the tiering region, in vLLM's chunk-major layout
(:class:`ChunkMajorOffloader`). Neither needs vLLM itself.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_kvswap import KVCacheOffloader

from .compat import REGION_BASE_ATTRIBUTES, REGION_VIEW_METHODS

__all__ = ["SharedRegionOffloader", "ChunkMajorOffloader", "region_base", "region_view"]


def region_view(region: Any, page: int) -> torch.Tensor:
    """The next ``page`` bytes of this rank's slot in every chunk row of
    vLLM's ``region``, under its release's method name."""
    for name in REGION_VIEW_METHODS:
        if hasattr(region, name):
            return getattr(region, name)(page)
    raise TypeError(f"vLLM's {type(region).__name__} has none of {list(REGION_VIEW_METHODS)}")


def region_base(region: Any) -> torch.Tensor:
    """The whole mapping of vLLM's ``region`` as a tensor, under its
    release's attribute name."""
    for name in REGION_BASE_ATTRIBUTES:
        base = getattr(region, name, None)
        if isinstance(base, torch.Tensor):
            return base
    raise TypeError(
        f"vLLM's {type(region).__name__} has none of {list(REGION_BASE_ATTRIBUTES)} "
        "as a tensor (a region already cleaned up has none)"
    )


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
            raise ValueError(
                f"the shared host region has {region.numel()} bytes; "
                f"{self.num_host_blocks} chunks of this worker need {need}"
            )
        if pin:
            torch.ops.kvswap._host_register(region, self.device, True)
            self._registered = True
            self.pinned = True
        mirrors, off = [], 0
        for t, bb in zip(self.device_tensors, self._block_bytes):
            mirrors.append(region[off : off + rows * bb].view(t.dtype).view(rows, *t.shape[1:]))
            off += rows * bb
        return region, region, mirrors


class ChunkMajorOffloader(KVCacheOffloader):
    """A :class:`KVCacheOffloader` whose mirrors are this rank's slot of
    vLLM's ``SharedOffloadRegion`` in vLLM's own chunk-major layout: row
    ``c`` of the region is host chunk ``c``; in it, this rank's slot
    starts at ``rank * cpu_page_size`` and holds every cache tensor's
    page back to back (:func:`region_view` per tensor, as vLLM's CPU
    worker takes them). Each mirror is the first
    ``width`` bytes of its tensor's page, with the region's row stride,
    so chunk ``c`` of every mirror lies inside ``primary_kv_view[c]``,
    the bytes vLLM's secondary tiers read and write. One device block
    per chunk only (``factor`` 1): a mirror row is then a chunk row."""

    def __init__(self, *args: Any, region: Any, pages: list[int], slot_bytes: int, **kw: Any) -> None:
        self._region, self._pages, self._slot_bytes = region, pages, slot_bytes
        super().__init__(*args, **kw)

    def _allocate_mirrors(self, pin: bool):
        region, self._region = self._region, None  # the region's views are held by its owner
        if self.factor != 1:
            raise ValueError(
                f"the chunk-major host layout holds one device block per chunk, "
                f"got {self.factor} blocks per chunk"
            )
        if sum(self._pages) > self._slot_bytes:
            raise ValueError(
                f"this rank's slot of the shared host region has {self._slot_bytes} "
                f"bytes per chunk; the cache tensors' pages need {sum(self._pages)}"
            )
        mirrors = []
        for t, page in zip(self.device_tensors, self._pages):
            view = region_view(region, page)
            if view.shape[0] < self.num_host_blocks or page < t.shape[1]:
                raise ValueError(
                    f"the shared host region's view is {tuple(view.shape)}; "
                    f"{self.num_host_blocks} chunks of {t.shape[1]} bytes are needed"
                )
            mirrors.append(view[: self.num_host_blocks, : t.shape[1]].view(t.dtype))
        base = region_base(region).view(torch.uint8)
        if pin:
            torch.ops.kvswap._host_register(base, self.device, True)
            self._registered = True
            self.pinned = True
        return base, base, mirrors
