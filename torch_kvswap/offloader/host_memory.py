"""Host memory for mirrors at its exact size, ready fast: an anonymous mapping
of the bytes asked for (rounded to a page, never to a power of two), placed
on a NUMA node before its first touch, pre-faulted in parallel, and
page-locked in place chunk by chunk on a background thread.

The runtimes' pinned allocators (torch's CachingHostAllocator) round an
allocation up to a power of two, up to 2x the memory asked for, so nothing
here falls back to them: where in-place page-locking is refused, the mirrors
are refused, with the size and the runtime's reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from . import numa
from .waits import wait_for

logger = logging.getLogger("torch_kvswap")

PAGE = 4096
#: the most bytes one registration call page-locks: one cudaHostRegister of
#: 512 GiB or more is refused, so registration goes in chunks of at most this
DEFAULT_CHUNK_BYTES = 64 << 30
MADV_POPULATE_WRITE = 23  # linux/mman.h; Linux 5.14 and later, else EINVAL
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
# Host buffers the runtime may still count as registered, kept for the life of
# the process: an unregistration failed, or a registration that could be
# neither confirmed nor undone.
STILL_REGISTERED: list[torch.Tensor] = []


def register(buffer: torch.Tensor, device: torch.device, pin: bool) -> None:
    """The engine's in-place page-locking (and its undo) of one range."""
    torch.ops.kvswap._host_register(buffer, device, pin)


