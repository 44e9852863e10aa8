"""``python -m torch_kvswap.bench host-memory``: how fast host mirrors are
ready (allocated, bound to their NUMA node, pre-faulted, and page-locked
where an engine registers them) against ``torch.zeros`` of the same bytes in
the same run, and what an offloader's construction costs against the number
of cache tensors and of host blocks. Ratios of medians; no timed asserts."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch

from torch_kvswap import KVCacheOffloader
from torch_kvswap.offloader import numa
from torch_kvswap.offloader.host_memory import HostMemory


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_kvswap.bench host-memory", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--gib", type=float, nargs="+", default=[1, 4, 8], help="mirror sizes, GiB")
    p.add_argument("--repeats", type=int, default=5, help="rounds of each; medians are reported")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="rounds of each run first and not counted: a virtual machine's first touch of "
        "memory it has not touched before is paid by whichever allocation comes first",
    )
    p.add_argument(
        "--device", default="cpu", help="the device the mirrors serve (an accelerator's are page-locked)"
    )
    p.add_argument(
        "--tensors",
        type=int,
        nargs="*",
        default=[2, 32, 256],
        help="cache tensors, for the construction cost (256 host blocks of 1 KiB each)",
    )
    p.add_argument(
        "--host-blocks",
        type=int,
        nargs="*",
        default=[1024, 16384, 131072],
        help="host blocks, for the construction cost (8 tensors of 1 KiB blocks)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    gc.collect()  # the previous round's memory is unmapped before this one starts
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def settle(nbytes: int) -> None:
    """Touches and frees ``nbytes`` before a timed allocation, so each one
    starts from the same state of the machine's free memory: on a virtual
    machine that reports freed pages back to its host, an allocation right
    after a large free and one after a pause cost up to 4x apart, and the
    order of the two contestants would decide the ratio."""
    torch.ones(nbytes, dtype=torch.uint8)
    gc.collect()


def ready(nbytes: int, device: torch.device) -> HostMemory:
    memory = HostMemory(nbytes, device, device.type != "cpu", numa_node=numa.choose_node(device, None))
    memory.wait()
    return memory


def ready_rows(sizes_gib: list[float], repeats: int, device: torch.device, warmup: int = 0) -> list[dict]:
    rows = []
    for gib in sizes_gib:
        nbytes = int(gib * (1 << 30))

        def zeros() -> float:
            settle(nbytes)
            return timed(lambda: torch.zeros(nbytes, dtype=torch.uint8))[0]

        def mirrors() -> float:
            settle(nbytes)
            seconds, memory = timed(lambda: ready(nbytes, device))
            memory.release()
            return seconds

        times: dict[str, list[float]] = {"zeros": [], "ready": []}
        for i in range(warmup + repeats):  # interleaved, each first in every other round
            order = [("zeros", zeros), ("ready", mirrors)]
            for name, fn in order if i % 2 == 0 else order[::-1]:
                seconds = fn()
                if i >= warmup:
                    times[name].append(seconds)
        z, m = statistics.median(times["zeros"]), statistics.median(times["ready"])
        rows.append(
            {
                "gib": gib,
                "zeros_s": z,
                "ready_s": m,
                "ratio": m / z,
                "zeros_all_s": times["zeros"],
                "ready_all_s": times["ready"],
            }
        )
    return rows


def construction_rows(tensors: list[int], host_blocks: list[int], repeats: int) -> list[dict]:
    def build(num_tensors: int, blocks: int) -> None:
        caches = [torch.zeros(4, 512, dtype=torch.bfloat16) for _ in range(num_tensors)]
        KVCacheOffloader(caches, 1, 1, num_host_blocks=blocks).shutdown()

    def median(fn: Callable[[], None]) -> float:
        return statistics.median(timed(fn)[0] for _ in range(repeats))

    rows = [{"tensors": t, "host_blocks": 256, "seconds": median(lambda: build(t, 256))} for t in tensors]
    rows += [{"tensors": 8, "host_blocks": b, "seconds": median(lambda: build(8, b))} for b in host_blocks]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.warmup < 0:
        raise SystemExit("--warmup must be >= 0")
    device = torch.device(args.device)
    result = {
        "ready": ready_rows(args.gib, args.repeats, device, args.warmup),
        "construction": construction_rows(args.tensors, args.host_blocks, args.repeats),
    }
    print(
        f"mirrors ready on {device} against torch.zeros of the same bytes (median of {args.repeats}, "
        f"after {args.warmup} uncounted round(s) of each)"
    )
    print(f"{'GiB':>6} {'zeros s':>9} {'ready s':>9} {'ratio':>7}")
    for r in result["ready"]:
        print(f"{r['gib']:>6g} {r['zeros_s']:>9.3f} {r['ready_s']:>9.3f} {r['ratio']:>7.3f}")
    print("offloader construction (CPU caches, 1 KiB blocks)")
    print(f"{'tensors':>8} {'host blocks':>12} {'seconds':>9}")
    for r in result["construction"]:
        print(f"{r['tensors']:>8} {r['host_blocks']:>12} {r['seconds']:>9.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
