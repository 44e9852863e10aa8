"""Demo: offload a model-shaped paged KV cache to host memory and load it back.

Run with ``python -m torch_kvswap.demo`` (``--help`` for the knobs). On the
default settings it builds a 32-layer, 8-KV-head, head-dim-128, 16-token-block
bf16 cache of 1 GiB on the present device (the CPU when there is no
accelerator), stores a random half of its blocks (512 MiB; ``--offload-fraction``)
to pinned host memory with :class:`torch_kvswap.KVCacheOffloader`, overwrites
those blocks on the device,
loads them back, checks every byte, and prints what it did with the
throughput and the per-job times reported by ``get_finished()``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import torch_kvswap
from torch_kvswap.handler import KVCacheOffloader, TransferResult


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch_kvswap.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per device block")
    p.add_argument("--cache-gib", type=float, default=1.0, help="device KV cache size")
    p.add_argument("--factor", type=int, default=2, help="device blocks per host block")
    p.add_argument("--offload-fraction", type=float, default=0.5,
                   help="share of the device blocks to offload and reload")
    p.add_argument("--jobs", type=int, default=4, help="split each direction into this many jobs")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "int8"])
    p.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def pick_device(name: str | None) -> torch.device:
    """`name`, else the current accelerator, else the CPU."""
    if name:
        return torch.device(name)
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return torch.device("cpu")
    return acc.current_accelerator()


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    info = torch.iinfo(raw.dtype)
    raw.copy_(torch.randint(info.min, info.max, raw.shape, dtype=raw.dtype, generator=gen).to(raw.device))


def report(kind: str, results: list[TransferResult], seconds: float) -> float:
    moved = sum(r.transfer_size for r in results)
    ok = all(r.success for r in results)
    job_times = ", ".join(f"{r.transfer_time * 1e3:.1f}" for r in results)
    rate = moved / seconds / 1e9
    print(f"  {kind:<5} {len(results)} jobs, {moved / 2**20:8.1f} MiB in {seconds * 1e3:8.1f} ms "
          f"= {rate:6.2f} GB/s  (success: {ok}; job times from get_finished, ms: {job_times})")
    return rate


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    per_block = args.block_tokens * args.kv_heads * args.head_dim * dtype.itemsize
    bytes_per_block_all_layers = 2 * args.layers * per_block
    num_blocks = max(args.factor, int(args.cache_gib * 2**30) // bytes_per_block_all_layers)
    num_blocks -= num_blocks % args.factor
    shape = (num_blocks, args.block_tokens, args.kv_heads, args.head_dim)
    print(f"torch_kvswap demo on {device} (engines loaded: "
          f"{', '.join(k for k, v in torch_kvswap.ENGINES.items() if v) or 'host only'})")
    print(f"  device cache: {args.layers} layers x (K, V) x {shape} {args.dtype} = "
          f"{num_blocks * bytes_per_block_all_layers / 2**30:.2f} GiB, {per_block // 1024} KiB per block "
          f"per tensor")

    caches = {}
    for layer in range(args.layers):
        kv = torch.empty((2, *shape), dtype=dtype, device=device)
        fill_random(kv, gen)
        caches[f"layer.{layer}"] = kv  # [2, num_blocks, ...] stacked layout

    host_blocks_needed = int(num_blocks * args.offload_fraction) // args.factor
    offloader = KVCacheOffloader(caches, device_block_size=args.block_tokens,
                                 host_block_size=args.block_tokens * args.factor,
                                 num_host_blocks=host_blocks_needed)
    print(f"  host mirror:  {host_blocks_needed} host blocks of {args.factor} device blocks, "
          f"{offloader.host_bytes / 2**30:.2f} GiB, pinned: {offloader.pinned}")

    n_dev = host_blocks_needed * args.factor
    device_ids = rng.permutation(num_blocks)[:n_dev].astype(np.int64)
    host_ids = rng.permutation(host_blocks_needed).astype(np.int64)
    # Keep what the blocks held, to check the round trip byte for byte.
    before = {name: kv[:, torch.from_numpy(device_ids).to(device)].cpu() for name, kv in caches.items()}

    # Whole host blocks per job: job i moves jobs_host[i] and its sub-blocks.
    jobs_host = np.array_split(host_ids, args.jobs)
    bounds = np.cumsum([0] + [len(h) for h in jobs_host]) * args.factor
    jobs_dev = [device_ids[bounds[i]:bounds[i + 1]] for i in range(args.jobs)]

    t0 = time.perf_counter()
    for j, (d, h) in enumerate(zip(jobs_dev, jobs_host)):
        offloader.store(job_id=j, device_block_ids=d, host_block_ids=h)
    offloader.wait(range(args.jobs))
    store_s = time.perf_counter() - t0
    store_results = offloader.get_finished()

    for kv in caches.values():  # the device blocks are reused for something else
        kv[:, torch.from_numpy(device_ids).to(device)] = 0

    t0 = time.perf_counter()
    for j, (d, h) in enumerate(zip(jobs_dev, jobs_host)):
        offloader.load(job_id=args.jobs + j, host_block_ids=h, device_block_ids=d)
    offloader.wait(range(args.jobs, 2 * args.jobs))
    load_s = time.perf_counter() - t0
    load_results = offloader.get_finished()
    offloader.shutdown()

    print(f"  moved {n_dev} device blocks ({n_dev * bytes_per_block_all_layers / 2**20:.0f} MiB) each way:")
    report("store", store_results, store_s)
    report("load", load_results, load_s)

    mismatched = [name for name, kv in caches.items()
                  if not torch.equal(kv[:, torch.from_numpy(device_ids).to(device)].cpu().view(torch.uint8),
                                     before[name].view(torch.uint8))]
    ok = not mismatched and all(r.success for r in store_results + load_results)
    print(f"  verified every byte of {len(caches)} layers: {'OK' if ok else 'MISMATCH in ' + ', '.join(mismatched)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
