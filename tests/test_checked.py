"""Checked mode of the ops: regions, overlapping destinations, chains, device-resident ids.

Every refusal is shown twice: in checked mode the call raises an error that
names the descriptor (and the nearest region) and no byte moves; unchecked,
the same call goes through, as it always did. The offloader's contract is in
tests/test_checked_offloader.py; docs/checked.md says what each check is for.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import torch_kvswap
from torch_kvswap import Direction
from helpers import plan_batch
from reference import read_address

OP = torch.ops.kvswap.swap_blocks_batch.default
PLAN = torch.ops.kvswap_test.plan_swap_blocks_batch.default
BLOCK = 256


@pytest.fixture(autouse=True)
def _mode_off_around_each_test():
    assert not torch_kvswap.is_checked(), "checked mode leaked into this test"
    yield
    torch_kvswap.set_checked(False)


def filled(blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (blocks, BLOCK), dtype=torch.uint8, generator=g)


class Setup:
    """A device cache (a CPU tensor standing in for device memory) and a host
    mirror, each registered, inside backings one block larger, so that a
    descriptor one block past a region writes memory the test can see."""

    def __init__(self, blocks: int = 8):
        self.cache_backing = filled(blocks + 1, seed=1)
        self.mirror_backing = filled(blocks + 1, seed=2)
        self.cache = self.cache_backing[:blocks]
        self.mirror = self.mirror_backing[:blocks]
        self.regions = [
            torch_kvswap.register_region(self.cache, side="device", label="cache"),
            torch_kvswap.register_region(self.mirror, label="mirror"),
        ]

    def close(self):
        for r in self.regions:
            r.unregister()

    def snapshot(self):
        return self.cache_backing.clone(), self.mirror_backing.clone()

    def unchanged(self, snap) -> bool:
        return torch.equal(self.cache_backing, snap[0]) and torch.equal(self.mirror_backing, snap[1])


@pytest.fixture
def setup():
    s = Setup()
    yield s
    s.close()


def blocks_of(t: torch.Tensor, ids, offset: int = 0) -> list[int]:
    return [t.data_ptr() + i * BLOCK + offset for i in ids]


def call(src, dst, sizes, direction):
    def as_t(v):
        return torch.tensor(v, dtype=torch.int64)

    OP(as_t(src), as_t(dst), as_t(sizes), int(direction))


# --- the mode switch --------------------------------------------------------------------


def test_checked_mode_is_off_by_default_and_on_inside_nested_blocks():
    assert not torch_kvswap.is_checked()
    with torch_kvswap.checked():
        assert torch_kvswap.is_checked()
        with torch_kvswap.checked():
            assert torch_kvswap.is_checked()
        assert torch_kvswap.is_checked()
    assert not torch_kvswap.is_checked()


def test_checked_mode_is_process_wide_so_other_threads_copies_are_checked_too():
    seen = []
    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        inside.wait()
        seen.append(torch_kvswap.is_checked())
        leave.set()

    t = threading.Thread(target=other_thread)
    t.start()
    with torch_kvswap.checked():
        inside.set()
        leave.wait()
    t.join()
    assert seen == [True]
    assert not torch_kvswap.is_checked()


def test_set_checked_turns_it_on_until_turned_off_and_blocks_keep_it_on():
    torch_kvswap.set_checked(True)
    assert torch_kvswap.is_checked()
    with torch_kvswap.checked():
        torch_kvswap.set_checked(False)
        assert torch_kvswap.is_checked()  # the open block keeps it on
    assert not torch_kvswap.is_checked()


@pytest.mark.parametrize("value,on", [("1", True), ("0", False), ("", False)])
def test_kvswap_check_in_the_environment_turns_it_on_at_import(value, on):
    env = dict(os.environ, KVSWAP_CHECK=value)
    out = subprocess.run(
        [sys.executable, "-c", "import torch_kvswap; print(torch_kvswap.is_checked())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(on)


# --- regions ----------------------------------------------------------------------------


def test_descriptors_inside_registered_regions_copy_as_unchecked(setup):
    src = blocks_of(setup.cache, [5, 0, 7])
    dst = blocks_of(setup.mirror, [0, 3, 7])
    expected = setup.mirror_backing.clone()
    expected[[0, 3, 7]] = setup.cache[[5, 0, 7]]
    with torch_kvswap.checked():
        call(src, dst, [BLOCK] * 3, Direction.DEVICE_TO_HOST)
    assert torch.equal(setup.mirror_backing, expected)


# Each case: (name, builds (src, dst, sizes, direction) from a Setup, regex of the message).
REFUSED = {
    # A destination id one past the mirror's last block: the off-by-one.
    "destination-one-block-past-the-region": (
        lambda s: (
            blocks_of(s.cache, [0, 1, 2]),
            blocks_of(s.mirror, [6, 7, 8]),
            [BLOCK] * 3,
            Direction.DEVICE_TO_HOST,
        ),
        r"dst_ptrs\[2\] = 0x[0-9a-f]+ \(\+256 bytes\) is not inside any registered host region; "
        r"the nearest host region is 'mirror' \[0x[0-9a-f]+, 0x[0-9a-f]+\), 0 bytes after its end",
    ),
    "destination-running-past-the-region-end": (
        lambda s: (
            blocks_of(s.cache, [0]),
            blocks_of(s.mirror, [7], offset=8),
            [BLOCK],
            Direction.DEVICE_TO_HOST,
        ),
        r"dst_ptrs\[0\] .* 'mirror' .* running 8 bytes past its end",
    ),
    "source-outside-every-region": (
        lambda s: (
            blocks_of(s.cache_backing, [8]),
            blocks_of(s.mirror, [0]),
            [BLOCK],
            Direction.DEVICE_TO_HOST,
        ),
        r"src_ptrs\[0\] = .* not inside any registered device region; the nearest device "
        r"region is 'cache'",
    ),
    # Direction says host->device, but the source is the device cache: the
    # descriptors are aimed at the wrong buffers.
    "direction-reversed": (
        lambda s: (blocks_of(s.cache, [0]), blocks_of(s.mirror, [0]), [BLOCK], Direction.HOST_TO_DEVICE),
        r"src_ptrs\[0\] = .* not inside any registered host region; the nearest host region is "
        r"'mirror'",
    ),
    "destination-of-a-device-to-device-copy-in-host-memory": (
        lambda s: (blocks_of(s.cache, [0]), blocks_of(s.mirror, [0]), [BLOCK], Direction.DEVICE_TO_DEVICE),
        r"dst_ptrs\[0\] = .* not inside any registered device region",
    ),
    "two-descriptors-write-one-block": (
        lambda s: (
            blocks_of(s.cache, [0, 1, 2]),
            blocks_of(s.mirror, [4, 5, 4]),
            [BLOCK] * 3,
            Direction.DEVICE_TO_HOST,
        ),
        r"the destinations of descriptors 0 and 2 overlap: dst_ptrs\[0\] = 0x[0-9a-f]+ \(\+256 "
        r"bytes\) and dst_ptrs\[2\]",
    ),
    "destinations-overlapping-by-one-byte": (
        lambda s: (
            blocks_of(s.cache, [0, 2]),
            [s.mirror.data_ptr(), s.mirror.data_ptr() + 255],
            [BLOCK, BLOCK],
            Direction.DEVICE_TO_HOST,
        ),
        r"the destinations of descriptors 0 and 1 overlap",
    ),
    # Within one address space (the host engine; or device to device): descriptor
    # 1 reads the block descriptor 0 writes.
    "a-chain": (
        lambda s: (
            blocks_of(s.cache, [0, 3]),
            blocks_of(s.cache, [3, 6]),
            [BLOCK] * 2,
            Direction.DEVICE_TO_DEVICE,
        ),
        r"descriptor 1 reads src_ptrs\[1\] = 0x[0-9a-f]+ \(\+256 bytes\), which descriptor 0 "
        r"writes \(dst_ptrs\[0\] = 0x[0-9a-f]+, \+256 bytes\): a chain",
    ),
    "a-chain-overlapping-by-one-byte": (
        lambda s: (
            blocks_of(s.cache, [0, 4]),
            [s.cache.data_ptr() + 4 * BLOCK - 255, s.cache.data_ptr() + 6 * BLOCK],
            [BLOCK, BLOCK],
            Direction.DEVICE_TO_DEVICE,
        ),
        r"descriptor 1 reads .* which descriptor 0 writes",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_refusal_names_the_descriptor_and_nothing_is_written(setup, case):
    build, message = REFUSED[case]
    args = build(setup)
    before = setup.snapshot()
    with torch_kvswap.checked():
        with pytest.raises(ValueError, match=r"swap_blocks_batch \(checked mode\): " + message):
            call(*args)
    assert setup.unchanged(before)


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_dry_run_refuses_exactly_like_the_op(setup, case):
    build, message = REFUSED[case]
    with torch_kvswap.checked():
        with pytest.raises(ValueError, match=message):
            plan_batch(*build(setup))


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_same_calls_pass_unchecked(setup, case):
    build, _ = REFUSED[case]
    src, dst, sizes, direction = build(setup)
    read = [read_address(a, n) for a, n in zip(src, sizes)]
    call(src, dst, sizes, direction)
    if "overlap" not in case and "chain" not in case and "write-one" not in case:
        # Unchecked, the bytes go where the descriptors say, in or out of a region.
        assert [read_address(a, n) for a, n in zip(dst, sizes)] == read


def test_with_no_region_of_that_side_the_message_says_so():
    src, dst = filled(2, seed=3), filled(2, seed=4)
    with torch_kvswap.register_region(src, side="device", label="cache"):
        with torch_kvswap.checked(), pytest.raises(ValueError, match="no host region is registered"):
            call([src.data_ptr()], [dst.data_ptr()], [BLOCK], Direction.DEVICE_TO_HOST)


def test_sources_may_repeat_and_destinations_may_touch(setup):
    # One block read twice, and destinations that meet without overlapping.
    src = blocks_of(setup.cache, [2, 2, 5])
    dst = blocks_of(setup.mirror, [0, 1, 2])
    expected = setup.mirror_backing.clone()
    expected[[0, 1, 2]] = setup.cache[[2, 2, 5]]
    with torch_kvswap.checked():
        call(src, dst, [BLOCK] * 3, Direction.DEVICE_TO_HOST)
    assert torch.equal(setup.mirror_backing, expected)


def test_a_chain_that_only_touches_is_not_a_chain(setup):
    # Descriptor 0 reads the block right before the one it writes, descriptor
    # 1 the block right after it: both touch block 3 from outside.
    src = blocks_of(setup.cache, [2, 4])
    dst = blocks_of(setup.cache, [3, 6])
    expected = setup.cache_backing.clone()
    expected[[3, 6]] = setup.cache[[2, 4]]
    with torch_kvswap.checked():
        call(src, dst, [BLOCK] * 2, Direction.DEVICE_TO_DEVICE)
    assert torch.equal(setup.cache_backing, expected)


def test_zero_byte_descriptors_are_not_checked(setup):
    with torch_kvswap.checked():
        call(
            [12345, setup.cache.data_ptr()],
            [64, setup.mirror.data_ptr()],
            [0, BLOCK],
            Direction.DEVICE_TO_HOST,
        )
    assert torch.equal(setup.mirror[0], setup.cache[0])


@pytest.mark.parametrize("shuffled", [False, True])
def test_four_thousand_descriptors_in_any_order_are_checked_exactly(shuffled):
    # Exercises the sort: one repeated destination among 4,096 is found, and
    # a permutation with none copies exactly.
    n, block = 4096, 64
    cache = filled(n * block // BLOCK, seed=5).view(n, block)
    mirror = torch.zeros(n, block, dtype=torch.uint8)
    rng = np.random.default_rng(7)
    sid = rng.permutation(n) if shuffled else np.arange(n)
    did = rng.permutation(n) if shuffled else np.arange(n)
    src = torch.from_numpy(cache.data_ptr() + sid * block)
    dst = torch.from_numpy(mirror.data_ptr() + did * block)
    sizes = torch.full((n,), block, dtype=torch.int64)
    with torch_kvswap.register_region(cache, side="device"), torch_kvswap.register_region(mirror):
        with torch_kvswap.checked():
            bad = dst.clone()
            bad[n - 1] = bad[n // 3]
            lo, hi = sorted((n // 3, n - 1))
            with pytest.raises(ValueError, match=f"destinations of descriptors {lo} and {hi} overlap"):
                OP(src, bad, sizes, int(Direction.DEVICE_TO_HOST))
            assert not mirror.any()
            OP(src, dst, sizes, int(Direction.DEVICE_TO_HOST))
    expected = torch.zeros_like(mirror)
    expected[torch.from_numpy(did)] = cache[torch.from_numpy(sid)]
    assert torch.equal(mirror, expected)


def test_regions_nested_in_each_other_and_descriptors_spanning_two_are_refused():
    outer = filled(8, seed=8)
    mirror = torch.zeros(8, BLOCK, dtype=torch.uint8)
    with (
        torch_kvswap.register_region(outer, side="device", label="outer"),
        torch_kvswap.register_region(outer[2:3], side="device", label="inner"),
        torch_kvswap.register_region(mirror[:4], label="low"),
        torch_kvswap.register_region(mirror[4:], label="high"),
    ):
        with torch_kvswap.checked():
            # Inside the outer region, though past the inner one: fine.
            call(blocks_of(outer, [5]), blocks_of(mirror, [1]), [BLOCK], Direction.DEVICE_TO_HOST)
            assert torch.equal(mirror[1], outer[5])
            # Two adjacent regions are two regions: a copy spanning both is refused.
            with pytest.raises(ValueError, match=r"dst_ptrs\[0\] .* 'low' .* running 256 bytes"):
                call([outer.data_ptr()], blocks_of(mirror, [3]), [2 * BLOCK], Direction.DEVICE_TO_HOST)
    assert not mirror[3:5].any()


def test_regions_are_weak_and_can_be_unregistered():
    labels = torch.ops.kvswap_test.region_labels
    t = torch.zeros(16, dtype=torch.uint8)
    region = torch_kvswap.register_region(t, label="short-lived")
    assert "host:short-lived" in labels()
    del t
    gc.collect()
    assert "host:short-lived" not in labels()  # its memory was freed: the region is gone
    assert not region.unregister()
    kept = torch.zeros(16, dtype=torch.uint8)
    region = torch_kvswap.register_region(kept, side="device", label="kept")
    assert "device:kept" in labels()
    assert region.unregister()
    assert "device:kept" not in labels()
    assert not region.unregister()


def test_register_region_checks_its_arguments():
    t = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="side must be 'host' or 'device', got 'gpu'"):
        torch_kvswap.register_region(t, side="gpu")
    with pytest.raises(ValueError, match="region 'nothing' is empty"):
        torch_kvswap.register_region(t[:0], label="nothing")


def test_a_strided_region_spans_its_first_to_last_element():
    t = torch.zeros(4, 2, BLOCK, dtype=torch.uint8)
    half = t[:, 0]  # blocks 0, 2, 4, 6 of the buffer
    src = filled(1, seed=9)
    with (
        torch_kvswap.register_region(half, side="device", label="half"),
        torch_kvswap.register_region(src, label="src"),
        torch_kvswap.checked(),
    ):
        call([src.data_ptr()], [half[3].data_ptr()], [BLOCK], Direction.HOST_TO_DEVICE)
        with pytest.raises(ValueError, match=r"'half' .* 0 bytes after its end"):
            call([src.data_ptr()], [t[3, 1].data_ptr()], [BLOCK], Direction.HOST_TO_DEVICE)
    assert torch.equal(t[3, 0], src[0])


# --- torch.compile ----------------------------------------------------------------------


def test_checks_run_in_the_compiled_graphs_eager_kernel_without_breaking_fullgraph(setup):
    def fn(src, dst, sizes):
        torch.ops.kvswap.swap_blocks_batch.default(src, dst, sizes, int(Direction.DEVICE_TO_HOST))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")

    def as_t(v):
        return torch.tensor(v, dtype=torch.int64)

    good = (as_t(blocks_of(setup.cache, [1])), as_t(blocks_of(setup.mirror, [2])), as_t([BLOCK]))
    bad = (as_t(blocks_of(setup.cache, [1])), as_t(blocks_of(setup.mirror, [8])), as_t([BLOCK]))
    before = setup.snapshot()
    with torch_kvswap.checked():
        with pytest.raises(ValueError, match=r"dst_ptrs\[0\] .* not inside any registered host"):
            compiled(*bad)
        assert setup.unchanged(before)
        compiled(*good)
    assert torch.equal(setup.mirror[2], setup.cache[1])
    compiled(*bad)  # unchecked: the same graph copies
    assert torch.equal(setup.mirror_backing[8], setup.cache[1])


def test_registering_a_region_inside_a_compiled_graph_is_refused():
    def fn(t):
        return torch.ops.kvswap._register_region(t, "host", "x")

    with pytest.raises(Exception, match="register_region is an eager call"):
        torch.compile(fn, fullgraph=True, backend="eager")(torch.zeros(4))


# --- block ids on the device (the CUDA kernel path, on the fake CUDA runtime) ------------


@pytest.fixture
def fake_cuda_devices():
    return 2


@pytest.fixture
def fake_cuda_kernel(fake_cuda):
    """The fake CUDA runtime (conftest.py) with a stream current on device 0
    and the copy kernel chosen: it reads ids on the device, never on the host."""
    stream = fake_cuda.create_stream(0, False)
    fake_cuda.set_stream(0, stream)
    torch_kvswap.set_copy_method("kernel")
    yield fake_cuda, stream


def device_ids(F, values):
    return F.device_copy(torch.tensor(values, dtype=torch.int64), 0)


@pytest.mark.parametrize(
    "did,error,message",
    [
        ([2, 2], ValueError, r"dst_block_ids\[0\] and dst_block_ids\[1\] are both 2"),
        ([2, 4], IndexError, r"dst_block_ids\[1\] = 4 is out of range for dst_caches\[0\], which has 4"),
    ],
)
def test_device_resident_ids_are_checked_like_host_ids(fake_cuda_kernel, did, error, message):
    F, stream = fake_cuda_kernel
    src = [F.device_copy(filled(4, seed=10), 0)]
    dst = [F.pinned_copy(torch.zeros(4, BLOCK, dtype=torch.uint8))]
    sid, did_t = device_ids(F, [0, 1]), device_ids(F, did)
    with torch_kvswap.checked(), pytest.raises(error, match=message):
        torch_kvswap.swap_blocks(src, dst, sid, did_t)
    assert F.synchronize(stream) == "cudaSuccess"
    assert F.launches() == [] and not dst[0].any()
    # Unchecked, the kernel runs: a repeated block is written twice, an id
    # out of range is skipped on the device.
    torch_kvswap.swap_blocks(src, dst, sid, did_t)
    assert F.synchronize(stream) == "cudaSuccess"
    assert F.launches() != [] and dst[0][2].any()


CAPTURE_SCRIPT = textwrap.dedent("""
    import torch
    import torch_kvswap
    import torch_kvswap._fake_cuda
    F = torch.ops.kvswap_fake_cuda
    F.install()
    F.reset(2)
    s = F.create_stream(0, False)
    F.set_stream(0, s)
    src = [F.device_copy(torch.zeros(4, 256, dtype=torch.uint8), 0)]
    dst = [F.pinned_copy(torch.zeros(4, 256, dtype=torch.uint8))]
    sid = F.device_copy(torch.tensor([0, 1]), 0)
    did = F.device_copy(torch.tensor([2, 2]), 0)  # a repeat that only a read-back finds
    torch_kvswap.set_copy_method("kernel")
    with torch_kvswap.checked():
        for _ in range(2):
            assert F.begin_capture(s, 0) == "cudaSuccess"
            torch_kvswap.swap_blocks(src, dst, sid, did)
            print(F.end_capture(s)[0])
