"""Small helpers shared by the test files: id tensors and the ops' dry runs.

Imported as ``helpers`` (pytest puts tests/ on the path, as for
``reference`` and ``fake_device``); fixtures live in conftest.py.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import torch

import extension_ops  # noqa: F401 - torch.ops.kvswap_test


def ids(values) -> torch.Tensor:
    """A 1-D int64 CPU tensor of block ids (or addresses, sizes)."""
    return torch.tensor(values, dtype=torch.int64)


def _as_ids(v) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else ids(v)


def plan_blocks(src_caches, dst_caches, src_ids, dst_ids) -> list[list[int]]:
    """The descriptors kvswap::swap_blocks would submit, as [src, dst, sizes] lists."""
    return [t.tolist() for t in torch.ops.kvswap._plan_swap_blocks(src_caches, dst_caches, src_ids, dst_ids)]


def plan_batch(src_ptrs, dst_ptrs, sizes, direction=0) -> list[list[int]]:
    """The descriptors kvswap::swap_blocks_batch would submit, as [src, dst,
    sizes] lists; the three columns are tensors, or lists made int64 tensors."""
    planned = torch.ops.kvswap_test.plan_swap_blocks_batch.default(
        _as_ids(src_ptrs), _as_ids(dst_ptrs), _as_ids(sizes), int(direction)
    )
    return [t.tolist() for t in planned]


class Signalled(Exception):
    """Raised by the handler ``signal_taken_by_another_thread`` installs."""


@contextlib.contextmanager
def signal_taken_by_another_thread(after: float = 0.1):
    """Within the block, a thread of its own sends itself SIGUSR1 after
    ``after`` seconds (``pthread_kill``), as the kernel may hand Ctrl-C to
    any thread that does not block it. CPython runs the handler, which
    raises ``Signalled``, in the main thread once that runs Python code."""

    def handler(signum, frame):
        raise Signalled

    previous = signal.signal(signal.SIGUSR1, handler)
    sender = threading.Thread(
        target=lambda: (time.sleep(after), signal.pthread_kill(threading.get_ident(), signal.SIGUSR1))
    )
    sender.start()
    try:
        yield
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, previous)


def gated(offloader) -> threading.Event:
    """Makes each copy of ``offloader`` wait for the returned gate."""
    gate, real_copy = threading.Event(), offloader._copy
    offloader._copy = lambda job: (gate.wait(), real_copy(job))
    return gate


def hold_registration(monkeypatch, registered) -> tuple[threading.Event, threading.Event]:
    """Holds back the page-locking of the second chunk of host memory
    (``registered()``, the runtime's count of register calls so far, is 1)
    until the returned ``go`` is set; ``held`` is set once it is held back.
    Stands between the offloader's host memory and the engine's register."""
    from torch_kvswap.offloader import host_memory

    go, held, real = threading.Event(), threading.Event(), host_memory.register

    def slow(buffer, device, pin):
        if pin and registered() == 1:
            held.set()
            assert go.wait(10)
        real(buffer, device, pin)

    monkeypatch.setattr(host_memory, "register", slow)
    return held, go
