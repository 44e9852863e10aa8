"""Polling vs waiting on the CPU path: ``python -m torch_kvswap.bench.polling``.

A serving engine's worker often polls ``KVCacheOffloader.get_finished()`` in a
tight loop instead of calling ``wait()``. On the CPU path the copies run on
the offloader's worker threads, which need the GIL between jobs; a poller
that holds the GIL could slow them down. This bench submits the same batch of
store jobs and measures the time until every job is reported, once with the
caller in ``wait()`` and once with the caller spinning on ``get_finished()``,
alternating per repetition; it prints the median of the paired ratios
(poll time / wait time) per job size.

``--no-yield`` disables the offloader's yield in an idle ``get_finished``
(for comparison only: it shows the starvation the yield removes).

It also checks that ``swap_blocks`` releases the GIL while it copies: a
Python thread counts loop iterations during one long copy; the count is
printed next to the count for the same time with no copy running.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from torch_kvswap import KVCacheOffloader, ops


def _run(off: KVCacheOffloader, jobs: int, blocks: int, poll: bool) -> float:
    f = off.factor
    n_dev = off.num_device_blocks
    t0 = time.perf_counter()
    for j in range(jobs):
        dev = [(j * blocks + k) % n_dev for k in range(blocks)]
        host = [(j * blocks // f + k) % off.num_host_blocks for k in range(blocks // f)]
        off.store(j, dev, host)
    if poll:
        seen = 0
        while seen < jobs:
            seen += len(off.get_finished())
    else:
        off.wait(range(jobs))
        assert len(off.get_finished()) == jobs
    return time.perf_counter() - t0


def polling_vs_waiting(block_kib: float, blocks: int, jobs: int, reps: int) -> tuple[float, float, float]:
    """Median wait time, median poll time (seconds) and median paired ratio."""
    elems = int(block_kib * 1024 // 2)
    caches = {f"l{i}": torch.randn(2, 4 * blocks, elems).half() for i in range(4)}
    off = KVCacheOffloader(caches, 16, 32, num_host_blocks=2 * blocks)
    try:
        _run(off, jobs, blocks, False)
        _run(off, jobs, blocks, True)
        waits, polls, ratios = [], [], []
        for r in range(reps):
            order = (False, True) if r % 2 == 0 else (True, False)
            t = {p: _run(off, jobs, blocks, p) for p in order}
            waits.append(t[False])
            polls.append(t[True])
            ratios.append(t[True] / t[False])
        return statistics.median(waits), statistics.median(polls), statistics.median(ratios)
    finally:
        off.shutdown()


def gil_released_during_copy() -> tuple[int, int]:
    """Python loop iterations on another thread during one long swap_blocks
    call, and in the same time with nothing running."""
    src = [torch.randn(512, 64 * 1024) for _ in range(2)]  # 256 MiB
    dst = [torch.empty_like(s) for s in src]
    ids = torch.randperm(512)
    ops.swap_blocks(src, dst, ids, ids)
    counted, stop = [0], threading.Event()

    def count():
        n = 0
        while not stop.is_set():
            n += 1
        counted[0] = n

    th = threading.Thread(target=count)
    th.start()
    t0 = time.perf_counter()
    ops.swap_blocks(src, dst, ids, ids)
    elapsed = time.perf_counter() - t0
    stop.set()
    th.join()
    during = counted[0]
    stop.clear()
    th = threading.Thread(target=count)
    th.start()
    time.sleep(elapsed)
    stop.set()
    th.join()
    return during, counted[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--blocks", type=int, default=8, help="device blocks per job (even)")
    p.add_argument(
        "--block-kib",
        type=float,
        nargs="+",
        default=[4, 32, 256],
        help="KiB per block of each of the 8 cache tensors",
    )
    p.add_argument("--reps", type=int, default=9)
    p.add_argument(
        "--no-yield", action="store_true", help="disable the yield in an idle get_finished (comparison only)"
    )
    args = p.parse_args(argv)
    if args.no_yield:
        os.sched_yield = lambda: None  # type: ignore[assignment]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
        f"{os.cpu_count()} CPUs; {args.jobs} store jobs of {args.blocks} blocks x 8 tensors; "
        f"yield in idle get_finished: {not args.no_yield}"
    )
    print(f"{'KiB/block':>9} {'wait ms':>9} {'poll ms':>9} {'poll/wait':>9}")
    for kib in args.block_kib:
        w, po, r = polling_vs_waiting(kib, args.blocks, args.jobs, args.reps)
        print(f"{kib:>9g} {w * 1e3:>9.1f} {po * 1e3:>9.1f} {r:>9.2f}")
    during, idle = gil_released_during_copy()
    print(
        f"GIL during swap_blocks: a Python thread ran {during} loop iterations during one "
        f"256 MiB copy, {idle} in the same time with no copy ({during / max(idle, 1):.0%})"
    )


if __name__ == "__main__":
    main()
