"""The offloader's lifecycle: Ctrl-C during ``wait`` and ``shutdown``, fork,
an offloader dropped without ``shutdown``, any exception inside a copy.

Each case runs in its own Python process, ``RUNS`` times (several at once),
each bounded by a timeout; ``KVSWAP_LIFECYCLE_RUNS=20`` runs each 20 times.
A child that must be interrupted inside a call makes that call slow (a copy
that repeats for a second) and prints a marker from inside it; the test then
sends SIGINT, as Ctrl-C does. Interpreter exit with jobs in flight is
tests/test_exit.py.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from torch_kvswap import KVCacheOffloader
from torch_kvswap.offloader import lanes
from helpers import Signalled, gated, signal_taken_by_another_thread

RUNS = int(os.environ.get("KVSWAP_LIFECYCLE_RUNS", "3"))
TIMEOUT = 60  # seconds per child; a hang shows as a timeout, never as a stuck suite

# A 16-block cache stored whole into 8 host blocks (factor 2), by a copy that
# repeats for SLOW seconds, or in the Ctrl-C cases until the signal came, so
# the job is surely running when it comes, however loaded the machine.
# At exit, after torch_kvswap's own exit handler, the child says whether the
# mirror holds the cache: a job is either copied whole or the process says so.
PRELUDE = textwrap.dedent("""
    import atexit, gc, os, sys, threading, time
    state = {}

    def verify():  # registered before torch_kvswap's exit handler, so it runs after it
        if "mirror" in state:
            import torch
            print("STORED" if torch.equal(state["mirror"], state["device"]) else "PARTIAL", flush=True)

    atexit.register(verify)
    import torch, torch_kvswap
    import signal
    SLOW = 1.0
    until_sigint = False  # the Ctrl-C cases: copy until the handler ran (30 s at most, then CAPPED)
    interrupted = threading.Event()

    def on_sigint(signum, frame):
        interrupted.set()
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    device = torch.randn(16, 8, 128, 128)  # 16 blocks of 512 KiB
    off = torch_kvswap.KVCacheOffloader({"l": device}, 1, 2, num_host_blocks=8)
    state.update(mirror=off.host_tensors[0], device=device)
    real_copy = off._copy

    def slow_copy(job):
        t0 = time.monotonic()
        while True:
            real_copy(job)
            elapsed = time.monotonic() - t0
            if interrupted.is_set() if until_sigint else elapsed >= SLOW:
                break
            if elapsed >= 30:  # the signal never reached the handler while the copy ran
                say("CAPPED")
                break

    def say(marker):
        print(marker, flush=True)

    def store_all(job_id):
        off.store(job_id, range(16), range(8))
