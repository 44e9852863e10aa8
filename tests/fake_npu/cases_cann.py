"""What CANN's runtime does that a kind fake would not, and how the engine
holds up against it: partial queuing of a failed batch, 207000 after some
entries were queued, refusals per stream, a pin that only records, batches
run in no particular order, and a capture limit counted in work entries.
Sources for each rule: tests/fake_npu/fake_acl.cpp; the table of what the
engine relies on: docs/ascend.md."""

from __future__ import annotations

import functools

import pytest
import torch

import npu_cases
import torch_kvswap
from npu_cases import (
    FEATURE_NOT_SUPPORT,
    MEMCPY_HOST_TO_DEVICE,
    RT_PARAM_INVALID,
    aligned_host_buffer,
    device_blocks,
    host_blocks,
    scattered,
)
from npu_cases import fake  # noqa: F401 - the fixture

BLOCK = 256
HOST, DEVICE, UNREGISTERED = 0, 1, 2
H2D_ATTR = (DEVICE, 0, HOST, 0, 0)  # (dst type, dst id, src type, src id, rsv byte)
NO_STREAM_RESOURCE = 207008
HOST_MEMORY_ALREADY_REGISTERED, HOST_MEMORY_NOT_REGISTERED = 507910, 507911
NPU = "npu:0"
pointer_copy = functools.partial(npu_cases.pointer_copy, block=BLOCK)


def raw(fake, host, dev, n, dst_index=None):
    """A raw host-to-device batch of n BLOCK-sized entries, entry i copying
    host block i to device block dst_index(i) (default i)."""
    dst_index = dst_index or (lambda i: i)
    sizes = [BLOCK] * n
    return fake.raw_batch(
        [dev.data_ptr() + BLOCK * dst_index(i) for i in range(n)],
        sizes,
        [host.data_ptr() + BLOCK * i for i in range(n)],
        sizes,
        [H2D_ATTR],
        [0],
        1,
    )


def pinned(t):
    """host_pinned as the Ascend engine answers it."""
    return torch.ops.kvswap_test.host_pinned("npu", t, NPU)


def warm_up(src, dst):
    """One host-to-device call, so the current stream has taken a batch."""
    pointer_copy(src, dst, [(0, 0)], 0)
    torch.accelerator.synchronize()


# --- the fake's rules ---------------------------------------------------------------------------------


def test_loop_route_queues_the_entries_before_a_failed_check(fake):
    host, dev, other = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2), host_blocks(8, BLOCK, 3)
    sizes = [BLOCK] * 4
    dsts = [dev.data_ptr(), dev.data_ptr() + BLOCK, other.data_ptr(), dev.data_ptr() + 3 * BLOCK]
    srcs = [host.data_ptr() + BLOCK * i for i in range(4)]
    assert fake.raw_batch(dsts, sizes, srcs, sizes, [H2D_ATTR], [0], 1) == (RT_PARAM_INVALID, 2)
    assert fake.pending(0, 0) == 2


def test_loop_route_failed_submission_has_no_index_and_queues_the_entries_before(fake):
    host, dev = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    fake.fail_entry(2, RT_PARAM_INVALID)
    assert raw(fake, host, dev, 4) == (RT_PARAM_INVALID, -1)
    assert fake.pending(0, 0) == 2


def test_loop_route_goes_past_207000_and_answers_with_the_last_code(fake):
    host, dev = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    fake.fail_entry(3, FEATURE_NOT_SUPPORT)
    assert raw(fake, host, dev, 4) == (FEATURE_NOT_SUPPORT, -1)
    assert fake.pending(0, 0) == 3  # 207000, with three copies queued
    fake.reset()
    fake.fail_entry(1, FEATURE_NOT_SUPPORT)
    assert raw(fake, host, dev, 4) == (0, -1)
    assert fake.pending(0, 0) == 3  # success, with entry 1 never copied


