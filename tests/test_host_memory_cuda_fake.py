"""Host mirrors' memory through the CUDA engine, on the fake CUDA runtime
(tests/fake_cuda): exact sizes, chunked in-place registration under the
runtime's per-call limit, a refused chunk undone and named, and the bytes
page-locked (the fake's cost clock), construction that returns while the
registration goes on. The Ascend engine's counterpart is
tests/fake_npu/cases_host_memory.py (where the offloader itself runs; its
streams are torch's CUDA objects here, so the buffer is tested alone)."""

from __future__ import annotations

import threading

import pytest
import torch

from torch_kvswap.offloader import caches
from torch_kvswap.offloader.host_memory import PAGE, HostMemory

from helpers import hold_registration
from test_cuda_fake import F, fake  # noqa: F401 - the fixture; skips where the fake is not built

DEV = torch.device("cuda", 0)


def mapped(t: torch.Tensor) -> bool:
    """Whether the engine calls every byte of ``t`` page-locked and mapped."""
    return torch.ops.kvswap_test.host_mapped("cuda", [t], DEV)


@pytest.mark.parametrize("nbytes", [PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 100])
def test_pinned_host_buffer_is_exact_and_pinned_in_place(fake, nbytes):
    allocation, buffer, registered = caches.pinned_host_buffer(nbytes, DEV, pin=True)
    try:
        assert registered and buffer.numel() == nbytes
        assert allocation.numel() == -(-nbytes // PAGE) * PAGE  # a page, never a power of two
        assert mapped(buffer) and fake.host_register_bytes() == nbytes
    finally:
        caches.unregister_mirrors(buffer, DEV)
    assert not mapped(buffer)


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_chunks_at_the_runtimes_per_call_limit_pin_the_whole_buffer(fake, chunks):
    fake.set_fault("host_register_max_bytes", 2 * PAGE)
    memory = HostMemory(chunks * 2 * PAGE, DEV, True, chunk_bytes=2 * PAGE)
    memory.wait()
    assert fake.count_calls("cudaHostRegister") == chunks
    assert fake.host_register_bytes() == chunks * 2 * PAGE  # the cost: every byte once
    assert mapped(memory.buffer) and memory.buffer._base.numel() == chunks * 2 * PAGE
    memory.release()
    assert not mapped(memory.buffer) and fake.count_calls("cudaHostUnregister") == chunks


def test_a_chunk_over_the_runtimes_limit_is_refused_named_and_the_rest_undone(fake):
    fake.set_fault("host_register_max_bytes", 2 * PAGE)
    memory = HostMemory(5 * PAGE, DEV, True, chunk_bytes=3 * PAGE)
    with pytest.raises(
        RuntimeError,
        match=r"20480-byte host mirrors .* chunk 0 of 2 \(bytes 0\.\.12288\) "
        r"was refused .*cudaErrorMemoryAllocation",
    ):
        memory.wait()
    assert not mapped(memory.buffer[:PAGE]) and fake.host_register_bytes() == 0


def test_construction_returns_before_registration_ends_and_a_wait_blocks_until_it_does(fake, monkeypatch):
    """Chunk 1 of 3 is held back: the buffer is constructed (mapped and
    pre-faulted) while chunk 1 is still being page-locked; ``wait`` blocks
    until every chunk is, then the runtime counts every byte pinned once."""
    held, go = hold_registration(monkeypatch, lambda: fake.count_calls("cudaHostRegister"))
    memory = HostMemory(3 * PAGE, DEV, True, chunk_bytes=PAGE)
    try:
        assert held.wait(10) and memory.register_seconds is None  # constructed, still registering
        assert fake.host_register_bytes() == PAGE
        waiter = threading.Thread(target=memory.wait)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # waits for chunks 1 and 2
        go.set()
        waiter.join(10)
        assert not waiter.is_alive() and memory.register_seconds is not None
        assert fake.host_register_bytes() == 3 * PAGE and mapped(memory.buffer)
    finally:
        go.set()
        memory.release()
