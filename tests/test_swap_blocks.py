"""kvswap::swap_blocks — the tensor op, on the host engine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_kvswap
from helpers import ids, plan_blocks
from reference import swap_blocks_ref

OP = torch.ops.kvswap.swap_blocks.default
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8]


def random_cache(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def layouts(num_blocks, dtype, seed):
    """Cache lists as an offload handler holds them: (name, src list, dst list)."""
    per_block = (4, 2, 8)  # e.g. block_size, heads, head_dim
    # One tensor per layer.
    per_layer = [random_cache((num_blocks, *per_block), dtype, seed + i) for i in range(3)]
    # A (key, value) pair per layer, flattened to halves.
    kv = [random_cache((num_blocks, *per_block), dtype, seed + 10 + i) for i in range(4)]
    # A [2, num_blocks, ...] stacked cache passed as its two halves.
    stacked = random_cache((2, num_blocks, *per_block), dtype, seed + 20)
    # A [num_blocks, 2, ...] cache: its halves have a dim-0 stride of two blocks.
    interleaved = random_cache((num_blocks, 2, *per_block), dtype, seed + 30)
    return [
        ("per_layer", per_layer),
        ("kv_halves", kv),
        ("stacked", [stacked[0], stacked[1]]),
        ("interleaved", [interleaved[:, 0], interleaved[:, 1]]),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["per_layer", "kv_halves", "stacked", "interleaved"])
def test_copies_blocks_between_caches_like_index_copy(dtype, layout):
    src = dict(layouts(16, dtype, seed=1))[layout]
    dst = [torch.zeros((32, *t.shape[1:]), dtype=dtype) for t in src]
    src_ids, dst_ids = ids([3, 0, 15, 7, 8, 9]), ids([31, 1, 2, 3, 20, 21])
    expected = swap_blocks_ref(src, dst, src_ids, dst_ids)
    torch_kvswap.swap_blocks(src, dst, src_ids, dst_ids)
    for got, want in zip(dst, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("layout", ["per_layer", "stacked", "interleaved"])
def test_writes_into_strided_destinations(layout):
    dst = dict(layouts(16, torch.float16, seed=2))[layout]
    src = [random_cache(t.shape, torch.float16, seed=40 + i) for i, t in enumerate(dst)]
    before = [t.clone() for t in dst]
    # Scattered ids, then runs that advance by one on both sides.
    torch_kvswap.swap_blocks(src, dst, ids([1, 2, 3]), ids([9, 4, 0]))
    torch_kvswap.swap_blocks(src, dst, ids([5, 6, 7]), ids([11, 12, 13]))
    for s, d, b in zip(src, dst, before):
        want = b.clone()
        want[[9, 4, 0]] = s[[1, 2, 3]]
        want[[11, 12, 13]] = s[[5, 6, 7]]
        assert torch.equal(d, want)


def test_leaves_other_blocks_untouched():
    src = [random_cache((8, 16), torch.float32, 3)]
    dst = [torch.full((8, 16), -1.0)]
    torch_kvswap.swap_blocks(src, dst, ids([2]), ids([5]))
    mask = torch.ones(8, dtype=torch.bool)
    mask[5] = False
    assert torch.equal(dst[0][mask], torch.full((7, 16), -1.0))


def test_the_last_block_is_in_range_on_both_sides():
    # id == num_blocks - 1 is the last valid id (num_blocks itself is refused:
    # tests/malformed_cases.py, *_equal_to_num_blocks*), for every tensor of
    # a list, including one with fewer blocks than the others.
    src = [random_cache((8, 4), torch.float32, 11), random_cache((5, 4), torch.float32, 12)]
    dst = [torch.zeros(6, 4), torch.zeros(3, 4)]
    expected = swap_blocks_ref(src, dst, ids([4, 0]), ids([2, 0]))
    torch_kvswap.swap_blocks(src, dst, ids([4, 0]), ids([2, 0]))
    for got, want in zip(dst, expected):
        assert torch.equal(got, want)
    assert plan_blocks(src, dst, ids([4]), ids([2]))[2] == [16, 16]


def test_neighbouring_caches_in_one_buffer_are_distinct_memory():
    # buf[:8] ends where buf[8:] begins: touching, not overlapping.
    buf = random_cache((16, 4), torch.float32, 13)
    want = buf.clone()
    want[8 + 5] = buf[2]
    torch_kvswap.swap_blocks([buf[:8]], [buf[8:]], ids([2]), ids([5]))
    assert torch.equal(buf, want)


def test_same_cache_copy_between_distinct_blocks():
    cache = random_cache((10, 4), torch.float32, 4)
    want = cache.clone()
    want[[7, 8]] = cache[[1, 2]]
    torch_kvswap.swap_blocks([cache], [cache], ids([1, 2]), ids([7, 8]))
    assert torch.equal(cache, want)


def test_empty_id_lists_copy_nothing():
    src, dst = [torch.ones(4, 4)], [torch.zeros(4, 4)]
    torch_kvswap.swap_blocks(src, dst, ids([]), ids([]))
    assert torch.equal(dst[0], torch.zeros(4, 4))


# Calls with nothing to copy (no ids, no caches, zero-byte blocks) reach no
# engine: tests/test_fake_device.py::test_calls_with_nothing_to_copy_*.


def test_non_contiguous_id_tensors():
    src, dst = [random_cache((8, 4), torch.float32, 5)], [torch.zeros(8, 4)]
    table = ids([[1, 6], [2, 7], [3, 0]])
    torch_kvswap.swap_blocks(src, dst, table[:, 0], table[:, 1])
    assert torch.equal(dst[0], swap_blocks_ref(src, [torch.zeros(8, 4)], ids([1, 2, 3]), ids([6, 7, 0]))[0])


def test_runs_of_consecutive_blocks_become_one_descriptor():
    src, dst = torch.zeros(16, 32, dtype=torch.uint8), torch.zeros(16, 32, dtype=torch.uint8)
    s, d = src.data_ptr(), dst.data_ptr()
    got = plan_blocks([src], [dst], ids([4, 5, 6, 9, 10]), ids([0, 1, 2, 3, 7]))
    # [4,5,6]->[0,1,2] is one run; 9->3 and 10->7 are not consecutive on the destination.
    assert got == [[s + 4 * 32, s + 9 * 32, s + 10 * 32], [d, d + 3 * 32, d + 7 * 32], [96, 32, 32]]


def test_host_copies_are_issued_in_source_address_order():
    # Order is free (the copies are independent); address order reads faster,
    # and lets runs merge that were split in the caller's order.
    src, dst = torch.zeros(16, 32, dtype=torch.uint8), torch.zeros(16, 32, dtype=torch.uint8)
    s, d = src.data_ptr(), dst.data_ptr()
    got = plan_blocks([src], [dst], ids([9, 4, 5, 0]), ids([1, 6, 7, 12]))
    assert got == [[s, s + 4 * 32, s + 9 * 32], [d + 12 * 32, d + 6 * 32, d + 32], [32, 64, 32]]


def test_sparse_ids_in_a_large_cache_are_ordered_too():
    src, dst = [random_cache((1000, 8), torch.float32, 9)], [torch.zeros(1000, 8)]
    src_ids, dst_ids = ids([900, 3, 500]), ids([0, 999, 10])
    got = plan_blocks(src, dst, src_ids, dst_ids)
    assert got[0] == [src[0].data_ptr() + b * 32 for b in (3, 500, 900)]
    expected = swap_blocks_ref(src, dst, src_ids, dst_ids)
    torch_kvswap.swap_blocks(src, dst, src_ids, dst_ids)
    assert torch.equal(dst[0], expected[0])


def test_strided_caches_get_one_descriptor_per_block():
    stacked = torch.zeros(8, 2, 16, dtype=torch.uint8)  # halves have a 32-byte dim-0 stride
    dst = torch.zeros(8, 16, dtype=torch.uint8)
    got = plan_blocks([stacked[:, 1]], [dst], ids([0, 1]), ids([0, 1]))
    base = stacked.data_ptr() + 16
    assert got == [[base, base + 32], [dst.data_ptr(), dst.data_ptr() + 16], [16, 16]]
    # The same with the strided cache as the destination.
    got = plan_blocks([dst], [stacked[:, 1]], ids([0, 1]), ids([0, 1]))
    assert got == [[dst.data_ptr(), dst.data_ptr() + 16], [base, base + 32], [16, 16]]


@settings(max_examples=50, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    num_src=st.integers(1, 12),
    num_dst=st.integers(1, 12),
    tail=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    pairs=st.integers(1, 3),
)
def test_matches_index_copy_reference(data, dtype, num_src, num_dst, tail, pairs):
    src = [random_cache((num_src, *tail), dtype, seed=i) for i in range(pairs)]
    dst = [random_cache((num_dst, *tail), dtype, seed=100 + i) for i in range(pairs)]
    n = data.draw(st.integers(0, min(num_src, num_dst)))
    dst_ids = data.draw(st.permutations(range(num_dst)))[:n]
    src_ids = data.draw(st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n))
    expected = swap_blocks_ref(src, dst, src_ids, dst_ids)
    OP(src, dst, ids(src_ids), ids(list(dst_ids)))
    for got, want in zip(dst, expected):
        assert torch.equal(got, want)


def test_opcheck():
    src = [random_cache((6, 2, 4), torch.bfloat16, 7), random_cache((6, 2, 4), torch.bfloat16, 8)]
    dst = [torch.zeros(9, 2, 4, dtype=torch.bfloat16), torch.zeros(9, 2, 4, dtype=torch.bfloat16)]
    results = torch.library.opcheck(OP, (src, dst, ids([0, 5, 2]), ids([8, 1, 3])))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("mode", ["auto", "stream"])
def test_calls_from_several_threads_at_once_are_all_exact(mode, monkeypatch):
    """Offload handlers copy from worker threads; each call gets torch's
    intra-op threads of its own calling thread, and none disturbs another."""
    import threading
    import time

    monkeypatch.setenv("KVSWAP_HOST_COPY", mode)
    jobs = []
    for j in range(4):
        src = [random_cache((96, 16384), torch.uint8, 40 + j) for _ in range(2)]  # 3 MiB per call
        dst = [torch.zeros(96, 16384, dtype=torch.uint8) for _ in range(2)]
        perm = torch.randperm(96, generator=torch.Generator().manual_seed(j))
        jobs.append((src, dst, perm))
    errors = []

    def run(src, dst, perm):
        try:
            for _ in range(5):
                torch_kvswap.swap_blocks(src, dst, torch.arange(96), perm)
        except Exception as exc:  # pragma: no cover - reported below  # noqa: BLE001
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=job, name=f"copier-{j}", daemon=True) for j, job in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30  # 20 copies of 6 MiB: well under a second
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"{hung} still inside swap_blocks after 30 s (5 calls of 6 MiB each)"
    assert not errors, errors
    for src, dst, perm in jobs:
        for s, d in zip(src, dst):
            expected = torch.empty_like(s)
            expected[perm] = s
            assert torch.equal(d, expected)


def test_host_engine_works_in_a_forked_child(capfd):
    """Data-loader style workers fork after the copy threads ran; the child still copies.

    The engine copies on torch's OpenMP threads, which do not survive fork():
    in a forked child it copies on the calling thread instead of hanging. The
    child first asks the engine how it would copy (and exits at once if the
    answer is "on the threads"), then copies under a 10 s watchdog that prints
    where it hung. It runs only the op and numpy: torch's own OpenMP kernels
    hang there once the parent has used them, which is torch's limit, not ours.
    """
    import os

    src = [random_cache((64, 32768), torch.uint8, 10)]  # 2 MiB: split across the threads
    dst = [torch.zeros(64, 32768, dtype=torch.uint8)]
    out = [torch.zeros(64, 32768, dtype=torch.uint8)]
    fwd, rev = torch.arange(64), torch.arange(64).flip(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        assert torch.ops.kvswap_test.host_copy_plan(2 << 20)[1] > 1  # the parent splits 2 MiB
        torch_kvswap.swap_blocks(src, dst, fwd, rev)  # starts the OpenMP threads in the parent
        status = _run_in_forked_child(src, out, fwd, capfd)
    finally:
        torch.set_num_threads(threads)
    assert os.WIFEXITED(status), f"the forked child was killed by signal {os.WTERMSIG(status)}"
    assert os.WEXITSTATUS(status) == 0, (
        {
            1: "the forked child hung in swap_blocks for 10 s (traceback below)",
            2: "the forked child copied the wrong bytes",
            3: "in the forked child the engine would still copy on the OpenMP threads",
        }.get(os.WEXITSTATUS(status), f"exit code {os.WEXITSTATUS(status)}")
        + "\n"
        + capfd.readouterr().err
    )
    assert torch.equal(dst[0], src[0].flip(0))


def _run_in_forked_child(src, out, ids, capfd) -> int:
    """Copies src into out in a forked child; returns its wait status."""
    import faulthandler
    import os
    import time

    import numpy as np

    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            if torch.ops.kvswap_test.host_copy_plan(2 << 20)[1] != 1:
                os.write(2, b"forked child: the engine would copy on the OpenMP threads\n")
                code = 3
            else:
                faulthandler.dump_traceback_later(10, exit=True)
                torch_kvswap.swap_blocks(src, out, ids, ids)
                code = 0 if np.array_equal(out[0].numpy(), src[0].numpy()) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError(
                "the forked child hung for 20 s in swap_blocks; stderr: " + capfd.readouterr().err
            )
        time.sleep(0.01)


@pytest.mark.parametrize("which", ["src_block_ids", "dst_block_ids"])
def test_meta_ids_with_real_caches_are_refused(which):
    src, dst = torch.ones(4, 2), torch.zeros(4, 2)
    block_ids = {"src_block_ids": torch.tensor([0]), "dst_block_ids": torch.tensor([1])}
    block_ids[which] = block_ids[which].to("meta")
    with pytest.raises(
        RuntimeError,
        match=rf"{which} is on the meta device and holds no values, "
        r"but src_caches\[0\] is a real tensor on cpu",
    ):
        torch_kvswap.swap_blocks([src], [dst], **block_ids)
    assert torch.equal(dst, torch.zeros(4, 2))


def test_meta_sources_with_real_destinations_are_refused():
    dst = torch.zeros(4, 2)
    with pytest.raises(
        RuntimeError,
        match=r"src_caches\[0\] is on the meta device and holds no "
        r"values, but dst_caches\[0\] is a real tensor on cpu",
    ):
        torch_kvswap.swap_blocks(
            [torch.empty(4, 2, device="meta")], [dst], torch.tensor([0]), torch.tensor([1])
        )
    assert torch.equal(dst, torch.zeros(4, 2))


def test_meta_caches_with_meta_ids_check_shapes_only():
    dst = torch.empty(4, 2, device="meta")
    torch_kvswap.swap_blocks(
        [torch.empty(4, 2, device="meta")],
        [dst],
        torch.tensor([0], device="meta"),
        torch.tensor([1], device="meta"),
    )
    assert dst.shape == (4, 2)


def test_blocks_without_elements_copy_nothing():
    # [num_blocks, 4, 0]: dim 1's stride says nothing about a block with no bytes.
    src, dst = torch.zeros(8, 4, 0), torch.zeros(8, 4, 0)
    torch_kvswap.swap_blocks([src], [dst], ids([7, 0]), ids([1, 2]))
    assert plan_blocks([src], [dst], ids([7]), ids([1])) == [[], [], []]


def test_k_half_copies_into_the_v_half_of_one_cache():
    # [num_blocks, 2, W]: the halves interleave on one stride and share no byte.
    cache = random_cache((8, 2, 16), torch.float32, seed=5)
    want = cache.clone()
    want[:, 1][ids([0, 3, 7])] = want[:, 0][ids([2, 3, 5])]
    torch_kvswap.swap_blocks([cache[:, 0]], [cache[:, 1]], ids([2, 3, 5]), ids([0, 3, 7]))
    assert torch.equal(cache, want)


def test_dtype_mismatch_names_torch_dtypes():
    with pytest.raises(
        TypeError, match=r"src_caches\[0\] is torch\.bfloat16 but dst_caches\[0\] is torch\.float16"
    ):
        torch_kvswap.swap_blocks(
            [torch.zeros(4, 2, dtype=torch.bfloat16)],
            [torch.zeros(4, 2, dtype=torch.float16)],
            ids([0]),
            ids([1]),
        )