def test_ub_route_checks_every_entry_before_queuing_any(fake):
    fake.set_batch_route("ub")
    host, dev, other = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2), host_blocks(8, BLOCK, 3)
    sizes = [BLOCK] * 4
    dsts = [dev.data_ptr(), dev.data_ptr() + BLOCK, other.data_ptr(), dev.data_ptr() + 3 * BLOCK]
    srcs = [host.data_ptr() + BLOCK * i for i in range(4)]
    assert fake.raw_batch(dsts, sizes, srcs, sizes, [H2D_ATTR], [0], 1) == (RT_PARAM_INVALID, 2)
    assert fake.pending(0, 0) == 0


def test_ub_route_chunk_failure_leaves_the_earlier_chunks_copied(fake):
    fake.set_batch_route("ub", ub_chunk=2)
    host, dev = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    before = dev.cpu()
    fake.fail_entry(2, RT_PARAM_INVALID)
    assert raw(fake, host, dev, 4) == (RT_PARAM_INVALID, -1)
    torch.accelerator.synchronize()
    assert torch.equal(dev.cpu()[:2], host[:2])  # the first chunk ran (synchronized before the second)
    assert torch.equal(dev.cpu()[2:], before[2:])


@pytest.mark.parametrize(
    "route,pinned,code",
    [("loop", True, 0), ("loop", False, 0), ("ub", True, 0), ("ub", False, FEATURE_NOT_SUPPORT)],
)
def test_only_the_ub_pageable_route_caps_a_batch_at_4096(fake, route, pinned, code):
    fake.set_batch_route(route)
    n = 4097
    host, dev = host_blocks(n, 64, 1, pinned=pinned), device_blocks(n, 64, 2)
    sizes = [64] * n
    got = fake.raw_batch(
        [dev.data_ptr() + 64 * i for i in range(n)],
        sizes,
        [host.data_ptr() + 64 * i for i in range(n)],
        sizes,
        [H2D_ATTR],
        [0],
        1,
    )
    assert got == (code, -1)


def test_4096_pageable_entries_pass_on_the_ub_route(fake):
    fake.set_batch_route("ub")
    n = 4096
    host, dev = host_blocks(n, 64, 1, pinned=False), device_blocks(n, 64, 2)
    sizes = [64] * n
    assert fake.raw_batch(
        [dev.data_ptr() + 64 * i for i in range(n)],
        sizes,
        [host.data_ptr() + 64 * i for i in range(n)],
        sizes,
        [H2D_ATTR],
        [0],
        1,
    ) == (0, -1)


def test_refusals_for_a_device_and_for_one_stream(fake):
    """A stream refuses only while it captures into a sub ACL graph
    (api_error.cc:7382-7384, capture_model_utils.cc:421-441)."""
    host, dev = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    side = torch.Stream(device="npu:0")
    fake.refuse_batches_on_stream(0, side.stream_id)
    with side:
        assert raw(fake, host, dev, 2) == (0, -1)  # not capturing: accepted
        fake.capture_begin(0, side.stream_id)
        try:
            assert raw(fake, host, dev, 2) == (FEATURE_NOT_SUPPORT, -1)
            assert (
                fake.raw_memcpy(dev.data_ptr(), BLOCK, host.data_ptr(), BLOCK, MEMCPY_HOST_TO_DEVICE)
                == FEATURE_NOT_SUPPORT
            )
        finally:
            fake.capture_end(0, side.stream_id)
    assert raw(fake, host, dev, 2) == (0, -1)
    fake.refuse_batches_on_device(0)
    assert raw(fake, host, dev, 2)[0] == FEATURE_NOT_SUPPORT
    assert fake.pending(0, 0) == 2 and fake.pending(0, side.stream_id) == 2


def test_a_batch_runs_in_a_scrambled_order(fake):
    """Two entries to one destination: the first submitted lands last."""
    host, dev = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    assert raw(fake, host, dev, 2, dst_index=lambda i: 0) == (0, -1)
    torch.accelerator.synchronize()
    assert torch.equal(dev.cpu().view(-1)[:BLOCK], host.view(-1)[:BLOCK])
    # separate calls stay in stream order: the last call's copy lands last
    for i in range(4):
        assert raw(fake, host[i:], dev, 1) == (0, -1)
    torch.accelerator.synchronize()
    assert torch.equal(dev.cpu()[0], host[3])


