"""Host memory for the mirrors (torch_kvswap/offloader/host_memory.py, numa.py):
exact sizes, pre-faulting, chunked background registration and NUMA
placement, with the engine's registration call and the NUMA binding replaced
by recording stand-ins (this machine has no accelerator and one node)."""

from __future__ import annotations

import ctypes
import errno
import platform
import threading
import time

import pytest
import torch

from helpers import Signalled, signal_taken_by_another_thread
from torch_kvswap import KVCacheOffloader
from torch_kvswap.offloader import caches, host_memory, numa
from torch_kvswap.offloader.host_memory import PAGE, HostMemory

DEV = torch.device("privateuseone", 0)  # never touched: registration is the stand-in's
_libc = ctypes.CDLL(None, use_errno=True)


def resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t`` (page-aligned) in memory now, as mincore(2) reports."""
    pages = -(-t.numel() // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), vec) == 0
    return sum(v & 1 for v in vec)


class Runtime:
    """A stand-in for the engine's page-locking: records each call, refuses
    where told, and can hold a chunk until released."""

    def __init__(
        self, fail_at: int | None = None, error: str = "cudaErrorMemoryAllocation", hold: int | None = None
    ):
        self.calls: list[tuple[int, int, bool]] = []
        self.fail_at, self.error, self.hold = fail_at, error, hold
        self.held, self.go = threading.Event(), threading.Event()

    def __call__(self, buffer, device, pin):
        span = (buffer.data_ptr(), buffer.numel(), pin)
        if pin and len([c for c in self.calls if c[2]]) == self.fail_at:
            raise RuntimeError(self.error)
        if pin and len([c for c in self.calls if c[2]]) == self.hold:
            self.held.set()
            assert self.go.wait(10)
        self.calls.append(span)


@pytest.fixture
def runtime(monkeypatch):
    def install(**kw):
        r = Runtime(**kw)
        monkeypatch.setattr(host_memory, "register", r)
        return r

    return install


def relative(calls, base):
    return [(p - base, n, pin) for p, n, pin in calls]


@pytest.mark.parametrize("nbytes", [1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE + 17, 3 << 20])
def test_a_buffer_is_its_size_rounded_to_a_page_never_to_a_power_of_two(nbytes):
    memory = HostMemory(nbytes, torch.device("cpu"), False)
    assert memory.buffer.numel() == nbytes
    assert memory.buffer._base.numel() == -(-nbytes // PAGE) * PAGE
    assert memory.buffer.data_ptr() % PAGE == 0 and not memory.buffer.any()


def pages_mapped(address: int, pages: int) -> int:
    """How many of the ``pages`` pages from ``address`` this process has
    mapped: mincore(2) fails with ENOMEM on a page no mapping covers. (The
    start lines of /proc/self/maps cannot say it: the kernel merges a new
    anonymous mapping with an adjacent one of the same protection, so the
    buffer need not start a line.)"""
    vec = (ctypes.c_ubyte * 1)()
    mapped = 0
    for page in range(pages):
        if _libc.mincore(ctypes.c_void_p(address + page * PAGE), ctypes.c_size_t(PAGE), vec) == 0:
            mapped += 1
        else:
            assert ctypes.get_errno() == errno.ENOMEM
    return mapped


def test_the_mapping_is_unmapped_when_the_memory_is_dropped_without_a_collection():
    memory = HostMemory(3 * PAGE, torch.device("cpu"), False)
    address = memory.buffer.data_ptr()
    assert pages_mapped(address, 3) == 3
    del memory  # no reference cycle keeps it: gc is not needed
    assert pages_mapped(address, 3) == 0


def test_the_offloaders_mirrors_take_exactly_their_page_rounded_bytes():
    caches_ = {"a": torch.zeros(4, 3, 100, dtype=torch.float16), "b": torch.zeros(4, 7)}
    off = KVCacheOffloader(caches_, 1, 2, num_host_blocks=3)
    try:
        rows = 3 * 2
        want = -(-rows * 600 // PAGE) * PAGE + -(-rows * 28 // PAGE) * PAGE
        assert off.host_bytes == want == off.buffer.numel()
    finally:
        off.shutdown()


@pytest.mark.parametrize("method", ["madvise", "touch"])
def test_prefault_makes_every_page_resident_and_keeps_the_bytes_zero(method, monkeypatch):
    if method == "madvise" and tuple(int(x) for x in platform.release().split(".")[:2]) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    if method == "touch":
        monkeypatch.setattr(host_memory, "_populate", lambda address, length: False)
    buffer = host_memory.map_exact(37 * PAGE)
    assert resident_pages(buffer) == 0
    assert host_memory.prefault(buffer, threads=4) == method
    assert resident_pages(buffer) == 37 and not buffer.any()


def _slowed(fn, seconds=0.05):
    def slow(*args):
        time.sleep(seconds)
        return fn(*args)

    return slow


@pytest.mark.parametrize("slow,chosen", [("_populate", "touch"), ("_touch", "madvise")])
def test_auto_prefault_measures_both_methods_and_faults_the_rest_in_with_the_faster(
    slow, chosen, monkeypatch
):
    if tuple(int(x) for x in platform.release().split(".")[:2]) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    monkeypatch.setattr(host_memory, "PROBE_BYTES", 4 * PAGE)
    monkeypatch.setattr(host_memory, slow, _slowed(getattr(host_memory, slow)))
    buffer = host_memory.map_exact(4 * 4 * PAGE + 3 * PAGE)  # four probes and a tail
    assert host_memory.prefault(buffer, threads=2) == chosen
    assert resident_pages(buffer) == 19 and not buffer.any()


@pytest.mark.parametrize("pages", [4 * 4 - 1, 4 * 4])
def test_auto_prefault_measures_only_a_buffer_of_at_least_four_probes(pages, monkeypatch):
    if tuple(int(x) for x in platform.release().split(".")[:2]) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    monkeypatch.setattr(host_memory, "PROBE_BYTES", 4 * PAGE)
    monkeypatch.setattr(host_memory, "_populate", _slowed(host_memory._populate))
    buffer = host_memory.map_exact(pages * PAGE)
    assert host_memory.prefault(buffer, threads=2) == ("madvise" if pages < 16 else "touch")
    assert resident_pages(buffer) == pages and not buffer.any()


def test_auto_prefault_touches_where_the_kernel_refuses_populate(monkeypatch):
    monkeypatch.setattr(host_memory, "PROBE_BYTES", 4 * PAGE)
    monkeypatch.setattr(host_memory, "_populate", lambda address, length: False)
    buffer = host_memory.map_exact(17 * PAGE)
    assert host_memory.prefault(buffer, threads=2) == "touch"
    assert resident_pages(buffer) == 17 and not buffer.any()


def test_prefault_names_an_unknown_method():
    with pytest.raises(ValueError, match="method must be 'auto', 'madvise' or 'touch', not 'fast'"):
        host_memory.prefault(host_memory.map_exact(PAGE), threads=1, method="fast")


@pytest.mark.parametrize(
    "nbytes,spans",
    [
        (4 * PAGE - 1, [(0, 4 * PAGE - 1)]),
        (4 * PAGE, [(0, 4 * PAGE)]),
        (4 * PAGE + 1, [(0, 4 * PAGE), (4 * PAGE, 4 * PAGE + 1)]),
        (9 * PAGE, [(0, 4 * PAGE), (4 * PAGE, 8 * PAGE), (8 * PAGE, 9 * PAGE)]),
    ],
)
def test_registration_goes_in_chunks_of_at_most_chunk_bytes(runtime, nbytes, spans):
    r = runtime()
    memory = HostMemory(nbytes, DEV, True, chunk_bytes=4 * PAGE)
    memory.wait()
    base = memory.buffer.data_ptr()
    assert relative(r.calls, base) == [(a, b - a, True) for a, b in spans]
    memory.release()
    assert relative(r.calls[len(spans) :], base) == [(a, b - a, False) for a, b in reversed(spans)]


@pytest.mark.parametrize("bad", [0, PAGE - 1, PAGE + 1, -PAGE, True, 4096.0])
def test_chunk_bytes_must_be_a_positive_multiple_of_a_page(bad):
    with pytest.raises(ValueError, match="register_chunk_bytes must be a positive multiple of 4096"):
        HostMemory(PAGE, DEV, True, chunk_bytes=bad)


def test_a_refused_chunk_undoes_the_chunks_before_it_and_is_named(runtime):
    r = runtime(fail_at=2)
    memory = HostMemory(5 * PAGE, DEV, True, chunk_bytes=PAGE)
    with pytest.raises(
        RuntimeError,
        match=r"20480-byte host mirrors .* chunk 2 of 5 "
        r"\(bytes 8192\.\.12288\) was refused \(cudaErrorMemoryAllocation\); "
        r"the chunks before it were unregistered.*power of two",
    ):
        memory.wait()
    base = memory.buffer.data_ptr()
    assert relative(r.calls, base) == [
        (0, PAGE, True),
        (PAGE, PAGE, True),
        (PAGE, PAGE, False),
        (0, PAGE, False),
    ]
    assert memory.registered == []


def test_a_chunk_that_may_still_be_registered_keeps_its_buffer_for_good(runtime):
    runtime(fail_at=0, error="the range may still be registered with CANN")
    kept = len(host_memory.STILL_REGISTERED)
    memory = HostMemory(PAGE, DEV, True)
    with pytest.raises(RuntimeError, match="may still be registered"):
        memory.wait()
    assert host_memory.STILL_REGISTERED[kept:] == [memory.buffer]


def test_pinned_host_buffer_refuses_rather_than_round_when_pinning_is_refused(runtime):
    runtime(fail_at=0, error="aclrtHostRegisterV2 is not available")
    with pytest.raises(RuntimeError, match=r"cannot page-lock the 12345-byte host mirrors in place"):
        caches.pinned_host_buffer(12345, DEV, pin=True)


def test_construction_returns_before_registration_ends_and_a_wait_blocks_until_it_does(runtime):
    r = runtime(hold=1)  # chunk 1 of 3 is held
    memory = HostMemory(3 * PAGE, DEV, True, chunk_bytes=PAGE)
    assert r.held.wait(10)
    assert memory.register_seconds is None and not memory.settled  # still registering
    waiter = threading.Thread(target=memory.wait)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # chunks 1 and 2 are not registered yet
    r.go.set()
    waiter.join(10)
    assert not waiter.is_alive()
    memory.wait()
    assert memory.register_seconds is not None
    assert memory.waited_seconds > 0
    memory.release()


def test_a_signal_another_thread_took_interrupts_the_wait_for_registration(runtime):
    """Ctrl-C during the first job's wait for registration (offloader/waits.py)."""
    r = runtime(hold=1)
    memory = HostMemory(3 * PAGE, DEV, True, chunk_bytes=PAGE)
    assert r.held.wait(10)
    with pytest.raises(Signalled), signal_taken_by_another_thread():
        memory.wait()
    assert not memory.settled  # chunk 1 was still held when the handler ran
    r.go.set()
    memory.wait()
    memory.release()


