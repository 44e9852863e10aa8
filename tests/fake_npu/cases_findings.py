"""One case per finding of the Ascend engine's review, on the fake
runtime. Each fails when its fix is reverted: scripts/mutants/ascend.py
holds the reverts and checks that.
"""

from __future__ import annotations

import functools

import pytest
import torch

import npu_cases
import torch_kvswap
from npu_cases import (
    FEATURE_NOT_SUPPORT,
    RT_PARAM_INVALID,
    aligned_host_buffer,
    cann,
    device_blocks,
    host_blocks,
    scattered,
)
from npu_cases import fake  # noqa: F401 - the fixture

BLOCK = 2048
pointer_copy = functools.partial(npu_cases.pointer_copy, block=BLOCK)


# 1. The batch API is looked up at run time: a CANN without it still copies.
def test_1_engine_copies_without_the_batch_api(fake):
    cann(fake, ["aclrtMemcpyBatchAsync"])
    src, dst = host_blocks(4, BLOCK, 1), device_blocks(4, BLOCK, 2)
    torch_kvswap.swap_blocks([src], [dst], torch.tensor([0, 3]), torch.tensor([1, 2]))
    torch.accelerator.synchronize()
    assert fake.calls("aclrtMemcpyAsync") == 2
    assert torch.equal(dst.cpu()[[1, 2]], src[[0, 3]])


# 2. 207000 from the batch API latches the per-descriptor path for that
#    device, with one warning; a failing capture query takes the path legal
#    in and out of capture.
def logged(capfd, recwarn) -> str:
    """Engine warnings so far: c10 prints them to stderr, or Python turns them
    into warnings when a warning handler is installed."""
    text = capfd.readouterr().err + "".join(str(w.message) for w in recwarn)
    recwarn.clear()
    return text


def test_2_batch_207000_latches_the_per_descriptor_path_once_per_device(fake, capfd, recwarn):
    fake.fail("aclrtMemcpyBatchAsync", FEATURE_NOT_SUPPORT)
    src, dst = host_blocks(4, BLOCK, 1), device_blocks(4, BLOCK, 2)
    torch_kvswap.swap_blocks([src], [dst], torch.tensor([0]), torch.tensor([1]))
    torch_kvswap.swap_blocks([src], [dst], torch.tensor([2]), torch.tensor([3]))
    torch.accelerator.synchronize()
    assert fake.calls("aclrtMemcpyBatchAsync") == 1  # not asked again on npu:0
    assert fake.calls("aclrtMemcpyAsync") == 2
    assert torch.equal(dst.cpu()[[1, 3]], src[[0, 2]])
    log = logged(capfd, recwarn)
    assert log.count("answered 207000") == 1 and "npu:0" in log  # logged once
    other = device_blocks(4, BLOCK, 3, "npu:1")
    torch_kvswap.swap_blocks([src], [other], torch.tensor([0]), torch.tensor([1]))
    assert fake.calls("aclrtMemcpyBatchAsync") == 2  # npu:1 has its own latch
    assert "answered 207000 (ACL_ERROR_RT_FEATURE_NOT_SUPPORT) on npu:1" in logged(capfd, recwarn)


def test_2_failing_capture_query_takes_the_per_descriptor_path(fake, capfd, recwarn):
    fake.fail("aclmdlRICaptureGetInfo", RT_PARAM_INVALID)
    src, dst = host_blocks(4, BLOCK, 1), device_blocks(4, BLOCK, 2)
    torch_kvswap.swap_blocks([src], [dst], torch.tensor([0]), torch.tensor([1]))
    torch.accelerator.synchronize()
    assert fake.calls("aclrtMemcpyBatchAsync") == 0 and fake.calls("aclrtMemcpyAsync") == 1
    assert torch.equal(dst.cpu()[1], src[0])
    assert "aclmdlRICaptureGetInfo failed" in logged(capfd, recwarn)


# 3. Pinning in place page-locks (aclrtHostRegisterV2 + ACL_HOST_REG_PINNED);
#    mapping alone does not.
def test_3_host_register_page_locks_in_place(fake):
    buf = aligned_host_buffer(1 << 16)
    torch.ops.kvswap._host_register(buf, torch.device("npu:0"), True)
    assert fake.kind(buf.data_ptr()) == "pinned"
    assert fake.calls("aclrtHostRegisterV2") == 1
    torch.ops.kvswap._host_register(buf, torch.device("npu:0"), False)
    assert fake.kind(buf.data_ptr()) == "pageable"


