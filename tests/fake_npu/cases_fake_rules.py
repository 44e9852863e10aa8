"""The fake ACL runtime refuses what CANN refuses: its batch and copy checks,
called directly (sources in tests/fake_npu/fake_acl.cpp)."""

from __future__ import annotations

import pytest
import torch

from npu_cases import FEATURE_NOT_SUPPORT, MEMCPY_HOST_TO_DEVICE, RT_PARAM_INVALID, device_blocks, host_blocks
from npu_cases import fake  # noqa: F401 - the fixture

INVALID_PARAM, ADDR_UNALIGNED, STREAM_CONTEXT = 100000, 107008, 107003
HOST, DEVICE = 0, 1
H2D_ATTR = (DEVICE, 0, HOST, 0, 0)  # (dst type, dst id, src type, src id, rsv byte)


@pytest.fixture
def mem(fake):
    return host_blocks(8, 256, 1), device_blocks(8, 256, 2)


def batch(
    fake,
    mem,
    n=4,
    sizes=None,
    dest_maxs=None,
    attrs=(H2D_ATTR,),
    indexes=(0,),
    num_attrs=None,
    dsts=None,
    srcs=None,
):
    host, dev = mem
    sizes = list(sizes if sizes is not None else [256] * n)
    return fake.raw_batch(
        dsts if dsts is not None else [dev.data_ptr() + 256 * i for i in range(n)],
        list(dest_maxs if dest_maxs is not None else sizes),
        srcs if srcs is not None else [host.data_ptr() + 256 * i for i in range(n)],
        sizes,
        list(attrs),
        list(indexes),
        len(attrs) if num_attrs is None else num_attrs,
    )


def test_a_valid_batch_succeeds_and_is_queued(fake, mem):
    assert batch(fake, mem) == (0, -1)
    assert fake.pending(0, 0) == 4


def test_two_attrs_entries_split_the_batch(fake, mem):
    assert batch(fake, mem, attrs=[H2D_ATTR, H2D_ATTR], indexes=[0, 2]) == (0, -1)


@pytest.mark.parametrize(
    "attrs,indexes,num_attrs",
    [
        ([H2D_ATTR], [0], 0),  # numAttrs == 0
        ([H2D_ATTR] * 5, [0, 1, 2, 3, 3], 5),  # numAttrs > numBatches
        ([H2D_ATTR], [1], 1),  # attrsIndexes[0] != 0
        ([H2D_ATTR, H2D_ATTR], [0, 0], 2),  # not increasing
        ([H2D_ATTR, H2D_ATTR], [0, 4], 2),  # index >= numBatches
    ],
)
def test_attrs_index_rules(fake, mem, attrs, indexes, num_attrs):
    assert batch(fake, mem, attrs=attrs, indexes=indexes, num_attrs=num_attrs)[0] == RT_PARAM_INVALID
    assert fake.pending(0, 0) == 0


def test_reserved_bytes_must_be_zero(fake, mem):
    assert batch(fake, mem, attrs=[(DEVICE, 0, HOST, 0, 1)])[0] == INVALID_PARAM


def test_dest_max_below_size_is_refused(fake, mem):
    assert batch(fake, mem, dest_maxs=[256, 256, 255, 256])[0] == INVALID_PARAM


def test_an_all_zero_batch_succeeds_without_checks(fake, mem):
    assert batch(fake, mem, sizes=[0] * 4, attrs=[(HOST, 0, HOST, 0, 9)]) == (0, -1)


@pytest.mark.parametrize(
    "attr,why",
    [
        ((HOST, 0, HOST, 0, 0), "dst is device memory, attribute says host"),
        ((DEVICE, 1, HOST, 0, 0), "device id 1 for memory of npu:0"),
        ((DEVICE, 0, DEVICE, 0, 0), "src is host memory, attribute says device"),
    ],
)
def test_locations_must_match_the_real_pointer_kind(fake, mem, attr, why):
    assert batch(fake, mem, attrs=[attr]) == (RT_PARAM_INVALID, 0), why