def test_release_during_registration_stops_and_undoes_what_was_registered(runtime):
    r = runtime(hold=1)
    memory = HostMemory(3 * PAGE, DEV, True, chunk_bytes=PAGE)
    assert r.held.wait(10)
    releaser = threading.Thread(target=memory.release)
    releaser.start()
    r.go.set()
    releaser.join(10)
    base = memory.buffer.data_ptr()
    assert relative(r.calls, base) == [
        (0, PAGE, True),
        (PAGE, PAGE, True),
        (PAGE, PAGE, False),
        (0, PAGE, False),
    ]


# --- NUMA -------------------------------------------------------------------------


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    """A sysfs tree of two nodes and three PCI functions."""

    def node(bus, value):
        d = tmp_path / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{value}\n")

    node("0000:1b:00.0", 0)
    node("0000:9c:00.0", 1)
    node("0000:aa:00.0", -1)
    (tmp_path / "devices" / "system" / "node").mkdir(parents=True)
    (tmp_path / "devices" / "system" / "node" / "has_memory").write_text("0-1\n")
    monkeypatch.setenv("KVSWAP_SYSFS_ROOT", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "bus,want",
    [("0000:1b:00.0", 0), ("0000:9C:00.0", 1), ("0000:aa:00.0", None), ("0000:ff:00.0", None), (None, None)],
)
def test_a_devices_node_is_its_pci_functions_numa_node(sysfs, bus, want):
    assert numa.node_of(bus) == want


