"""KVSwapCopyBackend, driven exactly as vLLM's SimpleCPUOffloadWorker drives DmaCopyBackend.

vLLM's worker (vllm/v1/simple_kv_offload/worker.py, 0.32 and 0.33) calls
``init(gpu_caches, cpu_caches, device, load_stream, store_stream)`` once, then
per step ``launch_copy(cpu_blocks, gpu_blocks, is_store=False, event_idx=i,
events_list=loads)`` for loads and ``launch_copy(gpu_blocks, cpu_blocks,
is_store=True, event_idx=j, events_list=stores, wait_event=compute_done)``
for stores; it polls each list front to back with ``event.query()`` and
flushes with ``event.synchronize()``. ``VllmWorkerCalls`` below makes those
calls; every result is compared with a plain reference copy.

Runs without vLLM: on the host engine (CPU) and on the CUDA engine over the
fake CUDA runtime (tests/fake_cuda), where streams are queues that land
copies only at a sync.
"""

from __future__ import annotations

import pytest
import torch

import torch_kvswap
from torch_kvswap.integrations.vllm import CopyFailed, HostEvent, KVSwapCopyBackend

# Regions of different widths and dtypes, as vLLM's worker passes them
# ({name: [num_blocks, ...]} views of the KV allocation).
REGIONS = {
    "layers.0": (1024, torch.int8),
    "layers.1": (4096, torch.int8),
    "layers.2.0": (256, torch.float16),
    "layers.2.1": (256, torch.float16),
}
DEVICE_BLOCKS, HOST_BLOCKS = 12, 20


def make_caches(place=lambda t: t, seed=0):
    g = torch.Generator().manual_seed(seed)
    gpu = {
        n: place(torch.randint(-100, 100, (DEVICE_BLOCKS, w), generator=g).to(dt))
        for n, (w, dt) in REGIONS.items()
    }
    cpu = {n: torch.zeros(HOST_BLOCKS, w, dtype=dt) for n, (w, dt) in REGIONS.items()}
    return gpu, cpu


class VllmWorkerCalls:
    """The calls vLLM's SimpleCPUOffloadWorker makes on its copy backend."""

    def __init__(self, backend, gpu, cpu, device, load_stream=None, store_stream=None):
        self.backend = backend
        self.loads: list = []
        self.stores: list = []
        self.load_hwm = self.store_hwm = -1
        backend.init(gpu, cpu, device, load_stream, store_stream)

    def load(self, event_idx, cpu_blocks, gpu_blocks):  # start_load_kv
        self.backend.launch_copy(
            cpu_blocks, gpu_blocks, is_store=False, event_idx=event_idx, events_list=self.loads
        )

    def store(self, event_idx, gpu_blocks, cpu_blocks, compute_done=None):  # wait_for_save
        self.backend.launch_copy(
            gpu_blocks,
            cpu_blocks,
            is_store=True,
            event_idx=event_idx,
            events_list=self.stores,
            wait_event=compute_done,
        )

    def poll(self, is_store):  # _poll_stream_events: front to back, stop at the first unfinished
        events = self.stores if is_store else self.loads
        hwm = self.store_hwm if is_store else self.load_hwm
        while events:
            idx, event = events[0]
            if not event.query():
                break
            hwm = idx
            events.pop(0)
        if is_store:
            self.store_hwm = hwm
        else:
            self.load_hwm = hwm
        return hwm

    def flush(self):  # _flush_and_sync_all (handle_preemptions with need_flush)
        for events, attr in ((self.loads, "load_hwm"), (self.stores, "store_hwm")):
            for idx, event in events:
                event.synchronize()
                setattr(self, attr, idx)
            events.clear()


def reference(src, dst, src_ids, dst_ids):
    out = {n: t.clone() for n, t in dst.items()}
    for n in out:
        out[n][dst_ids] = src[n][src_ids]
    return out


def assert_equal(got, want):
    for n in want:
        assert torch.equal(
            got[n].view(torch.uint8) if got[n].dtype != torch.uint8 else got[n], want[n].view(torch.uint8)
        ), f"region {n} differs"


# -- host engine ---------------------------------------------------------------


