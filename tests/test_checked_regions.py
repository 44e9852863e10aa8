"""Checked mode's regions follow their storage's memory, and registering them costs O(n).

A region is the bytes of a storage. ``tensor.resize_`` may reallocate that
storage, and ``untyped_storage().resize_`` (FSDP frees parameters with
``resize_(0)``) reallocates or frees it while the tensor lives on; the
region then covers the bytes the storage holds now, and a copy aimed at the
old ones (memory the allocator may have handed to another tensor) is
refused, naming the region and where its bytes went.
"""

from __future__ import annotations

import gc

import pytest
import torch

import torch_kvswap
from torch_kvswap import Direction, KVCacheOffloader

OP = torch.ops.kvswap.swap_blocks_batch.default
BLOCK = 256


@pytest.fixture(autouse=True)
def _mode_off():
    yield
    torch_kvswap.set_checked(False)


def filled(blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (blocks, BLOCK), dtype=torch.uint8, generator=g)


def to_device(src: torch.Tensor, address: int) -> None:
    """One block from host tensor ``src`` to ``address``, checked."""

    def as_t(v):
        return torch.tensor([v], dtype=torch.int64)

    with torch_kvswap.checked():
        OP(as_t(src.data_ptr()), as_t(address), as_t(BLOCK), int(Direction.HOST_TO_DEVICE))


@pytest.fixture
def source():
    src = filled(1, seed=7)
    with torch_kvswap.register_region(src, label="src"):
        yield src


def test_after_resize_reallocates_the_old_bytes_are_refused_and_the_new_ones_copied(source):
    cache = filled(8, seed=1)
    old = cache.data_ptr()
    with torch_kvswap.register_region(cache, side="device", label="cache"):
        cache.resize_(64, BLOCK)  # more than the storage holds: reallocated, the old bytes freed
        assert cache.data_ptr() != old
        with pytest.raises(
            ValueError,
            match=r"dst_ptrs\[0\] = 0x[0-9a-f]+ .* those bytes were "
            r"region 'cache' \[.*\) until its storage was reallocated or shrunk "
            r".*: they are at \[.*\) now\. Aim the copy at the tensor's current",
        ):
            to_device(source, old + 3 * BLOCK)
        to_device(source, cache[3].data_ptr())  # the region followed its storage
        assert torch.equal(cache[3], source[0])
        with pytest.raises(ValueError, match="'cache' .* 0 bytes after its end"):
            to_device(source, cache[8].data_ptr())  # grown past what was registered


def test_after_the_storage_is_resized_to_nothing_its_old_bytes_are_refused(source):
    # FSDP's pattern: the parameter's storage freed, then allocated again.
    cache = filled(8, seed=1)
    old = cache.data_ptr()
    with torch_kvswap.register_region(cache, side="device", label="cache"):
        cache.untyped_storage().resize_(0)
        with pytest.raises(
            ValueError,
            match=r"those bytes were region 'cache' .* it holds none "
            r"of them now",
        ):
            to_device(source, old)
        assert "device:cache" not in torch.ops.kvswap_test.region_labels()
        cache.untyped_storage().resize_(8 * BLOCK)
        cache.zero_()
        to_device(source, cache[7].data_ptr())
        assert torch.equal(cache[7], source[0]) and not cache[:7].any()


def test_a_tensor_shrunk_and_grown_in_place_keeps_its_bytes_covered(source):
    cache = filled(8, seed=1)
    old = cache.data_ptr()
    with torch_kvswap.register_region(cache, side="device", label="cache"):
        cache.resize_(2, BLOCK)  # the storage keeps its 8 blocks
        to_device(source, old + 7 * BLOCK)  # still the storage's own bytes
        cache.resize_(8, BLOCK)  # grows in place
        assert cache.data_ptr() == old
        assert torch.equal(cache[7], source[0])


def test_a_storage_shrunk_covers_only_the_bytes_it_still_holds(source):
    cache = filled(8, seed=1)
    old = cache.data_ptr()
    with torch_kvswap.register_region(cache, side="device", label="cache"):
        cache.untyped_storage().resize_(4 * BLOCK)  # reallocated, 4 blocks
        new = cache.untyped_storage().data_ptr()
        to_device(source, new + 3 * BLOCK)
        assert torch.equal(cache[3], source[0])
        with pytest.raises(ValueError, match="'cache' .* 0 bytes after its end"):
            to_device(source, new + 4 * BLOCK)
        with pytest.raises(ValueError, match="those bytes were region 'cache'"):
            to_device(source, old + 3 * BLOCK)


def test_the_offloaders_regions_follow_the_storages_of_its_caches_and_mirrors(source):
    tensors = [torch.zeros(4, 16, 16, dtype=torch.uint8) for _ in range(2)]  # blocks of 256 bytes
    with KVCacheOffloader(tensors, 16, 16, num_host_blocks=2, check=False) as off:
        cache, mirror = off.device_tensors[0], off.host_tensors[0]
        old_cache, old_mirror = cache[1].data_ptr(), mirror[1].data_ptr()
        tensors[0].untyped_storage().resize_(0)
        with pytest.raises(ValueError, match="those bytes were region 'device cache 0'"):
            to_device(source, old_cache)
        del cache, mirror

    # shutdown unmapped the mirrors: their region no longer vouches for those bytes
    def as_t(v):
        return torch.tensor([v], dtype=torch.int64)

    with torch_kvswap.checked(), pytest.raises(ValueError, match=f"0x{old_mirror:x}"):
        OP(as_t(tensors[1][0].data_ptr()), as_t(old_mirror), as_t(BLOCK), int(Direction.DEVICE_TO_HOST))


# --- registering many regions -----------------------------------------------------------


def table_work_of_an_offloader(num_tensors: int) -> int:
    """Region entries the table visits while an offloader over ``num_tensors``
    caches is built, checked once, and dropped."""
    work = torch.ops.kvswap_test.region_table_work
    tensors = [torch.zeros(2, 16, dtype=torch.uint8) for _ in range(num_tensors)]
    before = work()
    off = KVCacheOffloader(tensors, 16, 16, num_host_blocks=1, check=False)
    assert len(torch.ops.kvswap_test.region_labels()) >= 2 * num_tensors  # one check
    off.shutdown()
    del off
    gc.collect()
    torch.ops.kvswap_test.region_labels()
    return work() - before


def test_building_an_offloader_visits_region_entries_linearly_in_its_tensors():
    small, large = table_work_of_an_offloader(1000), table_work_of_an_offloader(4000)
    assert 2 * 1000 <= small and large <= 5 * small  # linear: 4x; a table rebuilt per region: 16x