def test_a_pin_without_the_driver_feature_only_records(fake):
    fake.set_pin_records_only(True)
    buf = aligned_host_buffer(1 << 14)
    torch.ops.kvswap._host_register(buf, NPU, True)
    assert fake.kind(buf.data_ptr()) == "recorded"
    # CANN's query says HOST for it, as for a locked range: the engine cannot tell.
    assert fake.raw_pointer_attributes(buf.data_ptr()) == (0, HOST, 0)
    torch.ops.kvswap._host_register(buf, NPU, False)
    assert fake.kind(buf.data_ptr()) == "pageable"


def test_pointer_attributes(fake):
    host, dev = host_blocks(2, BLOCK, 1), device_blocks(2, BLOCK, 2, "npu:1")
    assert fake.raw_pointer_attributes(dev.data_ptr() + 7) == (0, DEVICE, 1)
    assert fake.raw_pointer_attributes(host.data_ptr()) == (0, HOST, 0)
    assert fake.raw_pointer_attributes(torch.zeros(4).data_ptr())[:2] == (0, UNREGISTERED)
    assert fake.raw_pointer_attributes(0)[0] == RT_PARAM_INVALID


def test_register_twice_and_unregister_unknown_memory(fake):
    buf = aligned_host_buffer(1 << 14)
    torch.ops.kvswap._host_register(buf, NPU, True)
    with pytest.raises(RuntimeError, match="ACL error 507910"):
        torch.ops.kvswap._host_register(buf[4096:], NPU, True)
    torch.ops.kvswap._host_register(buf, NPU, False)
    with pytest.raises(RuntimeError, match="ACL error 507911"):
        torch.ops.kvswap._host_register(buf, NPU, False)


def test_capture_limit_counts_work_entries_and_answers_207008(fake):
    """Copies of 256 bytes at 64 bytes a work entry: 8192 copies fill the
    32768 entries, the next one fails at its own descriptor. The limit is
    the UB (v200) chips' (memory_task_v200_base.cc:260, :839)."""
    fake.set_batch_route("ub")
    fake.set_work_entry_bytes(64)
    n = 8193
    src, dst = device_blocks(2 * n, BLOCK, 1), host_blocks(2 * n, BLOCK, 2)
    fake.capture_begin(0, 0)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"failed at descriptor 8192:.*ACL error 207008.*EE1023.*"
            r"copies 0\.\.8191 of this call were already queued",
        ):
            pointer_copy(src, dst, [(2 * i, 2 * i) for i in range(n)], 1)
    finally:
        graph = fake.capture_end(0, 0)
    assert fake.graph_entries(graph) == 32768 and fake.graph_size(graph) == 8192


def test_only_ub_chips_cap_a_captured_stream_at_32768_work_entries(fake):
    """The loop route's chips take the same 32772 entries the UB route refuses."""
    fake.set_work_entry_bytes(64)
    n = 8193
    src, dst = device_blocks(2 * n, BLOCK, 1), host_blocks(2 * n, BLOCK, 2)
    fake.capture_begin(0, 0)
    try:
        pointer_copy(src, dst, [(2 * i, 2 * i) for i in range(n)], 1)
    finally:
        graph = fake.capture_end(0, 0)
    assert fake.graph_entries(graph) == 4 * n and fake.graph_size(graph) == n


# --- the engine against them -------------------------------------------------------------------------


def test_capture_of_exactly_32768_copies_is_allowed(fake):
    n = 32768
    src, dst = device_blocks(2 * n, 64, 1), host_blocks(2 * n, 64, 2)
    fake.capture_begin(0, 0)
    try:
        pointer_copy(src, dst, scattered(n), 1, block=64)
    finally:
        graph = fake.capture_end(0, 0)
    assert fake.graph_size(graph) == n
    fake.replay(graph, 0, 0)
    torch.accelerator.synchronize()
    assert torch.equal(dst[::2], src.cpu()[::2])