def test_stores_and_loads_round_trip_byte_exact_through_the_worker_calls():
    gpu, cpu = make_caches()
    w = VllmWorkerCalls(KVSwapCopyBackend(), gpu, cpu, torch.device("cpu"))
    try:
        want_cpu = reference(gpu, cpu, [3, 0, 11, 7], [19, 0, 5, 6])
        w.store(0, [3, 0, 11, 7], [19, 0, 5, 6])
        w.flush()
        assert w.store_hwm == 0
        assert_equal(cpu, want_cpu)
        saved = {n: t.clone() for n, t in gpu.items()}
        for t in gpu.values():
            t.zero_()
        want_gpu = reference(cpu, gpu, [19, 0, 5, 6], [1, 2, 3, 4])
        w.load(0, [19, 0, 5, 6], [1, 2, 3, 4])
        w.flush()
        assert_equal(gpu, want_gpu)
        for n in gpu:
            assert torch.equal(gpu[n][[1, 2, 3, 4]], saved[n][[3, 0, 11, 7]])
    finally:
        w.backend.shutdown()


def test_every_launch_is_one_swap_blocks_call_over_all_regions(monkeypatch):
    calls = []
    real = torch_kvswap.ops.swap_blocks

    def spy(src, dst, src_ids, dst_ids):
        calls.append((len(src), src_ids.tolist(), dst_ids.tolist()))
        real(src, dst, src_ids, dst_ids)

    monkeypatch.setattr(torch_kvswap.ops, "swap_blocks", spy)
    gpu, cpu = make_caches()
    w = VllmWorkerCalls(KVSwapCopyBackend(), gpu, cpu, torch.device("cpu"))
    try:
        w.store(4, list(range(12)), list(range(8, 20)))
        w.load(9, [8, 9], [0, 1])
        w.flush()
    finally:
        w.backend.shutdown()
    assert sorted(calls) == sorted([(4, list(range(12)), list(range(8, 20))), (4, [8, 9], [0, 1])])


def test_events_are_in_the_list_when_launch_copy_returns_in_launch_order():
    gpu, cpu = make_caches()
    w = VllmWorkerCalls(KVSwapCopyBackend(), gpu, cpu, torch.device("cpu"))
    try:
        for i in range(6):
            w.store(10 + i, [i], [i])
            assert [idx for idx, _ in w.stores] == list(range(10, 11 + i))
            w.load(20 + i, [i], [11])
            assert [idx for idx, _ in w.loads] == list(range(20, 21 + i))
        w.flush()
        assert (w.store_hwm, w.load_hwm) == (15, 25)
        assert_equal(cpu, reference(gpu, make_caches()[1], list(range(6)), list(range(6))))
    finally:
        w.backend.shutdown()


class Gate:
    """A wait_event that records, when it is waited on, whether the copy had landed."""

    def __init__(self, dst, block):
        self.dst, self.block, self.seen = dst, block, []

    def synchronize(self):
        self.seen.append({n: t[self.block].clone() for n, t in self.dst.items()})


def test_a_store_waits_for_its_wait_event_before_it_copies():
    gpu, cpu = make_caches()
    w = VllmWorkerCalls(KVSwapCopyBackend(), gpu, cpu, torch.device("cpu"))
    gate = Gate(cpu, 7)
    try:
        before = {n: t.clone() for n, t in cpu.items()}
        w.store(0, [5], [7], compute_done=gate)
        assert len(gate.seen) == 1
        assert_equal(gate.seen[0], {n: t[7] for n, t in before.items()})  # waited before the copy
        assert w.poll(is_store=True) == 0
        assert_equal(cpu, reference(gpu, before, [5], [7]))
    finally:
        w.backend.shutdown()


def test_a_failed_copy_raises_from_launch_copy_naming_event_blocks_and_cause():
    gpu, cpu = make_caches()
    w = VllmWorkerCalls(KVSwapCopyBackend(), gpu, cpu, torch.device("cpu"))
    try:
        with pytest.raises(
            CopyFailed,
            match=r"^kvswap: store event 3: device blocks \[1, 2\] -> host blocks "
            rf"\[4, {HOST_BLOCKS}\] failed: .*(range|bound)",
        ):
            w.store(3, [1, 2], [4, HOST_BLOCKS])  # host block id == num blocks: out of range
        assert w.stores == []  # no event for a copy that did not happen
        many = list(range(10))
        with pytest.raises(
            CopyFailed,
            match=r"load event 4: host blocks \[0, 1, 2, 3, 4, 5, 6, 7, \.\.\. 10 ids\] "
            r"-> device blocks \[0, 1, 2, 3, 4, 5, 6, 7, \.\.\. 10 ids\]",
        ):
            w.load(4, many, many[:-1] + [DEVICE_BLOCKS])
        # The backend goes on: a later copy lands.
        w.load(5, [0], [0])
        w.flush()
        assert w.load_hwm == 5
    finally:
        w.backend.shutdown()


