"""Per-call cost of an eager swap_blocks call (docs/performance.md, "Per-call cost").

One id per call, 16-byte blocks (the copy costs next to nothing), with 1 and
64 cache pairs, against a baseline in the same run: the empty custom op
``torch.ops.kvswap._get_copy_method()`` (one dispatcher crossing, no work).
The calls are timed in alternation, so that drift on a shared machine hits
each alike; each figure is the median of ``--repeats`` rounds of ``--inner``
calls.

Usage: ``.venv/bin/python scripts/measure_call_cost.py [--repeats N] [--inner M]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_kvswap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--inner", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sid, did = torch.tensor([3]), torch.tensor([5])
    cases = {"empty custom op": lambda: torch.ops.kvswap._get_copy_method()}
    for pairs in (1, 64):
        src = [torch.zeros(16, 4) for _ in range(pairs)]
        dst = [torch.zeros(16, 4) for _ in range(pairs)]
        cases[f"swap_blocks, {pairs} pair{'s' if pairs > 1 else ''}"] = lambda src=src, dst=dst: (
            torch_kvswap.swap_blocks(src, dst, sid, did)
        )
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        for _ in range(100):
            fn()
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(args.inner):
                fn()
            times[name].append((time.perf_counter() - t0) / args.inner)
    base = statistics.median(times["empty custom op"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:24s} {median * 1e6:7.2f} us  ({median / base:5.2f}x the empty op)")


if __name__ == "__main__":
    main()
