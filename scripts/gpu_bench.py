"""Benchmark of the CUDA engine's copy paths, run by scripts/gpu_check.sh.

    python scripts/gpu_bench.py OUT.json [--fake]

For host-to-device and device-to-host, every block size of gpu_report.BLOCK_KIB
(2 KiB to 1 MiB) at 256 and 4,096 descriptors, and device-to-device at 16 KiB,
it times on one non-default stream, in the same run and on the same buffers:

- ``contiguous``: one copy of all the row's bytes (torch's ``copy_``), the limit;
- ``batch_dma``: ``swap_blocks`` with ``set_copy_method("dma")``, one
  ``cudaMemcpyBatchAsync`` per call;
- ``kernel``: ``set_copy_method("kernel")``, host ids in the kernel's parameters;
- ``per_copy``: ``set_copy_method("dma")`` captured into a CUDA graph (the
  engine copies per descriptor under capture: one memcpy node each), replayed.

Ids are random permutations of the row's blocks on both sides, so descriptors
rarely merge. Each path's destination is zeroed first and every byte of it is
checked against the source afterwards (``ok``). A row holds at most
``row_bytes_cap`` bytes (1 GiB on a GPU): 4,096 descriptors of 1 MiB would be
4 GiB, so that row runs ``descriptors`` = cap / block size and says
``capped``. Timings: best of 5 (median too) after one warm-up, by CUDA events.

Written as it goes (a timeout keeps what was measured); at the end the
kernel/DMA crossover per direction and descriptor count (gpu_report.crossover).
``--fake`` runs the same code against the fake CUDA runtime with rows of at
most 1 MiB: the dry run, where the checks mean something and the timings
nothing; there each row also checks, through the fake's call log, that the
path it names made the calls it should.
"""

from __future__ import annotations

import os
import statistics
import sys
import traceback

import torch

import torch_kvswap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_report as R
from gpu_probe import CudaBackend, FakeBackend, Results

DIRECTION = {
    "h2d": torch_kvswap.Direction.HOST_TO_DEVICE,
    "d2h": torch_kvswap.Direction.DEVICE_TO_HOST,
    "d2d": torch_kvswap.Direction.DEVICE_TO_DEVICE,
}
# What each path must call on the fake (the API whose count grows, the APIs that must not).
FAKE_CALLS = {
    "batch_dma": ("cudaMemcpyBatchAsync", ("cudaLaunchKernel", "cudaMemcpyAsync")),
    "kernel": ("cudaLaunchKernel", ("cudaMemcpyBatchAsync", "cudaMemcpyAsync")),
    "per_copy": ("cudaMemcpyAsync", ("cudaMemcpyBatchAsync", "cudaLaunchKernel")),
}


class Pools:
    """One pinned host buffer and three device buffers of `cap` bytes, reused by every row:
    host (random), dev (random), scratch (a destination), host_ref (the host's bytes, on the
    device, for the checks; on the fake, CPU copies stand in for the refs)."""

    def __init__(self, B, cap: int):
        self.B, self.cap = B, cap
        if B.kind == "cuda":  # random bytes made on the device: 1 GiB on the host takes seconds
            g = torch.Generator(device=B.device).manual_seed(7)
            self.dev = torch.randint(0, 256, (cap,), generator=g, dtype=torch.uint8, device=B.device)
            self.host_ref = torch.randint(0, 256, (cap,), generator=g, dtype=torch.uint8, device=B.device)
            self.host = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
            self.host.copy_(self.host_ref)
            self.scratch = torch.zeros(cap, dtype=torch.uint8, device=B.device)
            self.dev_ref = self.dev  # never written: h2d and d2d write scratch, d2h the host
        else:
            g = torch.Generator().manual_seed(7)
            self.host_ref = torch.randint(0, 256, (cap,), generator=g, dtype=torch.uint8)
            self.dev_ref = torch.randint(0, 256, (cap,), generator=g, dtype=torch.uint8)
            self.host = B.pinned_tensor(self.host_ref)
            self.dev = B.device_tensor(self.dev_ref)
            self.scratch = B.device_tensor(torch.zeros(cap, dtype=torch.uint8))
        B.synchronize()

    def rows(self, t, n, bb):
        return t.view(-1)[: n * bb].view(n, bb)

    def checkable(self, t):
        """`t` where its bytes can be compared with the refs (the device; the host on the fake)."""
        B = self.B
        if B.kind != "cuda":
            return B.read(t)
        if t.is_cuda:
            return t
        flat = self.scratch.view(-1)[: t.numel()]
        flat.copy_(t.reshape(-1))
        torch.cuda.synchronize()
        return flat.view(t.shape)

    def zero(self, t):
        B = self.B
        if B.kind == "cuda":
            if t.is_cuda:
                t.zero_()
            else:
                t.copy_(torch.zeros(t.shape, dtype=t.dtype, device=B.device))
            torch.cuda.synchronize()
        else:
            B.fill(t, torch.zeros(t.shape, dtype=t.dtype))