def test_shutdown_is_idempotent_and_refuses_later_launches():
    gpu, cpu = make_caches()
    backend = KVSwapCopyBackend()
    w = VllmWorkerCalls(backend, gpu, cpu, torch.device("cpu"))
    w.store(0, [0, 1, 2], [0, 1, 2])
    backend.shutdown()
    backend.shutdown()
    assert_equal(cpu, reference(gpu, make_caches()[1], [0, 1, 2], [0, 1, 2]))
    with pytest.raises(RuntimeError, match="load event 5 launched after shutdown"):
        w.load(5, [0], [0])


def test_launch_before_init_and_a_second_init_are_refused():
    backend = KVSwapCopyBackend()
    with pytest.raises(RuntimeError, match="store event 1 launched before init"):
        backend.launch_copy([0], [0], True, 1, [])
    gpu, cpu = make_caches()
    backend.init(gpu, cpu, torch.device("cpu"), None, None)
    try:
        with pytest.raises(RuntimeError, match="already called"):
            backend.init(gpu, cpu, torch.device("cpu"), None, None)
    finally:
        backend.shutdown()


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda g, c: c.pop("layers.1"), r"same regions: \['layers.1'\]"),
        (lambda g, c: c.__setitem__("layers.0", torch.zeros(4, 1024, dtype=torch.uint8)), "same dtype"),
        (lambda g, c: c.__setitem__("layers.0", torch.zeros(4, 512, dtype=torch.int8)), "block size"),
        (lambda g, c: (g.clear(), c.clear()), "empty"),
    ],
)
def test_init_refuses_regions_that_do_not_pair_up(bad, message):
    gpu, cpu = make_caches()
    bad(gpu, cpu)
    with pytest.raises(ValueError, match=message):
        KVSwapCopyBackend().init(gpu, cpu, torch.device("cpu"), None, None)


def test_host_events_are_finished_when_made():
    event = HostEvent()
    assert event.query()
    event.synchronize()


# -- the stream path's order of calls, with stand-in streams over host caches ---------


class RecordingStream:
    """Records what the backend does with a stream; the copy itself runs on
    the host engine (host caches), so this needs no accelerator."""

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append(("enter", self))
        return self

    def __exit__(self, *exc):
        self.log.append(("exit", self))

    def wait_event(self, event):
        self.log.append(("wait", event))

    def record_event(self):
        event = SimpleEvent()
        self.log.append(("record", event))
        return event

    def synchronize(self):
        self.log.append(("synchronize", self))


class SimpleEvent:
    def query(self):
        return True

    def synchronize(self):
        pass


def test_the_stream_path_waits_then_copies_then_records_inside_the_stream(monkeypatch):
    log: list = []
    real = torch_kvswap.ops.swap_blocks
    monkeypatch.setattr(
        torch_kvswap.ops, "swap_blocks", lambda *a: (log.append(("copy", len(a[0]))), real(*a))
    )
    gpu, cpu = make_caches()
    load, store = RecordingStream(log), RecordingStream(log)
    # A device that is not the host selects the stream path; it is never touched.
    w = VllmWorkerCalls(KVSwapCopyBackend(), gpu, cpu, torch.device("cuda", 0), load, store)
    done = object()
    w.store(3, [1, 2], [0, 5], compute_done=done)
    ((_, event),) = w.stores
    assert log == [("enter", store), ("wait", done), ("copy", 4), ("record", event), ("exit", store)]
    log.clear()
    w.load(4, [0, 5], [7, 8])
    assert [k for k, _ in log] == ["enter", "copy", "record", "exit"] and log[0][1] is load
    assert [i for i, _ in w.loads] == [4]
    assert_equal(gpu, reference(cpu, make_caches()[0], [0, 5], [7, 8]))
    log.clear()
    w.backend.shutdown()
    w.backend.shutdown()
    assert sorted(id(s) for k, s in log) == sorted([id(load), id(store)])  # each synchronized once


