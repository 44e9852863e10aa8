"""A model-based test of KVCacheOffloader: random sequences of stores, loads,
waits (from the caller's thread and from helper threads), reports, injected
faults and shutdown, checked at every step against a reference model of the
contract in docs/offloader.md and docs/checked.md.

The model knows, for every device block (per allocation: two caches may view
one allocation) and every host sub-block (per cache tensor's mirror), which
bytes it must hold once every job that writes it has been seen to finish, and
asserts only what the contract promises:

* a job of one lane never reads what another job of its own lane writes
  (stores read device blocks and write host rows, loads the reverse), so a
  job's source bytes are known exactly when no job of another lane that
  writes them is still unseen (not reported by ``get_finished`` nor waited
  for); otherwise, and when a later job of another lane writes what it reads,
  its destinations become unknown;
* a location is compared with the model once no unseen job writes it; a
  failed job leaves its destinations unknown;
* ``get_finished`` reports every accepted job exactly once, in submission
  order per lane, stores then loads then expedited loads within one call,
  with the predicted success flag and size;
* strict mode refuses a load of a host row no store was submitted for (the
  bit is cleared when a failed store is reported, unless a later store was
  submitted for the row), checked mode refuses what
  docs/checked.md lists, judged by memory (two groups whose tensors view one
  allocation conflict like groups that share a tensor); a refused job is
  never pending and copies nothing.

Every blocking call runs on a thread joined within ``KVSWAP_MODEL_TIMEOUT``
seconds (default 10), so a hang is a failure, never a hung test.

Short run (CI): ``pytest tests/test_offloader_model.py``. Long run:
``KVSWAP_MODEL_EXAMPLES=7000 pytest tests/test_offloader_model.py -s`` runs
7000 examples of 50 steps per mode (over 1,000,000 steps in all) and prints
the steps run. ``KVSWAP_MODEL_RESIZE=0`` leaves out the resized-storage test,
which runs in a subprocess (a crash there is reported with its signal).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from torch_kvswap import KVCacheOffloader
from torch_kvswap.offloader import lanes as lanes_module

RESIZE = os.environ.get("KVSWAP_MODEL_RESIZE", "1") == "1"
EXAMPLES = int(os.environ.get("KVSWAP_MODEL_EXAMPLES", "0"))  # 0: the short run
STEPS_PER_EXAMPLE = int(os.environ.get("KVSWAP_MODEL_STEPS", "50" if EXAMPLES else "25"))
TIMEOUT = float(os.environ.get("KVSWAP_MODEL_TIMEOUT", "10"))
INNER = os.environ.get("KVSWAP_MODEL_INNER") == "1"  # set in the resize subprocess

MODES = ("plain", "strict", "checked")
LANES = ("store", "load", "expedited")
W = 8  # int64 elements per block of each cache tensor
NUM_DEVICE_BLOCKS = 4  # few blocks and host blocks: jobs collide often enough to find races
JOB_IDS = range(4)  # a small pool, so ids are reused

STEPS = {"count": 0, "examples": 0}


def pattern(stamp: int) -> torch.Tensor:
    """The bytes of a block that holds ``stamp`` (0: zeros, the fresh mirror)."""
    if stamp == 0:
        return torch.zeros(W, dtype=torch.int64)
    return torch.arange(W, dtype=torch.int64) + stamp * 1000


# ---------------------------------------------------------------- test hooks

_tls = threading.local()


def _slow_wait_for(event):
    """``waits.wait_for`` as lanes.py calls it; a helper thread that set
    ``_tls.hold`` then stays there until the test releases it: a slow thread
    whose ``wait`` has seen its job finish but has not returned yet."""
    entered = getattr(_tls, "entered", None)
    if entered is not None:
        entered.set()  # the wait has taken its jobs from the table
    _REAL_WAIT_FOR(event)
    hold = getattr(_tls, "hold", None)
    if hold is not None:
        hold.wait(TIMEOUT)


_REAL_WAIT_FOR = getattr(lanes_module, "wait_for", None)


@pytest.fixture
def slow_helpers(monkeypatch):
    if _REAL_WAIT_FOR is not None:
        monkeypatch.setattr(lanes_module, "wait_for", _slow_wait_for)
    yield


class BadStr(Exception):
    """An exception that cannot be turned into text."""

    def __str__(self) -> str:
        raise RuntimeError("BadStr.__str__ raises")


class RaisingHandler(logging.Handler):
    """A handler on the "torch_kvswap" logger whose emit raises, ``armed`` times."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = 0

    def emit(self, record):
        if self.armed > 0:
            self.armed -= 1
            raise RuntimeError("injected: a logging handler that raises")