def test_only_host_device_copies_in_a_batch(fake, mem):
    host, dev = mem
    other = host_blocks(8, 256, 3)
    err, fail = batch(
        fake,
        mem,
        dsts=[dev.data_ptr(), other.data_ptr()],
        srcs=[host.data_ptr()] * 2,
        n=2,
        attrs=[(DEVICE, 0, HOST, 0, 0), (HOST, 0, HOST, 0, 0)],
        indexes=[0, 1],
    )
    assert (err, fail) == (RT_PARAM_INVALID, 1)


def test_a_zero_size_entry_is_refused_at_its_index(fake, mem):
    assert batch(fake, mem, sizes=[256, 0, 256, 256]) == (RT_PARAM_INVALID, 1)


def test_memcpy_checks(fake, mem):
    host, dev = mem
    assert (
        fake.raw_memcpy(dev.data_ptr(), 100, host.data_ptr(), 256, 1) == RT_PARAM_INVALID
    )  # count > destMax
    assert fake.raw_memcpy(dev.data_ptr(), 256, host.data_ptr(), 0, 1) == RT_PARAM_INVALID  # zero bytes
    assert fake.raw_memcpy(host.data_ptr(), 256, host.data_ptr() + 256, 256, 0) == FEATURE_NOT_SUPPORT  # H2H
    assert fake.raw_memcpy(dev.data_ptr() + 32, 256, dev.data_ptr() + 512, 256, 3) == ADDR_UNALIGNED
    pageable = torch.zeros(256, dtype=torch.uint8)
    assert (
        fake.raw_memcpy(dev.data_ptr(), 256, pageable.data_ptr(), 256, 2) == RT_PARAM_INVALID
    )  # kind vs pageable
    assert fake.pending(0, 0) == 0


def test_an_event_destroyed_before_its_record_ran_is_freed_when_it_runs(fake):
    """aclrtDestroyEvent may be called before the event completes; its
    resources go when it does (CANN 8.0 aclcppdevg_03_0082). torch's
    Stream.wait_stream destroys its temporary event at once, while the
    record is still queued behind the waited stream's work."""
    busy, waiting = torch.Stream("npu:0"), torch.Stream("npu:0")
    host, dev = host_blocks(1, 256, 3), device_blocks(1, 256, 4)
    before = fake.live_events()
    prev = torch.accelerator.current_stream()
    torch.accelerator.set_stream(busy)
    try:
        assert fake.raw_memcpy(dev.data_ptr(), 256, host.data_ptr(), 256, MEMCPY_HOST_TO_DEVICE) == 0
    finally:
        torch.accelerator.set_stream(prev)
    waiting.wait_stream(busy)  # its record is queued behind the copy
    assert fake.live_events() == before + 1
    busy.synchronize()  # the record runs and frees the destroyed event
    assert fake.live_events() == before
    assert torch.equal(dev.cpu(), host)


def test_a_copy_on_a_stream_of_another_device_is_refused(fake):
    """ACL_ERROR_RT_STREAM_CONTEXT (107003): a stream belongs to its device's
    context (api_impl.cc:2882-2883, api_impl_david.cc:818-820, :924-925)."""
    host, dev = host_blocks(1, 256, 3), device_blocks(1, 256, 4)
    torch.accelerator.set_device_index(1)  # the stream passed below is npu:0's
    try:
        assert (
            fake.raw_memcpy(dev.data_ptr(), 256, host.data_ptr(), 256, MEMCPY_HOST_TO_DEVICE)
            == STREAM_CONTEXT
        )
        assert batch(fake, (host, dev), n=1) == (STREAM_CONTEXT, -1)
    finally:
        torch.accelerator.set_device_index(0)
    assert fake.raw_memcpy(dev.data_ptr(), 256, host.data_ptr(), 256, MEMCPY_HOST_TO_DEVICE) == 0
