"""What a compiled swap_blocks call costs per backend (docs/ops.md, "Backends without Inductor").

One 4 KiB block copied into a 16 MiB host cache per call, timed eager and
under torch.compile with backend aot_eager (with torch_kvswap's in-place
hook, and with torch's own behaviour: a clone of the whole cache per call)
and inductor. Usage: .venv/bin/python scripts/measure_compile_clone.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch._C import DispatchKey
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

import torch_kvswap
from torch_kvswap import _compile_hooks

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
    key = DispatchKey.CompositeExplicitAutograd
    hooked = auto_functionalized_v2.py_kernels[key]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; one {BLOCK}-byte block "
        f"into a {CACHE_MIB} MiB host cache per call; median of 200 calls"
    )
    print(f"eager: {per_call_us(step, src, dst, sid, did):.1f} us")
    for backend, in_place in [("aot_eager", True), ("aot_eager", False), ("inductor", True)]:
        torch._dynamo.reset()
        auto_functionalized_v2.py_kernels[key] = hooked if in_place else hooked.__wrapped__
        auto_functionalized_v2._dispatch_cache.clear()
        try:
            compiled = torch.compile(step, backend=backend, fullgraph=True)
            label = (
                backend
                if backend == "inductor"
                else (f"{backend}, {'in place (torch_kvswap hook)' if in_place else 'torch default: clone'}")
            )
            print(f"{label}: {per_call_us(compiled, src, dst, sid, did):.1f} us")
        finally:
            auto_functionalized_v2.py_kernels[key] = hooked
            auto_functionalized_v2._dispatch_cache.clear()
    assert _compile_hooks.DESTINATIONS_IN_PLACE_WITHOUT_INDUCTOR


if __name__ == "__main__":
    main()
