"""swap_blocks' overlap and aliasing checks against a byte-set reference.

Caches are ``torch.as_strided`` views of one or two small byte storages:
strided, interleaved, stacked, shared, touching and overrunning by a byte,
drawn at random with random pair lists and ids. The reference lists the bytes
each (pair, block) reads and writes and refuses a call, as docs/ops.md says,
when a destination's blocks overlap each other (dim 0's stride under the
block size), or when some byte is written twice, or both read and written, in
one call. The op must refuse exactly those calls (ValueError, nothing
written) and copy the others as a plain copy from a snapshot does.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import torch_kvswap

STORAGE_BYTES = 96


@st.composite
def cache_layout(draw, block_bytes: int, storages: int):
    """(storage index, offset, stride, num_blocks) of a view that fits its storage."""
    storage = draw(st.integers(0, storages - 1))
    num_blocks = draw(st.integers(1, 5))
    stride = draw(
        st.sampled_from(
            sorted(
                {0, max(block_bytes - 1, 0), block_bytes, block_bytes + 1, 2 * block_bytes, 3 * block_bytes}
            )
        )
    )
    span = (num_blocks - 1) * stride + block_bytes
    offset = draw(st.integers(0, STORAGE_BYTES - span))
    return storage, offset, stride, num_blocks


@st.composite
def calls(draw):
    storages = draw(st.integers(1, 2))
    pairs = []
    for _ in range(draw(st.integers(1, 3))):
        block_bytes = draw(st.integers(1, 6))
        src = draw(cache_layout(block_bytes, storages))
        # Often a destination placed against its source: the same layout, the
        # neighbouring block slot, one byte over, or interleaved on its stride.
        if draw(st.booleans()):
            storage, offset, stride, num_blocks = src
            shift = draw(st.sampled_from([0, -1, 1, block_bytes, -block_bytes, block_bytes + 1, stride]))
            span = (num_blocks - 1) * stride + block_bytes
            offset = min(max(offset + shift, 0), STORAGE_BYTES - span)
            dst = (storage, offset, stride, num_blocks)
        else:
            dst = draw(cache_layout(block_bytes, storages))
        pairs.append((block_bytes, src, dst))
    src_blocks = min(p[1][3] for p in pairs)
    dst_blocks = min(p[2][3] for p in pairs)
    n = draw(st.integers(0, 4))
    sid = draw(st.lists(st.integers(0, src_blocks - 1), min_size=n, max_size=n))
    did = draw(st.lists(st.integers(0, dst_blocks - 1), min_size=n, max_size=n))
    return storages, pairs, sid, did


def block_bytes_of(layout, block_bytes: int, b: int) -> set[tuple[int, int]]:
    storage, offset, stride, _ = layout
    start = offset + b * stride
    return {(storage, start + k) for k in range(block_bytes)}


def reference_refuses(pairs, sid, did) -> bool:
    for block_bytes, _, (_, _, stride, num_blocks) in pairs:
        if num_blocks > 1 and stride < block_bytes:
            return True  # the destination's own blocks overlap
    written: set[tuple[int, int]] = set()
    read: set[tuple[int, int]] = set()
    for block_bytes, src, dst in pairs:
        for s, d in zip(sid, did):
            w = block_bytes_of(dst, block_bytes, d)
            if w & written:
                return True  # a byte written twice
            written |= w
            read |= block_bytes_of(src, block_bytes, s)
    return bool(written & read)


def reference_copy(buffers, pairs, sid, did) -> list[torch.Tensor]:
    snapshot = [b.clone() for b in buffers]
    out = [b.clone() for b in buffers]
    for block_bytes, src, dst in pairs:
        for s, d in zip(sid, did):
            ss, so, sst, _ = src
            ds, do, dst_stride, _ = dst
            a, b = so + s * sst, do + d * dst_stride
            out[ds][b : b + block_bytes] = snapshot[ss][a : a + block_bytes]
    return out


def view(buffers, layout, block_bytes: int) -> torch.Tensor:
    storage, offset, stride, num_blocks = layout
    return torch.as_strided(buffers[storage], (num_blocks, block_bytes), (stride, 1), offset)


@pytest.mark.parametrize("op", ["swap_blocks", "plan"])
@settings(max_examples=int(os.environ.get("KVSWAP_PROPERTY_EXAMPLES", "400")), deadline=None)
@given(call=calls())
def test_refuses_exactly_what_the_byte_reference_refuses(op, call):
    storages, pairs, sid_list, did_list = call
    g = torch.Generator().manual_seed(len(sid_list) + 7 * len(pairs))
    buffers = [
        torch.randint(0, 256, (STORAGE_BYTES,), generator=g, dtype=torch.uint8) for _ in range(storages)
    ]
    before = [b.clone() for b in buffers]
    src = [view(buffers, p[1], p[0]) for p in pairs]
    dst = [view(buffers, p[2], p[0]) for p in pairs]
    sid, did = torch.tensor(sid_list, dtype=torch.int64), torch.tensor(did_list, dtype=torch.int64)
    refuse = reference_refuses(pairs, sid_list, did_list)
    event("refused" if refuse else "copied")
    call_op = torch_kvswap.swap_blocks if op == "swap_blocks" else torch.ops.kvswap._plan_swap_blocks.default
    if refuse:
        with pytest.raises(ValueError):
            call_op(src, dst, sid, did)
        assert all(torch.equal(a, b) for a, b in zip(buffers, before))
        return
    call_op(src, dst, sid, did)
    if op == "swap_blocks":
        expected = reference_copy(before, pairs, sid_list, did_list)
        assert all(torch.equal(a, b) for a, b in zip(buffers, expected))
