"""Cache pairs of one swap_blocks call may not alias each other.

The pairs of a call run concurrently (the host engine's threads, an
accelerator's unordered batch, the kernel's grid), so the bytes one pair
writes may not be read or written by another pair. The check is on the blocks
actually copied: caches that share memory stay legal where the copied blocks
do not meet. Each refused call writes nothing, in checked and unchecked mode;
each accepted one matches copying the pairs one after another.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_kvswap

BLOCK = 8  # bytes per block of every cache here


@pytest.fixture(params=["unchecked", "checked"])
def mode(request):
    if request.param == "checked":
        with torch_kvswap.checked():
            yield request.param
    else:
        yield request.param


def cache(buf: torch.Tensor, offset: int, blocks: int, stride: int = BLOCK) -> torch.Tensor:
    """A uint8 cache of `blocks` blocks of BLOCK bytes inside `buf`, at byte `offset`."""
    return buf.as_strided((blocks, BLOCK), (stride, 1), offset)


def touched(t: torch.Tensor, ids, base: int) -> set[int]:
    """Byte offsets (relative to `base`) of the blocks `ids` of `t`."""
    start = t.data_ptr() - base
    return {start + i * t.stride(0) + k for i in ids for k in range(BLOCK)}


def conflicts_ref(src, dst, sid, did, base: int) -> bool:
    """Whether some pair writes a byte that another pair reads or writes."""
    writes = [touched(d, did, base) for d in dst]
    reads = [touched(s, sid, base) for s in src]
    return any(writes[i] & (reads[k] | writes[k]) for i in range(len(dst)) for k in range(len(dst)) if i != k)


def sequential_ref(buf: torch.Tensor, src, dst, sid, did) -> torch.Tensor:
    """The buffer after copying pair 0, then pair 1, ... (the order cannot
    matter when no pair aliases another)."""
    out = buf.clone()
    for s, d in zip(src, dst):
        s2 = out.as_strided(s.shape, s.stride(), s.data_ptr() - buf.data_ptr())
        d2 = out.as_strided(d.shape, d.stride(), d.data_ptr() - buf.data_ptr())
        d2[did] = s2[sid].clone()
    return out


def run(buf, src, dst, sid, did):
    torch.ops.kvswap.swap_blocks(src, dst, torch.tensor(sid), torch.tensor(did))


def test_a_chain_through_a_block_that_is_read_and_written_is_refused(mode):
    buf = torch.arange(3 * 8 * BLOCK, dtype=torch.uint8)
    x, y, z = (cache(buf, k * 8 * BLOCK, 8) for k in range(3))
    before = buf.clone()
    # pair 0 writes y[1], which pair 1 reads
    with pytest.raises(
        ValueError,
        match=r"dst_caches\[0\] block 1 \(dst_block_ids\[0\], written\) and "
        r"src_caches\[1\] block 1 \(src_block_ids\[1\], read\) share the bytes",
    ):
        run(buf, [x, y], [y, z], [0, 1], [1, 2])
    assert torch.equal(buf, before)


def test_two_pairs_writing_the_same_cache_are_refused(mode):
    buf = torch.arange(3 * 8 * BLOCK, dtype=torch.uint8)
    x, y, z = (cache(buf, k * 8 * BLOCK, 8) for k in range(3))
    before = buf.clone()
    with pytest.raises(
        ValueError,
        match=r"dst_caches\[0\] block 5 .* dst_caches\[1\] block 5 .* "
        r"\(8 bytes\)",
    ):
        run(buf, [x, y], [z, z], [0], [5])
    assert torch.equal(buf, before)


def test_a_chain_whose_blocks_do_not_meet_is_copied(mode):
    buf = torch.arange(3 * 8 * BLOCK, dtype=torch.uint8)
    x, y, z = (cache(buf, k * 8 * BLOCK, 8) for k in range(3))
    expected = sequential_ref(buf, [x, y], [y, z], [0, 1], [4, 5])
    run(buf, [x, y], [y, z], [0, 1], [4, 5])  # y is written at 4, 5 and read at 0, 1
    assert torch.equal(buf, expected)


def test_interleaved_k_and_v_views_of_one_allocation_are_distinct_memory(mode):
    device = torch.zeros(8, 2, BLOCK, dtype=torch.uint8)
    host = torch.randint(0, 255, (8, 2, BLOCK), dtype=torch.uint8)
    torch.ops.kvswap.swap_blocks(
        [host[:, 0], host[:, 1]], [device[:, 0], device[:, 1]], torch.tensor([0, 7]), torch.tensor([7, 0])
    )
    assert torch.equal(device[7], host[0]) and torch.equal(device[0], host[7])


# Two caches of pair 1 placed around pair 0's destination: touching it from
# below or above, overlapping it by one byte from either side, inside it,
# covering it, and interleaved with it on a doubled stride (half a block off:
# the blocks overlap; a whole block off: they sit in each other's gaps).
PLACEMENTS = {  # (byte offset, stride) of pair 1's cache; pair 0 writes blocks at 32, 48, 64, 80
    "touching below": (0, BLOCK),  # bytes 0..31
    "touching above": (11 * BLOCK, BLOCK),  # bytes 88..119
    "one byte under": (1, BLOCK),  # its block 3 ends at byte 32
    "one byte over": (11 * BLOCK - 1, BLOCK),  # its block 0 starts at byte 87
    "inside": (5 * BLOCK, BLOCK),  # bytes 40..71: gaps and blocks
    "interleaved, half a block off": (4 * BLOCK + BLOCK // 2, 2 * BLOCK),
    "interleaved, one block off": (5 * BLOCK, 2 * BLOCK),  # every block in a gap of pair 0's
}
IDS = [([0], [0]), ([3], [3]), ([0], [3]), ([3], [0]), ([1, 2], [2, 1])]


@pytest.mark.parametrize("role", ["pair 1 reads there", "pair 1 writes there"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("sid,did", IDS, ids=str)
def test_refused_exactly_where_a_written_byte_is_shared_like_the_reference(mode, role, placement, sid, did):
    """Pair 0 writes blocks of d0 (4 blocks of 8 bytes at byte 32, stride 16:
    blocks at bytes 32, 48, 64 and 80); pair 1's cache c1 sits as PLACEMENTS
    says."""
    buf = torch.arange(40 * BLOCK, dtype=torch.uint8)
    s0 = cache(buf, 24 * BLOCK, 4)
    d0 = cache(buf, 4 * BLOCK, 4, stride=2 * BLOCK)
    offset, stride = PLACEMENTS[placement]
    c1 = cache(buf, offset, 4, stride)
    other = cache(buf, 32 * BLOCK, 4)
    src, dst = ([s0, c1], [d0, other]) if role == "pair 1 reads there" else ([s0, other], [d0, c1])
    expect_refusal = conflicts_ref(src, dst, sid, did, buf.data_ptr())
    before = buf.clone()
    expected = None if expect_refusal else sequential_ref(buf, src, dst, sid, did)
    if expect_refusal:
        with pytest.raises(ValueError, match="may not be read or written by another pair"):
            run(buf, src, dst, sid, did)
        assert torch.equal(buf, before)
    else:
        run(buf, src, dst, sid, did)
        assert torch.equal(buf, expected)


def test_the_reference_grid_has_both_verdicts():
    """The grid above is only worth its cases if it holds refusals and copies."""
    buf = torch.arange(40 * BLOCK, dtype=torch.uint8)
    verdicts = set()
    for (offset, stride), (sid, did) in itertools.product(PLACEMENTS.values(), IDS):
        src = [cache(buf, 24 * BLOCK, 4), cache(buf, offset, 4, stride)]
        dst = [cache(buf, 4 * BLOCK, 4, stride=2 * BLOCK), cache(buf, 32 * BLOCK, 4)]
        verdicts.add(conflicts_ref(src, dst, sid, did, buf.data_ptr()))
    assert verdicts == {True, False}


def test_many_disjoint_pairs_in_any_address_order_are_copied(mode):
    buf = torch.zeros(64 * 2 * 4 * BLOCK, dtype=torch.uint8)
    host = torch.randint(0, 255, (64 * 4 * BLOCK,), dtype=torch.uint8)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    src = [cache(host, k * 4 * BLOCK, 4) for k in range(64)]
    dst = [cache(buf, k * 4 * BLOCK, 4) for k in order]
    torch.ops.kvswap.swap_blocks(src, dst, torch.tensor([0, 1, 2, 3]), torch.tensor([3, 2, 1, 0]))
    for s, d in zip(src, dst):
        assert torch.equal(d, s.flip(0))


def test_an_aliasing_pair_among_many_in_random_address_order_is_found(mode):
    """Pairs 0 and 63 write the lowest cache; pair 1 writes the highest, the
    others are shuffled: only a sweep in address order brings the two
    writers of the lowest cache together."""
    buf = torch.zeros(64 * 4 * BLOCK, dtype=torch.uint8)
    host = torch.randint(0, 255, (64 * 4 * BLOCK,), dtype=torch.uint8)
    middle = (torch.randperm(61, generator=torch.Generator().manual_seed(1)) + 1).tolist()
    order = [0, 62, *middle, 0]
    src = [cache(host, k * 4 * BLOCK, 4) for k in range(64)]
    dst = [cache(buf, k * 4 * BLOCK, 4) for k in order]
    with pytest.raises(ValueError, match=r"dst_caches\[(0|63)\] block 2 .* dst_caches\[(0|63)\] block 2"):
        torch.ops.kvswap.swap_blocks(src, dst, torch.tensor([0, 1]), torch.tensor([2, 3]))
    assert not buf.any()


def test_layouts_found_disjoint_before_do_not_hide_an_alias_in_a_later_pair(mode):
    """A thread remembers the last layouts it found disjoint; a call that
    differs in any pair is looked at afresh."""
    buf = torch.zeros(4 * 8 * BLOCK, dtype=torch.uint8)
    x, y, z, w = (cache(buf, k * 8 * BLOCK, 8) for k in range(4))
    run(buf, [x, y], [z, w], [0], [1])
    run(buf, [x, y], [z, w], [0], [1])  # the same layouts again
    with pytest.raises(ValueError, match=r"dst_caches\[0\] block 1 .* dst_caches\[1\] block 1"):
        run(buf, [x, y], [z, z], [0], [1])


def test_the_offloader_refuses_caches_of_one_group_that_alias():
    layer = torch.zeros(8, 4, 16)
    with pytest.raises(ValueError, match=r"caches 'a' and 'b' share memory \(groups\[0\] holds both\)"):
        torch_kvswap.KVCacheOffloader({"a": layer, "b": layer}, 16, 16, num_host_blocks=4)
    with pytest.raises(ValueError, match=r"caches 'a' V and 'b' K share memory"):
        base = torch.zeros(3, 8, 4, 16)  # 'a' is base[0:2], 'b' is base[1:3]
        torch_kvswap.KVCacheOffloader({"a": base[0:2], "b": base[1:3]}, 16, 16, num_host_blocks=4)


def test_the_offloader_takes_interleaved_k_and_v_and_groups_that_share_a_cache():
    kv = torch.randn(8, 2, 4, 16)
    with torch_kvswap.KVCacheOffloader({"l0": (kv[:, 0], kv[:, 1])}, 16, 16, num_host_blocks=4) as off:
        off.store(1, [3], [0])
        off.wait({1})
        assert torch.equal(off.host_tensors[1][0], kv[3, 1])
    layer = torch.zeros(8, 4, 16)
    with torch_kvswap.KVCacheOffloader(
        {"a": layer, "b": layer}, 16, 16, num_host_blocks=4, groups=[[0], [1]]
    ):
        pass  # two groups are two calls: sharing across groups is the groups' contract
