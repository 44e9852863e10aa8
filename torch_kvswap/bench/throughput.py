"""Benchmark CLI: ``python -m torch_kvswap.bench``.

Measures, on the present device, the GB/s of scattered block copies per
method and block size, and the ratio of each to a contiguous copy of the same
bytes measured in the same run (the limit). Methods:

* ``contiguous`` — one ``copy_`` of all the bytes at once (the limit);
* ``kvswap_ptr`` — ``kvswap::swap_blocks_batch`` on prebuilt descriptors;
* ``kvswap_tensor`` — ``kvswap::swap_blocks`` on cache tensors and ids;
* ``copy_loop`` — a per-block ``copy_`` loop in Python;
* ``index`` — ``index_select`` + ``index_copy_`` per cache tensor.

Source and destination block ids are random permutations, so blocks are
scattered on both sides. Each repetition times every method at every block
size, in a rotating order, so drift on a shared machine hits them all alike;
the median time is reported.

When ``index`` runs, the kvswap ops' speed-up over it is printed too, paired
per repetition the same way.

``--overhead`` also measures the host-side cost of building descriptors (a dry
run that moves no bytes), per descriptor and per call.

Writes a table to stdout, and optionally JSON (``--json``) and a PNG plot of
GB/s against block size (``--plot``, needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

import torch_kvswap
from torch_kvswap.bench.demo import HelpWithDefaults, pick_device

METHODS = ["contiguous", "kvswap_ptr", "kvswap_tensor", "copy_loop", "index"]


@dataclass
class Row:
    block_kib: float
    method: str
    gbps: float
    ratio_to_contiguous: float
    seconds_median: float
    #: against the median contiguous GB/s over all block sizes of the run: a
    #: second view that does not hang on one size's contiguous copy
    ratio_to_run_limit: float = 0.0
    #: index_select/index_copy_ time over this method's time, paired per
    #: repetition like ratio_to_contiguous; None when ``index`` was not run
    speedup_over_index: float | None = None
    seconds_all: list[float] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_kvswap.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpWithDefaults,
    )
    p.add_argument(
        "--block-kib",
        type=float,
        nargs="+",
        default=[2, 4, 8, 16, 32, 64, 128, 256],
        help="bytes per block per cache tensor, in KiB",
    )
    p.add_argument("--total-mib", type=float, default=256, help="bytes moved per block size")
    p.add_argument("--layers", type=int, default=4, help="layers; each has a K and a V tensor")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32", "int8", "uint8"],
        help="cache element type",
    )
    p.add_argument("--repeats", type=int, default=7, help="timed rounds; the median is reported")
    p.add_argument(
        "--methods",
        nargs="+",
        default=METHODS,
        choices=METHODS,
        help="what to time (contiguous always runs: it is the limit)",
    )
    p.add_argument(
        "--direction",
        default="d2h",
        choices=["d2h", "h2d"],
        help="on an accelerator: device->host or host->device (ignored on the CPU)",
    )
    p.add_argument(
        "--device", default=None, help="device to measure on (default: the current accelerator, else cpu)"
    )
    p.add_argument(
        "--host-modes",
        nargs="*",
        default=[],
        choices=["parallel_for", "memcpy", "prefetch", "stream", "auto"],
        help="host engine only: also time kvswap_tensor with each KVSWAP_HOST_COPY mode",
    )
    p.add_argument("--overhead", action="store_true", help="also measure the host-side cost")
    p.add_argument("--json", default=None, help="write the results here (default: not written)")
    p.add_argument(
        "--plot",
        default=None,
        help="write a PNG plot here (needs matplotlib, checked before the run; default: no plot)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random block ids")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.plot and not matplotlib_available():
        p.error(
            f"--plot {args.plot} needs matplotlib, which is not installed "
            "(pip install matplotlib, or drop --plot)"
        )
    return args


def matplotlib_available() -> bool:
    """Whether --plot can work; asked before the run, which takes minutes."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Timer:
    """Times one call. Before each, it reads a buffer larger than the last-level
    cache, so that dirty lines left by the previous method are written back
    outside the timed region (otherwise whichever method runs after a
    cache-filling one pays for its write-backs)."""

    def __init__(self, device: torch.device, scrub_mib: int = 96) -> None:
        self.device = device
        self._scrub = torch.ones(scrub_mib * 2**20 // 8, dtype=torch.int64) if scrub_mib else None

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def __call__(self, fn) -> float:
        self.sync()
        if self._scrub is not None:
            self._scrub.sum()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


class Arenas:
    """The memory every case is carved from, allocated once per run.

    Every block size and every method then works on the same physical pages:
    a fresh allocation per size made the contiguous copy alone swing between
    15 and 22 GB/s from one size to the next on the same machine.
    """

    def __init__(self, args, device: torch.device) -> None:
        total = int(args.total_mib * 2**20)
        dev_is_src = args.direction == "d2h"
        on_device_src = dev_is_src and device.type != "cpu"
        on_device_dst = (not dev_is_src) and device.type != "cpu"
        pin = device.type != "cpu"

        def arena(nbytes, on_device):
            if on_device:
                return torch.ones(nbytes, dtype=torch.uint8, device=device)
            return torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)

        # Caches: the source holds twice the moved blocks, so ids are a sample.
        self.src = arena(2 * total, on_device_src)
        self.dst = arena(total, on_device_dst)
        self.flat_src = arena(total, on_device_src)
        self.flat_dst = arena(total, on_device_dst)


