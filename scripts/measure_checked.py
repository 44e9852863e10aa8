"""What checked mode costs (docs/performance.md, "Checked mode").

Two host-side costs, each checked against unchecked in the same run, the two
timed in alternation so that drift on a shared machine hits both alike:

* the pointer op at 4,096 descriptors: the dry run ``_plan_swap_blocks_batch``
  (validation and descriptor building, no copy), 2 KiB blocks, source and
  destination ids random permutations of a 4 GiB-spaced pair of regions'
  blocks; with sorted ids too (the checks then skip their sort);
* the offloader at 64 layers x 512 device blocks (128 cache tensors, 16-byte
  blocks so that the copies cost next to nothing): a cycle of one store of
  all 512 blocks, reported, and one load of them back, reported.

Usage: ``.venv/bin/python scripts/measure_checked.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import torch_kvswap
from torch_kvswap import Direction, KVCacheOffloader


def paired(fn_off, fn_on, repeats: int, inner: int) -> tuple[float, float]:
    """Median seconds per call of each, timed in alternation."""
    off, on = [], []
    for _ in range(3):
        fn_off()
        with torch_kvswap.checked():
            fn_on()
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn_off()
        off.append((time.perf_counter() - t0) / inner)
        with torch_kvswap.checked():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn_on()
            on.append((time.perf_counter() - t0) / inner)
    return statistics.median(off), statistics.median(on)


def pointer_op(repeats: int, shuffled: bool) -> tuple[float, float]:
    n, block = 4096, 2048
    cache = torch.empty(2 * n, block, dtype=torch.uint8)
    mirror = torch.empty(2 * n, block, dtype=torch.uint8)
    regions = [torch_kvswap.register_region(cache, side="device"), torch_kvswap.register_region(mirror)]
    rng = np.random.default_rng(0)
    sid = rng.permutation(2 * n)[:n] if shuffled else np.arange(n)
    did = rng.permutation(2 * n)[:n] if shuffled else np.arange(n)
    src = torch.from_numpy(cache.data_ptr() + sid * block)
    dst = torch.from_numpy(mirror.data_ptr() + did * block)
    sizes = torch.full((n,), block, dtype=torch.int64)
    plan = torch.ops.kvswap_test.plan_swap_blocks_batch.default
    d2h = int(Direction.DEVICE_TO_HOST)

    def call():
        return plan(src, dst, sizes, d2h)

    out = paired(call, call, repeats, 200)
    for r in regions:
        r.unregister()
    return out


def offloader_cycle(repeats: int) -> tuple[float, float]:
    layers, blocks = 64, 512
    caches = {f"l{i}": torch.zeros(2, blocks, 16, dtype=torch.uint8) for i in range(layers)}
    plain = KVCacheOffloader(caches, 16, 16, num_host_blocks=blocks, check=False)
    tracked = KVCacheOffloader(caches, 16, 16, num_host_blocks=blocks, check=True)
    ids = np.arange(blocks)
    job = [0]

    def cycle(off):
        def run():
            job[0] += 2
            off.store(job[0], ids, ids)
            off.wait({job[0]})
            off.get_finished()
            off.load(job[0] + 1, ids, ids)
            off.wait({job[0] + 1})
            off.get_finished()

        return run

    out = paired(cycle(plain), cycle(tracked), repeats, 5)
    plain.shutdown()
    tracked.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, (off, on) in [
        ("pointer op, 4,096 descriptors, random order", pointer_op(args.repeats, True)),
        ("pointer op, 4,096 descriptors, in order", pointer_op(args.repeats, False)),
        ("offloader, 64 layers x 512 blocks, store+load cycle", offloader_cycle(args.repeats)),
    ]:
        print(f"{name}: unchecked {off * 1e6:.1f} us, checked {on * 1e6:.1f} us, ratio {on / off:.2f}")


if __name__ == "__main__":
    main()
