"""Lanes and completion: how planned jobs are queued, copied and reported.

One lane per kind of job (stores, loads, expedited loads), each with its own
stream, or with no accelerator its own worker thread; jobs of one lane run and
finish in submission order. A job is reported by ``get_finished`` once its end
event (or its worker) says it is done; ``wait`` blocks on the same signals and
``shutdown`` drains every lane. The table lock guards the job tables and is
never held while a copy is launched or waited for.

:class:`Lanes` knows jobs, not what they copy: its owner hands it a ``copy``
function and the job trackers (:class:`JobTracker`: checked mode's contract,
strict mode's record of stores), and builds each :class:`Job`.

Lifecycle (docs/offloader.md, "Lifecycle contract"): lanes stay on the exit
list until their workers have stopped, so an interrupted ``shutdown`` is
finished by the next call or at exit; worker threads hold their lanes only
while they copy, so dropped lanes (and the offloader that owns them) are
collected; in a forked child the parent's lanes refuse every call.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .planning import Copy, as_job_ids
from .specs import TransferResult
from .waits import wait_for

logger = logging.getLogger("torch_kvswap")

_LANES = ("store", "load", "expedited")
# Lanes not yet shut down. At interpreter exit each is shut down: its
# in-flight jobs finish and its worker threads stop before the interpreter
# tears down, instead of being cut off inside a copy (which aborts the
# process: "terminate called without an active exception").
_LIVE: weakref.WeakSet = weakref.WeakSet()
# Bumped in every forked child: an offloader built in an earlier generation
# belongs to an ancestor, whose worker threads and streams the child lacks.
_generation = 0


def _forget_the_parents_offloaders() -> None:
    global _generation
    _generation += 1
    _LIVE.clear()  # the child's exit must not wait on the parent's threads


os.register_at_fork(after_in_child=_forget_the_parents_offloaders)


@atexit.register
def _shutdown_live() -> None:
    for lanes in list(_LIVE):
        try:
            lanes.shutdown()
        except Exception:  # exit goes on; the others still shut down
            logger.exception("kvswap: shutting down an offloader at exit failed")


def describe(exc: BaseException) -> str:
    """``"Type: message"`` for a job's error; never raises, even for an
    exception whose ``__str__`` does."""
    try:
        name = type(exc).__name__
    except BaseException:  # noqa: BLE001 - a hostile metaclass
        name = "exception"
    try:
        return f"{name}: {exc}"
    except BaseException:  # noqa: BLE001 - its __str__ raised
        return f"{name} (its message could not be formatted)"


def _run_lane(owner: weakref.ref, jobs: queue.SimpleQueue) -> None:
    """A lane's worker thread. It holds its lanes (and through their copy
    function, the offloader) only while it copies a job, so a dropped
    offloader is collected once no copy runs (its mirrors live until then);
    jobs still queued then are abandoned, never copied. Nothing a copy or its
    report raises ends the thread: the job is marked done (failed) and the
    next one runs."""
    while (job := jobs.get()) is not None:
        lanes = owner()
        if lanes is None:
            continue
        t0 = time.perf_counter()
        try:
            lanes._copy(job)
        except BaseException as exc:  # noqa: BLE001 - any kind, SystemExit too: the job failed, the lane goes on
            try:
                lanes._fail(job, exc)
            except BaseException as report_exc:  # noqa: BLE001 - the report raised: the job still fails
                job.error = job.error or describe(report_exc)
        finally:
            job.seconds = time.perf_counter() - t0
            job.done.set()
        del lanes  # may collect them, on this thread: _stop_lanes only queues the stops


def _stop_lanes(generation: int, queues: dict | None, streams: dict | None) -> None:
    """Stops lanes, once: at ``shutdown``, or when they are collected.
    Worker threads finish the job they run and stop; streams finish their
    copies before the mirrors they read or write are freed."""
    if generation != _generation:
        return  # a forked child: the lanes are the parent's
    for jobs in (queues or {}).values():
        jobs.put(None)
    for stream in (streams or {}).values():
        stream.synchronize()


_serials = itertools.count()


@dataclass(eq=False)
class Job:
    job_id: int
    lane: str
    num_bytes: int
    # Kept alive until the job is reported: the copies read them.
    copies: list[Copy]
    # Unique per job, unlike job_id, which the caller may reuse once reported.
    serial: int = field(default_factory=lambda: next(_serials))
    start_event: Any = None
    end_event: Any = None
    # Stream path: set once the events are recorded (or the launch failed).
    launched: threading.Event = field(default_factory=threading.Event)
    # Worker path: set when the copy returned; stream path: when the launch failed.
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    error: str | None = None
    # Set once get_finished has settled the job (see Lanes.get_finished).
    result: TransferResult | None = None
    events_returned: bool = False

    @property
    def is_store(self) -> bool:
        return self.lane == "store"

    def finished(self) -> bool:
        if self.done.is_set():
            return True
        if not self.launched.is_set():
            return False
        try:
            return bool(self.end_event.query())
        except Exception as exc:  # noqa: BLE001 - an asynchronous device error
            self.error = self.error or describe(exc)
            return True


class JobTracker(Protocol):
    """Follows jobs through the lanes; every method runs under the table lock.
    Checked mode's contract (``_checked.OffloaderChecks``) and strict mode's
    record of stores (``strict.StoreRecord``) are trackers."""

    def admit(self, job: Job) -> None:
        """A job about to be queued; raising refuses it, before any copy."""

    def observed(self, jobs: list[Job]) -> None:
        """The caller's ``wait`` returned for these jobs."""

    def finish(self, job: Job, ok: bool) -> None:
        """The job is reported, done (``ok``) or failed."""


