"""Demo: offload a model-shaped paged KV cache to host memory and load it back.

Run with ``python -m torch_kvswap.bench.demo`` (``--help`` for the knobs). On the
default settings it builds a 32-layer, 8-KV-head, head-dim-128, 16-token-block
bf16 cache of 1 GiB on the present device (the CPU when there is no
accelerator), stores a random half of its blocks (512 MiB; ``--offload-fraction``)
to pinned host memory with :class:`torch_kvswap.KVCacheOffloader`, overwrites
those blocks on the device,
loads them back, checks every byte, and prints what it did: which engine moved
the bytes, the throughput and the per-job times reported by ``get_finished()``.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import torch_kvswap
from torch_kvswap import _loader
from torch_kvswap.offloader import KVCacheOffloader, TransferResult


class HelpWithDefaults(argparse.HelpFormatter):
    """``--help`` ends each option's line with its default, unless the help
    already says it or there is none to give."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        default = action.default
        if isinstance(default, (list, tuple)):  # as it would be typed: 2 4 8
            default = " ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in default) or "none"
        return f"{text} (default: {str(default).replace('%', '%%')})"


def number(kind: type, accepts, expected: str):
    """An argparse type: `kind` of the text, refused with "expected
    <expected>, got <text>" unless `accepts(value)`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


positive_int = number(int, lambda v: v >= 1, "an integer >= 1")
seed_int = number(int, lambda v: 0 <= v < 2**64, "an integer in [0, 2**64)")  # torch's generator's range
positive_float = number(float, lambda v: 0 < v < float("inf"), "a finite number > 0")
fraction = number(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")


@dataclass
class Plan:
    """The cache and the transfers the arguments ask for, computed before
    anything is allocated."""

    per_block: int  # bytes of one block of one K or V tensor
    num_blocks: int  # device blocks per tensor
    host_blocks: int
    shape: tuple[int, ...]  # of one K or V tensor
    tensors: int  # 2 per layer
    factor: int

    @property
    def bytes_per_block_all_layers(self) -> int:
        return self.per_block * self.tensors

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block_all_layers

    def host_bytes(self, device: torch.device) -> int:
        """Host memory the run holds at its peak: the host mirror (with the
        offloader's page padding, under 4 KiB per tensor plus 4 KiB), the copy
        of the moved blocks the round trip is checked against, one layer's
        random contents before they go to the device, and the cache itself
        when it is on the CPU."""
        moved = self.host_blocks * self.factor * self.bytes_per_block_all_layers
        mirror = moved + 4096 * (self.tensors + 1)
        layer = 2 * self.num_blocks * self.per_block
        return mirror + moved + layer + (self.cache_bytes if device.type == "cpu" else 0)


def gib(n: float, rounding=math.ceil) -> str:
    """`n` bytes in GiB to 4 significant digits, rounded with `rounding`."""
    if n <= 0:
        return "0"
    scale = 10 ** (3 - math.floor(math.log10(n / 2**30)))
    return f"{rounding(n / 2**30 * scale) / scale:g}"


def blocks_needed(args: argparse.Namespace) -> int:
    """The fewest device blocks per tensor from which --offload-fraction
    gives --jobs host blocks of --factor device blocks."""

    def enough(n: int) -> bool:
        return int(n * args.offload_fraction) // args.factor >= args.jobs

    n = args.factor * math.ceil(args.jobs / args.offload_fraction)
    while not enough(n):  # float rounding: one block of --factor more
        n += args.factor
    while n > args.factor and enough(n - args.factor):
        n -= args.factor
    return n


def make_plan(args: argparse.Namespace) -> Plan:
    """Sizes from the arguments; raises ValueError naming the options when
    they describe no cache that fits in --cache-gib."""
    per_block = args.block_tokens * args.kv_heads * args.head_dim * getattr(torch, args.dtype).itemsize
    tensors = 2 * args.layers
    num_blocks = int(args.cache_gib * 2**30) // (tensors * per_block)
    num_blocks -= num_blocks % args.factor
    host_blocks = int(num_blocks * args.offload_fraction) // args.factor
    if host_blocks < args.jobs:
        need = blocks_needed(args)
        itemsize = getattr(torch, args.dtype).itemsize
        raise ValueError(
            f"--cache-gib {args.cache_gib:g} holds {num_blocks} device blocks in each of {tensors} "
            f"K/V tensors (--layers {args.layers}) of {per_block}-byte blocks (--block-tokens "
            f"{args.block_tokens} x --kv-heads {args.kv_heads} x --head-dim {args.head_dim} x "
            f"{itemsize}-byte {args.dtype}); --jobs {args.jobs} needs {args.jobs} host blocks of "
            f"--factor {args.factor} device blocks from --offload-fraction {args.offload_fraction:g} "
            f"of them, so {need} per tensor: raise --cache-gib to "
            f"at least {gib(need * tensors * per_block)}, or lower --layers, --kv-heads, --head-dim, "
            f"--block-tokens, --factor or --jobs"
        )
    return Plan(
        per_block,
        num_blocks,
        host_blocks,
        (num_blocks, args.block_tokens, args.kv_heads, args.head_dim),
        tensors,
        args.factor,
    )


def check_memory(args: argparse.Namespace, plan: Plan) -> None:
    """Raises ValueError naming --cache-gib when the run would need more
    host or device memory than is free, before anything is allocated."""
    device = args.device
    host = "the cache, its host mirror" if device.type == "cpu" else "the cache's host mirror"
    needs = [(torch.device("cpu"), "host", plan.host_bytes(device), host + " and a copy to check it against")]
    if device.type != "cpu":
        needs.append((device, str(device), plan.cache_bytes, "the cache"))
    for where, name, need, what in needs:
        free = free_bytes(where)
        if free is not None and need > free:
            raise ValueError(
                f"--cache-gib {args.cache_gib:g} needs {gib(need)} GiB of {name} memory ({what}), and "
                f"{gib(free, math.floor)} GiB is free: lower --cache-gib to at most about "
                f"{gib(args.cache_gib * 2**30 * free / need, math.floor)}"
                + (" or --offload-fraction" if name == "host" else "")
            )


def free_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device`, or None when torch
    (or, for the CPU, the system) cannot tell."""
    if device.type == "cpu":
        return free_host_bytes()
    mem_get_info = getattr(getattr(torch, device.type, None), "mem_get_info", None)
    return None if mem_get_info is None else int(mem_get_info(device.index)[0])


def free_host_bytes() -> int | None:
    """MemAvailable, less what the cgroup's memory limit leaves (a container
    is killed, not refused, past its limit)."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            free = min(int(limit) - used, free if free is not None else int(limit))
    except (OSError, ValueError):
        pass
    return free


def accelerator() -> tuple[str, int] | None:
    """The accelerator torch can use here, as (device type, device count)."""
    acc = torch.accelerator
    if not acc.is_available():
        return None
    return acc.current_accelerator().type, acc.device_count()


def device_option(text: str) -> torch.device:
    """An argparse type: cpu, or the accelerator torch can use here (its
    current device, or one by an index below its device count)."""
    acc = accelerator()
    accepted = "cpu" if acc is None else f"cpu, {acc[0]} or {acc[0]}:0 to {acc[0]}:{acc[1] - 1}"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is not None and device.type == "cpu":
        usable = device.index in (None, 0)
    else:
        usable = (
            device is not None
            and acc is not None
            and device.type == acc[0]
            and (device.index is None or device.index < acc[1])
        )
    if not usable:
        none = "" if acc is not None else " (torch finds no accelerator here)"
        raise argparse.ArgumentTypeError(f"expected {accepted}{none}, got {text}")
    return device


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_kvswap.bench.demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpWithDefaults,
    )
    p.add_argument("--layers", type=positive_int, default=32, help="model layers; each has a K and a V cache")
    p.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads per layer")
    p.add_argument("--head-dim", type=positive_int, default=128, help="elements per head")
    p.add_argument("--block-tokens", type=positive_int, default=16, help="tokens per device block")
    p.add_argument(
        "--cache-gib",
        type=positive_float,
        default=1.0,
        help="size of the device KV cache, all layers, in GiB",
    )
    p.add_argument(
        "--factor",
        type=positive_int,
        default=2,
        help="device blocks per host block (host blocks are this many times larger)",
    )
    p.add_argument(
        "--offload-fraction",
        type=fraction,
        default=0.5,
        help="share of the device blocks to offload and load back, in (0, 1]",
    )
    p.add_argument(
        "--jobs", type=positive_int, default=4, help="split each direction into this many offloader jobs"
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32", "int8"],
        help="element type of the cache",
    )
    p.add_argument(
        "--device",
        type=device_option,
        default=None,
        help="device of the cache, e.g. cuda:1 (default: the current accelerator, else cpu)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the cache's contents and block ids")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The options, each checked for its range: a bad one stops here with
    argparse's usage message and exit status 2, before anything is built."""
    p = build_parser()
    args = p.parse_args(argv)
    args.device = pick_device(args.device)
    try:
        args.plan = make_plan(args)
        check_memory(args, args.plan)
    except ValueError as exc:
        p.error(str(exc))
    return args


def pick_device(name: str | torch.device | None) -> torch.device:
    """`name`, else the current accelerator, else the CPU."""
    if name:
        return torch.device(name)
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return torch.device("cpu")
    return acc.current_accelerator()


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )
    info = torch.iinfo(raw.dtype)
    raw.copy_(torch.randint(info.min, info.max, raw.shape, dtype=raw.dtype, generator=gen).to(raw.device))


