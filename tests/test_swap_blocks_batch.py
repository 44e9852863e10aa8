"""kvswap::swap_blocks_batch — the pointer op, on the host engine."""

from __future__ import annotations

import contextlib
import os
import platform

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import torch_kvswap
from torch_kvswap import Direction
from helpers import plan_batch
from reference import copy_bytes_ref

OP = torch.ops.kvswap.swap_blocks_batch.default
# Every KVSWAP_HOST_COPY routine of the host engine.
HOST_COPY_MODES = ["auto", "memcpy", "prefetch", "stream", "parallel_for"]


def descriptors(*columns):
    return tuple(torch.tensor(c, dtype=torch.int64) for c in columns)


def arena(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("member", list(Direction))
def test_direction_enum_matches_the_cpp_codes(member):
    assert torch.ops.kvswap_test.direction_name(int(member)) == member.name.lower()


def test_direction_codes_are_the_reference_values():
    assert [int(d) for d in Direction] == [0, 1, 2]
    with pytest.raises(ValueError, match="direction must be 0"):
        torch.ops.kvswap_test.direction_name(3)


# The host engine copies the same way in every direction; the direction code
# an engine receives is checked in test_fake_device.py.
def test_copies_each_descriptor():
    src = arena(4096, seed=1)
    dst = torch.zeros(4096, dtype=torch.uint8)
    s, d = src.data_ptr(), dst.data_ptr()
    sp, dp, sz = descriptors([s + 100, s + 2000, s], [d + 3000, d + 7, d + 1000], [50, 700, 1])
    torch_kvswap.swap_blocks_batch(sp, dp, sz, Direction.DEVICE_TO_HOST)
    expected = torch.zeros(4096, dtype=torch.uint8)
    expected[3000:3050] = src[100:150]
    expected[7:707] = src[2000:2700]
    expected[1000] = src[0]
    assert torch.equal(dst, expected)


def test_reference_call_shape_from_numpy_is_accepted():
    # The reference handler builds its arrays with numpy and torch.from_numpy.
    src = arena(1 << 16, seed=2)
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    block = 1024
    ids_src = np.array([5, 9, 0, 63], dtype=np.int64)
    ids_dst = np.array([1, 2, 3, 4], dtype=np.int64)
    all_src = src.data_ptr() + ids_src * block
    all_dst = dst.data_ptr() + ids_dst * block
    sizes = np.full(4, block, dtype=np.int64)
    torch.ops.kvswap.swap_blocks_batch(
        torch.from_numpy(all_src), torch.from_numpy(all_dst), torch.from_numpy(sizes), 1
    )
    for a, b in zip(ids_src, ids_dst):
        assert torch.equal(dst[b * block : (b + 1) * block], src[a * block : (a + 1) * block])


def test_source_and_destination_may_touch_without_overlapping():
    # [a, a+64) -> [a+64, a+128): adjacent ranges are legal, one byte more is not.
    buf = arena(192, seed=12)
    want = buf.clone()
    want[64:128] = buf[:64]
    a = buf.data_ptr()
    OP(*descriptors([a], [a + 64], [64]), 0)
    assert torch.equal(buf, want)
    OP(*descriptors([a + 128], [a + 64], [64]), 0)
    assert torch.equal(buf[64:128], want[128:192])
    with pytest.raises(ValueError, match="overlap"):
        OP(*descriptors([a], [a + 63], [64]), 0)


def test_zero_byte_descriptors_are_skipped_even_with_null_addresses():
    dst = torch.zeros(8, dtype=torch.uint8)
    OP(*descriptors([0], [0], [0]), 2)
    assert torch.equal(dst, torch.zeros(8, dtype=torch.uint8))


def test_non_contiguous_descriptor_tensors_are_read_by_stride():
    src = arena(256, seed=3)
    dst = torch.zeros(256, dtype=torch.uint8)
    table = torch.tensor(
        [[src.data_ptr() + 10, dst.data_ptr() + 20, 30], [src.data_ptr() + 100, dst.data_ptr() + 200, 40]],
        dtype=torch.int64,
    )
    OP(table[:, 0], table[:, 1], table[:, 2], 0)
    assert torch.equal(dst[20:50], src[10:40])
    assert torch.equal(dst[200:240], src[100:140])


def test_adjacent_descriptors_are_merged():
    base_s, base_d = 1 << 20, 1 << 30
    # Three contiguous on both sides, then a break on the destination side.
    got = plan_batch(
        *descriptors(
            [base_s, base_s + 64, base_s + 128, base_s + 192],
            [base_d, base_d + 64, base_d + 128, base_d + 4096],
            [64, 64, 64, 64],
        )
    )
    assert got == [[base_s, base_s + 192], [base_d, base_d + 4096], [192, 64]]


def test_descriptors_continuing_only_on_one_side_are_not_merged():
    got = plan_batch(*descriptors([4096, 4096 + 64], [1 << 20, (1 << 20) + 128], [64, 64]))
    assert got == [[4096, 4096 + 64], [1 << 20, (1 << 20) + 128], [64, 64]]


def test_merging_skips_zero_byte_entries_between_runs():
    got = plan_batch(*descriptors([4096, 0, 4096 + 64], [1 << 20, 0, (1 << 20) + 64], [64, 0, 64]))
    assert got == [[4096], [1 << 20], [128]]


def test_host_route_orders_large_descriptors_by_source_and_merges_what_that_joins():
    # 8 KiB and more per descriptor: the host engine reads in source order.
    # Here the caller's order is reversed, so sorting also joins the blocks
    # into one run on both sides.
    block, base_s, base_d = 8192, 1 << 30, 1 << 40
    order = list(reversed(range(6)))
    got = plan_batch(
        *descriptors([base_s + i * block for i in order], [base_d + i * block for i in order], [block] * 6)
    )
    assert got == [[base_s], [base_d], [6 * block]]


@pytest.mark.parametrize("id_space", [600, 1 << 22], ids=["one-pass", "two-pass"])
def test_host_route_sort_is_a_permutation_of_the_callers_descriptors(id_space):
    # Source ids from a small space (a one-digit radix sort) and from a
    # 22-bit one (two digits).
    rng = np.random.default_rng(3)
    n, block = 300, 16384
    src_ids, dst_ids = rng.choice(id_space, size=n, replace=False), rng.permutation(n)
    src = (1 << 32) + src_ids * block
    dst = (1 << 44) + dst_ids * block
    got_s, got_d, got_z = plan_batch(*descriptors(src, dst, [block] * n))
    assert got_s == sorted(got_s)
    # Runs may merge; expanded back to blocks, the pairs are the caller's.
    pairs = {(s + k, d + k) for s, d, z in zip(got_s, got_d, got_z) for k in range(0, z, block)}
    assert pairs == set(zip(src.tolist(), dst.tolist()))


def test_host_route_sorts_sources_spread_wider_than_32_bits_of_alignment():
    # Byte-aligned sources terabytes apart: the comparison-sort path.
    src = [(1 << 45) + 1, (1 << 40) + 3, (1 << 42) + 7]
    dst = [1 << 30, (1 << 30) + 65536, (1 << 30) + 131072]
    got = plan_batch(*descriptors(src, dst, [20000] * 3))
    assert got == [[src[1], src[2], src[0]], [dst[1], dst[2], dst[0]], [20000] * 3]


def test_host_route_keeps_the_callers_order_for_small_descriptors():
    # Below 8 KiB per descriptor on average sorting costs what it saves.
    src = [(1 << 30) + 4096 * i for i in (5, 1, 3)]
    dst = [(1 << 40) + 4096 * i for i in (0, 2, 4)]
    assert plan_batch(*descriptors(src, dst, [4096] * 3)) == [src, dst, [4096] * 3]


@pytest.mark.parametrize("mode", HOST_COPY_MODES)
def test_large_unsorted_descriptors_copy_exactly(mode, monkeypatch):
    # The sorted path end to end: 96 blocks of 12 KiB in a random order.
    monkeypatch.setenv("KVSWAP_HOST_COPY", mode)
    rng = np.random.default_rng(4)
    n, block = 96, 12288
    src = arena(2 * n * block, seed=9)
    dst = torch.zeros(n * block, dtype=torch.uint8)
    sid, did = rng.permutation(2 * n)[:n], rng.permutation(n)
    OP(*descriptors(src.data_ptr() + sid * block, dst.data_ptr() + did * block, [block] * n), 0)
    expected = torch.zeros(n, block, dtype=torch.uint8)
    expected[torch.from_numpy(did)] = src.view(2 * n, block)[torch.from_numpy(sid)]
    assert torch.equal(dst.view(n, block), expected)


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63), st.integers(0, 64)), max_size=40),
)
def test_matches_a_byte_by_byte_reference(blocks):
    """Random descriptors over two arenas (no destination written twice)."""
    unit = 64
    src = arena(64 * unit, seed=len(blocks))
    dst = torch.zeros(64 * unit, dtype=torch.uint8)
    used, chosen = set(), []
    for s, d, n in blocks:
        if d not in used:
            used.add(d)
            chosen.append((s * unit, d * unit, n))
    memory = bytearray(src.numpy().tobytes()) + bytearray(dst.numpy().tobytes())
    half = len(memory) // 2
    expected = copy_bytes_ref(
        memory, 0, [c[0] for c in chosen], [half + c[1] for c in chosen], [c[2] for c in chosen]
    )[half:]
    sp, dp, sz = descriptors(
        [src.data_ptr() + c[0] for c in chosen] or [],
        [dst.data_ptr() + c[1] for c in chosen] or [],
        [c[2] for c in chosen] or [],
    )
    OP(sp, dp, sz, Direction.HOST_TO_DEVICE)
    assert dst.numpy().tobytes() == bytes(expected)