def replay_graph(B, fn):
    """`fn` captured once on the backend's capture stream; returns the replay."""
    with B.capture() as graph:
        fn()
    return graph


def fake_path_check(B, path, before):
    grows, still = FAKE_CALLS[path]
    after = {api: B.F.count_calls(api) for api in before}
    bad = []
    if after[grows] == before[grows]:
        bad.append(f"no {grows} call")
    bad += [f"{api} called {after[api] - before[api]} times" for api in still if after[api] != before[api]]
    return "; ".join(bad) or None


def measure_row(B, P, out, direction, kib, asked, side, reps):
    bb = kib * 1024
    n = min(asked, P.cap // bb)
    src_pool, dst_pool, ref_pool = {
        "h2d": (P.host, P.scratch, P.host_ref),
        "d2h": (P.dev, P.host, P.dev_ref),
        "d2d": (P.dev, P.scratch, P.dev_ref),
    }[direction]
    src, dst, ref = P.rows(src_pool, n, bb), P.rows(dst_pool, n, bb), P.rows(ref_pool, n, bb)
    g = torch.Generator().manual_seed(kib * 10007 + asked)
    sid_cpu, did_cpu = torch.randperm(n, generator=g), torch.randperm(n, generator=g)
    where = "cuda" if B.kind == "cuda" else "cpu"
    sid_c, did_c = sid_cpu.to(where), did_cpu.to(where)
    base = {
        "direction": direction,
        "block_kib": kib,
        "descriptors": n,
        "descriptors_asked": asked,
        "row_bytes": n * bb,
        "capped": n < asked,
    }
    total = n * bb

    def check(mapping: bool):
        got = P.checkable(dst)
        return bool(torch.equal(got[did_c], ref[sid_c]) if mapping else torch.equal(got, ref))

    def add(path, secs, ok, contiguous=None, error=None, **extra):
        best = min(secs) if secs else None
        row = dict(base, path=path, ok=ok, error=error, **extra)
        if best:
            row.update(seconds=best, median_s=statistics.median(secs), gbps=total / best / 1e9)
            if contiguous:
                row["vs_contiguous"] = contiguous / best
        out.add(flush=False, **row)
        return best

    # contiguous: one copy of the same bytes, same stream
    P.zero(dst)
    flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
    if B.kind == "cuda":

        def copy():
            return flat_dst.copy_(flat_src, non_blocking=True)
    else:  # the fake: one descriptor through the engine's pointer path
        sp, dp = torch.tensor([flat_src.data_ptr()]), torch.tensor([flat_dst.data_ptr()])

        def copy():
            return B.pointer_copy(sp, dp, torch.tensor([total]), DIRECTION[direction])

    try:
        with B.on(side):
            secs = B.times(copy, side, reps)
        B.synchronize()
        contiguous = add("contiguous", secs, check(False))
    except Exception as exc:  # noqa: BLE001 - recorded
        contiguous = add("contiguous", [], False, error=f"{type(exc).__name__}: {exc}"[:2000])

    for path in ("batch_dma", "kernel", "per_copy"):
        torch_kvswap.set_copy_method("kernel" if path == "kernel" else "dma")
        P.zero(dst)
        before = (
            {
                api: B.F.count_calls(api)
                for api in ("cudaMemcpyBatchAsync", "cudaLaunchKernel", "cudaMemcpyAsync")
            }
            if B.kind == "fake"
            else None
        )

        def call():
            return torch_kvswap.swap_blocks([src], [dst], sid_cpu, did_cpu)

        try:
            if path == "per_copy":
                with B.on(side):
                    graph = replay_graph(B, call)
                    secs = B.times(graph.replay, side, reps)
                del graph
            else:
                with B.on(side):
                    secs = B.times(call, side, reps)
            B.synchronize()
            ok, error = check(True), None
            if not ok:
                error = "bytes differ from the source"
            if before is not None:
                wrong_path = fake_path_check(B, path, before)
                if wrong_path:
                    ok, error = False, f"not the {path} path: {wrong_path}"
            add(path, secs, ok, contiguous, error)
        except Exception as exc:  # noqa: BLE001 - recorded
            add(path, [], False, error=f"{type(exc).__name__}: {exc}"[:2000])
    torch_kvswap.set_copy_method("auto")
    out.flush()


def engine_report(B):
    if B.kind != "cuda":
        return None
    try:
        return list(torch.ops.kvswap._engine_report(B.device))
    except Exception as exc:  # noqa: BLE001 - recorded
        return [f"engine report failed: {type(exc).__name__}: {exc}"]


def bench(path: str, B) -> int:
    out = Results(path, B)
    cap = (1 << 30) if B.kind == "cuda" else (1 << 20)
    reps = 5 if B.kind == "cuda" else 1
    out.data.update(
        row_bytes_cap=cap,
        row_bytes_note="a row holds descriptors x block bytes up to the cap; "
        "where that would pass it, it runs cap / block bytes descriptors ('capped', "
        "'descriptors' against 'descriptors_asked')",
        reps=reps,
        timing="best of reps after one warm-up"
        + (", CUDA events on the stream" if B.kind == "cuda" else ", wall clock (fake: meaningless)"),
        paths={
            "contiguous": "one copy of the row's bytes",
            "batch_dma": "set_copy_method('dma')",
            "kernel": "set_copy_method('kernel'), host ids",
            "per_copy": "set_copy_method('dma') captured in a graph, replayed",
        },
        engine_before=engine_report(B),
    )
    P = Pools(B, cap)
    side = B.bench_stream()
    grid = [(d, k, n) for d in R.DIRECTIONS for k in R.BLOCK_KIB for n in R.DESCRIPTORS]
    grid += [("d2d", R.D2D_KIB, n) for n in R.DESCRIPTORS]
    for direction, kib, asked in grid:
        measure_row(B, P, out, direction, kib, asked, side, reps)
    out.data["engine_after"] = engine_report(B)
    if B.kind == "fake":
        out.data["fake_violations"] = list(B.F.violations())
    res = out.data["results"]
    out.data["crossover"] = R.crossover(res)
    out.data["missing_rows"] = R.missing_rows(out.data)
    if out.data["engine_after"] and not any(
        "cudaMemcpyBatchAsync in use" in x for x in out.data["engine_after"]
    ):
        out.add(
            path="engine",
            ok=False,
            error="the batch API was not in use at the end: batch_dma rows are per copy",
        )
    out.flush()
    bad = [r for r in res if not r.get("ok")] or out.data["missing_rows"] or out.data.get("fake_violations")
    return 1 if bad else 0


def main(argv):
    backend = FakeBackend() if "--fake" in argv[2:] else CudaBackend()
    return bench(argv[1], backend)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