@pytest.mark.parametrize("text,want", [("0\n", 1), ("0-1\n", 2), ("0-1,3\n", 3), ("0,2-5\n", 5)])
def test_node_count_reads_the_nodes_with_memory(tmp_path, text, want):
    (tmp_path / "devices" / "system" / "node").mkdir(parents=True)
    (tmp_path / "devices" / "system" / "node" / "has_memory").write_text(text)
    assert numa.node_count(tmp_path) == want


def bus_of(mapping):
    return lambda device: mapping.get(device.index)


def test_the_default_node_is_the_devices_own(sysfs):
    ids = bus_of({0: "0000:1b:00.0", 1: "0000:9c:00.0"})
    assert numa.choose_node(torch.device("cuda", 0), None, ids) == 0
    assert numa.choose_node(torch.device("cuda", 1), None, ids) == 1
    assert numa.choose_node(torch.device("cuda", 2), None, ids) is None


def test_an_int_overrides_the_node_and_false_turns_binding_off(sysfs):
    ids = bus_of({1: "0000:9c:00.0"})
    assert numa.choose_node(torch.device("cuda", 1), 0, ids) == 0
    assert numa.choose_node(torch.device("cuda", 1), False, ids) is None


@pytest.mark.parametrize("bad", [-1, 1.0, "0", True])
def test_a_bad_numa_node_is_refused(bad):
    with pytest.raises(ValueError, match="numa_node must be a node number >= 0, False"):
        numa.choose_node(torch.device("cuda", 0), bad)