# 4. The tensor op refuses pageable host caches, naming the tensor and how
#    to pin it; memory pinned in place is accepted.
@pytest.mark.parametrize("side", ["src", "dst"])
def test_4_tensor_op_refuses_pageable_host_caches(fake, side):
    dev = device_blocks(4, BLOCK, 1)
    pageable = [host_blocks(4, BLOCK, 2, pinned=True), host_blocks(4, BLOCK, 3, pinned=False)]
    devs = [dev, device_blocks(4, BLOCK, 4)]
    args = (pageable, devs) if side == "src" else (devs, pageable)
    with pytest.raises(ValueError, match=rf"{side}_caches\[1\] is in pageable host memory.*pin_memory"):
        torch_kvswap.swap_blocks(*args, torch.tensor([0]), torch.tensor([1]))
    assert fake.calls("aclrtMemcpyBatchAsync") == 0 and fake.calls("aclrtMemcpyAsync") == 0
    buf = aligned_host_buffer(4 * BLOCK)
    torch.ops.kvswap._host_register(buf, torch.device("npu:0"), True)
    torch_kvswap.swap_blocks([dev], [buf.view(4, BLOCK)], torch.tensor([0]), torch.tensor([1]))
    torch.accelerator.synchronize()
    assert torch.equal(buf.view(4, BLOCK)[1], dev.cpu()[0])
    torch.ops.kvswap._host_register(buf, torch.device("npu:0"), False)


# 5. A null stream handle is refused before anything is queued.
def test_5_null_stream_is_refused(fake):
    src, dst = host_blocks(4, BLOCK, 1), device_blocks(4, BLOCK, 2)
    fake.null_stream_next()
    with pytest.raises(RuntimeError, match="null ACL handle.*nothing was copied: nothing was queued"):
        torch_kvswap.swap_blocks([src], [dst], torch.tensor([0]), torch.tensor([1]))
    assert fake.calls("aclrtMemcpyBatchAsync") == 0 and fake.pending(0, 0) == 0


# 6. One attrs entry with index 0 covers the whole batch (the second call:
#    a stream's first batch holds one entry).
def test_6_batch_passes_one_attrs_entry(fake):
    src, dst = host_blocks(32, BLOCK, 1), device_blocks(32, BLOCK, 2)
    pointer_copy(src, dst, scattered(10), 0)
    pointer_copy(src, dst, scattered(10), 0)
    num_batches, num_attrs, _ = fake.last_batch()
    assert (num_batches, num_attrs) == (10, 1)


# 7. Nothing is held after the call: the descriptor table goes straight back
#    to the core's pool, so the next call reuses it.
def test_7_descriptor_table_is_released_when_submit_returns(fake):
    src, dst = host_blocks(32, BLOCK, 1), device_blocks(32, BLOCK, 2)
    pointer_copy(src, dst, scattered(10), 0)
    pointer_copy(src, dst, scattered(10), 0)
    first = fake.last_batch()[2]
    pointer_copy(src, dst, scattered(10), 0)
    assert fake.last_batch()[2] == first
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[::2][:10], src[::2][:10])


# 8. Batches are split at CANN's entry cap (4096).
def test_8_batches_over_4096_entries_are_split(fake):
    n = 5000
    src, dst = host_blocks(2 * n, 64, 1), device_blocks(2 * n, 64, 2)
    pointer_copy(src, dst, scattered(1), 0, block=64)  # the stream's first batch: one entry
    pointer_copy(src, dst, scattered(n), 0, block=64)
    assert fake.calls("aclrtMemcpyBatchAsync") == 3
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[::2], src[::2])


def ub_pageable_copy(fake, n, block=16):
    """n scattered host-to-device descriptors from pageable memory on CANN's UB route, whose
    driver batch copy refuses more than 4096 entries; returns how many batch calls the copy
    made after the stream's one-entry probe, and the size of the last."""
    fake.set_batch_route("ub")
    src, dst = host_blocks(2 * n, block, 1, pinned=False), device_blocks(2 * n, block, 2)
    pointer_copy(src, dst, scattered(1), 0, block=block)  # the stream's first batch: one entry
    before = fake.calls("aclrtMemcpyBatchAsync")
    pointer_copy(src, dst, scattered(n), 0, block=block)
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[::2][:n], src[::2][:n])
    return fake.calls("aclrtMemcpyBatchAsync") - before, fake.last_batch()[0]