def report(kind: str, results: list[TransferResult], seconds: float) -> float:
    moved = sum(r.transfer_size for r in results)
    ok = all(r.success for r in results)
    job_times = ", ".join(f"{r.transfer_time * 1e3:.1f}" for r in results)
    rate = moved / seconds / 1e9
    print(
        f"  {kind:<5} {len(results)} jobs, {moved / 2**20:8.1f} MiB in {seconds * 1e3:8.1f} ms "
        f"= {rate:6.2f} GB/s  (success: {ok}; job times from get_finished, ms: {job_times})"
    )
    return rate


def engine_name(device: torch.device) -> str:
    """The engine that moves the bytes of copies on `device` (not merely one
    that loaded: a CUDA engine loaded on a machine with no GPU copies
    nothing), as "host engine (torch_kvswap._C)"."""
    key = _loader.engine_for(device)
    if key is None:
        return f"no kvswap engine for {device}"
    name, module = _loader.ENGINE_NAMES[key]
    return f"{name} ({module})"


def idle_engines(device: torch.device) -> list[str]:
    """Engines that loaded but move none of the demo's bytes."""
    key = _loader.engine_for(device)
    return [_loader.ENGINE_NAMES[k][0] for k, loaded in torch_kvswap.ENGINES.items() if loaded and k != key]


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = args.plan
    device = args.device
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    per_block, num_blocks, shape = plan.per_block, plan.num_blocks, plan.shape
    bytes_per_block_all_layers = plan.bytes_per_block_all_layers
    idle = idle_engines(device)
    print(
        f"torch_kvswap demo on {device}: copies run on the {engine_name(device)}"
        + (f"; loaded, unused here: {', '.join(idle)}" if idle else "")
    )
    print(
        f"  device cache: {args.layers} layers x (K, V) x {shape} {args.dtype} = "
        f"{num_blocks * bytes_per_block_all_layers / 2**30:.2f} GiB, {per_block // 1024} KiB per block "
        f"per tensor"
    )

    caches = {}
    for layer in range(args.layers):
        kv = torch.empty((2, *shape), dtype=dtype, device=device)
        fill_random(kv, gen)
        caches[f"layer.{layer}"] = kv  # [2, num_blocks, ...] stacked layout

    host_blocks_needed = plan.host_blocks
    with KVCacheOffloader(
        caches,
        device_block_size=args.block_tokens,
        host_block_size=args.block_tokens * args.factor,
        num_host_blocks=host_blocks_needed,
    ) as offloader:
        print(
            f"  host mirror:  {host_blocks_needed} host blocks of {args.factor} device blocks, "
            f"{offloader.host_bytes / 2**30:.2f} GiB, pinned: {offloader.pinned}"
        )
        n_dev = host_blocks_needed * args.factor
        device_ids = rng.permutation(num_blocks)[:n_dev].astype(np.int64)
        host_ids = rng.permutation(host_blocks_needed).astype(np.int64)
        # Keep what the blocks held, to check the round trip byte for byte.
        before = {name: kv[:, torch.from_numpy(device_ids).to(device)].cpu() for name, kv in caches.items()}

        # Whole host blocks per job: job i moves jobs_host[i] and its sub-blocks.
        jobs_host = np.array_split(host_ids, args.jobs)
        bounds = np.cumsum([0] + [len(h) for h in jobs_host]) * args.factor
        jobs_dev = [device_ids[bounds[i] : bounds[i + 1]] for i in range(args.jobs)]

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

    print(
        f"  the {engine_name(device)} moved {n_dev} device blocks "
        f"({n_dev * bytes_per_block_all_layers / 2**20:.0f} MiB) each way:"
    )
    report("store", store_results, store_s)
    report("load", load_results, load_s)

    mismatched = [
        name
        for name, kv in caches.items()
        if not torch.equal(
            kv[:, torch.from_numpy(device_ids).to(device)].cpu().view(torch.uint8),
            before[name].view(torch.uint8),
        )
    ]
    ok = not mismatched and all(r.success for r in store_results + load_results)
    verdict = "OK" if ok else "MISMATCH in " + ", ".join(mismatched)
    print(f"  verified every byte of {len(caches)} layers: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