def map_exact(nbytes: int) -> torch.Tensor:
    """``nbytes`` (rounded up to a page) of zeroed, page-aligned, untouched
    host memory: an anonymous private mapping, unmapped when the tensor and
    every view of it are gone."""
    size = max(-(-int(nbytes) // PAGE) * PAGE, PAGE)
    return torch.frombuffer(
        mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8
    )


def _pieces(start: int, end: int, count: int) -> list[tuple[int, int]]:
    step = max(-(-(end - start) // count // PAGE) * PAGE, PAGE)
    return [(a, min(a + step, end)) for a in range(start, end, step)]


def _populate(address: int, length: int) -> bool:
    return _libc.madvise(address, length, MADV_POPULATE_WRITE) == 0


def _touch(buffer: torch.Tensor, start: int, end: int) -> None:
    buffer[start:end:PAGE].zero_()


#: bytes faulted in by each method first when ``prefault`` chooses by measuring
PROBE_BYTES = 32 << 20


def prefault(buffer: torch.Tensor, threads: int, method: str = "auto") -> str:
    """Faults every page of ``buffer`` in, on ``threads`` threads at once, and
    returns how: ``"madvise"`` (``MADV_POPULATE_WRITE``: the kernel faults
    the pages in) or ``"touch"`` (a write of one byte per page; the bytes
    stay zero). Where the kernel has no ``MADV_POPULATE_WRITE`` (before Linux
    5.14) it is ``"touch"``.

    ``method="auto"`` times both on ``PROBE_BYTES`` each at the start of a
    buffer of at least four probes and faults the rest in with the faster:
    on bare metal the kernel's populate saves an exception per page, but
    under a hypervisor that shadows page tables it measured 2x slower than
    the touch (docs/performance.md, "Host mirrors ready")."""
    if method not in ("auto", "madvise", "touch"):
        raise ValueError(f"prefault: method must be 'auto', 'madvise' or 'touch', not {method!r}")
    n, base = buffer.numel(), buffer.data_ptr()
    start = 0
    if method == "auto":
        method = "madvise"
        if n >= 4 * PROBE_BYTES:
            t0 = time.perf_counter()
            if _populate(base, PROBE_BYTES):
                t1 = time.perf_counter()
                _touch(buffer, PROBE_BYTES, 2 * PROBE_BYTES)
                t2 = time.perf_counter()
                method, start = ("madvise" if t1 - t0 <= t2 - t1 else "touch"), 2 * PROBE_BYTES
    pieces = _pieces(start, n, max(int(threads), 1))
    if not pieces:
        return method
    with ThreadPoolExecutor(len(pieces)) as pool:
        if method == "madvise" and all(pool.map(lambda p: _populate(base + p[0], p[1] - p[0]), pieces)):
            return "madvise"
        list(pool.map(lambda p: _touch(buffer, *p), pieces))
    return "touch"


def chunks(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each registration call over ``nbytes``."""
    return [(a, min(a + chunk_bytes, nbytes)) for a in range(0, nbytes, chunk_bytes)]


def check_chunk_bytes(chunk_bytes: int) -> int:
    if (
        isinstance(chunk_bytes, bool)
        or not isinstance(chunk_bytes, int)
        or chunk_bytes < PAGE
        or chunk_bytes % PAGE
    ):
        raise ValueError(
            f"register_chunk_bytes must be a positive multiple of {PAGE} (a page), got {chunk_bytes!r}"
        )
    return chunk_bytes


def unregister_chunks(buffer: torch.Tensor, device: torch.device, spans: Iterable[tuple[int, int]]) -> None:
    """Undoes the registration of each span of ``buffer``, last first; where
    the runtime refuses, logs it and keeps ``buffer`` (a view, so its whole
    allocation) for the life of the process."""
    for a, b in reversed(list(spans)):
        try:
            register(buffer[a:b], device, False)
        except (NotImplementedError, RuntimeError) as exc:
            STILL_REGISTERED.append(buffer)
            logger.error(
                "kvswap: unregistering host bytes %d..%d failed (%s); the buffer is kept "
                "for the life of the process",
                a,
                b,
                exc,
            )


class HostMemory:
    """One exact-size host buffer: allocated, bound to ``numa_node``,
    pre-faulted, then (with ``pin``) page-locked chunk by chunk on a
    background thread. ``wait()`` blocks until every chunk is registered;
    the times each step took are attributes."""

    def __init__(
        self,
        nbytes: int,
        device: torch.device,
        pin: bool,
        *,
        numa_node: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        threads: int | None = None,
        bind: Callable[[int, int, int], None] = numa.mbind,
    ) -> None:
        self.device = device
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        #: the NUMA node the memory was bound to before its first touch (None: not bound)
        self.numa_node = numa_node
        t0 = time.perf_counter()
        self.buffer = map_exact(nbytes)[:nbytes]
        if numa_node is not None and nbytes:
            bind(self.buffer.data_ptr(), self.buffer._base.numel(), numa_node)
        t1 = time.perf_counter()
        #: "madvise" or "touch": how the pages were faulted in
        self.prefault_method = (
            prefault(self.buffer, threads or min(os.cpu_count() or 1, 16)) if nbytes else "none"
        )
        t2 = time.perf_counter()
        #: seconds to map and bind, and to fault every page in
        self.allocate_seconds, self.prefault_seconds = t1 - t0, t2 - t1
        #: seconds the background registration took (set when it ends), and
        #: seconds jobs spent waiting for it
        self.register_seconds: float | None = None
        self.waited_seconds = 0.0
        self.spans = chunks(nbytes, self.chunk_bytes) if pin else []
        self.registered: list[tuple[int, int]] = []
        #: why registration failed (None: it did not)
        self.error: str | None = None
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.spans:  # a thread holds self until it ends: only one that will end
            self._thread = threading.Thread(
                target=self._register_all, name="kvswap-host-register", daemon=True
            )
            self._thread.start()

    def _register_all(self) -> None:
        start = time.perf_counter()
        try:
            for i, (a, b) in enumerate(self.spans):
                if self._stop.is_set():
                    return
                try:
                    register(self.buffer[a:b], self.device, True)
                except (NotImplementedError, RuntimeError) as exc:
                    self._refuse(i, a, b, exc)
                    return
                self.registered.append((a, b))
        finally:
            self.register_seconds = time.perf_counter() - start
            self._done.set()

    def _refuse(self, i: int, a: int, b: int, exc: BaseException) -> None:
        if "may still be registered" in str(exc):
            STILL_REGISTERED.append(self.buffer)  # freeing it would hand out registered pages
        unregister_chunks(self.buffer, self.device, self.registered)
        self.registered = []
        self.error = (
            f"cannot page-lock the {self.buffer.numel()}-byte host mirrors in place on "
            f"{self.device}: chunk {i} of {len(self.spans)} (bytes {a}..{b}) was refused "
            f"({exc}); the chunks before it were unregistered. The mirrors are not taken "
            "from the pinned allocator, which would round them up to a power of two: "
            "use a runtime that page-locks memory in place (CUDA; CANN with "
            "aclrtHostRegisterV2)"
        )
        logger.error("kvswap: %s", self.error)

    @property
    def settled(self) -> bool:
        """Registration is over and succeeded (or there was none): no job waits."""
        return (not self.spans or self._done.is_set()) and self.error is None

    def wait(self) -> None:
        """Blocks until every chunk is registered (the offloader's first job
        waits here: the core checks a host tensor page-locked at both ends, so
        it is handed whole mirrors); raises ``RuntimeError`` if registration
        failed."""
        start = time.perf_counter()
        if self.spans:
            wait_for(self._done)
        self.waited_seconds += time.perf_counter() - start
        if self.error is not None:
            raise RuntimeError(self.error)

    def release(self) -> None:
        """Stops registering, then undoes every registration made."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        registered, self.registered = self.registered, []
        unregister_chunks(self.buffer, self.device, registered)