def test_first_batch_on_a_stream_holds_one_entry(fake):
    src, dst = host_blocks(10, BLOCK, 1), device_blocks(10, BLOCK, 2)
    pointer_copy(src, dst, scattered(5), 0)
    assert fake.calls("aclrtMemcpyBatchAsync") == 2 and fake.last_batch()[0] == 4
    pointer_copy(src, dst, scattered(5), 0)
    assert fake.calls("aclrtMemcpyBatchAsync") == 3 and fake.last_batch()[0] == 5
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[::2], src[::2])


def test_a_stream_capturing_into_a_sub_graph_fails_its_copies_and_no_other(fake):
    """A stream in a sub-graph capture refuses batches and host<->device
    copies alike. The capture query says it captures, so the engine never
    asks it for a batch; its copy fails with CANN's 207000. The other
    streams of the device keep the batch path."""
    src, dst = host_blocks(10, BLOCK, 1), device_blocks(10, BLOCK, 2)
    side = torch.Stream(device="npu:0")
    fake.refuse_batches_on_stream(0, side.stream_id)
    fake.capture_begin(0, side.stream_id)
    try:
        with side:
            with pytest.raises(
                RuntimeError, match=r"aclrtMemcpyAsync failed at descriptor 0.*ACL error 207000"
            ):
                pointer_copy(src, dst, [(0, 0), (2, 2)], 0)
    finally:
        fake.capture_end(0, side.stream_id)
    assert fake.calls("aclrtMemcpyBatchAsync") == 0 and fake.calls("aclrtMemcpyAsync") == 1
    with side:  # the capture is over: the stream takes batches again
        pointer_copy(src, dst, [(4, 4)], 0)
    pointer_copy(src, dst, [(6, 6), (8, 8)], 0)  # the default stream takes batches
    assert fake.calls("aclrtMemcpyBatchAsync") == 3 and fake.calls("aclrtMemcpyAsync") == 1
    torch.accelerator.synchronize()
    side.synchronize()
    assert torch.equal(dst.cpu()[[4, 6, 8]], src[[4, 6, 8]])


def test_207000_for_a_whole_batch_on_the_first_call_reissues_nothing_twice(fake):
    """CANN's loop queues entries 0..n-2 and answers 207000 for the last:
    the engine's one-entry first batch is what keeps this from being
    re-issued; every copy is queued exactly once."""
    n = 6
    src, dst = host_blocks(2 * n, BLOCK, 1), device_blocks(2 * n, BLOCK, 2)
    fake.fail_entry(n - 1, FEATURE_NOT_SUPPORT, at_call=1)
    pointer_copy(src, dst, scattered(n), 0)
    assert fake.pending(0, 0) == n
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[::2], src[::2])


def test_207000_after_the_stream_took_batches_fails_and_reissues_nothing(fake):
    n = 6
    src, dst = host_blocks(2 * n, BLOCK, 1), device_blocks(2 * n, BLOCK, 2)
    warm_up(src, dst)
    fake.fail_entry(n - 1, FEATURE_NOT_SUPPORT, at_call=2)
    with pytest.raises(
        RuntimeError,
        match=r"descriptors 0\.\.5 failed: ACL error 207000.*no failing descriptor "
        r"reported; copies 0\.\.5 may have been queued.*nothing was re-issued",
    ):
        pointer_copy(src, dst, scattered(n), 0)
    assert fake.pending(0, 0) == n - 1  # what CANN queued, once
    assert fake.calls("aclrtMemcpyAsync") == 0
    # the stream is asked again, with one entry first, on the next call
    pointer_copy(src, dst, scattered(3), 0)
    assert fake.calls("aclrtMemcpyBatchAsync") == 4 and fake.last_batch()[0] == 2


def test_207000_for_a_later_batch_of_a_call_is_not_reissued_from_descriptor_0(fake):
    n = 5000
    src, dst = host_blocks(2 * n, 64, 1), device_blocks(2 * n, 64, 2)
    warm_up(src, dst)
    fake.fail("aclrtMemcpyBatchAsync", FEATURE_NOT_SUPPORT, at_call=3)
    with pytest.raises(
        RuntimeError,
        match=r"descriptors 4096\.\.4999 failed: ACL error 207000.*copies 0\.\.4095 of "
        r"this call were already queued.*copies 4096\.\.4999 may have been queued",
    ):
        pointer_copy(src, dst, scattered(n), 0, block=64)
    assert fake.pending(0, 0) == 4096 and fake.calls("aclrtMemcpyAsync") == 0