""")


def start(body: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # its forks die with it on a timeout


def finish(proc: subprocess.Popen, first: str = "", timeout: float = TIMEOUT) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, first + out, err  # None: it hung
    return proc.returncode, first + out, err


def run(body: str, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    return finish(start(body), timeout=timeout)


def run_interrupted(body: str, marker: str) -> tuple[int, str, str]:
    """Runs ``body``; sends SIGINT once it prints ``marker``."""
    proc = start(body)
    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
    first = proc.stdout.readline() if ready else ""
    if first.strip() == marker:
        proc.send_signal(signal.SIGINT)
    return finish(proc, first)


def runs(fn, *args) -> list[tuple[int, str, str]]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        return list(pool.map(lambda _: fn(*args), range(RUNS)))


def outcome(status, out, err):
    assert status is not None, f"hung:\n{out}\n{err[-2000:]}"
    assert "terminate called" not in err and status != -signal.SIGABRT, (status, err[-2000:])
    return status, out.split()


# --- Ctrl-C -------------------------------------------------------------------

INTERRUPTED_SHUTDOWN = {
    "shutdown()": """
        until_sigint = True
        off._copy = slow_copy
        store_all(0)
        real_wait = off._lanes.wait
        off._lanes.wait = lambda *a, **k: (setattr(off._lanes, "wait", real_wait), say("IN_SHUTDOWN"),
                                    real_wait(*a, **k))
        off.shutdown()
        say("RETURNED")
    """,
    "leaving with": """
        until_sigint = True
        off._copy = slow_copy
        real_wait = off._lanes.wait
        off._lanes.wait = lambda *a, **k: (setattr(off._lanes, "wait", real_wait), say("IN_SHUTDOWN"),
                                    real_wait(*a, **k))
        with off:
            store_all(0)
        say("RETURNED")
    """,
}


@pytest.mark.parametrize("how", sorted(INTERRUPTED_SHUTDOWN))
def test_ctrl_c_during_shutdown_ends_the_process_by_sigint_after_the_jobs_finish(how):
    """The KeyboardInterrupt propagates (status -SIGINT, shell 130); exit then
    finishes the shutdown: the job in flight is copied whole, no abort."""
    for status, out, err in runs(run_interrupted, INTERRUPTED_SHUTDOWN[how], "IN_SHUTDOWN"):
        status, words = outcome(status, out, err)
        assert words == ["IN_SHUTDOWN", "STORED"], (out, err[-2000:])
        assert status == -signal.SIGINT, (status, err[-2000:])
        assert "KeyboardInterrupt" in err


def test_ctrl_c_during_wait_raises_keyboard_interrupt_and_the_offloader_keeps_working():
    body = """
        until_sigint = True
        off._copy = slow_copy
        store_all(0)
        try:
            say("WAITING")
            off.wait({0})
        except KeyboardInterrupt:
            say("INTERRUPTED")
        off._copy = real_copy
        off.wait({0})
        (result,) = off.get_finished()
        say(f"SUCCESS={result.success}")
        off.shutdown()
    """
    for status, out, err in runs(run_interrupted, body, "WAITING"):
        status, words = outcome(status, out, err)
        assert (status, words) == (0, ["WAITING", "INTERRUPTED", "SUCCESS=True", "STORED"]), err[-2000:]


@pytest.mark.parametrize("call", ["wait", "shutdown"])
def test_a_signal_another_thread_took_interrupts_the_call_while_the_copy_runs(call):
    """The kernel may hand Ctrl-C to a worker thread; the main thread's
    handler still runs during ``wait`` and ``shutdown``, before the copy
    ends (offloader/waits.py), not once it ends."""
    off = KVCacheOffloader({"l": torch.randn(8, 4, 4)}, 1, 1, num_host_blocks=8)
    gate = gated(off)
    fallback = threading.Timer(10, gate.set)  # a wait that sleeps through the signal ends here
    fallback.start()
    off.store(0, [0], [0])
    with pytest.raises(Signalled), signal_taken_by_another_thread():
        off.wait({0}) if call == "wait" else off.shutdown()
    assert not gate.is_set()  # the copy was still running when the handler ran
    fallback.cancel()
    gate.set()
    off.shutdown()
    assert [r.success for r in off.get_finished()] == [True]


def test_an_interrupted_shutdown_stays_registered_for_exit_and_a_second_shutdown_finishes_it():
    off = KVCacheOffloader({"l": torch.randn(8, 4, 4)}, 1, 1, num_host_blocks=8)
    gate = gated(off)
    off.store(0, [0], [0])
    real_wait = off._lanes.wait

    def interrupted_wait(*args, **kwargs):
        off._lanes.wait = real_wait
        raise KeyboardInterrupt  # as Ctrl-C inside the wait does

    off._lanes.wait = interrupted_wait
    with pytest.raises(KeyboardInterrupt):
        off.shutdown()
    assert off._lanes in lanes._LIVE and off.pending() == [0] and off.host_tensors != []
    threading.Timer(0.2, gate.set).start()
    off.shutdown()
    (result,) = off.get_finished()
    assert result.job_id == 0 and result.success
    assert off._lanes not in lanes._LIVE and off.host_tensors == []
    assert not any(w.is_alive() for w in off._lanes._workers.values())


# --- fork ---------------------------------------------------------------------

FORK_USES_OFFLOADER = """
    import warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
    store_all(0)
    off.wait({0})
    pid = os.fork()
    if pid == 0:
        state.clear()  # the parent verifies its mirror at its exit
        calls = {"store": lambda: off.store(1, [0, 1], [0]), "load": lambda: off.load(2, [0], [0, 1]),
                 "wait": lambda: off.wait({0}), "get_finished": off.get_finished, "pending": off.pending}
        for name, call in calls.items():
            try:
                call()
                say(f"{name}:no-error")
            except RuntimeError as exc:
                text = str(exc)
                say(f"{name}:" + ("refused" if "fork" in text and "new KVCacheOffloader" in text else text))
        off.shutdown()
        say("shutdown:returned")
        sys.exit(3)
    _, status = os.waitpid(pid, 0)
    say(f"child-status={os.waitstatus_to_exitcode(status)}")
    (result,) = off.get_finished()
    say(f"parent-success={result.success}")