""")


def test_device_resident_ids_are_not_read_back_under_capture_and_one_warning_says_so():
    pytest.importorskip("torch_kvswap._fake_cuda")
    out = subprocess.run([sys.executable, "-c", CAPTURE_SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # Both captures are valid: nothing was read back. The warning comes from
    # the core's log (stderr), once.
    assert out.stdout.split() == ["cudaSuccess", "cudaSuccess"], out.stdout + out.stderr
    assert (
        out.stderr.count(
            "block ids on the device are not checked while the stream of cuda:0 is being captured"
        )
        == 1
    ), out.stderr


# ---------------------------------------------------------------- the vLLM plug-ins' switch


@pytest.mark.parametrize(
    "extra, on",
    [({"kvswap_check": True}, True), ({"kvswap_check": False}, False), ({}, False), (None, False)],
)
def test_vllm_extra_config_key_turns_checked_mode_on(extra, on):
    from torch_kvswap.integrations.vllm.compat import apply_check_option

    assert not torch_kvswap.is_checked()
    try:
        assert apply_check_option(extra) is on
        assert torch_kvswap.is_checked() is on
    finally:
        torch_kvswap.set_checked(False)


def test_vllm_extra_config_check_key_must_be_a_boolean():
    from torch_kvswap.integrations.vllm.compat import apply_check_option

    with pytest.raises(
        ValueError, match=r"kv_connector_extra_config\['kvswap_check'\] must be true or false, got 'yes'"
    ):
        apply_check_option({"kvswap_check": "yes"})
    assert not torch_kvswap.is_checked()


# --- calls of 64 descriptors or more: checked without a sort first -------------------------------
#
# Such a call is first checked by marking its destinations in a bitmap of
# units (their common alignment); only a call that may fail takes the sorting
# walks, which name the descriptor. These cases hold one pool of device
# memory (so sources and destinations share an address space and chains are
# possible, device to device on the host engine) and compare the verdict with
# a plain reference over every pair, one possible fault per case, many of
# them exactly at a boundary.

POOL, GRAIN = 1 << 16, 16


def reference_refuses(src, dst, sizes, regions) -> bool:
    live = [(int(s), int(d), int(z)) for s, d, z in zip(src, dst, sizes) if z > 0]

    def inside(a, b):
        return any(r0 <= a and b <= r1 for r0, r1 in regions)

    if not all(inside(s, s + z) and inside(d, d + z) for s, d, z in live):
        return True
    for i, (si, di, zi) in enumerate(live):
        for j, (_sj, dj, zj) in enumerate(live):
            if i != j and di < dj + zj and dj < di + zi:
                return True  # two destinations overlap
            if si < dj + zj and dj < si + zi:
                return True  # a chain (i == j: a descriptor reading its own destination)
    return False


def unsorted_case(seed: int):
    """A valid call of 64-160 descriptors in random order, then one change:
    none, or a destination or a source moved onto, next to, or past
    something, by a grain or half of one, or exactly to the edge."""
    rng = np.random.default_rng(seed)
    slot = int(rng.choice([64, 96, 256]))  # each descriptor's share of its half of the pool
    n = int(rng.integers(64, min(160, POOL // 2 // slot) + 1))
    sizes = rng.integers(1, slot // GRAIN + 1, n) * GRAIN
    sizes[rng.random(n) < 0.05] = 0  # zero-byte descriptors copy nothing
    half = POOL // 2
    dst = rng.permutation(half // slot)[:n] * slot  # disjoint slots in the first half
    src = half + rng.permutation(half // slot)[:n] * slot  # in the second half
    if rng.random() < 0.5:  # sources off the destinations' grid by half a grain
        src = src + GRAIN // 2 * rng.integers(0, 2, n)
    live = np.flatnonzero(sizes > 0)
    i, j = rng.choice(live, 2, replace=False)
    fault = int(rng.integers(0, 7))
    if fault == 1:  # a destination onto another's last grain, or just after it
        dst[i] = dst[j] + sizes[j] - GRAIN * int(rng.integers(0, 2))
    elif fault == 2:  # a destination ending on another's first grain, or just before it
        dst[i] = dst[j] - sizes[i] + GRAIN * int(rng.integers(0, 2))
    elif fault == 3:  # a source onto another's destination by 0, 1/2 or 1 grain
        src[i] = dst[j] + sizes[j] - GRAIN // 2 * int(rng.integers(0, 3))
    elif fault == 4:  # a source ending 0, 1/2 or 1 grain into a destination
        src[i] = dst[j] - sizes[i] + GRAIN // 2 * int(rng.integers(0, 3))
    elif fault == 5:  # a destination at the pool's end, or a grain past it
        dst[i] = POOL - sizes[i] + GRAIN * int(rng.integers(0, 2))
    elif fault == 6:  # a source at the pool's end, or a grain past it
        src[i] = POOL - sizes[i] + GRAIN * int(rng.integers(0, 2))
    order = rng.permutation(n)
    return src[order], dst[order], sizes[order]


def test_large_calls_in_any_order_get_the_reference_verdict():
    backing = torch.zeros(POOL + 4096, dtype=torch.uint8)
    pool = backing[:POOL]
    base = pool.data_ptr()
    verdicts = {True: 0, False: 0}
    with torch_kvswap.register_region(pool, side="device", label="pool"), torch_kvswap.checked():
        for seed in range(400):
            src, dst, sizes = unsorted_case(seed)
            expected = reference_refuses(src, dst, sizes, [(0, POOL)])
            args = (
                torch.from_numpy(base + src),
                torch.from_numpy(base + dst),
                torch.from_numpy(sizes.astype(np.int64)),
                int(Direction.DEVICE_TO_DEVICE),
            )
            try:
                PLAN(*args)
                refused = False
            except ValueError:
                refused = True
            assert refused == expected, f"seed {seed}: refused={refused}, reference says {expected}"
            verdicts[refused] += 1
    # Both verdicts are well represented, so neither half of the check goes untested.
    assert min(verdicts.values()) >= 100, verdicts


def test_a_large_call_that_fails_names_the_same_descriptors_as_a_small_one():
    backing = torch.zeros(POOL, dtype=torch.uint8)
    base = backing.data_ptr()
    n, block = 128, 256
    rng = np.random.default_rng(3)
    dst = rng.permutation(n) * block
    src = POOL // 2 + rng.permutation(n) * block
    dst[100] = dst[7] + block // 2  # descriptors 7 and 100 overlap
    with torch_kvswap.register_region(backing, side="device"), torch_kvswap.checked():
        with pytest.raises(ValueError, match="destinations of descriptors 7 and 100 overlap"):
            PLAN(
                torch.from_numpy(base + src),
                torch.from_numpy(base + dst),
                torch.full((n,), block, dtype=torch.int64),
                int(Direction.DEVICE_TO_DEVICE),
            )