# -- CUDA engine on the fake CUDA runtime -----------------------------------------


class FakeCudaStream:
    """What the backend uses of a torch.cuda.Stream (context manager,
    wait_event, record_event, synchronize), over a stream of the fake runtime;
    a CPU build of torch has no CUDA stream class to run it with."""

    def __init__(self, F, log):
        self.F, self.log = F, log
        self.handle = F.create_stream(0, False)

    def __enter__(self):
        self.F.set_stream(0, self.handle)
        return self

    def __exit__(self, *exc):
        self.F.set_stream(0, 0)

    def wait_event(self, event):
        self.log.append(("wait", self.handle, event))

    def record_event(self):
        return FakeCudaEvent(self)

    def synchronize(self):
        assert self.F.synchronize(self.handle) == "cudaSuccess", self.F.violations()


class FakeCudaEvent:
    """A CUDA event's query()/synchronize(): the fake's streams run their queue at a sync."""

    def __init__(self, stream):
        self.stream = stream

    def query(self):
        self.stream.synchronize()
        return True

    def synchronize(self):
        self.stream.synchronize()


@pytest.mark.parametrize("method", ["auto", "dma", "kernel"])
def test_the_dma_copy_backend_call_pattern_on_the_cuda_engine(fake_cuda, monkeypatch, method):
    F = fake_cuda
    log: list = []
    real = torch_kvswap.ops.swap_blocks

    def spy(src, dst, src_ids, dst_ids):
        log.append(("copy", src[0].device.type))
        real(src, dst, src_ids, dst_ids)

    monkeypatch.setattr(torch_kvswap.ops, "swap_blocks", spy)
    torch_kvswap.set_copy_method(method)
    gpu_host, cpu = make_caches(seed=3)
    gpu = {n: F.device_copy(t, 0) for n, t in gpu_host.items()}
    cpu = {n: F.pinned_copy(t) for n, t in cpu.items()}
    load_stream, store_stream = FakeCudaStream(F, log), FakeCudaStream(F, log)
    w = VllmWorkerCalls(KVSwapCopyBackend(), gpu, cpu, torch.device("cuda", 0), load_stream, store_stream)
    compute_done = object()
    try:
        empty = {n: t.clone() for n, t in cpu.items()}
        w.store(0, [2, 9, 4], [17, 3, 0], compute_done=compute_done)
        assert log[0] == ("wait", store_stream.handle, compute_done)  # before the copy
        assert log[1][0] == "copy" and len(log) == 2
        assert [i for i, _ in w.stores] == [0]
        assert_equal(cpu, empty)  # queued on the store stream, not landed
        load_stream.synchronize()
        assert_equal(cpu, empty)  # the load stream has nothing of it
        assert w.poll(is_store=True) == 0
        assert_equal(cpu, reference(gpu_host, empty, [2, 9, 4], [17, 3, 0]))
        w.load(0, [17, 3, 0], [5, 6, 7])
        assert len(log) == 3  # a load waits on nothing
        w.flush()
        got = {n: F.host_view(t) for n, t in gpu.items()}
        assert_equal(got, reference(gpu_host, gpu_host, [2, 9, 4], [5, 6, 7]))
        assert F.violations() == []
    finally:
        w.backend.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        w.store(1, [0], [0])


def test_a_refused_launch_on_the_cuda_engine_raises_naming_the_copy(fake_cuda):
    F = fake_cuda
    gpu_host, cpu = make_caches()
    gpu = {n: F.device_copy(t, 0) for n, t in gpu_host.items()}
    cpu = {n: F.pinned_copy(t) for n, t in cpu.items()}
    streams = FakeCudaStream(F, []), FakeCudaStream(F, [])
    w = VllmWorkerCalls(KVSwapCopyBackend(), gpu, cpu, torch.device("cuda", 0), *streams)
    try:
        with pytest.raises(
            CopyFailed,
            match=rf"load event 8: host blocks \[{HOST_BLOCKS}\] -> "
            r"device blocks \[0\] failed: ",
        ):
            w.load(8, [HOST_BLOCKS], [0])
        assert w.loads == []  # no event for a copy that was not launched
    finally:
        w.backend.shutdown()