"""


def test_a_forked_child_that_uses_its_parents_offloader_gets_a_clear_error():
    """Every method but ``shutdown`` raises RuntimeError naming fork and the
    way out; ``shutdown`` returns at once; the child exits with its own status
    and the parent's offloader works on."""
    expected = [
        "store:refused",
        "load:refused",
        "wait:refused",
        "get_finished:refused",
        "pending:refused",
        "shutdown:returned",
        "child-status=3",
        "parent-success=True",
        "STORED",
    ]
    for status, out, err in runs(run, FORK_USES_OFFLOADER):
        status, words = outcome(status, out, err)
        assert (status, words) == (0, expected), (out, err[-2000:])


FORK_WITH_JOBS_IN_FLIGHT = """
    import warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
    off._copy = slow_copy
    store_all(0)
    pid = os.fork()
    if pid == 0:
        state.clear()  # the child's mirror is a copy from mid-job: nothing to verify
        sys.exit(5)    # runs the exit handlers, which must not wait on the parent's threads
    _, status = os.waitpid(pid, 0)
    say(f"child-status={os.waitstatus_to_exitcode(status)}")
    say(f"still-pending={off.pending()}")
"""


def test_a_child_forked_with_jobs_in_flight_exits_at_once_with_its_own_status():
    """The child exits 5 while the parent's job still runs; the parent's job
    finishes at its exit."""
    # "At once": a child that waits on its parent's threads hangs; 30 s, not 60, ends it.
    for status, out, err in runs(run, FORK_WITH_JOBS_IN_FLIGHT, 30):
        status, words = outcome(status, out, err)
        assert (status, words) == (0, ["child-status=5", "still-pending=[0]", "STORED"]), (out, err[-2000:])


# --- dropped without shutdown ---------------------------------------------------

DROP_TEN = """
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    state.clear()
    off.shutdown()
    del off, real_copy
    gc.collect()
    threads, before = threading.active_count(), rss()
    cache = torch.randn(8, 1 << 18)  # 8 blocks of 1 MiB
    for i in range(10):  # 64 MiB of mirrors each, with a job just submitted
        dropped = torch_kvswap.KVCacheOffloader({"l": cache}, 1, 1, num_host_blocks=64)
        dropped.store(i, range(8), range(8))
        del dropped
    deadline = time.monotonic() + 20  # they stop in milliseconds; a kept offloader never does
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    say(f"threads+{threading.active_count() - threads}")
    say(f"under-one-mirror={rss() - before < 64 << 20}")
"""


def test_ten_dropped_offloaders_are_collected_their_threads_stop_and_their_mirrors_are_freed():
    for status, out, err in runs(run, DROP_TEN):
        status, words = outcome(status, out, err)
        assert (status, words) == (0, ["threads+0", "under-one-mirror=True"]), (out, err[-2000:])


DROP_WHILE_COPYING = """
    import weakref
    state.clear()
    threads = threading.active_count() - 3
    copying, gate = threading.Event(), threading.Event()
    off._copy = lambda job: (copying.set(), gate.wait(), real_copy(job))
    mirror = weakref.ref(off.host_tensors[0])
    store_all(0)   # running (held at the gate) when the offloader is dropped
    store_all(1)   # queued behind it
    copying.wait(60)
    ref = weakref.ref(off)
    del off, real_copy
    gc.collect()
    say(f"alive-while-copying={ref() is not None and mirror() is not None}")
    gate.set()
    deadline = time.monotonic() + 60
    while (ref() is not None or threading.active_count() > threads) and time.monotonic() < deadline:
        gc.collect()  # the gate's lambda makes a cycle
        time.sleep(0.01)
    say(f"collected={ref() is None and mirror() is None}")
    say(f"threads+{threading.active_count() - threads}")
"""


def test_an_offloader_dropped_mid_copy_is_freed_only_after_the_copy_and_its_threads_stop():
    """The running copy keeps the offloader (and its mirrors) alive until it
    returns; the job queued behind it is abandoned."""
    for status, out, err in runs(run, DROP_WHILE_COPYING):
        status, words = outcome(status, out, err)
        assert (status, words) == (0, ["alive-while-copying=True", "collected=True", "threads+0"]), (
            out,
            err[-2000:],
        )


