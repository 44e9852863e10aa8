"""KVCacheOffloader end to end on the fake NPU: streams, events, pinned
mirrors and the Ascend engine together."""

from __future__ import annotations

import torch

from npu_cases import fake  # noqa: F401 - the fixture
from torch_kvswap import KVCacheOffloader


def kv_caches(num_blocks=16, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        f"l{i}": torch.randn(2, num_blocks, 4, 2, 8, generator=g).to(torch.bfloat16).to("npu:0")
        for i in range(layers)
    }


def test_store_then_load_round_trip(fake):
    caches = kv_caches()
    want = {k: v.cpu().clone() for k, v in caches.items()}
    off = KVCacheOffloader(caches, device_block_size=4, host_block_size=8, num_host_blocks=6)
    try:
        assert off.pinned
        off.host_memory.wait()  # page-locked in the background: under load, not yet at construction
        assert all(fake.kind(t.data_ptr()) == "pinned" for t in off.host_tensors)
        off.store(1, [2, 3, 4, 5], [0, 1])
        off.wait({1})
        for v in caches.values():
            v.zero_()
        off.load(2, [0, 1], [8, 9, 10, 11])
        off.wait({2})
        results = {r.job_id: r for r in off.get_finished()}
        assert results[1].success and results[2].success, results
        assert results[2].transfer_type == ("CPU", "NPU")
        for k, v in caches.items():
            got = v.cpu()
            assert torch.equal(got[:, 8:12], want[k][:, 2:6])
    finally:
        off.shutdown()


def test_store_is_ordered_after_queued_device_work(fake):
    """The offloader's stream waits for the compute stream: a store made right
    after a device write on the current stream reads the written data."""
    caches = kv_caches(seed=1)
    off = KVCacheOffloader(caches, device_block_size=4, host_block_size=4, num_host_blocks=4)
    try:
        for v in caches.values():
            v.fill_(3)
        off.store(1, [0], [2])
        off.wait({1})
        assert all(bool((t[2] == 3).all()) for t in off.host_tensors)
    finally:
        off.shutdown()