# -- the KV regions the simple-offload worker mirrors (vLLM's KVCacheTensor placement) --

from types import SimpleNamespace  # noqa: E402

from torch_kvswap.integrations.vllm.simple_offload import kv_regions  # noqa: E402


def placement(layers, layer_stride, block_stride, offset=0, size=0):
    return SimpleNamespace(
        layers=layers, layer_stride=layer_stride, block_stride=block_stride, offset=offset, size=size
    )


def test_layer_outermost_tensors_give_one_region_per_layer_viewing_the_cache():
    n, page = 6, 512
    caches = {f"l{i}": torch.randint(0, 100, (n, page), dtype=torch.uint8) for i in range(3)}
    config = SimpleNamespace(
        num_blocks=n, kv_cache_tensors=[placement([name], n * page, page) for name in caches]
    )
    regions = kv_regions(caches, config)
    assert list(regions) == ["l0", "l1", "l2"]
    for name, r in regions.items():
        assert r.shape == (n, page) and r.data_ptr() == caches[name].data_ptr()
        assert torch.equal(r.view(torch.uint8), caches[name])


def test_a_layer_with_k_and_v_halves_outermost_gives_two_regions():
    n, half = 5, 256
    kv = torch.randint(0, 100, (2, n, half), dtype=torch.uint8)  # [K|V, blocks, bytes]
    config = SimpleNamespace(num_blocks=n, kv_cache_tensors=[placement(["a"], 2 * n * half, half)])
    regions = kv_regions({"a": kv}, config)
    assert list(regions) == ["a.0", "a.1"]
    assert torch.equal(regions["a.0"].view(torch.uint8), kv[0])
    assert torch.equal(regions["a.1"].view(torch.uint8), kv[1])


def test_layers_sharing_one_allocation_and_overlaid_groups_give_each_region_once():
    n, page = 4, 128
    storage = torch.randint(0, 100, (2 * n * page,), dtype=torch.uint8)
    a, b = storage[: n * page].view(n, page), storage[n * page :].view(n, page)
    caches = {"x0": a, "x1": b, "y0": a, "y1": b}  # two groups overlaying the same two layers
    config = SimpleNamespace(
        num_blocks=n,
        kv_cache_tensors=[placement(["x0", "x1"], n * page, page), placement(["y0", "y1"], n * page, page)],
    )
    regions = kv_regions(caches, config)
    assert list(regions) == ["x0", "x1"]
    assert regions["x1"].data_ptr() == b.data_ptr()


def test_block_outermost_packing_gives_one_region_of_packed_blocks():
    n, page, layers = 4, 64, 3
    packed = torch.randint(0, 100, (n, layers * page), dtype=torch.uint8)
    caches = {f"l{i}": packed for i in range(layers)}
    config = SimpleNamespace(
        num_blocks=n,
        kv_cache_tensors=[
            placement(list(caches), page, layers * page, offset=0),
            placement(list(caches), page, layers * page, offset=page),
        ],
    )  # same blocks, another offset
    regions = kv_regions(caches, config)
    assert list(regions) == ["l0"]
    assert torch.equal(regions["l0"].view(torch.uint8), packed)


def test_a_placement_past_the_storage_is_refused():
    caches = {"a": torch.zeros(4, 100, dtype=torch.uint8)}
    config = SimpleNamespace(num_blocks=4, kv_cache_tensors=[placement(["a"], 4 * 128, 128)])
    with pytest.raises(
        ValueError, match=r"KV cache 'a': \['a'\] place 512 bytes at offset 0, past its 400-byte"
    ):
        kv_regions(caches, config)


def shared_by(layers, size):
    """vLLM 0.27/0.28's KVCacheTensor: no placement of its layers."""
    return SimpleNamespace(size=size, shared_by=layers, offset=0, block_stride=0)