def test_a_refused_first_batch_latches_and_copies_per_descriptor(fake, capfd, recwarn):
    """A device-wide refusal costs one refused one-entry call per stream, and
    is logged once per device."""
    fake.refuse_batches_on_device(0)
    src, dst = host_blocks(12, BLOCK, 1), device_blocks(12, BLOCK, 2)
    pointer_copy(src, dst, scattered(4), 0)
    assert fake.calls("aclrtMemcpyBatchAsync") == 1 and fake.calls("aclrtMemcpyAsync") == 4
    with torch.Stream(device="npu:0"):
        pointer_copy(src, dst, [(8, 8), (10, 10)], 0)
    assert fake.calls("aclrtMemcpyBatchAsync") == 2 and fake.calls("aclrtMemcpyAsync") == 6
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[::2], src[::2])
    log = capfd.readouterr().err + "".join(str(w.message) for w in recwarn)
    assert log.count("answered 207000") == 1


def test_a_refused_stream_is_probed_again_with_backoff(fake):
    """A refused one-entry probe may be the entry's memory, not the stream:
    the stream is asked again after 64 calls, then 128, ... (kFirstReprobe)."""
    src, dst = host_blocks(4, BLOCK, 1), device_blocks(4, BLOCK, 2)

    def copy():  # one descriptor: the two blocks are adjacent on both sides
        torch_kvswap.swap_blocks([src], [dst], torch.tensor([0, 1]), torch.tensor([2, 3]))

    fake.fail("aclrtMemcpyBatchAsync", FEATURE_NOT_SUPPORT, at_call=1)  # only the first probe
    copy()
    for _ in range(63):
        copy()
    assert fake.calls("aclrtMemcpyBatchAsync") == 1  # per descriptor for 63 more calls
    assert fake.calls("aclrtMemcpyAsync") == 64
    copy()  # the 64th call after the refusal: probed again, accepted
    assert fake.calls("aclrtMemcpyBatchAsync") == 2 and fake.calls("aclrtMemcpyAsync") == 64
    copy()
    assert fake.calls("aclrtMemcpyBatchAsync") == 3  # batched from now on
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[2:], src[:2])


def test_a_stream_that_keeps_refusing_is_probed_ever_less_often(fake):
    fake.refuse_batches_on_device(0)
    src, dst = host_blocks(4, BLOCK, 1), device_blocks(4, BLOCK, 2)
    probes = []
    for _ in range(1 + 64 + 128):
        torch_kvswap.swap_blocks([src], [dst], torch.tensor([0]), torch.tensor([1]))
        probes.append(fake.calls("aclrtMemcpyBatchAsync"))
    assert [i for i in range(1, len(probes)) if probes[i] > probes[i - 1]] == [64, 64 + 128]
    assert probes[-1] == 3 and fake.calls("aclrtMemcpyAsync") == len(probes)


def test_batch_error_at_the_first_entry_of_a_later_part_names_only_the_queued_parts(fake):
    """A stream's first batch (descriptor 0) is queued; the next part fails
    its check at its first entry: only descriptor 0 is on the stream."""
    src, dst, other = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2), host_blocks(8, BLOCK, 3)
    sp = torch.tensor([src.data_ptr(), src.data_ptr() + 2 * BLOCK])
    dp = torch.tensor([dst.data_ptr(), other.data_ptr()])
    with pytest.raises(RuntimeError) as info:
        torch_kvswap.swap_blocks_batch(sp, dp, torch.full((2,), BLOCK), 0)
    text = str(info.value)
    assert "failed at descriptor 1" in text and "copies 0..0 of this call were already queued" in text
    # the addresses as the caller passed them: a failed call leaves its arrays alone
    assert f"src 0x{src.data_ptr() + 2 * BLOCK:x} -> dst 0x{other.data_ptr():x}" in text
    assert "may have been queued" not in text
    assert fake.pending(0, 0) == 1