# --- exceptions inside a copy ---------------------------------------------------


class Custom(BaseException):
    pass


def three_stores(off) -> list:
    """Stores jobs 0, 1 and 2 (job 1's copy fails) and collects their results
    for up to 20 s: 0 and 2 succeed and 1 fails, the lane going on after it."""
    for j in range(3):
        off.store(j, [j], [j])
    results, deadline = [], time.monotonic() + 20
    while len(results) < 3 and time.monotonic() < deadline:
        results += off.get_finished()
    if len(results) < 3:  # a dead lane: exit must not wait on its jobs forever
        lanes._LIVE.discard(off._lanes)
    assert [(r.job_id, r.success) for r in results] == [(0, True), (1, False), (2, True)]
    return results


@pytest.mark.parametrize("kind", [RuntimeError, SystemExit, KeyboardInterrupt, GeneratorExit, Custom])
def test_any_exception_inside_a_copy_fails_that_job_and_the_lane_keeps_working(kind):
    off = KVCacheOffloader({"l": torch.randn(8, 4, 4)}, 1, 1, num_host_blocks=8)
    real_copy = off._copy

    def copy(job):
        if job.job_id == 1:
            raise kind("inside the copy")
        real_copy(job)

    off._copy = copy
    results = three_stores(off)
    assert results[1].error == f"{kind.__name__}: inside the copy"
    off.shutdown()


class Unprintable(RuntimeError):
    def __str__(self):
        raise ValueError("no message")


class RaisingHandler(logging.Handler):
    def handle(self, record):  # past logging's own error handling, as a test harness's may be
        raise RuntimeError("the log handler failed")


@pytest.mark.parametrize("fault", ["handler-raises", "message-raises", "handler-raises-base"])
def test_a_report_that_raises_fails_the_job_and_the_lane_keeps_working(fault):
    off = KVCacheOffloader({"l": torch.randn(8, 4, 4)}, 1, 1, num_host_blocks=8)
    real_copy = off._copy

    def copy(job):
        if job.job_id == 1:
            raise Unprintable() if fault == "message-raises" else RuntimeError("inside the copy")
        real_copy(job)

    off._copy = copy
    logger = logging.getLogger("torch_kvswap")
    handler = RaisingHandler()
    if fault == "handler-raises-base":
        handler.handle = lambda record: (_ for _ in ()).throw(SystemExit("the log handler exited"))
    if fault != "message-raises":
        logger.addHandler(handler)
    try:
        results = three_stores(off)
    finally:
        logger.removeHandler(handler)
    expected = "Unprintable (its message could not be formatted)" if fault == "message-raises" else None
    assert results[1].error == (expected or "RuntimeError: inside the copy")
    off.wait({5}, strict=False)
    off.store(5, [5], [5])
    off.wait({5})
    assert [r.success for r in off.get_finished()] == [True]
    off.shutdown()


def test_failing_a_job_never_raises_when_the_log_handler_does():
    # On an accelerator a failed launch is reported on the caller's thread
    # (Lanes._launch_on_stream): a raising handler must not escape store()/load().
    with KVCacheOffloader({"l": torch.randn(8, 4, 4)}, 1, 1, num_host_blocks=8) as off:
        job = lanes.Job(7, "store", 0, [])
        logger, handler = logging.getLogger("torch_kvswap"), RaisingHandler()
        logger.addHandler(handler)
        try:
            off._lanes._fail(job, RuntimeError("launch failed"))
        finally:
            logger.removeHandler(handler)
        assert job.error == "RuntimeError: launch failed"


# --- composition ----------------------------------------------------------------


def test_the_lanes_read_only_attributes_they_define():
    """Lanes know jobs, a copy function and trackers, not the offloader:
    every ``self.name`` that lanes.py's Lanes reads is a method of Lanes or
    is set in Lanes itself."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(lanes.Lanes))
    (cls,) = tree.body
    defined = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    read = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (defined if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    assert read and read <= defined, sorted(read - defined)
    off = KVCacheOffloader({"l": torch.randn(8, 4, 4)}, 1, 1, num_host_blocks=8)
    assert not isinstance(off, lanes.Lanes) and isinstance(off._lanes, lanes.Lanes)
    off.shutdown()
