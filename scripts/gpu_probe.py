"""GPU probes of the CUDA engine, run by scripts/gpu_check.sh; its backends serve gpu_bench.py.

    python scripts/gpu_probe.py OUT.json [--fake]   # capture + replay on every path

Each result is written to the JSON file as soon as it exists, so a timeout
keeps what was measured before it. Every probe checks every block it claims
to have copied and every block it claims to have left alone; a probe that
cannot check what it reports says so (``ok`` false, ``error`` why).

``--fake`` runs the same logic on a CPU build of torch against the fake CUDA
runtime (``torch_kvswap._fake_cuda``): the dry run of gpu_check.sh, so that
the kit's first run on a GPU is not the first run of its code. Timings there
mean nothing; the checks do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
import traceback

import torch

import torch_kvswap


class Results:
    def __init__(self, path: str, backend):
        self.path = path
        self.data: dict = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": backend.name(),
            "backend": backend.kind,
            "results": [],
        }
        self.flush()

    def add(self, flush=True, **entry):
        self.data["results"].append(entry)
        if flush:
            self.flush()
        print(json.dumps(entry), flush=True)

    def flush(self):
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1)


# --- backends: a GPU, or the fake runtime on the host ------------------------------------


class CudaBackend:
    kind = "cuda"
    device = torch.device("cuda", 0)

    def name(self):
        return torch.cuda.get_device_name(0)

    def device_tensor(self, t):
        return t.to(self.device)

    def pinned_tensor(self, t):
        return t.pin_memory()

    def ids(self, values, where):
        t = torch.tensor(values, dtype=torch.int64)
        return t.to(self.device) if where == "device" else t

    def read(self, t):
        return t.cpu() if t.is_cuda else t.clone()

    def write_ids(self, t, values):
        t.copy_(torch.tensor(values, dtype=torch.int64))

    def fill(self, t, cpu):
        t.copy_(cpu)

    def synchronize(self):
        torch.cuda.synchronize()

    def new_stream(self):
        return torch.cuda.Stream()

    @contextlib.contextmanager
    def on(self, stream):
        with torch.cuda.stream(stream):
            yield

    def sync_stream(self, stream):
        stream.synchronize()

    @contextlib.contextmanager
    def capture(self):
        """Yields a holder; after the block, holder.replay() replays the captured graph."""
        graph = torch.cuda.CUDAGraph()

        class Holder:
            replay = staticmethod(graph.replay)

        with torch.cuda.graph(graph):
            yield Holder

    def pointer_copy(self, sp, dp, sizes, direction):
        torch_kvswap.swap_blocks_batch(sp, dp, sizes, direction)

    def bench_stream(self):
        return torch.cuda.Stream()

    def times(self, fn, stream, reps):
        """Seconds of each of `reps` runs of fn on `stream` (the current one), after a warm-up."""
        fn()
        stream.synchronize()
        secs = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            secs.append(start.elapsed_time(end) * 1e-3)
        return secs


class FakeBackend(CudaBackend):
    """The fake CUDA runtime (tests/fake_cuda): "CUDA" tensors are host memory that the
    fake registers as device memory; streams are queues that run at a sync."""

    kind = "fake"

    def __init__(self):
        import torch_kvswap._fake_cuda  # noqa: F401 - registers torch.ops.kvswap_fake_cuda

        torch.set_num_threads(1)  # a shared CI machine: torch's CPU thread pool only waits there
        self.F = torch.ops.kvswap_fake_cuda
        self.F.install()
        self.F.reset(2)
        self.stream = self.new_stream()
        self.F.set_stream(0, self.stream)

    def name(self):
        return "fake CUDA runtime (tests/fake_cuda)"

    def device_tensor(self, t):
        return self.F.device_copy(t.contiguous(), 0)

    def pinned_tensor(self, t):
        return self.F.pinned_copy(t.contiguous())

    def ids(self, values, where):
        t = torch.tensor(values, dtype=torch.int64)
        return self.device_tensor(t) if where == "device" else t

    def read(self, t):
        return self.F.host_view(t).clone() if t.device.type == "cuda" else t.clone()

    def write_ids(self, t, values):
        self.fill(t, torch.tensor(values, dtype=torch.int64))

    def fill(self, t, cpu):
        (self.F.host_view(t) if t.device.type == "cuda" else t).copy_(cpu)

    def synchronize(self):
        for s in (self.stream, 0):
            err = self.F.synchronize(s)
            if err != "cudaSuccess":
                raise RuntimeError(f"fake cudaStreamSynchronize: {err}")

    def new_stream(self):
        return self.F.create_stream(0, False)

    @contextlib.contextmanager
    def on(self, stream):
        self.F.set_stream(0, stream)
        try:
            yield
        finally:
            self.F.set_stream(0, self.stream)

    def sync_stream(self, stream):
        err = self.F.synchronize(stream)
        if err != "cudaSuccess":
            raise RuntimeError(f"fake cudaStreamSynchronize: {err}")

    @contextlib.contextmanager
    def capture(self):
        F, stream = self.F, self.stream

        class Holder:
            exec = None

            @staticmethod
            def replay():
                err = F.launch_graph(Holder.exec, stream)
                if err != "cudaSuccess":
                    raise RuntimeError(f"fake cudaGraphLaunch: {err}")

        err = F.begin_capture(stream, 0)
        if err != "cudaSuccess":
            raise RuntimeError(f"fake cudaStreamBeginCapture: {err}")
        try:
            yield Holder
        finally:
            err, graph = F.end_capture(stream)
            if err != "cudaSuccess":
                raise RuntimeError(f"fake cudaStreamEndCapture: {err}")
            Holder.exec = F.instantiate(graph)

    def pointer_copy(self, sp, dp, sizes, direction):
        # The pointer op takes its device from torch's current accelerator, which a CPU
        # build of torch does not have: the engine call it makes, through the test extension.
        total = int(sizes.sum())
        torch.ops.kvswap_test.submit("cuda", sp, dp, sizes, int(direction), total, torch.device("cuda", 0))

    def bench_stream(self):
        return self.stream  # the stream capture() captures on

    def times(self, fn, stream, reps):
        fn()
        self.sync_stream(stream)
        secs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.sync_stream(stream)
            secs.append(time.perf_counter() - t0)
        return secs


def random_blocks(blocks, block_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (blocks, block_bytes), generator=g, dtype=torch.uint8)


# --- probes -------------------------------------------------------------------------


def check_rows(got, before, source, want_d, want_s):
    """Rows want_d of `got` equal rows want_s of `source`; every other row equals `before`."""
    expect = before.clone()
    expect[want_d] = source[want_s]
    bad = [r for r in range(got.shape[0]) if not torch.equal(got[r], expect[r])]
    return not bad, (f"rows differing from the reference: {bad}" if bad else None)


def probe_capture(B, method: str, id_place: str, block_bytes: int):
    """Capture one swap_blocks, change the ids, replay: host ids copy the blocks of capture
    time, device ids the blocks they name at replay."""
    torch_kvswap.set_copy_method(method)
    src_cpu, dst_cpu = random_blocks(8, block_bytes, 1), random_blocks(8, block_bytes, 2)
    src, dst = B.device_tensor(src_cpu), B.pinned_tensor(dst_cpu)
    sid, did = B.ids([2, 3], id_place), B.ids([0, 1], id_place)
    B.synchronize()
    with B.capture() as graph:
        torch_kvswap.swap_blocks([src], [dst], sid, did)
    B.write_ids(sid, [6, 7])
    B.write_ids(did, [4, 5])
    graph.replay()
    B.synchronize()
    want_s, want_d = ([2, 3], [0, 1]) if id_place == "host" else ([6, 7], [4, 5])
    return check_rows(B.read(dst), dst_cpu, src_cpu, want_d, want_s)


def probe_pointer_op(B):
    """The pointer op captured on a side stream and replayed: one D2H block."""
    src_cpu, dst_cpu = random_blocks(8, 4096, 3), random_blocks(8, 4096, 4)
    src, dst = B.device_tensor(src_cpu), B.pinned_tensor(dst_cpu)
    sp = torch.tensor([src.data_ptr() + 2 * 4096])
    dp = torch.tensor([dst.data_ptr() + 5 * 4096])
    B.synchronize()
    with B.capture() as graph:
        B.pointer_copy(sp, dp, torch.tensor([4096]), torch_kvswap.Direction.DEVICE_TO_HOST)
    sp.fill_(0)  # the graph holds the addresses of capture time
    graph.replay()
    B.synchronize()
    return check_rows(B.read(dst), dst_cpu, src_cpu, [5], [2])


class CudagraphWatch:
    """Whether torch.compile(mode="reduce-overhead") recorded a CUDA graph, and if not, why:
    inductor logs each skip ("skipping cudagraphs due to ...") on its cudagraphs artifact
    logger and counts it in counters["inductor"]["cudagraph_skips"]."""

    LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"

    def __enter__(self):
        from torch._dynamo.utils import counters

        self.counters = counters
        self.skips_before = counters["inductor"]["cudagraph_skips"]
        self.reasons: list[str] = []
        watch = self

        class Handler(logging.Handler):
            def emit(self, record):
                watch.reasons.append(record.getMessage())

        self.handler = Handler(logging.DEBUG)
        self.logger = logging.getLogger(self.LOGGER)
        self.level = self.logger.level
        self.logger.setLevel(logging.DEBUG)  # the artifact is off by default
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        return False

    def report(self, device_index=0):
        skips = self.counters["inductor"]["cudagraph_skips"] - self.skips_before
        recorded = None
        try:
            from torch._inductor import cudagraph_trees

            manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
            recorded = bool(manager is not None and any(manager.roots.values()))
        except Exception as exc:  # noqa: BLE001 - reported
            self.reasons.append(f"cannot inspect cudagraph trees: {type(exc).__name__}: {exc}")
        if recorded is None:
            recorded = skips == 0 and not self.reasons
        # Inductor logs a skip's reason only when the graph has a CUDA device; without
        # one it counts the skip and says nothing.
        why = "; ".join(dict.fromkeys(self.reasons)) or (
            None if recorded else f"{skips} cudagraph skip(s), no reason logged (no CUDA device in the graph)"
        )
        return {"graph_recorded": recorded, "cudagraph_skips": skips, "why_not": None if recorded else why}


def probe_reduce_overhead(B, id_place: str, block_bytes: int):
    """A store under torch.compile(mode="reduce-overhead"): correct on every call, and the
    report says whether inductor recorded a CUDA graph and, if not, why (with host caches
    among the graph's inputs inductor is expected to skip: cpu device / mutated inputs)."""
    torch._dynamo.reset()
    torch_kvswap.set_copy_method("auto")
    dev_cpu, host_cpu = random_blocks(8, block_bytes, 5), random_blocks(8, block_bytes, 6)
    if B.kind == "fake":  # inductor cannot compile for fake device memory: host caches only
        dev, host = dev_cpu.clone(), host_cpu.clone()
        id_place = "host"
    else:
        dev, host = B.device_tensor(dev_cpu), B.pinned_tensor(host_cpu)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def store(d, h, sid, did):
        torch_kvswap.swap_blocks([d], [h], sid, did)

    ok, errors = True, []
    expect = host_cpu.clone()
    with CudagraphWatch() as watch:
        for step in range(4):  # warm-up, record, replays
            sid, did = B.ids([step, step + 1], id_place), B.ids([7 - step, 3], id_place)
            store(dev, host, sid, did)
            B.synchronize()
            expect[[7 - step, 3]] = dev_cpu[[step, step + 1]]
            good, error = check_rows(B.read(host), expect, expect, [], [])
            ok = ok and good
            if error:
                errors.append(f"call {step}: {error}")
    return ok, "; ".join(errors) or None, watch.report()


def probe(path: str, B) -> int:
    out = Results(path, B)
    failures = 0
    blocks = (2048, 65536)
    cases = [
        ("capture", m, p, bb) for m in ("auto", "dma", "kernel") for p in ("host", "device") for bb in blocks
    ]
    cases += [("pointer_op",)]
    cases += (
        [("reduce_overhead", p, bb) for p in ("host", "device") for bb in blocks]
        if B.kind == "cuda"
        else [("reduce_overhead", "host", 2048)]
    )
    for case in cases:
        t0 = time.perf_counter()
        extra = {}
        try:
            if case[0] == "capture":
                ok, error = probe_capture(B, *case[1:])
            elif case[0] == "pointer_op":
                ok, error = probe_pointer_op(B)
            else:
                ok, error, extra = probe_reduce_overhead(B, *case[1:])
        except Exception as exc:  # noqa: BLE001 - recorded
            ok, error = False, f"{type(exc).__name__}: {exc}"[:2000]
            # dma + device ids under capture: refused before any CUDA call, as documented.
            if case[:2] == ("capture", "dma") and case[2] == "device" and "illegal while" in str(exc):
                ok, error = True, "refused as documented: " + error.splitlines()[0]
        failures += not ok
        out.add(case=list(case), ok=ok, error=error, seconds=round(time.perf_counter() - t0, 3), **extra)
    torch_kvswap.set_copy_method("auto")
    return 1 if failures else 0


def main(argv):
    backend = FakeBackend() if "--fake" in argv[2:] else CudaBackend()
    return probe(argv[1], backend)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