def test_without_the_attribute_query_a_registration_is_taken_at_its_word(fake):
    fake.set_absent(["aclrtPointerGetAttributes"])
    fake.set_register_does_nothing(True)
    buf = aligned_host_buffer(1 << 14)
    torch.ops.kvswap._host_register(buf, NPU, True)  # nothing can say otherwise
    assert fake.kind(buf.data_ptr()) == "pageable" and fake.calls("aclrtPointerGetAttributes") == 0


def test_batch_error_with_a_failing_index_never_says_nothing_was_queued(fake):
    src, dst, other = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2), host_blocks(8, BLOCK, 3)
    warm_up(src, dst)
    sp = torch.tensor([src.data_ptr() + 2 * BLOCK * i for i in range(3)])
    dp = torch.tensor([dst.data_ptr(), dst.data_ptr() + 2 * BLOCK, other.data_ptr()])
    with pytest.raises(RuntimeError) as info:
        torch_kvswap.swap_blocks_batch(sp, dp, torch.full((3,), BLOCK), 0)
    text = str(info.value)
    assert "failed at descriptor 2" in text and "copies 0..1 may have been queued" in text
    assert "no copy of this call was queued" not in text
    assert fake.pending(0, 0) == 2


@pytest.mark.parametrize("route", ["loop", "ub"])
def test_batch_error_without_a_failing_index_says_the_batch_may_be_queued(fake, route):
    fake.set_batch_route(route, ub_chunk=2)
    src, dst = host_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    warm_up(src, dst)
    fake.fail_entry(2, RT_PARAM_INVALID, at_call=2)
    with pytest.raises(RuntimeError) as info:
        pointer_copy(src, dst, scattered(4), 0)
    text = str(info.value)
    assert "no failing descriptor reported; copies 0..3 may have been queued" in text
    assert "no copy of this call was queued" not in text
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[[0, 2]], src[[0, 2]])  # both routes queued the first two


def test_per_descriptor_error_says_the_failed_copy_may_be_partly_queued(fake):
    src, dst = device_blocks(8, BLOCK, 1), device_blocks(8, BLOCK, 2)
    fake.fail("aclrtMemcpyAsync", RT_PARAM_INVALID, at_call=1)
    with pytest.raises(RuntimeError, match=r"failed at descriptor 0:.*copies 0\.\.0 may have been queued"):
        pointer_copy(src, dst, scattered(2), 2)


def test_registration_the_query_does_not_confirm_is_undone(fake, capfd, recwarn):
    fake.set_register_does_nothing(True)
    buf = aligned_host_buffer(1 << 14)
    for _ in range(2):
        with pytest.raises(
            NotImplementedError,
            match=r"does not report the whole range as registered host memory; "
            r"undoing it answered that nothing is registered "
            r"\(ACL error 507911",
        ):
            torch.ops.kvswap._host_register(buf, NPU, True)
    log = capfd.readouterr().err + "".join(str(w.message) for w in recwarn)
    assert log.count("fall back to the pinned allocator") == 1  # logged once


@pytest.mark.parametrize("failing_query", [1, 2])
def test_registration_is_checked_at_both_ends(fake, failing_query):
    buf = aligned_host_buffer(1 << 14)
    fake.fail("aclrtPointerGetAttributes", RT_PARAM_INVALID, at_call=failing_query)
    with pytest.raises(NotImplementedError, match="the registration was undone"):
        torch.ops.kvswap._host_register(buf, NPU, True)
    assert fake.kind(buf.data_ptr()) == "pageable" and fake.kind(buf.data_ptr() + (1 << 14) - 1) == "pageable"
    torch.ops.kvswap._host_register(buf, NPU, True)  # a query that answers: accepted
    assert fake.calls("aclrtPointerGetAttributes") == failing_query + 2
    torch.ops.kvswap._host_register(buf, NPU, False)