class Lanes:
    """The lanes, the job tables and completion of one offloader.

    Args:
        device: where the caches are; the streams' device on an accelerator.
        medium: the device side's name in results (``"GPU"``, ``"NPU"``, ...).
        on_accelerator: streams (True) or worker threads (False).
        copy: runs a job's copies on the current stream (from a worker
            thread with no accelerator); a raise fails the job.
        trackers: admit each job, in this order, and are told when the
            caller's ``wait`` observed it and when it finished (in reverse
            order).
    """

    def __init__(
        self,
        device: torch.device,
        medium: str,
        on_accelerator: bool,
        copy: Callable[[Job], None],
        trackers: Sequence[JobTracker] = (),
    ) -> None:
        self.device, self._medium = device, medium
        self._copy = copy
        self._trackers = tuple(trackers)
        self._lock = threading.Lock()  # the job tables; never held across a launch or a wait
        # One submission lock per lane keeps launch order equal to table order.
        self._lane_locks = {lane: threading.Lock() for lane in _LANES}
        self._pending: dict[int, Job] = {}  # submitted, not yet reported
        # Results settled by get_finished and not yet returned by it (see there).
        self._ready: list[TransferResult] = []
        self._fifo: dict[str, collections.deque[Job]] = {lane: collections.deque() for lane in _LANES}
        self._closed = False
        self._generation, self._pid = _generation, os.getpid()
        self._event_pool: list[Any] = []
        if on_accelerator:
            self._streams = {lane: torch.Stream(device=self.device) for lane in _LANES}
            self._queues = self._workers = None
        else:
            self._streams = None
            self._queues = {lane: queue.SimpleQueue() for lane in _LANES}
            owner = weakref.ref(self)  # a thread holding the lanes would keep them forever
            self._workers = {
                lane: threading.Thread(
                    target=_run_lane, args=(owner, self._queues[lane]), name=f"kvswap-{lane}", daemon=True
                )
                for lane in _LANES
            }
            for w in self._workers.values():
                w.start()
        self._stop = weakref.finalize(self, _stop_lanes, _generation, self._queues, self._streams)
        self._stop.atexit = False  # exit shuts live lanes down instead, jobs finished
        _LIVE.add(self)  # shut down at interpreter exit (_shutdown_live)

    def _check_process(self) -> None:
        if self._generation != _generation:
            raise RuntimeError(
                f"this KVCacheOffloader was built in process {self._pid}; process {os.getpid()} is a "
                "fork of it, without its worker threads and streams, so its jobs would never finish. "
                "Build a new KVCacheOffloader in the child (or start children with the 'spawn' method)"
            )

    # -- submission ------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queues `job` on its lane once every tracker admitted it; raises,
        nothing queued, when the lanes are shut down, the job id is pending
        or a tracker refuses the job."""
        self._check_process()
        lane = job.lane
        with self._lane_locks[lane]:  # launch order == table order, per lane
            with self._lock:
                if self._closed:
                    raise RuntimeError(
                        "KVCacheOffloader is shut down (shutdown() was called, or its with block "
                        "ended), so it takes no new jobs; the results of earlier ones stay "
                        "available from get_finished(). Build a new KVCacheOffloader for more jobs"
                    )
                if job.job_id in self._pending:
                    raise ValueError(f"job id {job.job_id} is already in flight or not yet reported")
                for tracker in self._trackers:
                    tracker.admit(job)  # refuses before anything is queued
                self._pending[job.job_id] = job
                self._fifo[lane].append(job)
            # Launched outside the table lock: get_finished never waits on a launch.
            if self._workers is not None:
                self._queues[lane].put(job)
            else:
                try:
                    self._launch_on_stream(job)
                except BaseException as exc:  # never leave a job unfinishable
                    self._fail(job, exc)
                    job.done.set()
                    if not isinstance(exc, Exception):
                        raise  # Ctrl-C in the caller's thread: the job is failed, the call interrupted
                finally:
                    job.launched.set()

    def _launch_on_stream(self, job: Job) -> None:
        stream = self._streams[job.lane]
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

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.error = describe(exc)
        # A logging handler that raises loses the log line, not the job.
        with contextlib.suppress(Exception):
            logger.error("kvswap: job %d (%s) failed: %s", job.job_id, job.lane, job.error)

    def _get_event(self):
        with self._lock:
            if self._event_pool:
                return self._event_pool.pop()
        return torch.Event(device=self.device, enable_timing=True)

    # -- completion --------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        """What ``KVCacheOffloader.get_finished`` returns (its docstring says
        in which order, and when a call yields the processor)."""
        self._check_process()
        # Ctrl-C may interrupt this call between any two steps. A job leaves
        # its lane's queue only once its result is in self._ready, and the
        # results leave self._ready in one swap, so an interrupted call loses
        # nothing: the next call returns what it had settled.
        with self._lock:
            for lane in _LANES:
                fifo = self._fifo[lane]
                while fifo and fifo[0].finished():
                    job = fifo[0]
                    if job.result is None:
                        job.result = self._report(job)
                    if not (self._ready and self._ready[-1] is job.result):
                        self._ready.append(job.result)
                    fifo.popleft()
            results = self._ready
            self._ready = []
            idle = not results and self._workers is not None and bool(self._pending)
        if idle:
            os.sched_yield()
        return results

    def _report(self, job: Job) -> TransferResult:
        """The job's result, and the tables forget it. Safe to run again on
        the same job after an interruption: each step is done once."""
        seconds = job.seconds
        if job.launched.is_set() and not job.done.is_set():
            try:
                seconds = job.start_event.elapsed_time(job.end_event) * 1e-3
            except Exception as exc:  # noqa: BLE001 - an asynchronous device error
                job.error = job.error or describe(exc)
            if not job.events_returned:
                job.events_returned = True
                self._event_pool += [job.start_event, job.end_event]
        if self._pending.get(job.job_id) is job:
            del self._pending[job.job_id]
        ok = job.error is None
        for tracker in reversed(self._trackers):
            tracker.finish(job, ok)
        kind = (self._medium, "CPU") if job.is_store else ("CPU", self._medium)
        return TransferResult(job.job_id, ok, job.num_bytes if ok else 0, seconds, kind, job.error)

    def wait(self, job_ids: Iterable[int], strict: bool) -> None:
        """Blocks until every listed pending job has finished (it stays
        reportable by ``get_finished``); other ids are ignored, or with
        ``strict`` refused with ``KeyError``."""
        self._check_process()
        wanted = as_job_ids(job_ids)
        with self._lock:
            missing = wanted - self._pending.keys()
            if strict and missing:
                raise KeyError(f"job ids not pending: {sorted(missing)}")
            jobs = [self._pending[j] for j in wanted - missing]
        for job in jobs:
            if self._workers is not None:
                wait_for(job.done)
                continue
            wait_for(job.launched)
            if not job.done.is_set():
                try:
                    job.end_event.synchronize()
                except Exception as exc:  # noqa: BLE001 - reported by get_finished
                    job.error = job.error or describe(exc)
        if self._trackers:
            with self._lock:
                for tracker in self._trackers:
                    tracker.observed(jobs)  # the caller has seen them finish

    def pending(self) -> list[int]:
        """Job ids submitted and not yet reported by ``get_finished``."""
        self._check_process()
        with self._lock:
            return list(self._pending)

    def shutdown(self) -> bool:
        """Finishes every in-flight job and stops the workers; results stay
        available from ``get_finished``. Idempotent and safe to interrupt
        (Ctrl-C): until the workers have stopped the lanes stay on the exit
        list, and the next call, or exit, finishes the shutdown. Returns
        whether the lanes are stopped: False in a forked child, where the
        jobs and the workers are the parent's (nothing is done)."""
        if self._generation != _generation:
            return False
        with self._lock:
            self._closed = True
        # A submission that passed the closed check is in the table now.
        for lock in self._lane_locks.values():
            with lock:
                pass
        with self._lock:
            jobs = list(self._pending.values())
        self.wait((j.job_id for j in jobs), strict=False)
        self._stop()  # once: later calls find the stops queued
        for worker in (self._workers or {}).values():
            worker.join()
        _LIVE.discard(self)
        return True