@contextlib.contextmanager
def threads(n: int):
    """torch's intra-op thread count (the engine's copy threads), for a block of code."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def host_copy(mode: str):
    """KVSWAP_HOST_COPY for a block of code (read by the engine on every call)."""
    before = os.environ.get("KVSWAP_HOST_COPY")
    os.environ["KVSWAP_HOST_COPY"] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVSWAP_HOST_COPY"]
        else:
            os.environ["KVSWAP_HOST_COPY"] = before


@pytest.fixture
def intra_op_threads():
    """Sets torch's intra-op thread count (the engine's copy threads) for one test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def cpu_has_avx2() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    with open("/proc/cpuinfo") as f:
        return " avx2" in f.read()


PLAN = torch.ops.kvswap_test.host_copy_plan
MIB = 1 << 20


def test_auto_streams_from_16_mib_on():
    # Streaming stores from 16 MiB per batch (where AVX2 exists); ordinary
    # stores below, so a small batch's destination stays in cache.
    with host_copy("auto"):
        assert PLAN(16 * MIB - 1)[0] == "memcpy"
        assert PLAN(16 * MIB)[0] == ("stream" if cpu_has_avx2() else "memcpy")
        assert PLAN(1 << 40)[0] == ("stream" if cpu_has_avx2() else "memcpy")
        assert PLAN(0)[0] == "memcpy"