def make_case(block_bytes: int, args, arenas: Arenas, rng: np.random.Generator):
    dtype = getattr(torch, args.dtype)
    elems = block_bytes // dtype.itemsize
    tensors = 2 * args.layers
    n = max(1, int(args.total_mib * 2**20) // (block_bytes * tensors))
    dev_is_src = args.direction == "d2h"
    total = n * tensors * block_bytes
    src_all = arenas.src[: 2 * total].view(dtype).view(tensors, 2 * n, elems)
    dst_all = arenas.dst[:total].view(dtype).view(tensors, n, elems)
    src = [src_all[t] for t in range(tensors)]
    dst = [dst_all[t] for t in range(tensors)]
    sid = torch.from_numpy(rng.permutation(2 * n)[:n].astype(np.int64))
    did = torch.from_numpy(rng.permutation(n).astype(np.int64))
    flat_src = arenas.flat_src[:total]
    flat_dst = arenas.flat_dst[:total]
    # Descriptors as the reference handler builds them (numpy broadcasting).
    sbase = np.array([t.data_ptr() for t in src], dtype=np.int64)[:, None]
    dbase = np.array([t.data_ptr() for t in dst], dtype=np.int64)[:, None]
    sp = torch.from_numpy((sbase + sid.numpy()[None, :] * block_bytes).ravel())
    dp = torch.from_numpy((dbase + did.numpy()[None, :] * block_bytes).ravel())
    sz = torch.full((sp.numel(),), block_bytes, dtype=torch.int64)
    direction = int(
        torch_kvswap.Direction.DEVICE_TO_HOST if dev_is_src else torch_kvswap.Direction.HOST_TO_DEVICE
    )
    sid_list, did_list = sid.tolist(), did.tolist()

    def copy_loop():
        for s, d in zip(src, dst):
            for a, b in zip(sid_list, did_list):
                d[b].copy_(s[a], non_blocking=True)

    def index():
        s_idx = sid.to(src[0].device)
        d_idx = did.to(dst[0].device)
        for s, d in zip(src, dst):
            d.index_copy_(0, d_idx, s.index_select(0, s_idx).to(d.device, non_blocking=True))

    fns = {
        "contiguous": lambda: flat_dst.copy_(flat_src, non_blocking=True),
        "kvswap_ptr": lambda: torch.ops.kvswap.swap_blocks_batch(sp, dp, sz, direction),
        "kvswap_tensor": lambda: torch.ops.kvswap.swap_blocks(src, dst, sid, did),
        "copy_loop": copy_loop,
        "index": index,
    }
    for mode in args.host_modes:

        def with_mode(mode=mode):
            os.environ["KVSWAP_HOST_COPY"] = mode
            try:
                torch.ops.kvswap.swap_blocks(src, dst, sid, did)
            finally:
                os.environ.pop("KVSWAP_HOST_COPY", None)

        fns[f"tensor[{mode}]"] = with_mode
    return total, fns, (src, dst, sid, did)


def check_case(case) -> None:
    src, dst, sid, did = case
    for s, _d in zip(src, dst):
        s.view(torch.uint8).copy_(torch.randint(0, 255, s.view(torch.uint8).shape, dtype=torch.uint8))
    torch.ops.kvswap.swap_blocks(src, dst, sid, did)
    if src[0].device.type != "cpu" or dst[0].device.type != "cpu":
        torch.accelerator.synchronize()
    for s, d in zip(src, dst):
        if not torch.equal(d.cpu()[did].view(torch.uint8), s.cpu()[sid].view(torch.uint8)):
            raise AssertionError("kvswap_tensor copied the wrong bytes")


def run_sizes(args, device: torch.device) -> list[Row]:
    rng = np.random.default_rng(args.seed)
    timer = Timer(device)
    arenas = Arenas(args, device)
    methods = ["contiguous"] + [m for m in args.methods if m != "contiguous"]
    methods += [f"tensor[{mode}]" for mode in args.host_modes]
    # Every size's case is carved from the same arenas, so all can be set up
    # first and then timed in the same rounds: a fast or slow spell of the
    # machine then falls on all block sizes alike instead of on one of them.
    cases = []
    for k, kib in enumerate(args.block_kib, 1):
        block_bytes = int(kib * 1024)
        total, fns, case = make_case(block_bytes, args, arenas, rng)
        check_case(case)
        progress(
            f"[{k}/{len(args.block_kib)}] {kib:g} KiB blocks: {total / 2**20:.0f} MiB in "
            f"{total // (block_bytes * 2 * args.layers)} blocks x {2 * args.layers} tensors, "
            f"checked"
        )
        cases.append((kib, total, fns))
        for m in methods:
            timer(fns[m])  # warm-up: first touch, allocator, caches
    times: dict[tuple[float, str], list[float]] = {(kib, m): [] for kib, _, _ in cases for m in methods}
    for r in range(args.repeats):
        progress(f"repetition {r + 1}/{args.repeats}: {len(cases)} block sizes x {len(methods)} methods")
        for kib, _, fns in cases:
            # Rotate the order too, so no method always follows the same one.
            for m in methods[r % len(methods) :] + methods[: r % len(methods)]:
                times[kib, m].append(timer(fns[m]))
    return summarize([(kib, total) for kib, total, _ in cases], methods, times)


def summarize(
    sizes: list[tuple[float, int]], methods: list[str], times: dict[tuple[float, str], list[float]]
) -> list[Row]:
    """Rows from the timings: ``times[kib, method]`` holds one time per
    repetition, in repetition order, for each ``(kib, total bytes)`` of
    ``sizes``; ``methods`` includes ``contiguous``. Checked on made-up times
    by tests/test_demo_and_bench.py::test_ratios_are_paired_per_repetition."""
    rows: list[Row] = []
    for kib, total in sizes:
        for m in methods:
            t = times[kib, m]
            med = statistics.median(t)
            # Paired per repetition: each method against the contiguous copy
            # of the same size timed in the same round, so slow spells of a
            # shared machine cancel out; the median of those ratios is reported.
            ratio = statistics.median(c / x for c, x in zip(times[kib, "contiguous"], t))
            over_index = (
                statistics.median(i / x for i, x in zip(times[kib, "index"], t))
                if "index" in methods
                else None
            )
            rows.append(
                Row(kib, m, total / med / 1e9, ratio, med, speedup_over_index=over_index, seconds_all=t)
            )
    run_limit = statistics.median(r.gbps for r in rows if r.method == "contiguous")
    for r in rows:
        r.ratio_to_run_limit = r.gbps / run_limit
    return rows


def measure_overhead(args) -> dict:
    """Host-side cost: the dry run builds and merges descriptors, moving nothing."""
    timer = Timer(torch.device("cpu"), scrub_mib=0)  # host-side cost is measured warm
    rng = np.random.default_rng(args.seed)
    out = {}
    tensors = 64  # 32 layers x (K, V)
    per_call = []
    for blocks in (1, 2048, 8192):
        caches = [torch.empty(4 * blocks, 16, dtype=torch.uint8) for _ in range(tensors)]
        hosts = [torch.empty(4 * blocks, 16, dtype=torch.uint8) for _ in range(tensors)]
        sid = torch.from_numpy(rng.permutation(4 * blocks)[:blocks].astype(np.int64))
        did = torch.from_numpy(rng.permutation(4 * blocks)[:blocks].astype(np.int64))

        def plan():
            return torch.ops.kvswap._plan_swap_blocks(caches, hosts, sid, did)

        for _ in range(3):
            timer(plan)
        t = statistics.median(timer(plan) for _ in range(21))
        per_call.append((blocks * tensors, t))
        # The reference handler's numpy descriptor build, for comparison.
        sb = np.array([c.data_ptr() for c in caches], dtype=np.int64)[:, None]
        db = np.array([c.data_ptr() for c in hosts], dtype=np.int64)[:, None]
        bsz = np.full((tensors, 1), 16, dtype=np.int64)

        def numpy_build():
            a = (sb + sid.numpy()[None, :] * bsz).ravel()
            b = (db + did.numpy()[None, :] * bsz).ravel()
            c = np.broadcast_to(bsz, (tensors, blocks)).ravel().copy()
            return torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)

        t_np = statistics.median(timer(numpy_build) for _ in range(21))
        out[f"plan_{blocks * tensors}_descriptors_us"] = t * 1e6
        out[f"numpy_build_{blocks * tensors}_descriptors_us"] = t_np * 1e6
    (n0, t0), (n1, t1), (n2, t2) = per_call
    out["per_descriptor_ns"] = (t2 - t1) / (n2 - n1) * 1e9
    # Fixed cost of a whole eager call from Python: one 1-byte block.
    src, dst = [torch.zeros(4, 1, dtype=torch.uint8)], [torch.zeros(4, 1, dtype=torch.uint8)]
    one, two = torch.tensor([1]), torch.tensor([2])

    def call():
        return torch.ops.kvswap.swap_blocks.default(src, dst, one, two)

    for _ in range(100):
        call()
    t = statistics.median(timer(call) for _ in range(2001))
    out["fixed_cost_per_call_us"] = t * 1e6
    sp, dp, sz = torch.tensor([src[0].data_ptr()]), torch.tensor([dst[0].data_ptr()]), torch.tensor([1])

    def call_ptr():
        return torch.ops.kvswap.swap_blocks_batch.default(sp, dp, sz, 0)

    t = statistics.median(timer(call_ptr) for _ in range(2001))
    out["fixed_cost_per_pointer_call_us"] = t * 1e6
    return out