# Faults injected into a job's copy; KVSWAP_MODEL_FAULTS=none,raise narrows them.
FAULTS = tuple(
    None if f == "none" else f
    for f in os.environ.get("KVSWAP_MODEL_FAULTS", "none,raise,interrupt,bad-str,bad-log").split(",")
)


def run_bounded(fn, what: str):
    """Runs ``fn`` on a thread; its result, or its exception re-raised; a
    failure when it has not returned within TIMEOUT seconds."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["exc"] = exc

    deaths = BASELINE[0]
    t = threading.Thread(target=body, daemon=True, name=f"model-{what}")
    t.start()
    _join(t, deaths)
    if t.is_alive():
        raise Hang(f"{what} did not return within {TIMEOUT:g} s" + _deaths_since(deaths))
    if "exc" in out:
        raise out["exc"]
    return out.get("value")


class Hang(AssertionError):
    pass


# Lane threads that died of an exception (a lane must outlive any job): a
# wait on one of their jobs would hang, so it fails at once instead.
LANE_DEATHS: list[str] = []
BASELINE = [0]  # deaths before the current example
_previous_excepthook = threading.excepthook


def _excepthook(args):
    if args.thread is not None and args.thread.name.startswith("kvswap-"):
        LANE_DEATHS.append(f"{args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")
    _previous_excepthook(args)


threading.excepthook = _excepthook


def _join(t: threading.Thread, deaths: int) -> None:
    """Joins ``t`` within TIMEOUT seconds, or within half a second once a lane
    thread has died (its jobs never finish, so a wait on them would hang)."""
    deadline = time.monotonic() + TIMEOUT
    while t.is_alive() and time.monotonic() < deadline:
        if len(LANE_DEATHS) > deaths:
            deadline = min(deadline, time.monotonic() + 0.5)
        t.join(0.005)


def _deaths_since(n: int) -> str:
    return f"; lane thread died: {LANE_DEATHS[n:]}" if len(LANE_DEATHS) > n else ""


# ------------------------------------------------------------------- the model


@dataclass(eq=False)
class MJob:
    seq: int
    jid: int
    lane: str
    pairs: list  # (src loc, dst loc)
    nbytes: int
    fault: str | None
    writes: dict = field(default_factory=dict)  # dst loc -> stamp, or None: unknown
    seen: bool = False

    @property
    def is_store(self) -> bool:
        return self.lane == "store"

    @property
    def ok(self) -> bool:
        return self.fault is None

    @property
    def reads(self) -> set:
        return {s for s, _ in self.pairs}


class OffloaderMachine(RuleBasedStateMachine):
    mode = "plain"
    resize_enabled = False

    # ---- setup / teardown

    @initialize(
        layout=st.sampled_from(["two-tensors", "aliased-groups"]),
        factor=st.sampled_from([1, 2]),
    )
    def build(self, layout, factor):
        STEPS["examples"] += 1
        BASELINE[0] = len(LANE_DEATHS)
        self.layout, self.factor = layout, factor
        self.num_host_blocks = 3 if factor == 1 else 2
        self.rows = self.num_host_blocks * factor
        if layout == "two-tensors":
            caches = {
                "a": torch.zeros(NUM_DEVICE_BLOCKS, W, dtype=torch.int64),
                "b": torch.zeros(NUM_DEVICE_BLOCKS, 2, W // 2, dtype=torch.int64),
            }
            groups, self.mem = None, [0, 1]
            self.groups = [[0, 1]]
        else:  # two groups, each a view of one allocation
            base = torch.zeros(NUM_DEVICE_BLOCKS, W, dtype=torch.int64)
            caches = {"a": base, "b": base.view(NUM_DEVICE_BLOCKS, 2, W // 2)}
            groups, self.mem = [[0], [1]], [0, 0]
            self.groups = groups
        self.caches = caches
        self.log_handler = RaisingHandler()
        logging.getLogger("torch_kvswap").addHandler(self.log_handler)
        kw = {"strict": self.mode == "strict", "check": self.mode == "checked"}
        self.off = KVCacheOffloader(
            caches, 16, 16 * factor, num_host_blocks=self.num_host_blocks, groups=groups, **kw
        )
        self.tensor_of_mem = {m: self.off.device_tensors[t] for t, m in reversed(list(enumerate(self.mem)))}
        # the model
        self.seq = 0
        self.stamp = 0
        self.base: dict = {}
        self.applied: dict = {}
        for m in set(self.mem):
            for d in range(NUM_DEVICE_BLOCKS):
                self.stamp += 1
                self.tensor_of_mem[m][d].view(-1).copy_(pattern(self.stamp))
                self.base[("d", m, d)] = self.stamp
        for t in range(len(self.mem)):
            for r in range(self.rows):
                self.base[("h", t, r)] = 0
        self.unseen: list[MJob] = []
        self.unreported: dict[int, MJob] = {}
        self.fifo = {lane: deque() for lane in LANES}
        self.reported_ids: list[tuple[int, int]] = []  # (seq, id) of every report
        self.accepted_seqs: set[int] = set()
        self.strict_bits: set = set()
        self.strict_last: dict = {}  # host row -> the latest store submitted for it
        self.ck_stored: set = set()
        self.ck_storing: dict = {}
        self.faults: dict[int, str] = {}
        self.helpers: list = []
        self.closed = False
        self.broken = False  # a hang was found: the offloader cannot be trusted
        real_copy = self.off._copy

        def copy(job):
            kind = self.faults.get(job.job_id)
            if kind is None:
                return real_copy(job)
            if kind == "raise":
                raise RuntimeError(f"injected fault in job {job.job_id}")
            if kind == "interrupt":
                raise KeyboardInterrupt
            if kind == "bad-str":
                raise BadStr()
            if kind == "bad-log":
                self.log_handler.armed += 1
                raise RuntimeError(f"injected fault in job {job.job_id}, logged by a raising handler")
            raise AssertionError(kind)

        self.off._copy = copy

    def teardown(self):
        if not hasattr(self, "off"):
            return
        if len(LANE_DEATHS) > BASELINE[0]:
            self.broken = True  # its jobs never finish: shutdown would hang
        try:
            if not self.broken:
                for h in list(self.helpers):
                    self._join_helper(h)
                if not self.closed:
                    self._shutdown()
                self._drain()
                reported = [j for _, j in self.reported_ids]
                assert sorted(s for s, _ in self.reported_ids) == sorted(self.accepted_seqs), (
                    "every accepted job is reported exactly once"
                )
                assert len(reported) == len(self.accepted_seqs)
                self._check_bytes()
        finally:
            logging.getLogger("torch_kvswap").removeHandler(self.log_handler)
            for h in self.helpers:
                h["release"].set()
            if self.broken:
                # A dead lane would make the exit handler's shutdown hang too.
                getattr(lanes_module, "_LIVE", set()).discard(self.off._lanes)
            else:
                self.off.shutdown()

    def _step(self):
        STEPS["count"] += 1

    # ---- the model's bookkeeping

    def _unseen_writers(self, loc):
        return [j for j in self.unseen if loc in j.writes]

    def _unseen_readers(self, loc):
        return [j for j in self.unseen if loc in j.reads]

    def _mark_seen(self, job: MJob) -> None:
        if job.seen:
            return
        job.seen = True
        self.unseen.remove(job)
        for loc, value in job.writes.items():
            if job.seq > self.applied.get(loc, -1):
                self.base[loc] = value if job.ok else None
                self.applied[loc] = job.seq
        if job.is_store:
            for _, h in job.pairs:
                if self.ck_storing.get(h) is job:
                    del self.ck_storing[h]
                    if job.ok:
                        self.ck_stored.add(h)
                    else:
                        self.ck_stored.discard(h)

    def _predict_refusal(self, lane: str, pairs: list) -> str | None:
        """Why the offloader must refuse the job at submission, or None."""
        is_store = lane == "store"
        if self.mode == "checked":
            for src, dst in pairs:
                if is_store:
                    # a store may not write host rows a pending load reads, nor
                    # read device blocks a pending load writes
                    if any(not j.is_store for j in self._unseen_readers(dst)):
                        return "checked: store into a host block a pending load reads"
                    if any(not j.is_store for j in self._unseen_writers(src)):
                        return "checked: store of device blocks a pending load writes"
                else:
                    # Stores of one lane finish in order: once the latest store of
                    # the block was seen to finish, earlier unseen ones have too.
                    if src in self.ck_storing:
                        return "checked: load of a host block whose store was not seen to finish"
                    if any(j.is_store for j in self._unseen_readers(dst)):
                        return "checked: load into device blocks a pending store reads"
                    other = "expedited" if lane == "load" else "load"
                    if any(j.lane == other for j in self._unseen_writers(dst)):
                        return "checked: load into device blocks a load of the other lane writes"
                    if src not in self.ck_stored:
                        return "checked: load of an empty host block"
        if self.mode == "strict" and not is_store:
            for src, _ in pairs:
                if src not in self.strict_bits:
                    return "strict: load of a never-stored host block"
        return None

    def _accept(self, jid, lane, pairs, nbytes, fault) -> MJob:
        self.seq += 1
        job = MJob(self.seq, jid, lane, pairs, nbytes, fault)
        for src, dst in pairs:
            value = self.base[src]
            if self._unseen_writers(src):  # another lane's job writes it: either bytes
                value = None
            if fault is not None:
                value = None
            if dst in job.writes:  # one job writing a location twice (aliased groups)
                value = None
            job.writes[dst] = value
        for dst in job.writes:
            for other in self._unseen_writers(dst):  # two lanes write it: either's bytes
                if other.lane != lane:
                    other.writes[dst] = None
                    job.writes[dst] = None
            for other in self._unseen_readers(dst):  # it may read the old or new bytes
                if other.lane != lane:
                    for loc in other.writes:
                        other.writes[loc] = None
        self.unseen.append(job)
        self.unreported[jid] = job
        self.fifo[lane].append(job)
        self.accepted_seqs.add(job.seq)
        if job.is_store:
            for _, h in pairs:
                self.strict_bits.add(h)
                self.strict_last[h] = job
                self.ck_storing[h] = job
                self.ck_stored.discard(h)
        return job

    def _report(self, result, lane_rank_so_far) -> int:
        job = self.unreported.get(result.job_id)
        assert job is not None, f"get_finished reported job {result.job_id}, which is not pending"
        rank = LANES.index(job.lane)
        assert rank >= lane_rank_so_far, "one call reports stores, then loads, then expedited loads"
        head = self.fifo[job.lane][0]
        assert head is job, (
            f"job {job.jid} reported before job {head.jid} of its lane ({job.lane}), submitted earlier"
        )
        assert result.success == job.ok, (
            f"job {job.jid} ({job.lane}, fault {job.fault}) reported success={result.success} "
            f"(error {result.error!r})"
        )
        assert result.transfer_size == (job.nbytes if job.ok else 0), (
            job.jid,
            result.transfer_size,
            job.nbytes,
        )
        assert (result.error is None) == job.ok
        assert result.transfer_type == (("CPU_DEVICE", "CPU") if job.is_store else ("CPU", "CPU_DEVICE"))
        self.fifo[job.lane].popleft()
        del self.unreported[job.jid]
        self.faults.pop(job.jid, None)
        self.reported_ids.append((job.seq, job.jid))
        self._mark_seen(job)
        if job.is_store and not job.ok:
            for _, h in job.pairs:
                if self.strict_last.get(h) is job:  # no later store rewrites it
                    self.strict_bits.discard(h)
        return rank

    def _get_finished_once(self) -> list:
        results = run_bounded(self.off.get_finished, "get_finished")
        rank = 0
        for r in results:
            rank = self._report(r, rank)
        return results

    def _drain(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        deaths = BASELINE[0]
        while True:
            self._get_finished_once()
            if not self.unreported:
                return
            if time.monotonic() > deadline or len(LANE_DEATHS) > deaths:
                self.broken = True
                missing = {j: (m.lane, m.fault) for j, m in self.unreported.items()}
                raise Hang(f"jobs never reported within {TIMEOUT:g} s: {missing}" + _deaths_since(deaths))
            time.sleep(0.0005)

    def _check_bytes(self) -> None:
        for loc, value in self.base.items():
            if value is None or self._unseen_writers(loc):
                continue
            kind, a, b = loc
            if kind == "h":
                if self.closed:
                    continue  # the mirrors are released
                got = self.off.host_tensors[a][b].reshape(-1)
            else:
                got = self.tensor_of_mem[a][b].reshape(-1)
            want = pattern(value)
            assert torch.equal(got, want), (
                f"{'host row' if kind == 'h' else 'device block'} {loc}: holds {got.tolist()}, "
                f"the model says {want.tolist()}"
            )

    def _shutdown(self) -> None:
        try:
            run_bounded(self.off.shutdown, "shutdown")
        except Hang:
            self.broken = True
            raise
        self.closed = True
        for job in list(self.unseen):  # shutdown waited for every job
            self._mark_seen(job)

    # ---- drawing jobs

    def _draw_job(self, data, lane):
        """(device ids, host ids, offsets, group_sizes, pairs, nbytes) of a valid job."""
        f, is_store = self.factor, lane == "store"
        use_offsets = f > 1 and data.draw(st.booleans(), label="offsets")
        ng = len(self.groups)
        sizes, offs, dev_all, host_all, pairs, nbytes = [], [], [], [], [], 0
        used_dev: set = set()
        for g in range(ng):
            off_g = data.draw(st.integers(0, f - 1), label=f"offset{g}") if use_offsets else 0
            if not is_store and not use_offsets:
                n = f * data.draw(st.integers(0 if ng > 1 else 1, 2), label=f"host_blocks{g}")
            else:
                n = data.draw(st.integers(0 if ng > 1 else 1, 3), label=f"n{g}")
            skip = off_g if use_offsets else (-n % f if is_store else 0)
            span = -(-(n + skip) // f) if n else 0
            if is_store:  # sources may repeat, destinations may not
                dev = data.draw(st.lists(st.integers(0, NUM_DEVICE_BLOCKS - 1), min_size=n, max_size=n))
                host = data.draw(
                    st.lists(
                        st.integers(0, self.num_host_blocks - 1), min_size=span, max_size=span, unique=True
                    )
                )
            else:  # loads of aliased groups write distinct memory: one job never writes a block twice
                dev = data.draw(
                    st.lists(
                        st.integers(0, NUM_DEVICE_BLOCKS - 1).filter(lambda d, used=used_dev: d not in used),
                        min_size=n,
                        max_size=n,
                        unique=True,
                    )
                )
                host = data.draw(
                    st.lists(st.integers(0, self.num_host_blocks - 1), min_size=span, max_size=span)
                )
            used_dev |= set(dev)
            subs = [h * f + k for h in host for k in range(f)][skip : skip + n]
            for d, r in zip(dev, subs):
                for t in self.groups[g]:
                    dloc, hloc = ("d", self.mem[t], d), ("h", t, r)
                    pairs.append((dloc, hloc) if is_store else (hloc, dloc))
            nbytes += n * len(self.groups[g]) * W * 8
            sizes.append(n)
            offs.append(off_g)
            dev_all += dev
            host_all += host
        if not dev_all:
            return None
        return (
            dev_all,
            host_all,
            (offs if ng > 1 else offs[0]) if use_offsets else None,
            sizes if ng > 1 else None,
            pairs,
            nbytes,
        )

    def _submit(self, data, lane, jid, fault):
        drawn = self._draw_job(data, lane)
        if drawn is None:
            return
        dev, host, offsets, group_sizes, pairs, nbytes = drawn
        if self.closed:
            expected = "closed"
        elif jid in self.unreported:
            expected = "duplicate"
        else:
            expected = self._predict_refusal(lane, pairs)
        if fault is not None and expected is None:
            self.faults[jid] = fault
        kw = {"offsets": offsets, "group_sizes": group_sizes}

        def call():
            if lane == "store":
                return self.off.store(jid, dev, host, **kw)
            return self.off.load(jid, host, dev, expedited=lane == "expedited", **kw)

        what = f"{lane} job {jid} device {dev} host {host} offsets {offsets} sizes {group_sizes}"
        try:
            run_bounded(call, lane)
        except Hang:
            self.broken = True
            raise
        except Exception as exc:  # noqa: BLE001 - compared with the model
            if expected is None:
                self.faults.pop(jid, None)
            assert expected is not None, f"{what}: refused ({type(exc).__name__}: {exc}), the model admits it"
            if expected == "closed":
                assert isinstance(exc, RuntimeError), exc
            else:
                assert isinstance(exc, ValueError), f"{what}: {type(exc).__name__}: {exc}"
                if expected.startswith("checked"):
                    assert "checked mode" in str(exc), exc
                elif expected.startswith("strict"):
                    assert "strict" in str(exc), exc
            if expected != "duplicate":
                assert jid not in run_bounded(self.off.pending, "pending") or self.closed
            return
        assert expected is None, f"{what}: admitted, the model expects a refusal ({expected})"
        self._accept(jid, lane, pairs, nbytes, fault)

    # ---- rules

    @rule(
        mem=st.integers(0, 1),
        block=st.integers(0, NUM_DEVICE_BLOCKS - 1),
    )
    def compute_writes_a_block(self, mem, block):
        """The model's compute writes a device block no unseen job reads or writes."""
        self._step()
        m = self.mem[mem % len(self.mem)] if self.layout == "two-tensors" else 0
        loc = ("d", m, block)
        if self._unseen_readers(loc) or self._unseen_writers(loc):
            return
        self.stamp += 1
        self.tensor_of_mem[m][block].view(-1).copy_(pattern(self.stamp))
        self.base[loc] = self.stamp
        self.seq += 1
        self.applied[loc] = self.seq

    @rule(data=st.data(), jid=st.sampled_from(JOB_IDS), fault=st.sampled_from(FAULTS))
    def store(self, data, jid, fault):
        self._step()
        self._submit(data, "store", jid, fault)

    @rule(
        data=st.data(),
        jid=st.sampled_from(JOB_IDS),
        expedited=st.booleans(),
        fault=st.sampled_from(FAULTS),
    )
    def load(self, data, jid, expedited, fault):
        self._step()
        self._submit(data, "expedited" if expedited else "load", jid, fault)

    @rule(
        ids=st.sets(st.sampled_from(JOB_IDS), min_size=1, max_size=3),
        strict=st.sampled_from([None, False, True]),
    )
    def wait(self, ids, strict):
        """wait() on the caller's side (run on a thread, bounded)."""
        self._step()
        jobs = [self.unreported[j] for j in ids if j in self.unreported]
        refused = (self.strict if strict is None else strict) and len(jobs) < len(ids)
        try:
            run_bounded(lambda: self.off.wait(ids, strict=strict), f"wait({sorted(ids)})")
        except Hang:
            self.broken = True
            raise
        except KeyError:
            assert refused, f"wait({sorted(ids)}) raised KeyError; the model says every id is pending"
            return
        assert not refused, (
            f"wait({sorted(ids)}, strict={strict}) returned; ids not pending must raise KeyError"
        )
        for job in jobs:
            self._mark_seen(job)

    @property
    def strict(self) -> bool:
        return self.mode == "strict"

    @precondition(lambda self: len(self.helpers) < 2 and not self.closed)
    @rule(jid=st.sampled_from(JOB_IDS))
    def start_a_waiting_thread(self, jid):
        """A helper thread waits on a job while the caller goes on; it returns from
        wait only once released (a slow thread)."""
        self._step()
        job = self.unreported.get(jid)
        release, out, entered = threading.Event(), {}, threading.Event()
        if job is None:  # nothing to wait for; still a helper, so the rules drawn do not depend on timing
            self.helpers.append({"thread": None, "release": release, "job": None, "out": out})
            return

        def body():
            _tls.hold, _tls.entered = release, entered
            try:
                self.off.wait({jid})
                out["ok"] = True
            except BaseException as exc:  # noqa: BLE001
                out["exc"] = exc

        t = threading.Thread(target=body, daemon=True, name=f"model-waiter-{jid}")
        t.start()
        # Until the thread's wait has taken its job, the caller does nothing:
        # otherwise it could report the job and reuse its id first.
        deadline = time.monotonic() + TIMEOUT
        while not entered.wait(0.001) and t.is_alive() and time.monotonic() < deadline:
            pass
        self.helpers.append({"thread": t, "release": release, "job": job, "out": out})

    def _join_helper(self, h) -> None:
        self.helpers.remove(h)
        h["release"].set()
        if h["thread"] is None:
            return
        deaths = BASELINE[0]
        _join(h["thread"], deaths)
        if h["thread"].is_alive():
            self.broken = True
            raise Hang(
                f"a thread waiting on job {h['job'].jid} ({h['job'].lane}) did not return "
                f"within {TIMEOUT:g} s"
            )
        assert "exc" not in h["out"], h["out"]
        self._mark_seen(h["job"])

    @precondition(lambda self: self.helpers)
    @rule(which=st.integers(0, 1))
    def join_a_waiting_thread(self, which):
        self._step()
        self._join_helper(self.helpers[which % len(self.helpers)])

    @rule()
    def get_finished(self):
        """One call, whatever is finished: each report checked (which jobs are
        finished depends on timing; the checks do not)."""
        self._step()
        self._get_finished_once()

    @rule()
    def drain(self):
        """get_finished until every accepted job is reported."""
        self._step()
        self._drain()

    @rule()
    def pending(self):
        self._step()
        assert set(run_bounded(self.off.pending, "pending")) == set(self.unreported)

    @precondition(lambda self: not self.closed)
    @rule()
    def shutdown(self):
        self._step()
        for h in list(self.helpers):
            self._join_helper(h)
        self._shutdown()
        # idempotent
        run_bounded(self.off.shutdown, "a second shutdown")

    @precondition(lambda self: self.resize_enabled and not self.closed)
    @rule(data=st.data(), tensor=st.integers(0, 1), jid=st.sampled_from(JOB_IDS), lane=st.sampled_from(LANES))
    def resize_a_cache_then_submit(self, data, tensor, jid, lane):
        """A cache's storage freed (``untyped_storage().resize_(0)``, as FSDP
        does), then a job over it: refused, or reported failed; nothing else
        written; then the storage is given its size back (new, unknown bytes)."""
        self._step()
        self._drain()
        for h in list(self.helpers):
            self._join_helper(h)
        if jid in self.unreported:
            return
        drawn = self._draw_job(data, lane)
        if drawn is None:
            return
        dev, host, offsets, group_sizes, pairs, nbytes = drawn
        m = self.mem[tensor]
        if not any(loc[0] == "d" and loc[1] == m for p in pairs for loc in p):
            return
        expected = self._predict_refusal(lane, pairs)
        storage = self.tensor_of_mem[m].untyped_storage()
        size = storage.nbytes()
        storage.resize_(0)
        kw = {"offsets": offsets, "group_sizes": group_sizes}
        try:
            try:
                if lane == "store":
                    run_bounded(lambda: self.off.store(jid, dev, host, **kw), "store over a freed cache")
                else:
                    run_bounded(
                        lambda: self.off.load(jid, host, dev, expedited=lane == "expedited", **kw),
                        "load over a freed cache",
                    )
            except Hang:
                self.broken = True
                raise
            except Exception:  # noqa: BLE001 - refused: fine, nothing queued
                assert jid not in run_bounded(self.off.pending, "pending")
            else:
                assert expected is None, f"admitted; the model expects a refusal ({expected})"
                job = self._accept(jid, lane, pairs, nbytes, "resized")
                self._drain()
                assert not job.ok
        finally:
            storage.resize_(size)
        for loc in self.base:
            if loc[0] == "d" and loc[1] == m:
                self.seq += 1
                self.base[loc] = None
                self.applied[loc] = self.seq

    @invariant()
    def bytes_match_the_model(self):
        if hasattr(self, "off") and not self.broken:
            self._check_bytes()