@pytest.mark.parametrize("mode", ["memcpy", "prefetch", "stream", "parallel_for"])
def test_a_forced_copy_routine_is_used_at_every_size(mode):
    expected = "memcpy" if mode == "stream" and not cpu_has_avx2() else mode
    with host_copy(mode):
        assert PLAN(100)[0] == PLAN(64 * MIB)[0] == expected


def test_an_unknown_copy_routine_means_auto():
    with host_copy("fastest"):
        assert PLAN(100)[0] == "memcpy"


def test_batches_from_1_mib_on_are_split_across_the_threads():
    # One part per half MiB at most, one per intra-op thread at most; under
    # 1 MiB the calling thread copies alone.
    with host_copy("memcpy"), threads(3):
        assert PLAN(MIB - 1)[1] == 1
        assert PLAN(MIB)[1] == 2
        assert PLAN(3 * MIB // 2 - 1)[1] == 2
        assert PLAN(3 * MIB // 2)[1] == 3
        assert PLAN(1 << 40)[1] == 3
    with host_copy("memcpy"), threads(1):
        assert PLAN(1 << 40)[1] == 1


@pytest.mark.parametrize("mode", HOST_COPY_MODES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_batch_split_across_threads_is_exact(threads, mode, intra_op_threads, monkeypatch):
    # Over the parallel threshold, with sizes that do not divide evenly, so
    # the byte split cuts descriptors; every copy routine, 1 to 3 threads.
    intra_op_threads(threads)
    monkeypatch.setenv("KVSWAP_HOST_COPY", mode)
    n_blocks, block = 700, 4099
    src = arena(n_blocks * block, seed=5)
    dst = torch.zeros_like(src)
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(0))
    sp = src.data_ptr() + torch.arange(n_blocks) * block
    dp = dst.data_ptr() + perm * block
    OP(sp, dp, torch.full((n_blocks,), block, dtype=torch.int64), 0)
    expected = torch.empty_like(src).view(n_blocks, block)
    expected[perm] = src.view(n_blocks, block)
    assert torch.equal(dst.view(n_blocks, block), expected)


def scattered_copy_case(sizes, slot, misalign, rng):
    """Descriptors for `sizes` with destinations in disjoint slots at the given
    byte misalignments and sources anywhere (sources may overlap each other).
    Returns the arenas, the descriptors and the expected destination bytes."""
    n = len(sizes)
    src = arena(slot * n + slot, seed=int(rng.integers(1 << 30)))
    dst = torch.zeros(slot * n, dtype=torch.uint8)
    src_off = rng.integers(0, slot * n, size=n)
    dst_off = rng.permutation(n) * slot + np.asarray(misalign)
    expected = dst.numpy().copy()
    s_np = src.numpy()
    for so, do, z in zip(src_off, dst_off, sizes):
        expected[do : do + z] = s_np[so : so + z]
    cols = descriptors(src.data_ptr() + src_off, dst.data_ptr() + dst_off, np.asarray(sizes, dtype=np.int64))
    return src, dst, cols, expected


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    mode=st.sampled_from(HOST_COPY_MODES),
    large=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_copy_routine_handles_any_size_and_alignment(data, mode, large, seed):
    # Streaming copies work on 32-byte-aligned destinations, 128 bytes of
    # several descriptors in turn: heads, tails and unequal sizes must come out
    # exact whatever the alignment of either side. Large examples (over 1 MiB)
    # are split across three threads, cutting descriptors; KVSWAP_HOST_COPY
    # reaches each routine (stream included) at any size.
    if large:
        pieces = data.draw(
            st.lists(st.tuples(st.integers(40_000, 80_000), st.integers(0, 63)), min_size=28, max_size=40),
            label="pieces",
        )
    else:
        pieces = data.draw(
            st.lists(st.tuples(st.integers(0, 900), st.integers(0, 63)), min_size=1, max_size=24),
            label="pieces",
        )
    sizes = [z for z, _ in pieces]
    src, dst, cols, expected = scattered_copy_case(
        sizes, max(sizes) + 64, [m for _, m in pieces], np.random.default_rng(seed)
    )
    event(f"{mode}, {'split across threads' if large else 'one part'}")
    with host_copy(mode), threads(3):
        routine, parts = PLAN(sum(sizes))
        assert routine == ("memcpy" if mode == "auto" or (mode == "stream" and not cpu_has_avx2()) else mode)
        if mode != "parallel_for":  # that one splits by descriptor, at any size
            assert (parts > 1) == large, "the example does not reach the path it was drawn for"
        OP(*cols, 0)
    assert np.array_equal(dst.numpy(), expected)


@pytest.mark.parametrize("mode", HOST_COPY_MODES)
def test_mixed_sizes_split_across_threads_are_exact(mode, monkeypatch):
    # 2.6 MB in descriptors of 1 B to 12 KB at odd alignments: several parts,
    # cut inside descriptors, streaming groups of unequal sizes.
    monkeypatch.setenv("KVSWAP_HOST_COPY", mode)
    rng = np.random.default_rng(11)
    sizes = rng.integers(1, 12_000, size=440)
    src, dst, cols, expected = scattered_copy_case(sizes, 12_032, rng.integers(0, 32, size=440), rng)
    OP(*cols, 0)
    assert np.array_equal(dst.numpy(), expected)


def test_opcheck():
    src = arena(1024, seed=6)
    dst = torch.zeros(1024, dtype=torch.uint8)
    args = (
        *descriptors(
            [src.data_ptr(), src.data_ptr() + 512], [dst.data_ptr() + 512, dst.data_ptr()], [256, 128]
        ),
        1,
    )
    results = torch.library.opcheck(OP, args)
    assert set(results.values()) == {"SUCCESS"}, results
    assert torch.equal(dst[512:768], src[:256])


@pytest.mark.skipif(
    torch.accelerator.current_accelerator() is None or torch.accelerator.device_count() > 0,
    reason="needs a torch build with an accelerator backend (e.g. a CUDA build) on a "
    "machine without its device; scripts/test_torch_matrix.sh runs CUDA builds here",
)
def test_an_accelerator_build_without_a_device_copies_on_the_host():
    # A CUDA build of torch names CUDA its accelerator with no GPU present;
    # the pointer op must not hand the copy to an engine for a device that
    # does not exist.
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    torch_kvswap.swap_blocks_batch(
        torch.tensor([src.data_ptr() + 8]),
        torch.tensor([dst.data_ptr()]),
        torch.tensor([16]),
        Direction.DEVICE_TO_HOST,
    )
    assert torch.equal(dst[:16], src[8:24]) and not dst[16:].any()
