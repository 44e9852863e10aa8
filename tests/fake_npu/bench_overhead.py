"""What the Ascend engine itself costs, with an ACL table of no-op functions.

    .venv/bin/python tests/fake_npu/bench_overhead.py

Times kvswap::ascend::Engine::submit in C++ (no dispatcher, no Python) for 1
and 4096 descriptors on each path, and a no-op ACL call through the table;
prints per call and per descriptor what is left after the ACL calls. The
numbers of docs/performance.md ("Ascend engine overhead") come from here.
"""

from __future__ import annotations

import statistics

from fake_npu import load_fake

H2D, D2D = 0, 2


def best(fn, repeats=7):
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    ext = load_fake()
    call = best(lambda: ext.bench_acl_call(2_000_000))
    rows = []
    for label, direction, batch in [
        ("batch (H2D)", H2D, True),
        ("per-descriptor (H2D, no batch API)", H2D, False),
        ("per-descriptor (D2D)", D2D, True),
    ]:
        small = best(lambda: ext.bench_submit(1, 200_000, direction, batch))
        large = best(lambda: ext.bench_submit(4096, 2_000, direction, batch))
        # ACL calls per submit: the capture query, then one batch call per
        # 4096 descriptors, or one aclrtMemcpyAsync per descriptor.
        calls_small, calls_large = (2, 2) if batch and direction != D2D else (2, 4097)
        per_call = small - calls_small * call
        per_desc_total = (large - small) / 4095
        per_desc_acl = (calls_large - calls_small) * call / 4095
        rows.append((label, small, large, per_call, per_desc_total, per_desc_acl))
    print(
        f"no-op ACL call through the table: {call:.2f} ns (measured alone; inside the engine's "
        "loop it costs less)"
    )
    print(
        f"{'path':36} {'1 desc':>9} {'4096 desc':>10} {'engine/call':>12} {'per desc':>9} {'of it ACL':>10}"
    )
    for label, small, large, per_call, total, acl in rows:
        print(
            f"{label:36} {small:7.1f}ns {large / 1000:7.2f}us {per_call:10.1f}ns {total:7.3f}ns {acl:8.3f}ns"
        )


if __name__ == "__main__":
    main()
