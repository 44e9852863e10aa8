"""What the core hands an engine, seen through a recording engine (tests/fake_device.py).

These run on any machine: accelerator caches are stand-ins on
``privateuseone`` whose memory is host memory, and the engine is a recording
engine installed in the core (the test extension's) that records each call
and copies with memmove.
"""

from __future__ import annotations

import pytest
import torch

import torch_kvswap
from fake_device import engine_spy, on_fake_device
from helpers import ids
from reference import swap_blocks_ref
from torch_kvswap import Direction

EMPTY = torch.empty(0, dtype=torch.int64)


def caches(num_blocks, seed, pairs=2, width=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (num_blocks, width), generator=g, dtype=torch.int32) for _ in range(pairs)]


@pytest.mark.parametrize(
    "route,direction",
    [
        ("host_to_device", Direction.HOST_TO_DEVICE),
        ("device_to_host", Direction.DEVICE_TO_HOST),
        ("device_to_device", Direction.DEVICE_TO_DEVICE),
    ],
)
def test_each_route_hands_the_engine_its_direction_code(route, direction):
    # The core picks the route from the caches' devices and passes the C++
    # enum's value to the engine: the public code of torch_kvswap.Direction.
    src_host, dst_host = caches(8, seed=1), caches(6, seed=2)
    expected = swap_blocks_ref(src_host, dst_host, ids([7, 0, 3]), ids([5, 1, 2]))
    src = [on_fake_device(t) for t in src_host] if route != "host_to_device" else src_host
    dst = [on_fake_device(t) for t in dst_host] if route != "device_to_host" else dst_host
    with engine_spy("PrivateUse1") as calls:
        torch_kvswap.swap_blocks(src, dst, ids([7, 0, 3]), ids([5, 1, 2]))
    assert [c.direction for c in calls] == [int(direction)]
    assert calls[0].device == torch.device("privateuseone", 0)
    assert calls[0].total_bytes == 2 * 3 * 16 * 4
    for got, want in zip(dst_host, expected):
        assert torch.equal(got, want)


def test_accelerator_routes_keep_the_callers_order():
    # Only the host route reorders by source address; an accelerator engine
    # gets the blocks in the caller's order.
    src_host, dst_host = caches(8, seed=3, pairs=1), caches(8, seed=4, pairs=1)
    s, d, row = src_host[0].data_ptr(), dst_host[0].data_ptr(), 16 * 4
    with engine_spy("PrivateUse1") as calls:
        torch_kvswap.swap_blocks([on_fake_device(src_host[0])], dst_host, ids([6, 1, 4]), ids([0, 2, 4]))
    assert calls[0].src == [s + 6 * row, s + row, s + 4 * row]
    assert calls[0].dst == [d, d + 2 * row, d + 4 * row]


def test_a_device_without_its_engine_is_refused_by_name():
    src, dst = caches(4, seed=5, pairs=1), caches(4, seed=6, pairs=1)
    before = dst[0].clone()
    with pytest.raises(
        NotImplementedError,
        match=r"kvswap: no engine for privateuseone:0 to copy: the Ascend engine "
        r"\(torch_kvswap\._C_npu\) is not loaded",
    ):
        torch_kvswap.swap_blocks([on_fake_device(src[0])], dst, ids([1]), ids([2]))
    assert torch.equal(dst[0], before)


@pytest.mark.parametrize("what", ["no ids", "zero-byte blocks", "no caches"])
def test_calls_with_nothing_to_copy_look_up_no_engine(what):
    # No engine serves the stand-in device, so any engine lookup would raise.
    src_host = torch.zeros(4, 0 if what == "zero-byte blocks" else 8)
    dst = [torch.zeros_like(src_host)]
    src = [on_fake_device(src_host)] if what != "no caches" else []
    if what == "no caches":
        dst = []
    sid, did = (EMPTY, EMPTY) if what == "no ids" else (ids([1, 2]), ids([3, 0]))
    torch_kvswap.swap_blocks(src, dst, sid, did)  # returns without an engine


def test_copies_between_two_accelerators_are_refused():
    a, b = caches(4, seed=7, pairs=1), caches(4, seed=8, pairs=1)
    with (
        engine_spy("PrivateUse1") as calls,
        pytest.raises(
            ValueError,
            match=r"src_caches are on privateuseone:0 but dst_caches are on "
            r"privateuseone:1; copies between two accelerators are not supported",
        ),
    ):
        torch_kvswap.swap_blocks([on_fake_device(a[0])], [on_fake_device(b[0], 1)], ids([0]), ids([1]))
    assert calls == []


# --- the host engine's side ------------------------------------------------------


def test_calls_with_nothing_to_copy_never_reach_the_host_engine():
    src, dst = [torch.ones(4, 4)], [torch.zeros(4, 4)]
    with engine_spy("CPU") as calls:
        torch_kvswap.swap_blocks(src, dst, EMPTY, EMPTY)
        torch_kvswap.swap_blocks([torch.ones(4, 0)], [torch.zeros(4, 0)], ids([1]), ids([2]))
        torch_kvswap.swap_blocks([], [], ids([0, 1]), ids([1, 0]))
        torch_kvswap.swap_blocks_batch(EMPTY, EMPTY, EMPTY, Direction.DEVICE_TO_HOST)
        torch_kvswap.swap_blocks_batch(ids([0, 0]), ids([0, 0]), ids([0, 0]), Direction.HOST_TO_DEVICE)
        assert calls == []
        torch_kvswap.swap_blocks(src, dst, ids([1]), ids([2]))  # the spy does see a real copy
    assert len(calls) == 1 and torch.equal(dst[0][2], torch.ones(4))


@pytest.mark.parametrize("direction", list(Direction))
def test_pointer_op_hands_the_engine_the_callers_direction(direction):
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    with engine_spy("CPU") as calls:
        torch_kvswap.swap_blocks_batch(ids([src.data_ptr()]), ids([dst.data_ptr() + 8]), ids([16]), direction)
    assert [(c.direction, c.sizes, c.device) for c in calls] == [(int(direction), [16], torch.device("cpu"))]
    assert torch.equal(dst[8:24], src[:16])


def test_host_tensor_copies_hand_the_engine_one_call_with_every_byte():
    src, dst = caches(8, seed=9), caches(8, seed=10)
    with engine_spy("CPU") as calls:
        torch_kvswap.swap_blocks(src, dst, ids([0, 1, 2, 5]), ids([3, 4, 5, 0]))
    assert len(calls) == 1
    assert calls[0].total_bytes == sum(calls[0].sizes) == 2 * 4 * 16 * 4
    assert calls[0].device == torch.device("cpu")


def test_a_batch_carries_only_the_enums_direction_codes():
    # An engine's batch holds a Direction (csrc/kvswap.h, CopyBatch): a code
    # outside the C++ enum cannot become one, so no engine meets it.
    src, dst = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(
        ValueError,
        match=r"direction must be 0 \(host_to_device\), 1 "
        r"\(device_to_host\) or 2 \(device_to_device\), got 3",
    ):
        torch.ops.kvswap_test.submit(
            "cpu", ids([src.data_ptr()]), ids([dst.data_ptr()]), ids([16]), 3, 16, torch.device("cpu")
        )
    assert torch.equal(dst, torch.zeros(16, dtype=torch.uint8))