def test_nothing_is_bound_on_a_one_node_machine(sysfs):
    (sysfs / "devices" / "system" / "node" / "has_memory").write_text("0\n")
    assert numa.choose_node(torch.device("cuda", 1), None, bus_of({1: "0000:9c:00.0"})) is None


def test_the_memory_is_bound_before_its_first_touch():
    seen = []

    def bind(address, length, node):
        seen.append((address % PAGE, length, node, resident_pages(memory_view(address, length))))

    memory = HostMemory(10 * PAGE + 1, torch.device("cpu"), False, numa_node=1, bind=bind)
    assert seen == [(0, 11 * PAGE, 1, 0)]  # the whole mapping, none of it touched yet
    assert memory.numa_node == 1 and resident_pages(memory.buffer._base) == 11


def memory_view(address, length):
    class View:
        def numel(self):
            return length

        def data_ptr(self):
            return address

    return View()


def test_mbind_to_node_0_succeeds_here_and_refuses_a_bad_node():
    buffer = host_memory.map_exact(4 * PAGE)
    numa.mbind(buffer.data_ptr(), buffer.numel(), 0)
    with pytest.raises(ValueError, match="numa_node must be in 0..1023"):
        numa.mbind(buffer.data_ptr(), buffer.numel(), 1024)


# --- the benchmark ------------------------------------------------------------------


def test_the_host_memory_bench_reports_ratios_of_medians_against_zeros(monkeypatch):
    from torch_kvswap.bench import host_memory as bench

    # a warm-up round, then three counted ones; each contestant goes first in every other round
    order = []
    times = iter([9.0, 9.0, 0.4, 0.2, 0.1, 0.3, 0.5, 0.1])

    def timed(fn):
        order.append("zeros" if "zeros" in fn.__code__.co_names else "ready")
        return next(times), fn()

    settled = []
    monkeypatch.setattr(bench, "timed", timed)
    monkeypatch.setattr(bench, "settle", settled.append)
    rows = bench.ready_rows([1 / 1024], 3, torch.device("cpu"), warmup=1)
    assert order == ["zeros", "ready", "ready", "zeros", "zeros", "ready", "ready", "zeros"]
    assert settled == [1 << 20] * 8  # every timed allocation starts from the same state
    # counted: ready 0.4, zeros 0.2; zeros 0.1, ready 0.3; ready 0.5, zeros 0.1
    assert rows == [
        {
            "gib": 1 / 1024,
            "zeros_s": 0.1,
            "ready_s": 0.4,
            "ratio": 4.0,
            "zeros_all_s": [0.2, 0.1, 0.1],
            "ready_all_s": [0.4, 0.3, 0.5],
        }
    ]


def test_the_host_memory_bench_refuses_a_negative_warmup():
    from torch_kvswap.bench import host_memory as bench

    with pytest.raises(SystemExit, match="--warmup must be >= 0"):
        bench.main(["--warmup", "-1"])


def test_the_host_memory_bench_runs_from_the_command_line(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "hm.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_kvswap.bench",
            "host-memory",
            "--gib",
            "0.001",
            "--repeats",
            "1",
            "--tensors",
            "2",
            "--host-blocks",
            "8",
            "--json",
            str(out),
        ],
        check=True,
        timeout=120,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert [r["gib"] for r in result["ready"]] == [0.001]
    assert [(r["tensors"], r["host_blocks"]) for r in result["construction"]] == [(2, 256), (8, 8)]
