"""Checked mode of KVCacheOffloader: every pair of a pending job and a new one.

Jobs of one lane run in order; the lanes (stores, loads, expedited loads) are
not ordered against each other. For each cell of (pending store | load) x
(new store | load) x (the device blocks | the host blocks they share), the
new job is either refused at submission, naming both jobs, the block and the
way out, or accepted with every byte where a plain model of the two jobs, run
in submission order, puts it. The pending job is held inside its copy by a
gate, so it is pending and its lane busy whatever the timing.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from torch_kvswap import KVCacheOffloader

BLOCK = (4, 2, 8)
FACTOR = 2  # device blocks per host block
HOST_BLOCKS = 4


def make(check=True):
    g = torch.Generator().manual_seed(0)
    tensors = {f"l{i}": torch.randn((8, *BLOCK), generator=g).to(torch.float16) for i in range(2)}
    return KVCacheOffloader(tensors, 16, 16 * FACTOR, num_host_blocks=HOST_BLOCKS, check=check)


@contextlib.contextmanager
def held(off, job_id):
    """Holds job ``job_id`` inside its copy until the block ends."""
    gate = threading.Event()
    real = off._copy
    off._copy = lambda job: (gate.wait() if job.job_id == job_id else None, real(job))
    try:
        yield
    finally:
        gate.set()  # a failure inside must not leave shutdown waiting for the job


def submit(off, job):
    kind, job_id, ids = job[0], job[1], job[2:]
    if kind == "store":
        off.store(job_id, *ids)
    else:
        off.load(job_id, *ids, expedited=kind == "expedited")


def model(state, job):
    """What ``job`` leaves in ``state`` (the caches, the mirrors), copied one block at a time."""
    caches, mirrors = state
    kind, _, *ids = job
    dev, host = (ids[0], ids[1]) if kind == "store" else (ids[1], ids[0])
    for i, d in enumerate(dev):
        row = host[i // FACTOR] * FACTOR + i % FACTOR
        for cache, mirror in zip(caches, mirrors):
            if kind == "store":
                mirror[row] = cache[d]
            else:
                cache[d] = mirror[row]


def state(off):
    return [t.clone() for t in off.device_tensors], [t.clone() for t in off.host_tensors]


# Host block 0 holds device blocks 0 and 1 and host block 3 device blocks
# 2 and 3, stored and reported before each cell. Jobs: ("store", id,
# device ids, host ids), ("load" | "expedited", id, host ids, device ids).
STORE_45_TO_1 = ("store", 1, [4, 5], [1])
LOAD_0_TO_45 = ("load", 1, [0], [4, 5])
CELLS = {
    # pending store, new store: one lane, in order
    "store-store-device": (STORE_45_TO_1, ("store", 2, [4, 5], [2]), None),
    "store-store-host": (STORE_45_TO_1, ("store", 2, [6, 7], [1]), None),
    # pending store, new load
    "store-load-device": (
        STORE_45_TO_1,
        ("load", 2, [0], [5, 6]),
        r"load job 2 writes device block 5 \(group 0\), which store job 1 still reads .*"
        r"Load after job 1 is reported \(wait for it first\)",
    ),
    "store-load-host": (
        STORE_45_TO_1,
        ("load", 2, [1], [6, 7]),
        r"load job 2 reads host block 1 \(sub-block 0, group 0\), whose store job 1 has not been "
        r"reported finished.*Load after job 1 is reported",
    ),
    # pending load, new store
    "load-store-device": (
        LOAD_0_TO_45,
        ("store", 2, [5, 6], [2]),
        r"store job 2 reads device block 5 \(group 0\), which load job 1 is still writing.*"
        r"Store after job 1 is reported",
    ),
    "load-store-host": (
        LOAD_0_TO_45,
        ("store", 2, [6, 7], [0]),
        r"store job 2 writes host block 0 \(sub-block 0, group 0\), which load job 1 still reads"
        r".*Store after job 1 is reported",
    ),
    # pending load, new load: in order on one lane, unordered across the two load lanes
    "load-load-device-one-lane": (LOAD_0_TO_45, ("load", 2, [3], [5, 6]), None),
    "load-load-device-two-lanes": (
        LOAD_0_TO_45,
        ("expedited", 2, [3], [5, 6]),
        r"load job 2 writes device block 5 \(group 0\), which load job 1 of the load lane is "
        r"still writing.*Load after job 1 is reported",
    ),
    "expedited-load-device-two-lanes": (
        ("expedited", 1, [0], [4, 5]),
        ("load", 2, [3], [5, 6]),
        r"load job 2 writes device block 5 \(group 0\), which load job 1 of the expedited lane",
    ),
    "load-load-host": (LOAD_0_TO_45, ("expedited", 2, [0], [6, 7]), None),
}


def prepared(off):
    off.store(10, [0, 1, 2, 3], [0, 3])
    off.wait({10})
    assert [r.success for r in off.get_finished()] == [True]
    return state(off)


@pytest.mark.parametrize("name", list(CELLS))
def test_a_new_job_beside_a_pending_one_is_refused_or_lands_byte_for_byte(name):
    pending, new, refusal = CELLS[name]
    with make() as off:
        want = prepared(off)
        with held(off, pending[1]):
            submit(off, pending)
            if refusal is None:
                submit(off, new)
            else:
                with pytest.raises(ValueError, match="checked mode: " + refusal):
                    submit(off, new)
                assert new[1] not in off.pending()
        off.wait(off.pending())
        assert all(r.success for r in off.get_finished())
        model(want, pending)
        if refusal is None:
            model(want, new)
        got = state(off)
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", [n for n, cell in CELLS.items() if cell[2]])
def test_the_refused_pairs_are_accepted_unchecked(name):
    pending, new, _ = CELLS[name]
    with make(check=False) as off:
        prepared(off)
        with held(off, pending[1]):
            submit(off, pending)
            submit(off, new)
        off.wait(off.pending())
        assert all(r.success for r in off.get_finished())


def test_unchecked_a_load_over_a_pending_store_runs_first_and_the_store_saves_its_bytes():
    # Why the load over a pending store is refused: the load lane does not
    # wait for the store lane, so the store saves the loaded bytes.
    with make(check=False) as off:
        prepared(off)
        with held(off, 9):
            off.store(9, [6, 7], [2])  # keeps the store lane busy
            off.store(1, [4, 5], [1])
            off.load(2, [0], [5, 6])
            off.wait({2})
        off.wait(off.pending())
        row = 1 * FACTOR + 1  # where device block 5 was to be stored
        for mirror in off.host_tensors:
            assert torch.equal(mirror[row], mirror[0])  # host block 0's bytes, loaded into block 5


def test_a_refused_load_goes_through_once_the_store_is_waited_for():
    with make() as off:
        want = prepared(off)
        with held(off, 1):
            off.store(1, [4, 5], [1])
            with pytest.raises(ValueError, match="which store job 1 still reads"):
                off.load(2, [0], [5, 6])
        off.wait({1})
        off.load(2, [0], [5, 6])
        off.wait({2})
        model(want, STORE_45_TO_1)
        model(want, ("load", 2, [0], [5, 6]))
        assert all(torch.equal(a, b) for a, b in zip(state(off)[1], want[1]))
        assert all(torch.equal(a, b) for a, b in zip(state(off)[0], want[0]))