# ----------------------------------------------------------------- the tests


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=STEPS_PER_EXAMPLE,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


def _run(mode: str, resize: bool, examples: int) -> None:
    machine = type(f"OffloaderMachine_{mode}", (OffloaderMachine,), {"mode": mode, "resize_enabled": resize})
    before = dict(STEPS)
    try:
        run_state_machine_as_test(machine, settings=_settings(examples))
    finally:
        steps = STEPS["count"] - before["count"]
        examples_run = STEPS["examples"] - before["examples"]
        line = (
            f"offloader model [{mode}{', resize' if resize else ''}]: {examples_run} examples, {steps} steps"
        )
        print(line)
        out = os.environ.get("KVSWAP_MODEL_STEPS_FILE")
        if out:
            with open(out, "a") as fh:
                fh.write(line + "\n")


@pytest.mark.parametrize("mode", MODES)
def test_offloader_matches_its_model(mode, slow_helpers):
    _run(mode, resize=False, examples=EXAMPLES or {"plain": 150, "strict": 150, "checked": 400}[mode])


@pytest.mark.skipif(not INNER, reason="run by test_a_freed_cache_fails_its_job_in_a_subprocess")
@pytest.mark.parametrize("mode", MODES)
def test_inner_model_with_freed_caches(mode, slow_helpers):
    _run(mode, resize=True, examples=EXAMPLES or 10)