def print_table(rows: list[Row]) -> None:
    methods = list(dict.fromkeys(r.method for r in rows))
    sizes = list(dict.fromkeys(r.block_kib for r in rows))
    by = {(r.block_kib, r.method): r for r in rows}
    head = "| block | " + " | ".join(f"{m} GB/s (×limit)" for m in methods) + " |"
    print(head)
    print("|---" * (len(methods) + 1) + "|")
    for s in sizes:
        cells = [f"{by[s, m].gbps:.2f} ({by[s, m].ratio_to_contiguous:.2f})" for m in methods]
        print(f"| {s:g} KiB | " + " | ".join(cells) + " |")


def print_run_limit_table(rows: list[Row]) -> None:
    limit = statistics.median(r.gbps for r in rows if r.method == "contiguous")
    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != "contiguous"]
    by = {(r.block_kib, r.method): r for r in rows}
    print(f"\nagainst the run's median contiguous copy ({limit:.2f} GB/s):")
    print("| block | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    for s in dict.fromkeys(r.block_kib for r in rows):
        print(f"| {s:g} KiB | " + " | ".join(f"{by[s, m].ratio_to_run_limit:.2f}" for m in methods) + " |")


def print_index_table(rows: list[Row]) -> None:
    methods = [m for m in ("kvswap_ptr", "kvswap_tensor") if any(r.method == m for r in rows)]
    if not methods or all(r.speedup_over_index is None for r in rows):
        return
    by = {(r.block_kib, r.method): r for r in rows}
    print("\nspeed-up over index_select + index_copy_ (paired per repetition):")
    print("| block | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    for s in dict.fromkeys(r.block_kib for r in rows):
        print(f"| {s:g} KiB | " + " | ".join(f"{by[s, m].speedup_over_index:.1f}x" for m in methods) + " |")


def plot(rows: list[Row], path: str, title: str) -> None:
    """Writes the PNG of GB/s against block size to `path`."""
    fig = make_figure(rows, title)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_figure(rows: list[Row], title: str):
    """The plot's figure: one line per method, ticks at the measured sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in dict.fromkeys(r.method for r in rows):
        pts = [(r.block_kib, r.gbps) for r in rows if r.method == m]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    # Ticks at the measured sizes only: the log axis would add powers of two
    # that were never run.
    sizes = sorted({r.block_kib for r in rows})
    ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("block size (KiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    env = {
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "layers": args.layers,
        "dtype": args.dtype,
        "total_mib": args.total_mib,
        "repeats": args.repeats,
        "direction": args.direction if device.type != "cpu" else "host->host",
    }
    print(f"torch_kvswap bench on {device}: {json.dumps(env)}")
    rows = run_sizes(args, device)
    print_table(rows)
    print_run_limit_table(rows)
    print_index_table(rows)
    result = {"env": env, "rows": [asdict(r) for r in rows]}
    if args.overhead:
        result["overhead"] = measure_overhead(args)
        print("host-side cost:", json.dumps({k: round(v, 3) for k, v in result["overhead"].items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote the results to {os.path.abspath(args.json)}")
    if args.plot:
        plot(rows, args.plot, f"torch_kvswap on {device} ({env['direction']}, {args.layers} layers)")
        print(f"wrote the plot to {os.path.abspath(args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