def test_a_registration_that_can_be_neither_confirmed_nor_undone_is_never_freed(fake):
    """aclrtHostRegisterV2 succeeds, the query fails, the undo fails: CANN may
    still count the range registered, so the offloader keeps its memory for
    the life of the process instead of handing it back to the allocator."""
    from torch_kvswap import KVCacheOffloader
    from torch_kvswap.offloader import caches as offloader_caches

    buf = aligned_host_buffer(1 << 14)
    fake.fail("aclrtPointerGetAttributes", RT_PARAM_INVALID)
    fake.fail("aclrtHostUnregister", RT_PARAM_INVALID)
    with pytest.raises(
        NotImplementedError,
        match=r"undoing the registration failed too \(ACL error 107000.*\): "
        r"the range may still be registered with CANN",
    ):
        torch.ops.kvswap._host_register(buf, NPU, True)
    kept = len(offloader_caches._STILL_REGISTERED)
    caches = {"l0": torch.randn(2, 8, 4, 2, 8).to("npu:0")}
    off = KVCacheOffloader(caches, device_block_size=4, host_block_size=4, num_host_blocks=4)
    try:
        with pytest.raises(RuntimeError, match="the range may still be registered with CANN"):
            off.host_memory.wait()  # refused: never the pinned allocator's rounding
        assert len(offloader_caches._STILL_REGISTERED) == kept + 1
        assert offloader_caches._STILL_REGISTERED[-1].data_ptr() == off.buffer.data_ptr()
        assert fake.kind(off.buffer.data_ptr()) == "pinned"  # still registered with the fake CANN
    finally:
        off.shutdown()
        fake.fail("aclrtHostUnregister", 0)


def test_the_simple_connectors_mirrors_keep_a_registration_that_could_not_be_undone(fake):
    """The same rule for the simple connector's host mirrors, which take their
    buffer from the offloader's exact-size host memory: refused, and kept."""
    from torch_kvswap.integrations.vllm.simple_offload import _host_mirrors
    from torch_kvswap.offloader import caches as offloader_caches

    fake.fail("aclrtPointerGetAttributes", RT_PARAM_INVALID)
    fake.fail("aclrtHostUnregister", RT_PARAM_INVALID)
    kept = len(offloader_caches._STILL_REGISTERED)
    try:
        regions = {"l0": torch.zeros(4, 3000, dtype=torch.int8), "l1": torch.zeros(4, 100, dtype=torch.int8)}
        with pytest.raises(
            RuntimeError,
            match=r"cannot page-lock the 16384-byte host mirrors in place.*"
            r"may still be registered",
        ):
            _host_mirrors(regions, 4, torch.device(NPU))
        assert len(offloader_caches._STILL_REGISTERED) == kept + 1
        first_page = offloader_caches._STILL_REGISTERED[-1].data_ptr()
        assert fake.kind(first_page) == "pinned"  # still registered with the fake CANN
    finally:
        fake.fail("aclrtPointerGetAttributes", 0)
        fake.fail("aclrtHostUnregister", 0)


def test_offloader_refuses_mirrors_when_registration_does_nothing(fake):
    from torch_kvswap import KVCacheOffloader
    from torch_kvswap.offloader import caches as offloader_caches

    fake.set_register_does_nothing(True)
    kept = len(offloader_caches._STILL_REGISTERED)
    caches = {"l0": torch.randn(2, 8, 4, 2, 8).to("npu:0")}
    off = KVCacheOffloader(caches, device_block_size=4, host_block_size=4, num_host_blocks=4)
    try:
        with pytest.raises(RuntimeError, match="does not report the whole range as registered host memory"):
            off.store(1, [0], [0])
        assert len(offloader_caches._STILL_REGISTERED) == kept  # nothing was registered: nothing kept
    finally:
        off.shutdown()


def test_a_host_tensor_is_pinned_only_if_its_whole_range_is(fake):
    outer = aligned_host_buffer(4 * 4096)
    torch.ops.kvswap._host_register(outer[: 2 * 4096], NPU, True)
    try:
        assert pinned(outer[: 2 * 4096]) and pinned(outer[4096 : 2 * 4096])
        assert not pinned(outer[4096 : 3 * 4096])  # straddles the end of the pinned range
        assert not pinned(outer[2 * 4096 :])
    finally:
        torch.ops.kvswap._host_register(outer[: 2 * 4096], NPU, False)