def test_without_placements_k_and_v_outermost_give_two_regions_read_from_the_strides():
    # vLLM 0.27's CPU attention cache: (2, num_blocks, heads, tokens, head_size)
    n = 5
    kv = {f"l{i}": torch.randn(2, n, 2, 16, 8).half() for i in range(2)}
    config = SimpleNamespace(num_blocks=n, kv_cache_tensors=[shared_by([k], 2 * n * 512) for k in kv])
    regions = kv_regions(kv, config)
    assert list(regions) == ["l0.0", "l0.1", "l1.0", "l1.1"]
    for name, t in kv.items():
        for i in range(2):
            r = regions[f"{name}.{i}"]
            assert r.shape == (n, 2 * 16 * 8 * 2) and r.data_ptr() == t[i].data_ptr()
            assert torch.equal(r, t[i].reshape(n, -1).view(torch.int8))


def test_without_placements_blocks_outermost_and_shared_storage_give_one_region_each():
    n = 4
    packed = torch.randint(0, 100, (n, 3, 64), dtype=torch.uint8)  # every layer's page in a block
    mamba = [torch.zeros(n, 32, dtype=torch.uint8)]
    mamba.append(mamba[0][:, :16])  # a list of tensors on one storage: its first one counts
    caches = {"a": packed, "b": packed, "m": mamba}
    config = SimpleNamespace(
        num_blocks=n, kv_cache_tensors=[shared_by(["a", "b"], packed.numel()), shared_by(["m"], 128)]
    )
    regions = kv_regions(caches, config)
    assert list(regions) == ["a", "m"]
    assert torch.equal(regions["a"].view(torch.uint8), packed.reshape(n, -1))
    assert regions["m"].shape == (n, 32) and regions["m"].data_ptr() == mamba[0].data_ptr()


def test_without_placements_a_storage_smaller_than_the_blocks_is_refused():
    config = SimpleNamespace(num_blocks=8, kv_cache_tensors=[shared_by(["a"], 4)])
    with pytest.raises(
        ValueError, match=r"KV cache 'a': its 4-byte storage holds less than one byte per block of 8"
    ):
        kv_regions({"a": torch.zeros(4, dtype=torch.uint8)}, config)


def test_the_backend_bench_checks_every_method_byte_exact_and_reports_ratios(tmp_path, capsys):
    import json

    from torch_kvswap.bench import vllm_backend as bench_vllm_backend

    out = tmp_path / "b.json"
    assert (
        bench_vllm_backend.main(
            ["--block-kib", "4", "1", "--layers", "3", "--blocks", "5", "--repeats", "2", "--json", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["block_kib"], r["layers"], r["blocks"]) for r in rows] == [(4, 3, 5), (1, 3, 5)]
    for r in rows:
        assert set(r["seconds"]) == {"kvswap", "loop", "pointers", "memcpy"}
        assert r["loop_over_kvswap"] == r["seconds"]["loop"] / r["seconds"]["kvswap"]
    assert "loop/kvswap" in capsys.readouterr().out


def test_the_bench_loop_and_pointer_patterns_copy_like_the_reference():
    from torch_kvswap.bench.vllm_backend import PointerCopy, loop_copy

    gpu, _ = make_caches()
    gpu = {n: t.view(torch.int8).view(DEVICE_BLOCKS, -1) for n, t in gpu.items()}
    want = reference(
        gpu,
        {n: torch.zeros(HOST_BLOCKS, t.shape[1], dtype=torch.int8) for n, t in gpu.items()},
        [0, 3, 11],
        [19, 2, 4],
    )
    for run in ("loop", "pointers"):
        host = {n: torch.zeros(HOST_BLOCKS, t.shape[1], dtype=torch.int8) for n, t in gpu.items()}
        if run == "loop":
            loop_copy(gpu, host, [0, 3, 11], [19, 2, 4])
        else:
            p = PointerCopy(gpu, host)
            p.launch([0, 3, 11], [19, 2, 4]).result()
            p.close()
        assert_equal(host, want)


def test_the_bench_pointer_pattern_raises_a_failed_copy_to_its_waiter():
    from torch_kvswap.bench.vllm_backend import PointerCopy

    p = PointerCopy({"a": torch.zeros(4, 8, dtype=torch.int8)}, {"a": torch.zeros(4, 8, dtype=torch.int8)})
    try:
        with pytest.raises(OverflowError):
            p.launch([0], [-1 << 40]).result(timeout=60)  # a block id the copy cannot address
        p.launch([1], [2]).result(timeout=60)  # the copy thread is still there
    finally:
        p.close()