@pytest.mark.skipif(not RESIZE, reason="KVSWAP_MODEL_RESIZE=0")
@pytest.mark.skipif(INNER, reason="the subprocess itself")
def test_a_freed_cache_fails_its_job_in_a_subprocess():
    """The model with caches whose storage is freed and given back, in a
    subprocess: a crash there (a copy through the freed pointer) is a failure
    naming the signal, not a crashed test run."""
    env = dict(os.environ, KVSWAP_MODEL_INNER="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", __file__, "-k", "inner_model"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode < 0:
        pytest.fail(f"the subprocess was killed by {signal.Signals(-proc.returncode).name}:\n{tail}")
    assert proc.returncode == 0, tail


def test_ctrl_c_inside_get_finished_loses_no_report():
    """SIGINT sent to the caller's thread every millisecond while it polls
    get_finished: each KeyboardInterrupt is caught and the poll retried, and
    every job is still reported exactly once. The handler raises only while
    get_finished runs, so an interrupt between calls cannot lose what a call
    returned."""
    caches = {"a": torch.zeros(16, W, dtype=torch.int64)}
    n = 600
    off = KVCacheOffloader(caches, 16, 16, num_host_blocks=16)
    gate, real_copy = threading.Event(), off._copy
    off._copy = lambda job: (gate.wait(TIMEOUT), real_copy(job))
    for j in range(n):
        if j % 3 == 0:
            off.store(j, [j % 16], [j % 16])
        else:
            off.load(j, [j % 16], [(j + 1) % 16], expedited=j % 3 == 2)
    inside, interrupts = threading.Event(), [0]

    def handler(signum, frame):
        if inside.is_set():
            interrupts[0] += 1
            raise KeyboardInterrupt

    def poll():
        inside.set()
        try:
            return off.get_finished()
        finally:
            inside.clear()

    main, stop = threading.get_ident(), threading.Event()

    def sender():
        while not stop.wait(0.001):
            signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, handler)
    t = threading.Thread(target=sender, daemon=True)
    reported: list[int] = []
    try:
        t.start()
        gate.set()
        deadline = time.monotonic() + TIMEOUT
        while len(reported) < n and time.monotonic() < deadline:
            try:
                results = poll()
            except KeyboardInterrupt:
                continue
            reported += [r.job_id for r in results]
    finally:
        stop.set()
        t.join()
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 2
        while len(reported) < n and time.monotonic() < deadline:
            reported += [r.job_id for r in off.get_finished()]
            time.sleep(0.001)
        dup = sorted({j for j in reported if reported.count(j) > 1})
        missing = sorted(set(range(n)) - set(reported))
        assert not dup and not missing, (
            f"{interrupts[0]} interrupts inside get_finished: {len(missing)} jobs never reported "
            f"({missing[:10]}...), {len(dup)} reported twice; still pending: {sorted(off.pending())[:10]}"
        )
    finally:
        off.shutdown()
