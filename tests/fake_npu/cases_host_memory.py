"""The offloader's host memory through the Ascend engine on the fake CANN:
exact sizes, chunked in-place registration under a per-call limit,
registration that overlaps the rest of start-up, and the refusal where CANN
cannot page-lock in place (never the pinned allocator's power of two)."""

from __future__ import annotations

import threading

import pytest
import torch

from helpers import hold_registration
from npu_cases import ABSENT_8_0, cann
from npu_cases import fake  # noqa: F401 - the fixture
from torch_kvswap import KVCacheOffloader
from torch_kvswap.offloader import caches
from torch_kvswap.offloader.host_memory import PAGE, HostMemory


def npu() -> torch.device:
    """The fake's device (the "npu" name exists once the fixture set it up)."""
    return torch.device("npu:0")


def kv_caches(num_blocks=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        f"l{i}": torch.randn(2, num_blocks, 4, 2, 8, generator=g).to(torch.bfloat16).to("npu:0")
        for i in range(2)
    }


@pytest.mark.parametrize("nbytes", [PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 100])
def test_pinned_host_buffer_is_exact_and_pinned_in_place(fake, nbytes):
    allocation, buffer, registered = caches.pinned_host_buffer(nbytes, npu(), pin=True)
    try:
        assert registered and buffer.numel() == nbytes
        assert allocation.numel() == -(-nbytes // PAGE) * PAGE  # a page, never a power of two
        assert fake.kind(buffer.data_ptr()) == "pinned" == fake.kind(buffer.data_ptr() + nbytes - 1)
        assert fake.registered_bytes() == nbytes
    finally:
        caches.unregister_mirrors(buffer, npu())
    assert fake.kind(buffer.data_ptr()) == "pageable"


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_chunks_at_the_runtimes_per_call_limit_pin_the_whole_buffer(fake, chunks):
    fake.set_register_max_bytes(2 * PAGE)
    memory = HostMemory(chunks * 2 * PAGE, npu(), True, chunk_bytes=2 * PAGE)
    memory.wait()
    assert fake.calls("aclrtHostRegisterV2") == chunks
    assert fake.registered_bytes() == chunks * 2 * PAGE  # the cost: every byte once
    assert all(fake.kind(memory.buffer.data_ptr() + a) == "pinned" for a in range(0, chunks * 2 * PAGE, PAGE))
    memory.release()
    assert fake.kind(memory.buffer.data_ptr()) == "pageable"


def test_a_chunk_over_the_limit_is_refused_named_and_the_earlier_ones_undone(fake):
    fake.set_register_max_bytes(2 * PAGE)
    memory = HostMemory(2 * PAGE + 3 * PAGE, npu(), True, chunk_bytes=3 * PAGE)
    with pytest.raises(RuntimeError, match=r"chunk 0 of 2 \(bytes 0\.\.12288\) was refused .*207001"):
        memory.wait()
    assert fake.kind(memory.buffer.data_ptr()) == "pageable" and fake.registered_bytes() == 0


def test_construction_returns_before_registration_ends_and_the_first_job_waits_for_it(fake, monkeypatch):
    """Chunk 1 of the mirrors is held back: the offloader is built, and its
    first store waits until every chunk is pinned (the core checks a host
    tensor page-locked at both ends), then lands."""
    held, go = hold_registration(monkeypatch, lambda: fake.calls("aclrtHostRegisterV2"))
    cache = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    # one mirror of 64 rows x 128 bytes: rows 0-31 are chunk 0, rows 32-63 chunk 1
    off = KVCacheOffloader({"l0": cache.to("npu:0")}, 1, 1, num_host_blocks=64, register_chunk_bytes=PAGE)
    try:
        assert held.wait(10) and off.host_memory.register_seconds is None  # still registering
        assert off.host_bytes == 2 * PAGE
        first = threading.Thread(target=off.store, args=(1, [5], [0]))
        first.start()
        first.join(0.2)
        assert first.is_alive()  # waits for chunk 1
        go.set()
        first.join(10)
        off.wait({1})
        results = off.get_finished()
        assert [r.success for r in results] == [True], [r.error for r in results]
        assert torch.equal(off.host_tensors[0][0], cache[5])
        assert off.host_memory.register_seconds is not None and off.host_memory.waited_seconds > 0
        assert fake.registered_bytes() == 2 * PAGE
    finally:
        go.set()
        off.shutdown()


def test_without_in_place_pinning_the_offloader_refuses_instead_of_rounding(fake):
    cann(fake, ABSENT_8_0)  # CANN 8.0: no aclrtHostRegisterV2
    off = KVCacheOffloader(kv_caches(), 4, 8, num_host_blocks=6)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"cannot page-lock the \d+-byte host mirrors in place on npu:0: "
            r"chunk 0 of 1 .*no aclrtHostRegisterV2.*power of two",
        ):
            off.store(1, [0, 1], [0])
        assert off.pending() == [] and fake.kind(off.buffer.data_ptr()) == "pageable"
    finally:
        off.shutdown()