@pytest.mark.parametrize("n,calls,last", [(4095, 1, 4095), (4096, 1, 4096), (4097, 2, 1)])
def test_8_a_call_is_split_at_the_4096_entry_cap(fake, n, calls, last):
    assert ub_pageable_copy(fake, n) == (calls, last)


def test_8_a_call_of_100000_descriptors_lands_byte_exact(fake):
    assert ub_pageable_copy(fake, 100_000) == (25, 100_000 - 24 * 4096)
    assert fake.calls("aclrtMemcpyAsync") == 0


# 9. Capture: device-resident ids are refused with a clear error (the engine
#    answers stream_capturing); more copies than a captured stream holds
#    are refused before any is queued (EE1023).
def test_9_device_ids_under_capture_are_refused(fake):
    src, dst = device_blocks(4, BLOCK, 1), host_blocks(4, BLOCK, 2)
    ids = torch.tensor([0, 1], device="npu:0")
    torch.accelerator.synchronize()
    fake.capture_begin(0, 0)
    try:
        with pytest.raises(ValueError, match="being captured.*pass the block ids as CPU tensors"):
            torch_kvswap.swap_blocks([src], [dst], ids, ids)
    finally:
        fake.capture_end(0, 0)


def test_9_capture_over_the_task_capacity_is_refused(fake):
    n = 32769
    src, dst = device_blocks(2 * n, 64, 1), host_blocks(2 * n, 64, 2)
    fake.capture_begin(0, 0)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"32769 copies.*at most 32768.*EE1023.*nothing was copied: no copy of this call was queued",
        ):
            pointer_copy(src, dst, scattered(n), 1, block=64)
    finally:
        graph = fake.capture_end(0, 0)
    assert fake.graph_size(graph) == 0


# 10. An error says which copies were already queued.
def test_10_error_names_the_copies_already_queued(fake):
    src, dst = device_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    fake.fail("aclrtMemcpyAsync", RT_PARAM_INVALID, at_call=3)
    with pytest.raises(
        RuntimeError,
        match=r"failed at descriptor 2:.*copies 0\.\.1 of this call were already queued"
        r".*copies 2\.\.2 may have been queued",
    ):
        pointer_copy(src, dst, scattered(4), 2)
    assert fake.pending(0, 0) == 2


def test_10_batch_error_names_the_batches_already_queued(fake):
    n = 5000
    src, dst = host_blocks(2 * n, 64, 1), device_blocks(2 * n, 64, 2)
    pointer_copy(src, dst, scattered(1), 0, block=64)  # the stream's first batch: one entry
    fake.fail("aclrtMemcpyBatchAsync", RT_PARAM_INVALID, at_call=3)
    with pytest.raises(
        RuntimeError,
        match=r"descriptors 4096\.\.4999 failed.*copies 0\.\.4095 of this call were already queued",
    ):
        pointer_copy(src, dst, scattered(n), 0, block=64)


# 11. The pinned allocator learns the copy's stream: a pinned source freed
#     right after the call is not handed out again before the copy has run.
def test_11_pinned_tensor_freed_after_the_call_is_not_reused_mid_copy(fake):
    dst = device_blocks(4, BLOCK, 1)
    src = torch.full((4, BLOCK), 7, dtype=torch.uint8).pin_memory()
    torch_kvswap.swap_blocks([src], [dst], torch.tensor([0]), torch.tensor([0]))
    del src
    other = torch.empty((4, BLOCK), dtype=torch.uint8).pin_memory()  # same size as the freed block
    other.fill_(9)
    torch.accelerator.synchronize()
    assert bool((dst.cpu()[0] == 7).all())


# 12. Device-to-device addresses must be 64-byte aligned; checked before
#     anything is queued.
def test_12_unaligned_device_to_device_copy_is_refused_before_queuing(fake):
    src, dst = device_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    sp = torch.tensor([src.data_ptr(), src.data_ptr() + 2 * BLOCK, src.data_ptr() + 4 * BLOCK + 32])
    dp = torch.tensor([dst.data_ptr(), dst.data_ptr() + 2 * BLOCK, dst.data_ptr() + 4 * BLOCK])
    with pytest.raises(
        ValueError,
        match=r"descriptor 2:.*64-byte-aligned.*nothing was copied: no copy of this call was queued",
    ):
        torch_kvswap.swap_blocks_batch(sp, dp, torch.full((3,), 256), 2)
    assert fake.pending(0, 0) == 0
