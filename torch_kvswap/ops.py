"""Typed Python wrappers of the ``kvswap`` operators.

Each wrapper calls the operator's ``.default`` overload, so it works the same
in eager mode and inside ``torch.compile``. The schemas are declared once, in
``csrc/registration.cpp``; the fake kernels live in ``torch_kvswap/fake_kernels.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "Direction",
    "swap_blocks_batch",
    "swap_blocks",
    "expand_block_ids",
    "set_copy_method",
    "get_copy_method",
]


class Direction(enum.IntEnum):
    """Direction codes of :func:`swap_blocks_batch` (the reference call's values)."""

    HOST_TO_DEVICE = 0
    DEVICE_TO_HOST = 1
    DEVICE_TO_DEVICE = 2


def swap_blocks_batch(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    direction: int | Direction,
) -> None:
    """Copy ``sizes[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i.

    Drop-in for the reference handler's
    ``swap_blocks_batch(batch_src, batch_dst, batch_sizes, direction)``.

    Args:
        src_ptrs, dst_ptrs: 1-D int64 CPU tensors of raw addresses (``data_ptr()``
            values), any stride.
        sizes: 1-D int64 CPU tensor of byte counts, same length; zero-byte
            entries are skipped.
        direction: :class:`Direction` (0 host→device, 1 device→host,
            2 device→device). It selects the copy kind for the accelerator's
            DMA API; the host engine ignores it. A ``bool`` is refused with
            ``TypeError``: it is what vLLM passes in this place
            (``is_src_access_order_any``), not a direction.

    Device and stream: the copies are issued on the **current stream of the
    current accelerator** (``torch.accelerator.current_stream()``) and are
    asynchronous with respect to the host when both the accelerator and pinned
    host memory allow it: synchronize or record an event before reading the
    destination. With no accelerator the host engine copies on torch's
    intra-op threads (``torch.get_num_threads()``) and returns when the bytes
    have arrived.

    Every descriptor is validated before any byte moves (negative size, null
    address with a non-zero size, an address range that wraps or where source
    and destination overlap, wrong dtype/shape/device/length, unknown
    direction); errors name the argument and the index. Neighbouring
    descriptors that continue each other on both sides are merged.

    The op cannot see which tensors the addresses point into. torch_kvswap
    registers it as an ordered side effect, so ``torch.compile`` neither drops
    it nor reorders it against other ordered effects, but inside a compiled
    graph it is *not* ordered against functionalized writes to the tensors
    behind the addresses. Use :func:`swap_blocks` in compiled code.
    """
    if isinstance(direction, (bool, np.bool_)):
        raise TypeError(
            f"direction must be a Direction or an int 0/1/2, got the bool {bool(direction)}. "
            "vLLM's swap_blocks_batch(src_ptrs, dst_ptrs, sizes, bool is_src_access_order_any) "
            "takes a source-access-order hint in that place, not a direction: True (its loads) "
            "would read here as 1 = DEVICE_TO_HOST, the reverse of the copy. Pass the direction "
            "explicitly: Direction.HOST_TO_DEVICE for vLLM's loads (CPU->GPU, "
            "is_src_access_order_any=True), Direction.DEVICE_TO_HOST for its stores (GPU->CPU, "
            "False); see docs/ops.md (nothing was copied)"
        )
    torch.ops.kvswap.swap_blocks_batch.default(src_ptrs, dst_ptrs, sizes, int(direction))


def swap_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> None:
    """Copy block ``src_block_ids[j]`` of every ``src_caches[i]`` into block
    ``dst_block_ids[j]`` of ``dst_caches[i]``, in place.

    Args:
        src_caches: tensors whose dim 0 is the block dimension: one per layer,
            or one per K/V half (pass a ``[2, num_blocks, ...]`` stacked cache
            as its two halves ``cache[0], cache[1]``). Each block (``t[b]``)
            must be contiguous in memory; dim 0 may have any stride.
        dst_caches: the matching destinations: same length, and pairwise the
            same dtype and bytes per block. Mutated in place.
        src_block_ids, dst_block_ids: 1-D int64 tensors of equal length; every
            id must be in range for every tensor it indexes, and no destination
            block may appear twice. CPU tensors are preferred: ids on an
            accelerator are read back to the host (a synchronizing copy),
            except on the CUDA kernel path, which reads them on the device
            when it runs (and which ``"auto"`` takes for them during graph
            capture).

    Devices: all sources on one device, all destinations on one device. Host
    to host runs on the host engine (synchronous). Host↔accelerator and
    accelerator→same accelerator are issued on that accelerator's **current
    stream**, asynchronously; keep the host caches pinned for truly
    asynchronous copies, and order later reads with an event.

    Under ``torch.compile(fullgraph=True)`` the op compiles without a graph
    break, sees every earlier write to the source caches in the same graph, and
    writes the destination caches in place (no clone).
    """
    torch.ops.kvswap.swap_blocks.default(list(src_caches), list(dst_caches), src_block_ids, dst_block_ids)


def expand_block_ids(block_ids: torch.Tensor, block_size_factor: int, skip_count: int = 0) -> torch.Tensor:
    """Expand host block ids into device sub-block ids.

    Each id ``b`` becomes ``b*f, b*f+1, ..., b*f+f-1`` (``f = block_size_factor``),
    then the first ``skip_count`` entries of the result are dropped. For
    example ``expand_block_ids(tensor([0, 1, 3]), 4)`` is
    ``[0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]``.

    Args:
        block_ids: 1-D int64 tensor of non-negative ids, any stride, any device
            (on an accelerator the checks read the ids back: a sync).
        block_size_factor: ``f >= 1``.
        skip_count: ``0 <= skip_count < f``.

    Returns:
        A new 1-D int64 tensor on ``block_ids``' device, of length
        ``len(block_ids) * f - skip_count`` (0 for empty input).
    """
    return torch.ops.kvswap.expand_block_ids.default(block_ids, block_size_factor, skip_count)


def set_copy_method(method: str) -> None:
    """Choose how :func:`swap_blocks` copies where the engine offers a choice.

    ``"auto"`` (default): the engine's copy kernel for blocks under 32 KiB,
    batched DMA above; ``"dma"``: always descriptors and the DMA API;
    ``"kernel"``: always the copy kernel (CUDA only: ``NotImplementedError``
    when no loaded engine has a copy kernel). Process-wide; host-to-host
    copies take the host engine's one path whatever the choice. The host and
    Ascend engines have only the DMA path.
    """
    torch.ops.kvswap._set_copy_method(method)


def get_copy_method() -> str:
    """The current :func:`set_copy_method` choice."""
    return torch.ops.kvswap._get_copy_method()
