"""Plain reference implementations the tests compare the ops against."""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def expand_block_ids_ref(block_ids, factor: int, skip_count: int = 0) -> np.ndarray:
    """The reference design's expand_block_ids, restated with numpy."""
    ids = np.asarray(block_ids, dtype=np.int64)
    all_ids = (ids[:, None] * factor + np.arange(factor)[None, :]).ravel()
    return all_ids[skip_count:]


def swap_blocks_ref(src_caches, dst_caches, src_ids, dst_ids) -> list[torch.Tensor]:
    """Expected destination caches after swap_blocks, built with index_select/index_copy."""
    out = []
    src_ids = torch.as_tensor(src_ids, dtype=torch.int64).cpu()
    dst_ids = torch.as_tensor(dst_ids, dtype=torch.int64).cpu()
    for s, d in zip(src_caches, dst_caches):
        expected = d.detach().cpu().clone()
        if len(src_ids):
            expected.index_copy_(0, dst_ids, s.detach().cpu().index_select(0, src_ids))
        out.append(expected)
    return out


def copy_bytes_ref(memory: bytearray, base: int, src, dst, sizes) -> bytearray:
    """Applies descriptors (addresses relative to `base`) one by one, in order."""
    out = bytearray(memory)
    for s, d, n in zip(src, dst, sizes):
        out[d - base : d - base + n] = memory[s - base : s - base + n]
    return out


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())


def read_address(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)
