"""Checked mode of KVCacheOffloader: the contract on host blocks, tracked and enforced.

Each refused job is refused at submission with a message that names it and
the job it collides with, nothing of it is queued or copied, and the same
sequence of jobs is accepted by an offloader built without checks.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import torch

import torch_kvswap
from helpers import gated
from torch_kvswap import KVCacheOffloader

BLOCK = (4, 2, 8)
FACTOR = 2


def caches(num_blocks=8, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn((num_blocks, *BLOCK), generator=g).to(torch.float16) for i in range(layers)}


def make(check=True, **kw):
    kw.setdefault("num_host_blocks", 4)
    return KVCacheOffloader(caches(), 16, 16 * FACTOR, check=check, **kw)


def settle(off, *job_ids):
    off.wait(set(job_ids))
    return {r.job_id: r.success for r in off.get_finished()}


def copies_done(off):
    """Waits until every pending job's copy has run, without telling the offloader
    (``wait`` would count as the caller seeing them finish)."""
    while not all(job.finished() for job in list(off._lanes._pending.values())):
        time.sleep(0.001)


def state(off):
    return [t.clone() for t in off.device_tensors], [t.clone() for t in off.host_tensors]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


@pytest.fixture(autouse=True)
def _mode_off():
    yield
    torch_kvswap.set_checked(False)


# Scenarios: a list of jobs ("store"/"load", job id, device ids, host ids,
# whether to report every job before it) whose last one breaks the contract,
# and the message that names it.
SCENARIOS = {
    "load-of-a-host-block-never-stored": (
        [("load", 7, [0, 1], [2], True)],
        r"load job 7 reads host block 2 \(sub-block 0, group 0\), which holds nothing",
    ),
    "load-of-the-host-block-after-the-one-stored": (  # the off-by-one id
        [("store", 1, [0, 1], [2], True), ("load", 7, [0, 1], [3], True)],
        r"load job 7 reads host block 3 .*which holds nothing",
    ),
    "load-before-its-store-is-reported": (
        [("store", 1, [4, 5], [2], True), ("load", 2, [0, 1], [2], False)],
        r"load job 2 reads host block 2 \(sub-block 0, group 0\), whose store job 1 has not been "
        r"reported finished",
    ),
    "store-into-a-host-block-a-pending-load-reads": (
        [("store", 1, [4, 5], [2], True), ("load", 2, [0, 1], [2], True), ("store", 3, [6, 7], [2], False)],
        r"store job 3 writes host block 2 \(sub-block 0, group 0\), which load job 2 still reads",
    ),
    "store-of-device-blocks-a-pending-load-writes": (
        [("store", 1, [4, 5], [2], True), ("load", 2, [0, 1], [2], True), ("store", 3, [1, 2], [0], False)],
        r"store job 3 reads device block 1 \(group 0\), which load job 2 is still writing",
    ),
}


def run(off, jobs):
    """Submits every job; reports (waits and collects) before each one flagged so."""
    for kind, job_id, dev, host, report_first in jobs:
        if report_first:
            settle(off, *off.pending())
        if kind == "store":
            off.store(job_id, dev, host)
        else:
            off.load(job_id, host, dev)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_broken_contract_is_refused_naming_the_jobs_and_nothing_is_copied(name):
    jobs, message = SCENARIOS[name]
    with make() as off:
        run(off, jobs[:-1])
        copies_done(off)  # the earlier jobs' copies have run; the caller has not seen it
        before = state(off)
        with pytest.raises(ValueError, match="checked mode: " + message):
            run(off, jobs[-1:])
        assert jobs[-1][1] not in off.pending()
        off.wait(off.pending())
        assert same(state(off), before)
        assert all(settle(off, *off.pending()).values())


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_same_jobs_are_accepted_unchecked(name):
    jobs, _ = SCENARIOS[name]
    with make(check=False) as off:
        run(off, jobs)
        assert all(settle(off, *off.pending()).values())


def test_the_contract_kept_passes_and_round_trips():
    with make() as off:
        want = [t[[4, 5]].clone() for t in off.device_tensors]
        off.store(1, [4, 5], [2])
        assert settle(off, 1) == {1: True}
        off.load(2, [2], [0, 1])
        off.load(3, [2], [6, 7], expedited=True)  # two loads may read one host block
        assert settle(off, 2, 3) == {2: True, 3: True}
        off.store(4, [0, 1], [2])  # once the loads are reported, the block may be stored again
        assert settle(off, 4) == {4: True}
        for t, w in zip(off.device_tensors, want):
            assert torch.equal(t[[0, 1]], w) and torch.equal(t[[6, 7]], w)


def test_a_job_waited_for_counts_as_seen_finished_before_it_is_reported():
    with make() as off:
        off.store(1, [4, 5], [2])
        off.wait({1})
        off.load(2, [2], [0, 1])  # job 1 is not reported yet, but was waited for
        off.wait({2})
        off.store(3, [0, 1], [2])  # likewise job 2
        off.wait({3})
        assert [(r.job_id, r.success) for r in off.get_finished()] == [(1, True), (3, True), (2, True)]
        for t in off.device_tensors:
            assert torch.equal(t[[0, 1]], t[[4, 5]])


def test_a_block_stored_twice_is_pending_until_the_later_store_is_reported():
    with make() as off:
        gate = threading.Event()
        real = off._copy
        off._copy = lambda job: (gate.wait() if job.job_id == 2 else None, real(job))
        off.store(1, [0, 1], [2])
        off.store(2, [2, 3], [2])
        try:
            off.wait({1})
            assert [r.job_id for r in off.get_finished()] == [1]  # job 2 is still running
            with pytest.raises(ValueError, match="load job 3 reads host block 2 .*whose store job 2"):
                off.load(3, [2], [4, 5])
        finally:
            gate.set()  # a failure above must not leave shutdown waiting for job 2
        assert settle(off, 2) == {2: True}
        off.load(3, [2], [4, 5])
        assert settle(off, 3) == {3: True}
        for t in off.device_tensors:
            assert torch.equal(t[[4, 5]], t[[2, 3]])


def test_a_partial_store_leaves_the_other_sub_blocks_empty():
    with make() as off:
        off.store(1, [3], [1], offsets=1)  # only sub-block 1 of host block 1
        settle(off, 1)
        with pytest.raises(ValueError, match=r"load job 2 reads host block 1 \(sub-block 0"):
            off.load(2, [1], [0, 1])
        off.load(3, [1], [5], offsets=1)  # the stored sub-block alone is fine
        assert settle(off, 3) == {3: True}


def test_a_failed_store_leaves_its_host_blocks_empty():
    with make() as off:
        real = off._copy
        off._copy = lambda job: (_ for _ in ()).throw(RuntimeError("device lost"))
        off.store(1, [0, 1], [2])
        assert settle(off, 1) == {1: False}
        off._copy = real
        with pytest.raises(ValueError, match="load job 2 reads host block 2 .*holds nothing"):
            off.load(2, [2], [0, 1])


def test_groups_that_share_a_tensor_conflict_and_disjoint_groups_do_not():
    tensors = caches(layers=3)
    with KVCacheOffloader(tensors, 16, 32, num_host_blocks=4, groups=[[0, 1], [1, 2]], check=True) as off:
        off.store(1, [0, 1, 2, 3], [0, 1], group_sizes=[2, 2])
        settle(off, 1)
        off.load(2, [0], [4, 5], group_sizes=[2, 0])  # group 0 reads host block 0
        with pytest.raises(ValueError, match=r"store job 3 writes host block 0 .*load job 2"):
            off.store(3, [6, 7], [0], group_sizes=[0, 2])  # group 1 shares tensor 1
        settle(off, 2)
    with KVCacheOffloader(tensors, 16, 32, num_host_blocks=4, groups=[[0], [1, 2]], check=True) as off:
        off.store(1, [0, 1, 2, 3], [0, 1], group_sizes=[2, 2])
        settle(off, 1)
        off.load(2, [0], [4, 5], group_sizes=[2, 0])
        with pytest.raises(ValueError, match="group 1.*which holds nothing"):
            off.load(3, [0], [4, 5], group_sizes=[0, 2])  # group 1 stored host block 1, not 0
        off.store(4, [6, 7], [0], group_sizes=[0, 2])  # disjoint tensors: no conflict
        assert settle(off, 2, 4) == {2: True, 4: True}


def test_check_none_follows_the_mode_at_construction():
    with make(check=None) as off:
        assert off._checks is None
        off.load(1, [0], [0, 1])  # unchecked: the mirror's zeros
        settle(off, 1)
    with torch_kvswap.checked():
        off = make(check=None)
    with off:
        with pytest.raises(ValueError, match="holds nothing"):
            off.load(1, [0], [0, 1])


def test_the_offloader_registers_its_caches_and_mirrors_and_drops_them_with_itself():
    import gc

    labels = torch.ops.kvswap_test.region_labels
    off = make(check=False)
    names = [lab for lab in labels() if "cache" in lab or "mirror" in lab]
    assert names.count("device:device cache 0") >= 1 and "host:host mirror 1" in labels()
    # The pointer op, checked, may copy between them, and nowhere else.
    cache, mirror = off.device_tensors[0], off.host_tensors[0]
    nbytes = cache[0].numel() * cache.element_size()

    def ptrs(a):
        return torch.tensor([a], dtype=torch.int64)

    with torch_kvswap.checked():
        torch_kvswap.swap_blocks_batch(
            ptrs(cache[3].data_ptr()),
            ptrs(mirror[5].data_ptr()),
            ptrs(nbytes),
            torch_kvswap.Direction.DEVICE_TO_HOST,
        )
        assert torch.equal(mirror[5], cache[3])
        with pytest.raises(ValueError, match="'host mirror 0'"):
            torch_kvswap.swap_blocks_batch(
                ptrs(cache[3].data_ptr()),
                ptrs(mirror[mirror.shape[0] - 1].data_ptr() + nbytes),
                ptrs(nbytes),
                torch_kvswap.Direction.DEVICE_TO_HOST,
            )
    before = len(labels())
    off.shutdown()
    del off, cache, mirror
    gc.collect()
    assert len(labels()) <= before - 4  # 2 caches and 2 mirrors


@pytest.mark.parametrize("seed", [0, 1])
def test_random_jobs_that_keep_the_contract_are_never_refused(seed):
    # A scheduler that keeps the contract: it loads only host blocks whose
    # store it has seen reported, into device blocks no unreported job
    # touches, and stores only into host blocks and from device blocks that
    # no unreported load touches.
    rng = random.Random(seed)
    with make(num_host_blocks=8) as off:
        stored: set[int] = set()
        busy_host: dict[int, set[int]] = {}
        busy_dev: dict[int, set[int]] = {}
        storing: dict[int, int] = {}
        store_dev: dict[int, set[int]] = {}  # device blocks unreported stores read
        for job in range(300):
            for r in off.get_finished():
                assert r.success
                busy_host.pop(r.job_id, None)
                busy_dev.pop(r.job_id, None)
                store_dev.pop(r.job_id, None)
                if r.job_id in storing:
                    stored.add(storing.pop(r.job_id))
            h = rng.randrange(8)
            dev = rng.sample(range(8), FACTOR)
            loading_h = set().union(*busy_host.values()) if busy_host else set()
            loading_d = set().union(*busy_dev.values()) if busy_dev else set()
            storing_d = set().union(*store_dev.values()) if store_dev else set()
            if (
                h in stored
                and h not in storing.values()
                and rng.random() < 0.5
                and not set(dev) & (loading_d | storing_d)
            ):
                off.load(job, [h], dev)
                busy_host[job], busy_dev[job] = {h}, set(dev)
            elif h not in loading_h and not set(dev) & loading_d and h not in storing.values():
                stored.discard(h)
                off.store(job, dev, [h])
                storing[job], store_dev[job] = h, set(dev)
        off.wait(off.pending())
        assert all(r.success for r in off.get_finished())


def test_a_late_wait_on_another_thread_does_not_forget_a_new_job_with_the_reused_id():
    # Thread A waits for store 1; the main thread sees store 1 reported and
    # reuses id 1 for a new store of host block 1. A's bookkeeping for the old
    # job, arriving late, must leave the new job tracked: a load of host block
    # 1 is still refused until the new store is reported.
    with make() as off, released(gated(off)) as gate:
        off.store(1, [0, 1], [0])
        old_job = off._lanes._pending[1]
        gate.set()
        settle(off, 1)  # reported: id 1 is free again
        gate.clear()
        off.store(1, [2, 3], [1])  # the new job 1, held
        off._checks.observed([old_job])  # thread A's wait for the old job 1 returning now
        with pytest.raises(ValueError, match=r"load job 2 reads host block 1 .*whose store job 1 has not"):
            off.load(2, [1], [4, 5])
        gate.set()
        assert settle(off, 1) == {1: True}
        off.load(2, [1], [4, 5])
        assert settle(off, 2) == {2: True}


@contextlib.contextmanager
def released(gate):
    """The gate, opened when the block ends, whatever happened in it: a held
    job never keeps the offloader's shutdown waiting."""
    try:
        yield gate
    finally:
        gate.set()


