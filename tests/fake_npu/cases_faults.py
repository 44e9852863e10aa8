"""Missing ACL functions and injected faults, on the fake runtime.

CANN releases differ in which functions they have (docs/ascend.md, "CANN
versions"); the engine looks them up at run time. Faults: a function absent,
207000, an error at call k, and the errors CANN's own checks raise.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_kvswap
from npu_cases import (
    ABSENT_8_0,
    FEATURE_NOT_SUPPORT,
    RT_PARAM_INVALID,
    aligned_host_buffer,
    cann,
    device_blocks,
    host_blocks,
)
from npu_cases import fake  # noqa: F401 - the fixture

BLOCK = 2048
OPTIONAL = [
    "aclrtMemcpyBatchAsync",
    "aclmdlRICaptureGetInfo",
    "aclmdlRICaptureBegin",
    "aclrtHostRegisterV2",
    "aclGetRecentErrMsg",
]
NONE, ACTIVE, UNKNOWN = 0, 1, 2  # kvswap::ascend::Capture


def round_trip(fake):
    """h2d, d2h and d2d through the tensor op; returns the data seen afterwards."""
    host = host_blocks(6, BLOCK, 1)
    dev = device_blocks(6, BLOCK, 2)
    back = host_blocks(6, BLOCK, 3)
    torch_kvswap.swap_blocks([host], [dev], torch.tensor([0, 1]), torch.tensor([2, 3]))
    torch_kvswap.swap_blocks([dev], [dev], torch.tensor([2, 3]), torch.tensor([4, 5]))
    torch_kvswap.swap_blocks([dev], [back], torch.tensor([4, 5]), torch.tensor([0, 1]))
    torch.accelerator.synchronize()
    assert torch.equal(back[[0, 1]], host[[0, 1]])


@pytest.mark.parametrize(
    "absent",
    [c for r in range(len(OPTIONAL) + 1) for c in itertools.combinations(OPTIONAL, r)],
    ids=lambda c: "+".join(c) or "none",
)
def test_every_combination_of_missing_functions_copies(fake, absent):
    cann(fake, absent)
    round_trip(fake)
    batch_expected = "aclrtMemcpyBatchAsync" not in absent and (
        "aclmdlRICaptureGetInfo" not in absent or "aclmdlRICaptureBegin" in absent
    )
    assert (fake.calls("aclrtMemcpyBatchAsync") > 0) == batch_expected


def test_cann_8_0_like_answers_not_capturing_and_copies_per_descriptor(fake):
    cann(fake, ABSENT_8_0)
    assert fake.capture_state(0, 0) == NONE
    ids = torch.tensor([0], device="npu:0")
    src, dst = device_blocks(2, BLOCK, 1), host_blocks(2, BLOCK, 2)
    torch_kvswap.swap_blocks([src], [dst], ids, ids + 1)  # device ids may be read back
    torch.accelerator.synchronize()
    assert torch.equal(dst[1], src.cpu()[0])
    assert fake.calls("aclrtMemcpyAsync") == 1


@pytest.mark.parametrize("status,expected", [(0, NONE), (1, ACTIVE), (2, ACTIVE)])
def test_capture_query_answers(fake, status, expected):
    fake.set_capture_status(0, 0, status)
    assert fake.capture_state(0, 0) == expected
    fake.set_capture_status(0, 0, 0)


def test_capture_query_207000_means_no_capture_on_this_chip(fake):
    fake.fail("aclmdlRICaptureGetInfo", FEATURE_NOT_SUPPORT)
    assert fake.capture_state(0, 0) == NONE
    src, dst = host_blocks(2, BLOCK, 1), device_blocks(2, BLOCK, 2)
    torch_kvswap.swap_blocks([src], [dst], torch.tensor([0]), torch.tensor([1]))
    assert fake.calls("aclrtMemcpyBatchAsync") == 1


def test_missing_capture_query_with_capture_api_is_unknown_and_refuses_device_ids(fake):
    cann(fake, ["aclmdlRICaptureGetInfo"])
    assert fake.capture_state(0, 0) == UNKNOWN
    src, dst = device_blocks(2, BLOCK, 1), host_blocks(2, BLOCK, 2)
    ids = torch.tensor([0], device="npu:0")
    with pytest.raises(ValueError, match="pass the block ids as CPU tensors"):
        torch_kvswap.swap_blocks([src], [dst], ids, ids)


def test_failure_at_call_k_of_the_per_descriptor_path(fake):
    cann(fake, ["aclrtMemcpyBatchAsync"])
    src, dst = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    fake.fail("aclrtMemcpyAsync", RT_PARAM_INVALID, at_call=1)
    with pytest.raises(
        RuntimeError, match=r"ACL error 107000: injected fault.*copies 0\.\.0 may have been queued"
    ):
        torch_kvswap.swap_blocks([src], [dst], torch.tensor([0, 2]), torch.tensor([1, 3]))


def test_batch_failure_reports_the_failing_descriptor(fake):
    """A copy between two host buffers in a host-to-device batch: CANN's own
    check (only host<->device) fails at that entry."""
    src, dst, pinned = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2), host_blocks(8, BLOCK, 3)
    sp = torch.tensor([src.data_ptr(), src.data_ptr() + 2 * BLOCK, src.data_ptr() + 4 * BLOCK])
    dp = torch.tensor([dst.data_ptr(), dst.data_ptr() + 2 * BLOCK, pinned.data_ptr()])
    with pytest.raises(
        RuntimeError,
        match=r"ACL error 107000.*entry 1.*failed at descriptor 2.*copies 0\.\.0 of this "
        r"call were already queued.*copies 1\.\.1 may have been queued",
    ):
        torch_kvswap.swap_blocks_batch(sp, dp, torch.full((3,), BLOCK), 0)


def test_batch_failure_without_a_fail_index(fake):
    fake.fail("aclrtMemcpyBatchAsync", RT_PARAM_INVALID)
    src, dst = host_blocks(2, BLOCK, 1), device_blocks(2, BLOCK, 2)
    with pytest.raises(
        RuntimeError, match=r"no failing descriptor reported; copies 0\.\.0 may have been queued"
    ):
        torch_kvswap.swap_blocks([src], [dst], torch.tensor([0]), torch.tensor([1]))


def test_error_text_without_recent_error_message(fake):
    cann(fake, ["aclGetRecentErrMsg"])
    fake.fail("aclrtMemcpyBatchAsync", RT_PARAM_INVALID)
    src, dst = host_blocks(2, BLOCK, 1), device_blocks(2, BLOCK, 2)
    with pytest.raises(RuntimeError, match=r"failed: ACL error 107000; no failing"):
        torch_kvswap.swap_blocks([src], [dst], torch.tensor([0]), torch.tensor([1]))


def test_pageable_pointer_copy_is_synchronous(fake):
    """The pointer op cannot know what memory it is given: CANN copies
    pageable memory synchronously (docs/ascend.md states the requirement)."""
    src, dst = host_blocks(2, BLOCK, 1, pinned=False), device_blocks(2, BLOCK, 2)
    torch_kvswap.swap_blocks_batch(
        torch.tensor([src.data_ptr()]), torch.tensor([dst.data_ptr()]), torch.tensor([BLOCK]), 0
    )
    assert fake.pending(0, 0) == 0
    assert torch.equal(dst.cpu()[0], src[0])


def test_pageable_pointer_copy_fails_under_capture(fake):
    src, dst = host_blocks(2, BLOCK, 1, pinned=False), device_blocks(2, BLOCK, 2)
    fake.capture_begin(0, 0)
    try:
        with pytest.raises(RuntimeError, match="EE1016"):
            torch_kvswap.swap_blocks_batch(
                torch.tensor([src.data_ptr()]), torch.tensor([dst.data_ptr()]), torch.tensor([BLOCK]), 0
            )
    finally:
        fake.capture_end(0, 0)


def test_host_register_without_v2_is_not_implemented(fake):
    cann(fake, ["aclrtHostRegisterV2"])
    with pytest.raises(NotImplementedError, match="no aclrtHostRegisterV2.*pin_memory=True"):
        torch.ops.kvswap._host_register(aligned_host_buffer(8192), torch.device("npu:0"), True)


def test_host_register_refuses_an_unaligned_buffer(fake):
    buf = aligned_host_buffer(8192 + 64)[64:]
    with pytest.raises(RuntimeError, match="4 KiB-aligned"):
        torch.ops.kvswap._host_register(buf, torch.device("npu:0"), True)
    assert fake.calls("aclrtHostRegisterV2") == 0


@pytest.mark.parametrize("function", ["aclrtHostRegisterV2", "aclrtHostUnregister"])
def test_host_register_errors_are_reported(fake, function):
    buf = aligned_host_buffer(8192)
    if function == "aclrtHostUnregister":
        torch.ops.kvswap._host_register(buf, torch.device("npu:0"), True)
    fake.fail(function, RT_PARAM_INVALID)
    with pytest.raises(RuntimeError, match=f"{function}.*failed: ACL error 107000"):
        torch.ops.kvswap._host_register(buf, torch.device("npu:0"), function == "aclrtHostRegisterV2")


def test_memory_the_allocator_pinned_counts_as_pinned(fake):
    def pinned(t):
        return torch.ops.kvswap_test.host_pinned("npu", t, torch.device("npu:0"))

    t = host_blocks(2, BLOCK, 1)
    assert pinned(t) and pinned(t[1])
    assert not pinned(t.clone())


def test_engine_refuses_a_device_of_another_type(fake):
    t = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="asked to copy on cpu"):
        torch.ops.kvswap_test.submit("npu", t, t, t, 0, 0, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="asked about a stream of cpu"):
        torch.ops.kvswap_test.stream_capturing("npu", torch.device("cpu"))
