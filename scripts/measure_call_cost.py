"""Per-call cost of eager swap_blocks and swap_blocks_batch calls
(docs/performance.md, "Per-call cost").

swap_blocks: one id per call, 16-byte blocks (the copy costs next to
nothing), with 1 and 64 cache pairs. swap_blocks_batch: 1, 64 and 1,024
descriptors of 16 bytes each, between separate rows (none merge), on the
host. Against a baseline in the same run: the empty custom op
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
    host = int(torch_kvswap.Direction.HOST_TO_DEVICE)  # no accelerator: the host engine copies
    rows = torch.zeros(2, 2048, 4)  # 16-byte rows; descriptor i copies row 2i of one into row 2i of the other
    for n in (1, 64, 1024):
        src_ptrs = torch.tensor([rows[0, 2 * i].data_ptr() for i in range(n)])
        dst_ptrs = torch.tensor([rows[1, 2 * i].data_ptr() for i in range(n)])
        sizes = torch.full((n,), 16)
        cases[f"swap_blocks_batch, {n} descriptor{'s' if n > 1 else ''}"] = (
            lambda s=src_ptrs, d=dst_ptrs, z=sizes: torch.ops.kvswap.swap_blocks_batch(s, d, z, host)
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
        print(f"{name:34s} {median * 1e6:7.2f} us  ({median / base:5.2f}x the empty op)")


if __name__ == "__main__":
    main()
