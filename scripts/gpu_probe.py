"""GPU probes and benchmark of the CUDA engine, run by scripts/gpu_check.sh.

    python scripts/gpu_probe.py probe OUT.json   # capture + replay on every path
    python scripts/gpu_probe.py bench OUT.json   # H2D / D2H GB/s per path

Each result is written to the JSON file as soon as it exists, so a timeout
keeps what was measured before it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

import torch_kvswap

DEV = torch.device("cuda", 0)


class Results:
    def __init__(self, path: str):
        self.path = path
        self.data: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "gpu": torch.cuda.get_device_name(0), "results": []}
        self.flush()

    def add(self, **entry):
        self.data["results"].append(entry)
        self.flush()
        print(json.dumps(entry), flush=True)

    def flush(self):
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1)


def caches(block_bytes, blocks, where, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 255, (blocks, block_bytes), generator=g, dtype=torch.uint8)
    return t.pin_memory() if where == "host" else t.to(DEV)


# --- probes -------------------------------------------------------------------------


def probe_capture(method: str, id_place: str, block_bytes: int):
    torch_kvswap.set_copy_method(method)
    src = caches(block_bytes, 8, DEV, 1)
    dst = caches(block_bytes, 8, "host", 2)
    where = DEV if id_place == "device" else "cpu"
    sid = torch.tensor([2, 3], device=where)
    did = torch.tensor([0, 1], device=where)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        torch_kvswap.swap_blocks([src], [dst], sid, did)
    sid.copy_(torch.tensor([6, 7]))
    did.copy_(torch.tensor([4, 5]))
    graph.replay()
    torch.cuda.synchronize()
    want_s, want_d = ([2, 3], [0, 1]) if id_place == "host" else ([6, 7], [4, 5])
    return bool(torch.equal(dst[want_d], src.cpu()[want_s]))


def probe_pointer_op():
    src = caches(4096, 8, DEV, 3)
    dst = caches(4096, 8, "host", 4)
    sp = torch.tensor([src.data_ptr() + 2 * 4096])
    dp = torch.tensor([dst.data_ptr() + 5 * 4096])
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        torch_kvswap.swap_blocks_batch(sp, dp, torch.tensor([4096]), torch_kvswap.Direction.DEVICE_TO_HOST)
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(dst[5], src[2].cpu()))


def probe_reduce_overhead(id_place: str, block_bytes: int):
    torch._dynamo.reset()
    torch_kvswap.set_copy_method("auto")
    dev = caches(block_bytes, 8, DEV, 5)
    host = caches(block_bytes, 8, "host", 6)
    where = DEV if id_place == "device" else "cpu"

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def store(d, h, sid, did):
        d.add_(1)
        torch_kvswap.swap_blocks([d], [h], sid, did)

    ok = True
    for step in range(4):  # warm-up, record, replays
        sid = torch.tensor([step, step + 1], device=where)
        did = torch.tensor([7 - step, 3], device=where)
        store(dev, host, sid, did)
        torch.cuda.synchronize()
        ok = ok and bool(torch.equal(host[[7 - step, 3]], dev.cpu()[[step, step + 1]]))
    return ok


def probe(path: str) -> int:
    out = Results(path)
    failures = 0
    cases = [("capture", m, p, bb) for m in ("auto", "dma", "kernel") for p in ("host", "device")
             for bb in (2048, 65536)]
    cases += [("pointer_op",), ("reduce_overhead", "host", 2048), ("reduce_overhead", "device", 2048),
              ("reduce_overhead", "host", 65536), ("reduce_overhead", "device", 65536)]
    for case in cases:
        t0 = time.perf_counter()
        try:
            if case[0] == "capture":
                ok = probe_capture(*case[1:])
            elif case[0] == "pointer_op":
                ok = probe_pointer_op()
            else:
                ok = probe_reduce_overhead(*case[1:])
            error = None
        except Exception as exc:  # noqa: BLE001 - recorded
            ok, error = False, f"{type(exc).__name__}: {exc}"[:2000]
            if case[:2] == ("capture", "dma") and case[2] == "device" and "illegal while" in str(exc):
                ok, error = True, "refused as documented: " + error.splitlines()[0]
        failures += not ok
        out.add(case=list(case), ok=ok, error=error, seconds=round(time.perf_counter() - t0, 3))
    torch_kvswap.set_copy_method("auto")
    return 1 if failures else 0


# --- benchmark ------------------------------------------------------------------------


def timed(fn, stream, reps=5):
    fn()
    stream.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    return best


def bench(path: str) -> int:
    out = Results(path)
    total = 64 << 20
    for direction in ("h2d", "d2h"):
        for kib in (2, 16, 256):
            bb = kib * 1024
            blocks = total // bb
            host = caches(bb, blocks, "host", 7)
            dev = caches(bb, blocks, DEV, 8)
            src, dst = (host, dev) if direction == "h2d" else (dev, host)
            sid_cpu = torch.randperm(blocks)
            did_cpu = torch.randperm(blocks)
            side = torch.cuda.Stream()
            flat_src = caches(total, 1, "host" if direction == "h2d" else DEV, 9)
            if direction == "h2d":
                flat_dst = torch.empty(total, dtype=torch.uint8, device=DEV)
            else:
                flat_dst = torch.empty(total, dtype=torch.uint8).pin_memory()
            flat_src = flat_src.view(-1)
            with torch.cuda.stream(side):
                base = timed(lambda: flat_dst.copy_(flat_src, non_blocking=True), side)
            out.add(direction=direction, block_kib=kib, path="contiguous", seconds=base,
                    gbps=total / base / 1e9, ok=True)
            paths = [("batch_dma", "dma", side, "cpu"), ("per_descriptor", "dma", None, "cpu"),
                     ("kernel_host_ids", "kernel", side, "cpu"), ("kernel_device_ids", "kernel", side, DEV)]
            for name, method, stream, where in paths:
                torch_kvswap.set_copy_method(method)
                sid, did = sid_cpu.to(where), did_cpu.to(where)
                dst.zero_()
                torch.cuda.synchronize()
                s = stream if stream is not None else torch.cuda.default_stream()
                try:
                    with torch.cuda.stream(s):
                        secs = timed(lambda: torch_kvswap.swap_blocks([src], [dst], sid, did), s)
                    torch.cuda.synchronize()
                    sample = torch.randint(0, blocks, (64,))
                    ok = bool(torch.equal(dst[did_cpu[sample]].cpu(), src[sid_cpu[sample]].cpu()))
                    out.add(direction=direction, block_kib=kib, path=name, seconds=secs,
                            gbps=total / secs / 1e9, vs_contiguous=base / secs, ok=ok)
                except Exception as exc:  # noqa: BLE001 - recorded
                    out.add(direction=direction, block_kib=kib, path=name, ok=False,
                            error=f"{type(exc).__name__}: {exc}"[:2000])
            del host, dev, flat_src, flat_dst
    torch_kvswap.set_copy_method("auto")
    res = out.data["results"]

    def ratio(d, kib, path):
        r = [x for x in res if x.get("direction") == d and x.get("block_kib") == kib and x.get("path") == path]
        return r[0].get("vs_contiguous") if r else None

    out.data["goals"] = {
        f"{d}: batch DMA at {kib} KiB >= {goal}x contiguous": (ratio(d, kib, "batch_dma"), goal)
        for d in ("h2d", "d2h") for kib, goal in ((16, 0.8), (256, 0.9))}
    for d in ("h2d", "d2h"):
        k, b = ratio(d, 2, "kernel_host_ids"), ratio(d, 2, "batch_dma")
        out.data["goals"][f"{d}: kernel at 2 KiB >= 5x batch DMA"] = (k / b if k and b else None, 5.0)
    out.flush()
    return 0 if all(x.get("ok") for x in res) else 1


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    try:
        sys.exit(probe(path) if mode == "probe" else bench(path))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
