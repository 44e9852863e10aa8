"""KVCacheOffloader: host mirrors of a paged KV cache and asynchronous block transfers.

The class an offloading connector builds on: it owns a host mirror of every
KV-cache tensor, turns "store these device blocks into those host blocks" (and
the reverse) into one :func:`torch_kvswap.swap_blocks` call per job, and
tracks the jobs until they finish.

Lifecycle::

    offloader = KVCacheOffloader(caches, device_block_size=16, host_block_size=32,
                                 num_host_blocks=1024)
    offloader.store(job_id=1, device_block_ids=[4, 9], host_block_ids=[7])
    offloader.load(job_id=2, host_block_ids=[3], device_block_ids=[0, 1])
    for result in offloader.get_finished():  # never blocks
        ...
    offloader.wait({2})                       # blocks until job 2 is done
    offloader.shutdown()                      # drains, frees; idempotent

Ordering (see docs/handler.md):

* One stream per direction (with no accelerator: one worker thread per
  direction). Jobs of one direction run and finish in submission order.
* At submission, every job waits for the work already queued on the current
  compute stream, so a store reads finished KV data and a load does not
  overwrite blocks that queued compute still reads.
* There is no ordering *between* directions, as in the reference design: load
  a host block only after its store was reported finished.

Threads: every public method may be called from any thread; an internal lock
guards the job tables. ``wait`` and ``shutdown`` release the lock while they
block, so ``get_finished`` on another thread is never held up by them.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

from . import ops

logger = logging.getLogger("torch_kvswap")

__all__ = ["KVCacheOffloader", "TransferResult", "HostBlocks", "DeviceBlocks"]

BlockIds = Union[Sequence[int], np.ndarray, torch.Tensor]
_ALIGN = 4096  # host mirrors start on page boundaries


@dataclass(frozen=True)
class TransferResult:
    """What ``get_finished`` reports for one job."""

    job_id: int
    success: bool
    transfer_size: int  #: bytes moved (all layers, K and V)
    transfer_time: float  #: seconds, from the copy's start to its end
    transfer_type: tuple[str, str]  #: (source medium, destination medium)
    error: str | None = None  #: why the job failed, when it did


@dataclass(frozen=True)
class HostBlocks:
    """Typed spec: host block ids (each ``factor`` device blocks)."""

    block_ids: BlockIds

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclass(frozen=True)
class DeviceBlocks:
    """Typed spec: device block ids."""

    block_ids: BlockIds

    @staticmethod
    def medium() -> str:
        return "DEVICE"


def _is_host_spec(spec: Any) -> bool:
    medium = getattr(spec, "medium", None)
    name = medium() if callable(medium) else type(spec).__name__
    return str(name).upper().startswith("CPU")


def _as_ids(block_ids: BlockIds, name: str) -> np.ndarray:
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().cpu().numpy()
    arr = np.asarray(block_ids)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D array of integer block ids, got "
                         f"dtype {arr.dtype} and shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _check_range(ids: np.ndarray, limit: int, name: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise IndexError(f"{name}[{bad}] = {int(ids[bad])} is out of range: valid ids are "
                         f"0..{limit - 1}")


def _flatten_caches(caches: Mapping[str, Any] | Sequence[Any], kv_stacked: bool | None) -> list[torch.Tensor]:
    """Per-layer caches -> the list of tensors whose dim 0 indexes blocks."""
    values = list(caches.values()) if isinstance(caches, Mapping) else list(caches)
    if not values:
        raise ValueError("device_caches is empty")
    out: list[torch.Tensor] = []
    for i, v in enumerate(values):
        if isinstance(v, (tuple, list)):
            out.extend(v)  # (key, value) per layer
        elif isinstance(v, torch.Tensor):
            stacked = kv_stacked if kv_stacked is not None else (v.dim() >= 3 and v.shape[0] == 2)
            out.extend([v[0], v[1]] if stacked else [v])
        else:
            raise TypeError(f"device_caches entry {i} is {type(v).__name__}; expected a tensor or a "
                            "(key, value) tuple of tensors")
    first = out[0]
    for i, t in enumerate(out):
        if t.device != first.device:
            raise ValueError(f"cache tensor {i} is on {t.device}, tensor 0 on {first.device}")
        if t.shape[0] != first.shape[0]:
            raise ValueError(f"cache tensor {i} has {t.shape[0]} blocks, tensor 0 has {first.shape[0]}")
        if not t[0].is_contiguous():
            raise ValueError(f"cache tensor {i}: each block must be contiguous in memory")
    return out


@dataclass
class _Job:
    job_id: int
    is_store: bool
    num_bytes: int
    # Kept alive until the job is reported: the copy reads them.
    src_ids: torch.Tensor
    dst_ids: torch.Tensor
    start_event: Any = None
    end_event: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    error: str | None = None

    def finished(self) -> bool:
        if self.done.is_set():
            return True
        return self.end_event is not None and self.end_event.query()


class KVCacheOffloader:
    """Host mirrors of a paged KV cache and asynchronous store/load jobs.

    Args:
        device_caches: the KV cache, per layer: ``{name: tensor}`` with dim 0
            indexing blocks, ``{name: (key, value)}``, or ``{name: kv}`` with
            ``kv`` of shape ``[2, num_blocks, ...]`` (a sequence of the same
            also works). Every block must be contiguous in memory.
        device_block_size: tokens per device block.
        host_block_size: tokens per host block; a multiple of
            ``device_block_size`` (``factor = host_block_size // device_block_size``).
        num_host_blocks: host blocks to allocate.
        kv_stacked: whether a tensor entry is a stacked ``[2, num_blocks, ...]``
            cache; by default, a tensor of 3 or more dims whose dim 0 is 2.
        pin_memory: page-lock the host mirrors for asynchronous DMA; default:
            when the caches are on an accelerator.

    The host mirrors have the device caches' per-block layout, in one
    allocation, pinned at its exact size where the engine supports it (the
    pinned allocator's power-of-two rounding would waste up to half).
    """

    def __init__(self, device_caches: Mapping[str, Any] | Sequence[Any], device_block_size: int,
                 host_block_size: int, num_host_blocks: int, *, kv_stacked: bool | None = None,
                 pin_memory: bool | None = None) -> None:
        if device_block_size < 1 or host_block_size < 1 or host_block_size % device_block_size:
            raise ValueError(f"host_block_size ({host_block_size}) must be a positive multiple of "
                             f"device_block_size ({device_block_size})")
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        self.factor = host_block_size // device_block_size
        self.num_host_blocks = num_host_blocks
        self.device_tensors = _flatten_caches(device_caches, kv_stacked)
        self.device = self.device_tensors[0].device
        self.num_device_blocks = self.device_tensors[0].shape[0]
        self._block_bytes = [t[0].numel() * t.element_size() for t in self.device_tensors]
        #: bytes of one device block across every cache tensor
        self.bytes_per_device_block = sum(self._block_bytes)
        on_accelerator = self.device.type != "cpu"
        if pin_memory and not on_accelerator:
            raise ValueError("pin_memory=True needs caches on an accelerator; these are on cpu, "
                             "where the host engine copies pageable memory directly")
        #: whether the host mirrors are page-locked; _registered: pinned in place by us
        self.pinned = False
        self._registered = False
        self._buffer, self.host_tensors = self._allocate_mirrors(
            on_accelerator if pin_memory is None else pin_memory)
        self._device_medium = {"cuda": "GPU", "npu": "NPU"}.get(self.device.type,
                                                               self.device.type.upper() + "_DEVICE")

        self._lock = threading.Lock()
        self._pending: dict[int, _Job] = {}  # submitted, not yet reported
        self._fifo = {True: collections.deque(), False: collections.deque()}  # by is_store
        self._closed = False
        self._event_pool: list[Any] = []
        if on_accelerator:
            self._streams = {True: torch.Stream(device=self.device), False: torch.Stream(device=self.device)}
            self._workers = None
        else:
            self._streams = None
            self._queues = {True: queue.SimpleQueue(), False: queue.SimpleQueue()}
            self._workers = {
                d: threading.Thread(target=self._worker_loop, args=(self._queues[d],),
                                    name=f"kvswap-{'store' if d else 'load'}", daemon=True)
                for d in (True, False)}
            for w in self._workers.values():
                w.start()

    # -- host mirrors ----------------------------------------------------------

    def _allocate_mirrors(self, pin: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        rows = self.num_host_blocks * self.factor
        offsets, total = [], 0
        for bb in self._block_bytes:
            offsets.append(total)
            total += -(-rows * bb // _ALIGN) * _ALIGN
        buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        if pin:
            try:
                torch.ops.kvswap._host_register(buffer, self.device, True)
                self._registered = True
            except (NotImplementedError, RuntimeError) as exc:
                logger.warning("kvswap: cannot pin %d host bytes in place (%s); using the pinned "
                               "allocator, which rounds up to a power of two", total, exc)
                buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
            self.pinned = True
        mirrors = []
        for t, off, bb in zip(self.device_tensors, offsets, self._block_bytes):
            view = buffer[off:off + rows * bb].view(t.dtype).view(rows, *t.shape[1:])
            view.zero_()
            mirrors.append(view)
        return buffer, mirrors

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory held for the mirrors."""
        return self._buffer.numel()

    @property
    def host_bytes_needed(self) -> int:
        """Bytes the mirrors need without alignment padding."""
        return self.num_host_blocks * self.factor * self.bytes_per_device_block

    # -- submission ------------------------------------------------------------

    def store(self, job_id: int, device_block_ids: BlockIds, host_block_ids: BlockIds) -> bool:
        """Device -> host. ``device_block_ids`` may end mid host block: the first
        ``-len(device_block_ids) % factor`` sub-blocks of the first host block are skipped."""
        return self._submit(job_id, True, _as_ids(device_block_ids, "device_block_ids"),
                            _as_ids(host_block_ids, "host_block_ids"))

    def load(self, job_id: int, host_block_ids: BlockIds, device_block_ids: BlockIds) -> bool:
        """Host -> device, whole host blocks: ``len(device_block_ids) == factor * len(host_block_ids)``."""
        return self._submit(job_id, False, _as_ids(host_block_ids, "host_block_ids"),
                            _as_ids(device_block_ids, "device_block_ids"))

    def transfer_async(self, job_id: int, spec: tuple[Any, Any]) -> bool:
        """Reference-compatible entry: ``spec = (src_spec, dst_spec)``, each with
        ``block_ids``; the spec whose ``medium()`` is ``"CPU"`` is the host side
        (vLLM's ``CPULoadStoreSpec``/``GPULoadStoreSpec``, or :class:`HostBlocks`
        and :class:`DeviceBlocks`)."""
        src_spec, dst_spec = spec
        src_host, dst_host = _is_host_spec(src_spec), _is_host_spec(dst_spec)
        if src_host == dst_host:
            raise ValueError("spec must pair one host (CPU) side with one device side, got "
                             f"{type(src_spec).__name__} -> {type(dst_spec).__name__}")
        if dst_host:
            return self.store(job_id, src_spec.block_ids, dst_spec.block_ids)
        return self.load(job_id, src_spec.block_ids, dst_spec.block_ids)

    def _plan(self, is_store: bool, src: np.ndarray, dst: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.factor
        if is_store:
            _check_range(src, self.num_device_blocks, "device_block_ids")
            _check_range(dst, self.num_host_blocks, "host_block_ids")
            skip = -len(src) % f
            if len(src) != len(dst) * f - skip or (len(src) == 0) != (len(dst) == 0):
                raise ValueError(f"store of {len(src)} device blocks needs "
                                 f"{-(-len(src) // f)} host blocks (factor {f}), got {len(dst)}")
            dev = torch.from_numpy(src)
            host = ops.expand_block_ids(torch.from_numpy(dst), f, skip)
            return dev, host
        _check_range(src, self.num_host_blocks, "host_block_ids")
        _check_range(dst, self.num_device_blocks, "device_block_ids")
        if len(dst) != len(src) * f:
            raise ValueError(f"load of {len(src)} host blocks fills {len(src) * f} device blocks "
                             f"(factor {f}), got {len(dst)} device block ids; loads move whole "
                             "host blocks")
        return ops.expand_block_ids(torch.from_numpy(src), f), torch.from_numpy(dst)

    def _submit(self, job_id: int, is_store: bool, src: np.ndarray, dst: np.ndarray) -> bool:
        src_ids, dst_ids = self._plan(is_store, src, dst)
        if len(np.unique(dst_ids.numpy())) != len(dst_ids):
            raise ValueError("destination block ids repeat within one job")
        job = _Job(int(job_id), is_store, len(src_ids) * self.bytes_per_device_block,
                   src_ids, dst_ids)
        with self._lock:
            if self._closed:
                raise RuntimeError("KVCacheOffloader is shut down")
            if job.job_id in self._pending:
                raise ValueError(f"job id {job.job_id} is already in flight or not yet reported")
            self._pending[job.job_id] = job
            self._fifo[is_store].append(job)
            if self._workers is not None:
                self._queues[is_store].put(job)
            else:
                try:
                    self._launch_on_stream(job)
                except Exception as exc:  # noqa: BLE001 - never leave a job unfinishable
                    self._fail(job, exc)
                    job.done.set()
        return True

    def _copy(self, job: _Job) -> None:
        src, dst = (self.device_tensors, self.host_tensors) if job.is_store else \
            (self.host_tensors, self.device_tensors)
        if len(job.src_ids):
            ops.swap_blocks(src, dst, job.src_ids, job.dst_ids)

    def _launch_on_stream(self, job: _Job) -> None:
        stream = self._streams[job.is_store]
        job.start_event, job.end_event = self._get_event(), self._get_event()
        # Wait for queued compute: a store must read finished KV data, and a
        # load must not overwrite blocks that queued compute still reads.
        stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            job.start_event.record(stream)
            try:
                self._copy(job)
            except Exception as exc:  # noqa: BLE001 - reported as a failed job
                self._fail(job, exc)
            job.end_event.record(stream)

    def _worker_loop(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                self._copy(job)
            except Exception as exc:  # noqa: BLE001 - reported as a failed job
                self._fail(job, exc)
            job.seconds = time.perf_counter() - t0
            job.done.set()

    def _fail(self, job: _Job, exc: BaseException) -> None:
        job.error = f"{type(exc).__name__}: {exc}"
        logger.error("kvswap: job %d (%s) failed: %s", job.job_id,
                     "store" if job.is_store else "load", job.error)

    def _get_event(self):
        if self._event_pool:
            return self._event_pool.pop()
        return torch.Event(device=self.device, enable_timing=True)

    # -- completion --------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs that finished since the last call, in completion
        order per direction (stores first). Never blocks."""
        results = []
        with self._lock:
            for is_store in (True, False):
                fifo = self._fifo[is_store]
                while fifo and fifo[0].finished():
                    results.append(self._report(fifo.popleft()))
        return results

    def _report(self, job: _Job) -> TransferResult:
        seconds = job.seconds
        if job.end_event is not None and not job.done.is_set():
            seconds = job.start_event.elapsed_time(job.end_event) * 1e-3
            self._event_pool += [job.start_event, job.end_event]
        del self._pending[job.job_id]
        kind = (self._device_medium, "CPU") if job.is_store else ("CPU", self._device_medium)
        return TransferResult(job.job_id, job.error is None, job.num_bytes, seconds, kind, job.error)

    def wait(self, job_ids: Iterable[int], *, strict: bool = False) -> None:
        """Block until every listed job has finished (it stays reportable by
        ``get_finished``). Ids that are not pending (already reported, or never
        submitted) are ignored, as in the reference; ``strict=True`` raises
        ``KeyError`` for them instead."""
        wanted = set(job_ids)
        with self._lock:
            missing = wanted - self._pending.keys()
            if strict and missing:
                raise KeyError(f"job ids not pending: {sorted(missing)}")
            jobs = [self._pending[j] for j in wanted - missing]
        for job in jobs:
            if job.end_event is not None and not job.done.is_set():
                job.end_event.synchronize()
            else:
                job.done.wait()

    def pending(self) -> list[int]:
        """Job ids submitted and not yet reported by ``get_finished``."""
        with self._lock:
            return list(self._pending)

    def shutdown(self) -> None:
        """Finish every in-flight job, stop the workers and release the host
        mirrors. Results stay available from ``get_finished``. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._pending.values())
        self.wait(j.job_id for j in jobs)
        if self._workers is not None:
            for d, worker in self._workers.items():
                self._queues[d].put(None)
                worker.join()
        if self._registered:
            torch.ops.kvswap._host_register(self._buffer, self.device, False)
            self._registered = False
        self.host_tensors = []
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def __enter__(self) -> KVCacheOffloader:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