def overlaid_caches():
    base = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
    return {"a": base, "b": base.view(8, 2, 8)}, base


def test_groups_that_view_one_allocation_through_different_tensors_conflict():
    caches_, _ = overlaid_caches()
    with (
        KVCacheOffloader(caches_, 16, 16, num_host_blocks=8, groups=[[0], [1]], check=True) as off,
        contextlib.ExitStack() as stack,
    ):
        off.store(9, [6], [1], group_sizes=[0, 1])
        settle(off, 9)
        gate = stack.enter_context(released(gated(off)))
        off.store(1, [5], [0], group_sizes=[1, 0])  # group 0 reads block 5 of "a", held
        with pytest.raises(
            ValueError, match=r"load job 2 writes device block 5 of group 0, which store job 1"
        ):
            off.load(2, [1], [5], group_sizes=[0, 1])  # block 5 of "b": the same bytes
        off.load(3, [1], [4], group_sizes=[0, 1])  # another block: no conflict
        gate.set()
        assert settle(off, 1, 3) == {1: True, 3: True}


def test_overlaid_views_map_blocks_by_address_not_by_index():
    # "b" starts half a block into "a": block 2 of "b" spans blocks 2 and 3 of "a".
    base = torch.zeros(9 * 8)
    caches_ = {"a": base[:64].view(8, 8), "b": base[4:68].view(8, 8)}
    with (
        KVCacheOffloader(caches_, 16, 16, num_host_blocks=8, groups=[[0], [1]], check=True) as off,
        released(gated(off)) as gate,
    ):
        off.store(1, [3], [0], group_sizes=[1, 0])
        with pytest.raises(ValueError, match=r"device block 3 of group 0, which store job 1"):
            off.load(2, [1], [2], group_sizes=[0, 1])
        with pytest.raises(ValueError, match=r"which holds nothing|device block 3 of group 0"):
            off.load(3, [1], [3], group_sizes=[0, 1])
        blocks = dict(off._checks._overlays.blocks(1, torch.tensor([0, 2, 7]).numpy()))
        assert blocks[0].tolist() == [0, 1, 2, 3, 7] and blocks[1].tolist() == [0, 2, 7]
        gate.set()
        settle(off, 1)


def test_interleaved_views_of_one_allocation_do_not_conflict():
    # K and V halves of one [num_blocks, 2, ...] buffer share no byte.
    base = torch.zeros(8, 2, 16)
    caches_ = {"k": base[:, 0], "v": base[:, 1]}
    with KVCacheOffloader(caches_, 16, 16, num_host_blocks=8, groups=[[0], [1]], check=True) as off:
        assert [h for h, _ in off._checks._overlays.blocks(0, torch.arange(8).numpy())] == [0]
