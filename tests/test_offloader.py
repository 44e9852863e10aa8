"""KVCacheOffloader: round trips, ordering under stress, bad input, failures, threads."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from torch_kvswap import DeviceBlocks, HostBlocks, KVCacheOffloader
from conftest import accelerator_or_skip
from helpers import gated

DTYPES = [torch.bfloat16, torch.float16, torch.int8]
BLOCK = (4, 2, 8)  # tokens, heads, head_dim


def rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-128, 127, shape, generator=g, dtype=dtype)


def make_caches(layout: str, num_blocks: int, dtype, layers=3, seed=0, device="cpu"):
    if layout == "per_layer":
        return {f"l{i}": rand((num_blocks, *BLOCK), dtype, seed + i).to(device) for i in range(layers)}
    if layout == "kv_tuple":
        return {
            f"l{i}": (
                rand((num_blocks, *BLOCK), dtype, seed + 2 * i).to(device),
                rand((num_blocks, *BLOCK), dtype, seed + 2 * i + 1).to(device),
            )
            for i in range(layers)
        }
    if layout == "stacked":
        return {f"l{i}": rand((2, num_blocks, *BLOCK), dtype, seed + i).to(device) for i in range(layers)}
    raise ValueError(layout)


def flat(caches) -> list[torch.Tensor]:
    out = []
    for v in caches.values():
        out.extend(v if isinstance(v, tuple) else ([v[0], v[1]] if v.dim() == len(BLOCK) + 2 else [v]))
    return out


# vLLM-style specs: the medium is a static method, block ids a numpy array.
@dataclass
class CPULoadStoreSpec:
    block_ids: np.ndarray

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclass
class GPULoadStoreSpec:
    block_ids: np.ndarray

    @staticmethod
    def medium() -> str:
        return "GPU"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("layout", ["per_layer", "kv_tuple", "stacked"])
def test_store_overwrite_load_round_trip_is_bit_exact(layout, factor, dtype):
    caches = make_caches(layout, num_blocks=24, dtype=dtype)
    tensors = flat(caches)
    original = [t.clone() for t in tensors]
    dev = np.array([5, 17, 2, 3, 11, 20, 8, 9][: 2 * factor], dtype=np.int64)
    host = np.array([4, 1], dtype=np.int64)
    with KVCacheOffloader(caches, 16, 16 * factor, num_host_blocks=6) as off:
        off.store(1, dev, host)
        off.wait({1})
        for t in tensors:
            t[torch.from_numpy(dev)] = 0  # the device blocks are reused
        back = np.array([0, 1, 23, 22, 21, 19, 18, 16][: 2 * factor], dtype=np.int64)
        off.load(2, host, back)
        off.wait({2})
        results = {r.job_id: r for r in off.get_finished()}
    assert results[1].success and results[2].success
    assert results[1].transfer_size == len(dev) * sum(t[0].numel() * t.element_size() for t in tensors)
    for t, o in zip(tensors, original):
        assert torch.equal(
            t[torch.from_numpy(back)].view(torch.uint8), o[torch.from_numpy(dev)].view(torch.uint8)
        )


@pytest.mark.parametrize("factor,num_dev", [(2, 3), (4, 5), (4, 7), (4, 1)])
def test_partial_host_block_store_skips_the_leading_sub_blocks(factor, num_dev):
    caches = make_caches("per_layer", 16, torch.float16)
    tensors = flat(caches)
    dev = np.arange(num_dev, dtype=np.int64) + 3
    n_host = -(-num_dev // factor)
    skip = -num_dev % factor
    host = np.arange(n_host, dtype=np.int64)
    with KVCacheOffloader(caches, 8, 8 * factor, num_host_blocks=4) as off:
        off.store(7, dev, host)
        off.wait({7})
        for t, mirror in zip(tensors, off.host_tensors):
            assert torch.equal(mirror[:skip], torch.zeros_like(mirror[:skip]))  # untouched
            assert torch.equal(mirror[skip : skip + num_dev], t[torch.from_numpy(dev)])
        assert off.get_finished()[0].success


def test_reference_specs_drive_both_directions():
    caches = make_caches("kv_tuple", 8, torch.bfloat16, layers=2)
    tensors = flat(caches)
    want = [t[[6, 7]].clone() for t in tensors]
    with KVCacheOffloader(caches, 16, 32, num_host_blocks=2) as off:
        assert off.transfer_async(1, (GPULoadStoreSpec(np.array([6, 7])), CPULoadStoreSpec(np.array([1]))))
        off.wait([1])
        assert off.transfer_async(
            2, (CPULoadStoreSpec(torch.tensor([1])), GPULoadStoreSpec(np.array([0, 1])))
        )
        off.wait([2])
        kinds = {r.job_id: r.transfer_type for r in off.get_finished()}
    assert kinds == {1: ("CPU_DEVICE", "CPU"), 2: ("CPU", "CPU_DEVICE")}
    for t, w in zip(tensors, want):
        assert torch.equal(t[[0, 1]], w)


def test_typed_specs_work_like_the_reference_form():
    caches = make_caches("per_layer", 4, torch.float16, layers=1)
    with KVCacheOffloader(caches, 16, 16, num_host_blocks=4) as off:
        off.transfer_async(3, (DeviceBlocks([2]), HostBlocks([0])))
        off.wait({3})
        assert torch.equal(off.host_tensors[0][0], flat(caches)[0][2])


@pytest.mark.parametrize("block_shape", [(16, 8, 128), (3, 5, 7), (1,)])
def test_host_mirrors_are_page_aligned_with_under_a_page_of_padding_each(block_shape):
    caches = {f"l{i}": torch.zeros(2, 8, *block_shape, dtype=torch.bfloat16) for i in range(5)}
    offs = [KVCacheOffloader(caches, 16, 32, num_host_blocks=3) for _ in range(2)]
    try:
        for off in offs:
            n = len(off.host_tensors)
            assert off.host_bytes_needed == 3 * 2 * 10 * int(np.prod(block_shape)) * 2
            assert off.buffer.data_ptr() % 4096 == 0
            assert all(m.data_ptr() % 4096 == 0 for m in off.host_tensors)
            assert 0 <= off.host_bytes - off.host_bytes_needed < 4096 * n + 4096
            assert off.pinned is False  # no accelerator: nothing to pin
        # The two offloaders' buffers share no page.
        (a0, a1), (b0, b1) = [
            (o.buffer.data_ptr() // 4096, (o.buffer.data_ptr() + o.buffer.numel() - 1) // 4096) for o in offs
        ]
        assert a1 < b0 or b1 < a0
    finally:
        for off in offs:
            off.shutdown()


def test_host_bytes_sizes_the_mirrors():
    caches = {"l0": torch.zeros(2, 8, 64, dtype=torch.float16)}  # 256 bytes per device block
    with KVCacheOffloader(caches, 16, 64, host_bytes=10 * 4 * 256 + 1023) as off:
        assert off.num_host_blocks == 10
        assert off.host_bytes_needed == 10 * 4 * 256
    with pytest.raises(ValueError, match="less than one host block"):
        KVCacheOffloader(caches, 16, 64, host_bytes=4 * 256 - 1)
    with pytest.raises(ValueError, match="exactly one of num_host_blocks and host_bytes"):
        KVCacheOffloader(caches, 16, 64, 10, host_bytes=4096)
    with pytest.raises(ValueError, match="exactly one of num_host_blocks and host_bytes"):
        KVCacheOffloader(caches, 16, 64)


@pytest.mark.parametrize("kv_stacked,tensors,blocks", [(True, 2, 4), (False, 1, 2), (None, 2, 4)])
def test_kv_stacked_says_how_to_read_a_tensor_whose_dim_0_is_2(kv_stacked, tensors, blocks):
    # A per-layer cache with exactly 2 blocks of shape (4, 8): the default
    # guesses "stacked [2, 4 blocks, 8]", which is wrong for this cache.
    cache = torch.arange(2 * 4 * 8, dtype=torch.float32).view(2, 4, 8)
    with KVCacheOffloader({"l0": cache}, 16, 16, num_host_blocks=4, kv_stacked=kv_stacked) as off:
        assert len(off.device_tensors) == tensors and off.num_device_blocks == blocks
        off.store(1, [1], [3])
        off.wait({1})
        if kv_stacked is False:
            assert torch.equal(off.host_tensors[0][3], cache[1])
        else:
            assert torch.equal(off.host_tensors[0][3], cache[0, 1])
            assert torch.equal(off.host_tensors[1][3], cache[1, 1])


def test_a_num_blocks_2_cache_moves_through_its_k_and_v_views():
    """A [num_blocks, 2, ...] cache (K and V interleaved per block) is given
    as its two strided views; blocks round-trip whole and nothing else of
    the cache changes (against a plain reference)."""
    kv = torch.randn(16, 2, 4, 8)
    expected = kv.clone()
    expected[[7, 9]] = kv[[3, 5]]
    expected[[3, 5]] = 0
    with KVCacheOffloader({"l0": (kv[:, 0], kv[:, 1])}, 4, 4, num_host_blocks=8) as off:
        off.store(1, [3, 5], [0, 1])
        off.wait({1})
        kv[[3, 5]] = 0
        off.load(2, [0, 1], [7, 9])
        off.wait({2})
    assert torch.equal(kv, expected)


class Scheduler:
    """Drives random jobs like a serving engine's scheduler, with a shadow model.

    Block contents are tags. A job is submitted only when it does not race an
    in-flight job of the other direction (the offloader's documented contract);
    the same direction is FIFO-ordered by the offloader itself.
    """

    def __init__(self, off: KVCacheOffloader, tensors, rng: random.Random):
        self.off, self.tensors, self.rng = off, tensors, rng
        self.f = off.factor
        self.dev = [float(i) for i in range(off.num_device_blocks)]
        self.host = [-1.0] * (off.num_host_blocks * self.f)
        for t in tensors:
            t.copy_(torch.tensor(self.dev, dtype=t.dtype).view(-1, *[1] * (t.dim() - 1)).expand_as(t))
        for m in off.host_tensors:
            m.fill_(-1)
        self.inflight: dict[int, tuple[bool, set, set]] = {}  # id -> (is_store, dev set, host set)
        self.next_id, self.reported = 0, []

    def _conflicts(self, is_store, dev, host):
        return [j for j, (s, d, h) in self.inflight.items() if s != is_store and (d & dev or h & host)]

    def submit_random(self):
        is_store = self.rng.random() < 0.5
        n_host = self.rng.randint(1, 3)
        host_blocks = self.rng.sample(range(self.off.num_host_blocks), n_host)
        n_dev = n_host * self.f - self.rng.randint(0, self.f - 1) if is_store else n_host * self.f
        dev_blocks = self.rng.sample(range(self.off.num_device_blocks), n_dev)
        skip = (-n_dev % self.f) if is_store else 0
        subs = [h * self.f + k for h in host_blocks for k in range(self.f)][skip:]
        dev_set, host_set = set(dev_blocks), set(subs)
        blockers = self._conflicts(is_store, dev_set, host_set)
        if blockers:
            self.off.wait(blockers)
        job = self.next_id
        self.next_id += 1
        if is_store:
            self.off.store(job, dev_blocks, host_blocks)
            for d, h in zip(dev_blocks, subs):
                self.host[h] = self.dev[d]
        else:
            self.off.load(job, host_blocks, dev_blocks)
            for d, h in zip(dev_blocks, subs):
                self.dev[d] = self.host[h]
        self.inflight[job] = (is_store, dev_set, host_set)

    def compute(self):
        """Model code writes a device block no in-flight job touches."""
        busy = set().union(*(d for _, d, _ in self.inflight.values())) if self.inflight else set()
        free = [b for b in range(self.off.num_device_blocks) if b not in busy]
        if free:
            b = self.rng.choice(free)
            self.dev[b] = float(1000 + self.next_id)
            for t in self.tensors:
                t[b] = self.dev[b]

    def collect(self):
        for r in self.off.get_finished():
            assert r.success, r
            self.inflight.pop(r.job_id)
            self.reported.append(r.job_id)

    def check(self):
        for t in self.tensors:
            assert t.flatten(1)[:, 0].tolist() == self.dev
            assert (t.flatten(1) == t.flatten(1)[:, :1]).all()
        for m in self.off.host_tensors:
            assert m.flatten(1)[:, 0].tolist() == self.host


@pytest.mark.parametrize("factor", [1, 2, 4])
def test_stress_random_interleaved_jobs_match_a_shadow_model(factor):
    rng = random.Random(factor)
    caches = make_caches("stacked", 48, torch.float32, layers=2)
    off = KVCacheOffloader(caches, 16, 16 * factor, num_host_blocks=24)
    sched = Scheduler(off, flat(caches), rng)
    for _ in range(1000):
        sched.submit_random()
        if rng.random() < 0.3:
            sched.compute()
        if rng.random() < 0.2:
            sched.collect()
        if rng.random() < 0.05 and sched.inflight:
            subset = rng.sample(sorted(sched.inflight), k=min(3, len(sched.inflight)))
            off.wait(subset)
            # Every waited job has finished, so get_finished reports it now
            # (the jobs before it in its lane finished first).
            sched.collect()
            assert not set(subset) & set(sched.inflight)
    # Shut down with jobs still in flight: nothing is lost.
    in_flight_at_shutdown = set(off.pending())
    off.shutdown()
    sched.collect()
    assert not sched.inflight
    assert sorted(sched.reported) == list(range(1000))
    assert in_flight_at_shutdown <= set(sched.reported)
    # The mirrors are released by shutdown; the device side carries the result.
    for t in sched.tensors:
        assert t.flatten(1)[:, 0].tolist() == sched.dev


def test_stress_host_mirrors_match_before_shutdown():
    rng = random.Random(11)
    caches = make_caches("per_layer", 32, torch.float32, layers=2)
    off = KVCacheOffloader(caches, 16, 32, num_host_blocks=16)
    sched = Scheduler(off, flat(caches), rng)
    for _ in range(300):
        sched.submit_random()
        if rng.random() < 0.3:
            sched.compute()
    off.wait(off.pending())
    sched.collect()
    sched.check()
    off.shutdown()


# --- bad input ------------------------------------------------------------------


@pytest.fixture
def offloader():
    off = KVCacheOffloader(make_caches("per_layer", 8, torch.float16, layers=2), 16, 32, num_host_blocks=4)
    yield off
    off.shutdown()


def test_wait_ignores_ids_that_are_not_pending(offloader):
    offloader.wait({12345})  # returns at once, as in the reference
    with pytest.raises(KeyError, match="12345"):
        offloader.wait({12345}, strict=True)


def test_duplicate_job_ids_are_rejected(offloader):
    gate = threading.Event()
    real_copy = offloader._copy
    offloader._copy = lambda job: (gate.wait(), real_copy(job))
    offloader.store(1, [0, 1], [0])
    with pytest.raises(ValueError, match="job id 1 is already in flight"):
        offloader.store(1, [2, 3], [1])
    gate.set()
    offloader.wait({1})
    assert [r.job_id for r in offloader.get_finished()] == [1]
    offloader.store(1, [2, 3], [1])  # reported ids may be reused
    offloader.wait({1})


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda o: o.store(1, [0, 8], [0]),
            r"device_block_ids\[1\] = 8 is out of range: valid ids are 0\.\.7$",
        ),
        (
            lambda o: o.store(1, [0, 1], [4]),
            r"host_block_ids\[0\] = 4 is out of range: valid ids are 0\.\.3$",
        ),
        (lambda o: o.load(1, [-1], [0, 1]), r"host_block_ids\[0\] = -1 is out of range"),
        (lambda o: o.load(1, [0], [0, 9]), r"device_block_ids\[1\] = 9 is out of range"),
    ],
)
def test_out_of_range_block_ids_are_rejected_before_any_copy(offloader, call, match):
    before = [m.clone() for m in offloader.host_tensors]
    with pytest.raises(IndexError, match=match):
        call(offloader)
    assert offloader.pending() == []
    assert all(torch.equal(a, b) for a, b in zip(before, offloader.host_tensors))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda o: o.store(1, [0, 1, 2], [0]), r"store of 3 device blocks needs 2 host blocks"),
        (lambda o: o.store(1, [0], [0, 1]), r"store of 1 device blocks needs 1 host blocks"),
        (lambda o: o.load(1, [0], [0]), r"without offsets, loads move whole host blocks$"),
        (lambda o: o.load(1, [0, 1], [0, 1, 2]), r"load of 2 host blocks fills 4 device blocks"),
        (lambda o: o.store(1, [[0, 1]], [0]), r"must be a 1-D array"),
        (lambda o: o.store(1, [0, 1, 2, 3], [1, 1]), r"^destination block ids repeat within one job$"),
        # a repeat that is not the smallest id (store: host sub-blocks 6 and 7; load: device block 5)
        (
            lambda o: o.store(1, [0, 1, 2, 3, 4, 5], [0, 3, 3]),
            r"^destination block ids repeat within one job$",
        ),
        (lambda o: o.load(1, [0, 1], [2, 5, 6, 5]), r"^destination block ids repeat within one job$"),
        (lambda o: o.transfer_async(1, (HostBlocks([0]), HostBlocks([1]))), r"one host \(CPU\) side"),
    ],
)
def test_mismatched_specs_are_rejected(offloader, call, match):
    with pytest.raises(ValueError, match=match):
        call(offloader)
    assert offloader.pending() == []


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda o: o.store("a", [0, 1], [0]), r"job_id must be an int, got str 'a'"),
        (lambda o: o.load(1.0, [0], [0, 1]), r"job_id must be an int, got float 1.0"),
        (lambda o: o.store(True, [0, 1], [0]), r"job_id must be an int, got bool True"),
        (
            lambda o: o.store(1, [0.5, 1.0], [0]),
            r"device_block_ids must hold integer block ids, got dtype float64",
        ),
        (
            lambda o: o.load(1, 3, [0, 1]),
            r"host_block_ids must be a 1-D sequence of integer block ids .*got int 3",
        ),
        (lambda o: o.store(1, "01", [0]), r"device_block_ids must be a 1-D sequence .*got str '01'"),
        (lambda o: o.wait(1), r"job_ids must be an iterable of int job ids .*got int 1"),
        (lambda o: o.wait(["x"]), r"job_ids entry must be an int, got str 'x'"),
    ],
)
def test_bad_job_ids_and_block_ids_raise_type_errors_naming_the_argument(offloader, call, match):
    with pytest.raises(TypeError, match=match):
        call(offloader)
    assert offloader.pending() == []


def test_constructor_errors_name_the_cache_by_its_key_and_k_or_v():
    kv = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match=r"cache 'layer.1' V has 3 blocks, but 'layer.0' K has 4"):
        KVCacheOffloader({"layer.0": kv, "layer.1": (kv[0], torch.zeros(3, 8))}, 16, 16, 1)
    with pytest.raises(
        ValueError,
        match=r"cache 'layer.0' K: each block must be contiguous in memory, "
        r"but dim 2 of shape \(4, 8, 2\) has stride 8 \(expected 1\)",
    ):
        KVCacheOffloader({"layer.0": torch.zeros(2, 4, 2, 8).transpose(-1, -2)}, 16, 16, 1)
    with pytest.raises(ValueError, match=r"cache device_caches\[1\] is on meta, but device_caches\[0\]"):
        KVCacheOffloader([torch.zeros(4, 8), torch.zeros(4, 8, device="meta")], 16, 16, 1)


def test_strict_refuses_loads_of_never_stored_host_blocks_and_unknown_waits():
    caches = make_caches("per_layer", 8, torch.float16, layers=2)
    with KVCacheOffloader(caches, 16, 32, num_host_blocks=4, strict=True) as off:
        with pytest.raises(
            ValueError,
            match=r"reads host block 1 \(sub-block 0\) of cache 'l0', "
            r"which no store has written.*nothing was copied",
        ):
            off.load(1, [1], [0, 1])
        with pytest.raises(KeyError, match="999"):
            off.wait({999})
        off.wait({999}, strict=False)  # a call may still ask for the lenient answer
        off.store(2, [2, 3], [1])
        off.wait({2})
        off.load(3, [1], [4, 5])  # stored now
        off.store(4, [6], [2])  # a partial store fills only sub-block 1 of host block 2
        with pytest.raises(ValueError, match=r"host block 2 \(sub-block 0\)"):
            off.load(5, [2], [0, 1])
        off.wait(off.pending())
        assert [r.success for r in off.get_finished()] == [True, True, True]
        assert torch.equal(flat(caches)[0][4:6], flat(caches)[0][2:4])


def test_a_failed_store_leaves_its_blocks_never_stored_under_strict():
    caches = make_caches("per_layer", 8, torch.float16, layers=1)
    with KVCacheOffloader(caches, 16, 16, num_host_blocks=4, strict=True) as off:
        real = off._copy
        off._copy = lambda job: (
            (_ for _ in ()).throw(RuntimeError("injected")) if job.job_id == 1 else real(job)
        )
        off.store(1, [0], [3])
        off.wait({1})
        assert [r.success for r in off.get_finished()] == [False]
        with pytest.raises(ValueError, match=r"whose latest store \(job 1\) failed"):
            off.load(2, [3], [0])


def test_without_strict_a_never_stored_block_loads_zeros_and_unknown_waits_return():
    caches = make_caches("per_layer", 8, torch.float16, layers=1)
    with KVCacheOffloader(caches, 16, 16, num_host_blocks=4) as off:
        off.load(1, [2], [5])
        off.wait({1, 999})
        assert [r.success for r in off.get_finished()] == [True]
        assert not flat(caches)[0][5].any()


def test_constructor_rejects_bad_sizes():
    caches = make_caches("per_layer", 4, torch.float16, layers=1)
    with pytest.raises(ValueError, match="multiple of device_block_size"):
        KVCacheOffloader(caches, 16, 24, 4)
    with pytest.raises(ValueError, match="num_host_blocks must be >= 1"):
        KVCacheOffloader(caches, 16, 32, 0)
    with pytest.raises(ValueError, match="cache 'b' has 3 blocks, but 'a' has 4"):
        KVCacheOffloader({"a": torch.zeros(4, 2), "b": torch.zeros(3, 2)}, 16, 16, 1)
    with pytest.raises(ValueError, match="empty"):
        KVCacheOffloader({}, 16, 16, 1)
    with pytest.raises(ValueError, match="pin_memory=True needs caches on an accelerator"):
        KVCacheOffloader(caches, 16, 32, 4, pin_memory=True)
    with pytest.raises(TypeError, match="expected a tensor or a"):
        KVCacheOffloader({"a": "not a tensor"}, 16, 16, 1)


def test_submitting_after_shutdown_raises_and_shutdown_is_idempotent(offloader):
    offloader.shutdown()
    offloader.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        offloader.store(1, [0, 1], [0])


# --- completion, failures, threads ------------------------------------------------


def test_get_finished_never_blocks_on_a_running_job(offloader):
    gate = threading.Event()
    real_copy = offloader._copy
    offloader._copy = lambda job: (gate.wait(), real_copy(job))
    offloader.store(5, [0, 1], [0])
    assert offloader.get_finished() == []  # the job is stuck, the call is not
    gate.set()
    offloader.wait({5})
    (result,) = offloader.get_finished()
    assert result.job_id == 5 and result.success and result.transfer_time > 0
    assert result.transfer_size == 2 * offloader.bytes_per_device_block


def test_a_failed_copy_is_reported_and_logged_and_later_jobs_still_run(offloader, caplog):
    real_copy = offloader._copy

    def flaky(job):
        if job.job_id == 2:
            raise RuntimeError("simulated DMA failure")
        real_copy(job)

    offloader._copy = flaky
    with caplog.at_level(logging.ERROR, logger="torch_kvswap"):
        for j in range(4):
            offloader.store(j, [2 * (j % 4), 2 * (j % 4) + 1], [j])
        offloader.wait(range(4))
    results = {r.job_id: r for r in offloader.get_finished()}
    assert sorted(results) == [0, 1, 2, 3]
    assert not results[2].success and "simulated DMA failure" in results[2].error
    assert results[2].transfer_size == 0
    assert all(results[j].success for j in (0, 1, 3))
    assert "job 2 (store) failed" in caplog.text


def test_transfer_async_on_one_thread_and_get_finished_on_another(offloader):
    collected, done = [], threading.Event()

    def poll():
        while not done.is_set() or offloader.pending():
            collected.extend(offloader.get_finished())

    poller = threading.Thread(target=poll, daemon=True)  # a failed submission must not leave it spinning
    poller.start()
    try:
        for j in range(200):
            offloader.transfer_async(j, (DeviceBlocks([2 * (j % 4), 2 * (j % 4) + 1]), HostBlocks([j % 4])))
            if j % 4 == 3:
                offloader.wait(range(j - 3, j + 1))  # same host blocks come round again
    finally:
        done.set()
    poller.join(timeout=60)
    assert not poller.is_alive()
    assert [r.job_id for r in collected] == list(range(200))  # submission order, exactly
    assert all(r.success for r in collected)


# --- stream/event discipline on an accelerator (skipped without one) ------------------


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_store_waits_for_compute_queued_before_it(kind):
    device = accelerator_or_skip(kind)
    caches = {"l0": torch.zeros(2, 64, 1024, device=device)}
    with KVCacheOffloader(caches, 16, 16, num_host_blocks=8) as off:
        assert off.pinned
        big = torch.randn(4096, 4096, device=device)
        for _ in range(20):  # keep the compute stream busy, then write the block
            big = big @ big / 4096
        caches["l0"][:, 3] = 7.0
        off.store(1, [3], [0])
        off.wait({1})
        assert bool((off.host_tensors[0][0] == 7.0).all()) and bool((off.host_tensors[1][0] == 7.0).all())


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_load_does_not_overwrite_blocks_queued_compute_still_reads(kind):
    device = accelerator_or_skip(kind)
    caches = {"l0": torch.full((2, 8, 1024), 1.0, device=device)}
    with KVCacheOffloader(caches, 16, 16, num_host_blocks=2) as off:
        off.host_tensors[0].fill_(5.0)
        off.host_tensors[1].fill_(5.0)
        big = torch.randn(4096, 4096, device=device)
        for _ in range(20):
            big = big @ big / 4096
        snapshot = caches["l0"][:, 2].clone()  # queued read of the old block
        off.load(1, [0], [2])
        off.wait({1})
        torch.accelerator.synchronize()
        assert bool((snapshot == 1.0).all())
        assert bool((caches["l0"][:, 2] == 5.0).all())


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_events_are_recycled(kind):
    device = accelerator_or_skip(kind)
    caches = {"l0": torch.zeros(2, 8, 64, device=device)}
    with KVCacheOffloader(caches, 16, 16, num_host_blocks=8) as off:
        for j in range(10):
            off.store(j, [j % 8], [j % 8])
            off.wait({j})
            off.get_finished()
        assert len(off._lanes._event_pool) == 2  # one start/end pair, reused every time


# --- explicit offsets, partial chunks, groups, expedited loads ----------------------


class MirrorModel:
    """Plain reference of the host mirrors: sub-block (h * factor + k) of tensor t."""

    def __init__(self, off: KVCacheOffloader):
        self.off = off
        self.host = [m.clone() for m in off.host_tensors]

    def subs(self, host_ids, offset, n):
        f = self.off.factor
        return [h * f + k for h in host_ids for k in range(f)][offset : offset + n]

    def store(self, tensors, dev, host_ids, offset):
        for i in tensors:
            for d, s in zip(dev, self.subs(host_ids, offset, len(dev))):
                self.host[i][s] = self.off.device_tensors[i][d]

    def expected_load(self, tensors, host_ids, offset, n):
        return {i: [self.host[i][s].clone() for s in self.subs(host_ids, offset, n)] for i in tensors}


@pytest.mark.parametrize("factor", [2, 4])
@pytest.mark.parametrize("offset,n", [(0, 1), (1, 1), ("last", 1), (0, 3), ("last", 2), (1, 6), (0, 8)])
def test_explicit_offset_stores_and_loads_partial_chunks_at_both_ends(factor, offset, n):
    offset = factor - 1 if offset == "last" else offset
    caches = make_caches("kv_tuple", 24, torch.float16, layers=2)
    with KVCacheOffloader(caches, 16, 16 * factor, num_host_blocks=8) as off:
        model = MirrorModel(off)
        n_host = -(-(offset + n) // factor)
        host = [7, 2, 5, 0][:n_host]
        dev = [20, 3, 11, 9, 0, 14, 6, 22][:n]
        assert off.store(1, dev, host, offsets=offset)
        model.store(range(4), dev, host, offset)
        off.wait({1})
        for got, want in zip(off.host_tensors, model.host):  # only the addressed sub-blocks changed
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        back = [1, 4, 5, 8, 10, 12, 13, 15][:n]
        off.load(2, host, back, offsets=offset)
        off.wait({2})
        for i, t in enumerate(off.device_tensors):
            for b, want in zip(back, model.expected_load([i], host, offset, n)[i]):
                assert torch.equal(t[b].view(torch.uint8), want.view(torch.uint8))
        (r1, r2) = off.get_finished()
        assert r1.transfer_size == r2.transfer_size == n * off.bytes_per_device_block


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda o: o.store(1, [0], [0], offsets=2),
            r"offsets\[0\] = 2 is out of range: valid offsets are 0..1",
        ),
        (lambda o: o.store(1, [0], [0], offsets=-1), r"offsets\[0\] = -1 is out of range"),
        (lambda o: o.store(1, [0, 1], [0], offsets=1), r"store of 2 device blocks needs 2 host blocks"),
        (
            lambda o: o.load(1, [0, 1], [0], offsets=0),
            r"load of 1 device blocks needs 1 host blocks \(factor 2\), got 2",
        ),
        (
            lambda o: o.store(1, [0], [0], offsets=[0, 0]),
            r"offsets has 2 entries; this offloader has 1 groups",
        ),
        (lambda o: o.store(1, [0], [0], group_sizes=[2]), r"group_sizes \[2\] must give 1"),
        (
            lambda o: o.store(1, [0], [0], group_sizes=[1, 0]),
            r"group_sizes \[1, 0\] must give 1",
        ),  # right sum
    ],
)
def test_bad_offsets_and_group_sizes_are_rejected(offloader, call, match):
    with pytest.raises(ValueError, match=match):
        call(offloader)
    assert offloader.pending() == []


GROUP_LAYOUTS = {
    "disjoint": [[0, 1], [2, 3]],
    "shared": [[0, 1, 2, 3], [0, 1, 2, 3]],  # hybrid groups overlaying the same tensors
    "overlap": [[0, 1, 2], [2, 3]],
}


@pytest.mark.parametrize("layout", sorted(GROUP_LAYOUTS))
@pytest.mark.parametrize("factor", [1, 3])
def test_groups_move_only_their_own_tensors_against_a_reference(layout, factor):
    rng = random.Random(f"{layout}{factor}")
    groups = GROUP_LAYOUTS[layout]
    caches = make_caches("kv_tuple", 40, torch.bfloat16, layers=2)
    with KVCacheOffloader(caches, 16, 16 * factor, num_host_blocks=60, groups=groups) as off:
        model = MirrorModel(off)
        free_host = list(range(60))
        rng.shuffle(free_host)
        for job in range(12):
            sizes, offsets, dev, host, plan = [], [], [], [], []
            used = set()
            for g in range(2):
                n = rng.choice([0, 1, 2, factor, factor + 1])
                o = rng.randrange(factor)
                d = rng.sample([b for b in range(40) if b not in used], n)
                used |= set(d)
                h = [free_host.pop() for _ in range(-(-(n + o) // factor) if n else 0)]
                sizes.append(n), offsets.append(o), dev.extend(d), host.extend(h)
                plan.append((groups[g], d, h, o))
            off.store(job, dev, host, offsets=offsets, group_sizes=sizes)
            off.wait({job})
            for tensors, d, h, o in plan:
                model.store(tensors, d, h, o)
            (r,) = off.get_finished()
            assert r.success and r.transfer_size == sum(
                n * sum(off.device_tensors[i][0].numel() * 2 for i in groups[g]) for g, n in enumerate(sizes)
            )
            for got, want in zip(off.host_tensors, model.host):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            # Load the same chunks back into other device blocks, group by group.
            before = [t.clone() for t in off.device_tensors]
            back_all, expected = [], {}
            for tensors, d, h, o in plan:
                back = rng.sample([b for b in range(40) if b not in set(back_all)], len(d))
                back_all.extend(back)
                for i, rows in model.expected_load(tensors, h, o, len(d)).items():
                    for b, row in zip(back, rows):
                        expected[(i, b)] = row
            off.load(100 + job, host, back_all, offsets=offsets, group_sizes=sizes)
            off.wait({100 + job})
            assert off.get_finished()[0].success
            for i, t in enumerate(off.device_tensors):
                for b in range(40):
                    want = expected.get((i, b), before[i][b])  # untouched unless loaded
                    assert torch.equal(t[b].view(torch.uint8), want.view(torch.uint8)), (i, b)


@pytest.mark.parametrize("kind", ["store", "load"])
@pytest.mark.parametrize("form", [np.array, torch.tensor])
def test_a_job_keeps_its_own_ids_and_the_caller_may_reuse_its_arrays_once_the_call_returns(kind, form):
    """vLLM-style callers refill one id buffer per step; a job still queued
    must copy the blocks named when it was submitted."""
    caches = {"l": torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)}
    with KVCacheOffloader(caches, 16, 16, num_host_blocks=4) as off:
        gate = gated(off)
        host, device = off.host_tensors[0], off.device_tensors[0]
        host.copy_(-torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64))
        want_host, want_device = host.clone(), device.clone()
        ids_a, ids_b = form([5, 6]), form([0, 3])
        if kind == "store":
            off.store(1, ids_a, ids_b)
            want_host[[0, 3]] = want_device[[5, 6]]
        else:
            off.load(1, ids_b, ids_a)
            want_device[[5, 6]] = want_host[[0, 3]]
        ids_a[:] = form([1, 2])  # reused for the next step before the job ran
        ids_b[:] = form([1, 2])
        gate.set()
        off.wait({1})
        assert off.get_finished()[0].success
        assert torch.equal(host, want_host) and torch.equal(device, want_device)


def test_a_load_of_several_groups_without_offsets_fills_each_groups_blocks_from_whole_host_blocks():
    caches = make_caches("per_layer", 8, torch.float16, layers=2)
    with KVCacheOffloader(caches, 16, 32, 4, groups=[[0], [1]]) as off:  # factor 2
        for mirror in off.host_tensors:
            mirror.copy_(torch.randn(mirror.shape).to(mirror.dtype))
        off.load(1, [3, 1], [0, 1, 6, 7], group_sizes=[2, 2])
        off.wait({1})
        assert off.get_finished()[0].success
        device, host = off.device_tensors, off.host_tensors
        assert torch.equal(device[0][0:2], host[0][6:8])  # group 0: host block 3 = rows 6, 7
        assert torch.equal(device[1][6:8], host[1][2:4])  # group 1: host block 1 = rows 2, 3


def test_group_sizes_are_required_with_several_groups_and_groups_are_checked():
    caches = make_caches("per_layer", 8, torch.float16, layers=2)
    with KVCacheOffloader(caches, 16, 16, 4, groups=[[0], [1]]) as off:
        with pytest.raises(ValueError, match="group_sizes is required: this offloader has 2 groups"):
            off.store(1, [0], [0])
        # Disjoint groups: the same device block id in both groups names
        # different tensors, so a load may fill it for each group.
        off.load(2, [0, 1], [5, 5], group_sizes=[1, 1], offsets=[0, 0])
        off.wait({2})
        assert off.get_finished()[0].success
        assert torch.equal(off.device_tensors[0][5], off.host_tensors[0][0])
        assert torch.equal(off.device_tensors[1][5], off.host_tensors[1][1])
    with KVCacheOffloader(caches, 16, 16, 4, groups=[[0, 1], [1]]) as off:
        with pytest.raises(ValueError, match="two groups that share a cache tensor write the same block"):
            off.load(1, [2, 3], [5, 5], group_sizes=[1, 1], offsets=[0, 0])
    # Three groups: each pair is compared, not only neighbours in some order.
    with KVCacheOffloader(make_caches("per_layer", 8, torch.float16, layers=3), 16, 16, 4,
                          groups=[[0, 1], [1], [2]]) as off:  # fmt: skip
        with pytest.raises(ValueError, match="two groups that share a cache tensor write the same block"):
            off.load(1, [0, 1, 2], [5, 5, 6], group_sizes=[1, 1, 1], offsets=[0, 0, 0])
    for groups, match in [
        ([[0], [2]], r"groups\[1\] names cache tensor 2; valid indices are 0..1"),
        ([[0, 0]], r"groups\[0\] names a cache tensor twice"),
        ([[]], r"groups\[0\] is empty"),
        ([], "at least one KV-cache group"),
    ]:
        with pytest.raises(ValueError, match=match):
            KVCacheOffloader(caches, 16, 16, 4, groups=groups)


def test_an_expedited_load_does_not_queue_behind_ordinary_loads(offloader):
    gate = threading.Event()
    real_copy = offloader._copy

    def copy(job):
        if job.job_id == 1:
            gate.wait()
        real_copy(job)

    offloader._copy = copy
    try:
        offloader.load(1, [0], [0, 1])  # ordinary lane, stuck
        offloader.load(2, [1], [2, 3], expedited=True)
        waiter = threading.Thread(target=offloader.wait, args=({2},))
        waiter.start()
        waiter.join(30)  # returns although job 1 is stuck
        assert not waiter.is_alive(), "the expedited load queued behind the stuck load"
        assert [r.job_id for r in offloader.get_finished()] == [2]
        assert offloader.pending() == [1]
    finally:
        gate.set()
    offloader.wait({1})
    assert [r.job_id for r in offloader.get_finished()] == [1]


def test_get_finished_is_not_held_up_by_a_submission_being_launched(offloader):
    entered, release = threading.Event(), threading.Event()
    lane = offloader._lanes._queues["store"]

    class SlowQueue:
        def put(self, job):
            entered.set()
            release.wait()
            lane.put(job)

    offloader._lanes._queues["store"] = SlowQueue()
    try:
        submitter = threading.Thread(target=offloader.store, args=(1, [0, 1], [0]), daemon=True)
        submitter.start()
        deadline = time.monotonic() + 30
        while not entered.wait(0.05):  # a store that fails before queuing ends the wait at once
            assert submitter.is_alive() and time.monotonic() < deadline, (
                "the store never reached its lane's queue"
            )
        poller = threading.Thread(target=offloader.get_finished)
        poller.start()
        poller.join(10)
        launch_was_blocking_get_finished = poller.is_alive()
    finally:
        release.set()  # and the lane's own queue again, for the stop at shutdown
        offloader._lanes._queues["store"] = lane
    submitter.join()
    poller.join()
    assert not launch_was_blocking_get_finished
    offloader.wait({1})
    assert [r.job_id for r in offloader.get_finished()] == [1]


def test_each_lane_reports_in_submission_order_stores_then_loads_then_expedited(offloader):
    gate = threading.Event()
    real_copy = offloader._copy
    offloader._copy = lambda job: (gate.wait(), real_copy(job))
    offloader.load(10, [3], [6, 7], expedited=True)
    offloader.load(11, [2], [4, 5])
    for j in (3, 1, 2):
        offloader.store(j, [2 * (j - 1), 2 * (j - 1) + 1], [j - 1])
    gate.set()
    offloader.wait({10, 11, 1, 2, 3})
    assert [r.job_id for r in offloader.get_finished()] == [3, 1, 2, 11, 10]


@dataclass
class GroupedGPUSpec:
    """vLLM 0.33's GPULoadStoreSpec shape: ids, group_sizes, block_indices."""

    block_ids: np.ndarray
    group_sizes: list
    block_indices: list

    @staticmethod
    def medium() -> str:
        return "GPU"


def test_transfer_async_takes_offsets_from_vllm_block_indices():
    caches = make_caches("per_layer", 16, torch.float16, layers=2)
    with KVCacheOffloader(caches, 16, 64, num_host_blocks=4, groups=[[0], [1]]) as off:
        # Group 0: logical block 7 -> sub-block 3 of host block 2 (the last one);
        # group 1: logical block 4 -> sub-block 0 of host block 1, two blocks.
        spec = GroupedGPUSpec(np.array([5, 9, 10], dtype=np.int32), [1, 2], [7, 4])
        off.transfer_async(1, (spec, CPULoadStoreSpec(np.array([2, 1]))))
        off.wait({1})
        assert torch.equal(off.host_tensors[0][2 * 4 + 3], off.device_tensors[0][5])
        assert torch.equal(off.host_tensors[1][1 * 4 + 0], off.device_tensors[1][9])
        assert torch.equal(off.host_tensors[1][1 * 4 + 1], off.device_tensors[1][10])
        assert off.get_finished()[0].transfer_size == 3 * off.device_tensors[0][0].numel() * 2
        back = GroupedGPUSpec(np.array([0, 1], dtype=np.int32), [0, 2], [0, 5])
        off.transfer_async(2, (CPULoadStoreSpec(np.array([1])), back), expedited=True)
        off.wait({2})
        assert torch.equal(off.device_tensors[1][0], off.host_tensors[1][5])
        assert torch.equal(off.device_tensors[1][1], off.host_tensors[1][6])


def test_typed_device_spec_carries_offsets_and_group_sizes():
    caches = make_caches("per_layer", 8, torch.float16, layers=2)
    with KVCacheOffloader(caches, 16, 32, num_host_blocks=4, groups=[[0], [1]]) as off:
        off.transfer_async(1, (DeviceBlocks([3, 4], group_sizes=[1, 1], offsets=[1, 0]), HostBlocks([2, 3])))
        off.wait({1})
        assert torch.equal(off.host_tensors[0][2 * 2 + 1], off.device_tensors[0][3])
        assert torch.equal(off.host_tensors[1][3 * 2 + 0], off.device_tensors[1][4])
        assert not off.host_tensors[0][2 * 2].any() and not off.host_tensors[1][3 * 2 + 1].any()


def test_strict_load_after_a_failed_store_and_a_good_store_of_the_same_block_is_admitted():
    with KVCacheOffloader({"a": torch.randn(8, 4)}, 1, 1, num_host_blocks=4, strict=True) as off:
        gate, real = gated(off), off._copy
        off._copy = lambda job: (_ for _ in ()).throw(RuntimeError("lost")) if job.job_id == 1 else real(job)
        try:
            off.store(1, [0], [2])  # fails
            off.store(2, [3], [2])  # rewrites host block 2 and succeeds
        finally:
            gate.set()
        off.wait({1, 2})
        assert {r.job_id: r.success for r in off.get_finished()} == {1: False, 2: True}
        off.load(3, [2], [5])
        off.wait({3})
        assert [r.success for r in off.get_finished()] == [True]
        assert torch.equal(off.device_tensors[0][5], off.device_tensors[0][3])


def test_strict_load_of_a_block_whose_only_store_failed_names_the_failed_job():
    with KVCacheOffloader({"a": torch.randn(8, 4)}, 1, 1, num_host_blocks=4, strict=True) as off:
        off._copy = lambda job: (_ for _ in ()).throw(RuntimeError("lost"))
        off.store(1, [0], [2])
        off.wait({1})
        assert [r.success for r in off.get_finished()] == [False]
        with pytest.raises(
            ValueError, match=r"host block 2 .*whose latest store \(job 1\) failed.*store it again"
        ):
            off.load(3, [2], [5])


def test_a_shut_down_offloader_says_what_to_do_instead():
    off = KVCacheOffloader({"a": torch.randn(8, 4)}, 1, 1, num_host_blocks=4)
    off.shutdown()
    with pytest.raises(RuntimeError, match=r"is shut down .*get_finished\(\).*Build a new KVCacheOffloader"):
        off.store(1, [0], [0])