def test_memory_registered_by_someone_else_is_judged_by_the_runtime_at_both_ends(fake):
    """Outside the engine's own registrations, the runtime answers for the
    first and the last byte (the pinned allocator's blocks hold a storage
    whole)."""
    page = 4096
    outer = aligned_host_buffer(3 * page)
    assert fake.raw_register(outer.data_ptr(), page, True) == 0  # page 0 only, not through the engine
    try:
        assert pinned(outer[:page]) and pinned(outer[10:page])
        assert not pinned(outer[: 2 * page])  # starts pinned, ends pageable
        assert not pinned(outer[page : 2 * page])
    finally:
        assert fake.raw_register(outer.data_ptr(), 0, False) == 0


def test_a_gap_between_two_registrations_is_not_pinned_and_adjacent_ones_are(fake):
    """Pinned means every byte: CANN judges a copy by its start address
    (api_impl.cc:8799, :8814), so a pageable page between two registrations
    would be copied as pinned memory."""
    page = 4096
    outer = aligned_host_buffer(4 * page)
    torch.ops.kvswap._host_register(outer[:page], NPU, True)
    torch.ops.kvswap._host_register(outer[2 * page : 3 * page], NPU, True)
    try:
        assert fake.kind(outer.data_ptr() + page) == "pageable"
        assert not pinned(outer[: 3 * page])  # both ends pinned, the middle page not
        assert not pinned(outer[page - 1 : 2 * page + 1])
        host = outer[: 3 * page].view(3, page)
        dev = device_blocks(3, page, 5)
        with pytest.raises(ValueError, match=r"src_caches\[0\] is in pageable host memory"):
            torch_kvswap.swap_blocks([host], [dev], torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]))
        torch.ops.kvswap._host_register(outer[page : 2 * page], NPU, True)  # fills the gap
        try:
            assert pinned(outer[: 3 * page]) and pinned(outer[page - 1 : 2 * page + 1])
            assert pinned(outer[100 : page + 100])  # a view at an offset, across two registrations
            assert not pinned(outer[: 4 * page])  # the last page is pageable
        finally:
            torch.ops.kvswap._host_register(outer[page : 2 * page], NPU, False)
    finally:
        torch.ops.kvswap._host_register(outer[:page], NPU, False)
        torch.ops.kvswap._host_register(outer[2 * page : 3 * page], NPU, False)


def test_a_registration_the_runtime_no_longer_reports_is_not_pinned(fake):
    """The engine's table first, the runtime's query as a second opinion."""
    outer = aligned_host_buffer(2 * 4096)
    torch.ops.kvswap._host_register(outer, NPU, True)
    try:
        assert pinned(outer[10:20])
        fake.fail("aclrtPointerGetAttributes", RT_PARAM_INVALID)
        assert not pinned(outer[10:20])
    finally:
        fake.fail("aclrtPointerGetAttributes", 0)  # answers again
        torch.ops.kvswap._host_register(outer, NPU, False)


def test_shutdown_survives_an_unregister_failure(fake, caplog):
    from torch_kvswap import KVCacheOffloader
    from torch_kvswap.offloader import caches as offloader_caches

    caches = {"l0": torch.randn(2, 8, 4, 2, 8).to("npu:0")}
    off = KVCacheOffloader(caches, device_block_size=4, host_block_size=4, num_host_blocks=4)
    off.host_memory.wait()  # pinned in the background
    assert fake.kind(off.host_tensors[0].data_ptr()) == "pinned"
    kept = len(offloader_caches._STILL_REGISTERED)
    fake.fail("aclrtHostUnregister", RT_PARAM_INVALID)
    with caplog.at_level("ERROR", logger="torch_kvswap"):
        off.shutdown()
    assert "unregistering" in caplog.text and "ACL error 107000" in caplog.text
    assert off.host_tensors == [] and off.host_bytes == 0
    assert len(offloader_caches._STILL_REGISTERED) == kept + 1  # the still-registered memory is never freed
    off.shutdown()  # idempotent
