"""What a compiled swap_blocks call costs per backend (docs/ops.md, "Backends without Inductor").

One 4 KiB block copied into a 16 MiB host cache per call, timed eager and
under torch.compile with backend aot_eager (torch's own behaviour: its
auto_functionalized_v2 clones the whole cache per call) and inductor (which
writes it in place). Usage: .venv/bin/python scripts/measure_compile_clone.py
"""

from __future__ import annotations

import statistics
import time

import torch

import torch_kvswap

BLOCK = 4096
CACHE_MIB = 16


def step(src, dst, sid, did):
    torch_kvswap.swap_blocks([src], [dst], sid, did)


def per_call_us(fn, *args, calls=200) -> float:
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    src = torch.ones(64, BLOCK, dtype=torch.uint8)
    dst = torch.zeros(CACHE_MIB * 2**20 // BLOCK, BLOCK, dtype=torch.uint8)
    sid, did = torch.tensor([3]), torch.tensor([100])
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; one {BLOCK}-byte block "
        f"into a {CACHE_MIB} MiB host cache per call; median of 200 calls"
    )
    print(f"eager: {per_call_us(step, src, dst, sid, did):.1f} us")
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        print(f"{backend}: {per_call_us(compiled, src, dst, sid, did):.1f} us")


if __name__ == "__main__":
    main()
