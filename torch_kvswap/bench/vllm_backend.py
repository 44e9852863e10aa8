"""vLLM simple-offload copy backends side by side on CPU: ``python -m torch_kvswap.bench.vllm_backend``.

Three ways to run one ``launch_copy`` of vLLM's ``SimpleCPUOffloadConnector``
(copy ``n`` blocks of every layer region between the KV cache and its host
mirror), measured in the same run on the same caches and ids:

* ``kvswap``: :class:`~torch_kvswap.integrations.vllm.KVSwapCopyBackend`,
  ``launch_copy`` then the event's ``synchronize()`` (one ``swap_blocks``
  over every region);
* ``loop``: the per-block, per-layer ``copy_`` loop of vLLM's
  ``CpuCopyBackend``, reproduced here: for every region, for every block
  pair, ``dst[d].copy_(src[s])``;
* ``pointers``: vLLM's ``DmaCopyBackend`` call pattern (``copy_backend.py``
  and ``cuda_mem_ops.py``: per-region base addresses and bytes per block built
  once; per launch a queue hands the ids to a copy thread, which computes
  ``base[:, None] + ids[None, :] * bytes_per_block`` with numpy and makes one
  batched call, then signals an event) through torch_kvswap's pointer op
  ``swap_blocks_batch``.

Also timed: ``memcpy``, one contiguous ``copy_`` of the same number of bytes,
the machine's memory-bandwidth bound for the launch.

Every method's destination is compared byte for byte with a plain reference
after its runs. Reported: the median time per launch (methods interleaved
within each repetition) and the ratios ``loop / kvswap`` and
``pointers / kvswap`` (above 1: kvswap is faster) and ``kvswap / memcpy``.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from concurrent.futures import Future

import numpy as np
import torch

from .. import ops
from ..integrations.vllm.copy_backend import KVSwapCopyBackend


def loop_copy(
    src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], src_ids: list[int], dst_ids: list[int]
) -> None:
    """vLLM's CpuCopyBackend: one ``copy_`` per block and layer."""
    for name, s in src.items():
        d = dst[name]
        for i, j in zip(src_ids, dst_ids):
            d[j].copy_(s[i])


class PointerCopy:
    """vLLM's DmaCopyBackend call pattern (a copy thread fed by a queue),
    through ``swap_blocks_batch``."""

    def __init__(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> None:
        self.src_bases = np.array([t.data_ptr() for t in src.values()], dtype=np.uint64)
        self.dst_bases = np.array([t.data_ptr() for t in dst.values()], dtype=np.uint64)
        self.bpb = np.array([t.stride(0) * t.element_size() for t in src.values()], dtype=np.uint64)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def launch(self, src_ids: list[int], dst_ids: list[int]) -> Future:
        done: Future = Future()
        self.jobs.put((src_ids, dst_ids, done))
        return done

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def _loop(self) -> None:
        # A failed copy is the waiter's error, never a copy thread that dies
        # and leaves its waiter blocked.
        while (job := self.jobs.get()) is not None:
            try:
                self.copy(job[0], job[1])
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                job[2].set_exception(exc)
            else:
                job[2].set_result(None)

    def copy(self, src_ids: list[int], dst_ids: list[int]) -> None:
        s = np.array(src_ids, dtype=np.uint64)
        d = np.array(dst_ids, dtype=np.uint64)
        src_all = (self.src_bases[:, None] + s[None, :] * self.bpb[:, None]).ravel()
        dst_all = (self.dst_bases[:, None] + d[None, :] * self.bpb[:, None]).ravel()
        sizes = np.repeat(self.bpb, len(s))
        ops.swap_blocks_batch(
            torch.from_numpy(src_all.view(np.int64)),
            torch.from_numpy(dst_all.view(np.int64)),
            torch.from_numpy(sizes.view(np.int64)),
            ops.Direction.DEVICE_TO_HOST,
        )


def measure(block_kib: float, layers: int, blocks: int, repeats: int, seed: int) -> dict:
    block_bytes = int(block_kib * 1024)
    num = 2 * blocks
    g = torch.Generator().manual_seed(seed)
    device = {
        f"layers.{i}": torch.randint(-128, 127, (num, block_bytes), generator=g, dtype=torch.int8)
        for i in range(layers)
    }
    rng = np.random.default_rng(seed)
    src_ids = sorted(rng.choice(num, blocks, replace=False).tolist())
    dst_ids = rng.permutation(num)[:blocks].tolist()
    want = {n: torch.zeros(num, block_bytes, dtype=torch.int8) for n in device}
    for n in want:
        want[n][dst_ids] = device[n][src_ids]

    hosts = {
        m: {n: torch.zeros(num, block_bytes, dtype=torch.int8) for n in device}
        for m in ("kvswap", "loop", "pointers")
    }
    flat_src = torch.randint(-128, 127, (layers * blocks * block_bytes,), generator=g, dtype=torch.int8)
    flat_dst = torch.zeros_like(flat_src)
    backend = KVSwapCopyBackend()
    backend.init(device, hosts["kvswap"], torch.device("cpu"), None, None)
    pointers = PointerCopy(device, hosts["pointers"])
    events: list = []

    def kvswap():
        backend.launch_copy(src_ids, dst_ids, True, 0, events)
        events.pop()[1].synchronize()

    runs = {
        "kvswap": kvswap,
        "loop": lambda: loop_copy(device, hosts["loop"], src_ids, dst_ids),
        "pointers": lambda: pointers.launch(src_ids, dst_ids).result(),
        "memcpy": lambda: flat_dst.copy_(flat_src),
    }
    times: dict[str, list[float]] = {m: [] for m in runs}
    try:
        for _ in range(repeats):
            for m, fn in runs.items():  # interleaved: drift hits every method alike
                t0 = time.perf_counter()
                fn()
                times[m].append(time.perf_counter() - t0)
    finally:
        backend.shutdown()
        pointers.close()
    for m, host in hosts.items():
        for n in device:
            if not torch.equal(host[n], want[n]):
                raise AssertionError(f"{m}: region {n} differs from the reference copy")
    med = {m: statistics.median(t) for m, t in times.items()}
    return {
        "block_kib": block_kib,
        "layers": layers,
        "blocks": blocks,
        "seconds": med,
        "loop_over_kvswap": med["loop"] / med["kvswap"],
        "pointers_over_kvswap": med["pointers"] / med["kvswap"],
        "kvswap_over_memcpy": med["kvswap"] / med["memcpy"],
        "kvswap_gib_s": layers * blocks * block_bytes / med["kvswap"] / 2**30,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torch_kvswap.bench.vllm_backend",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--block-kib", type=float, nargs="+", default=[4, 32, 256])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="blocks per launch (default: 8 MiB per launch, at least 8 blocks)",
    )
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for the run (the host engine's copy threads)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(
        f"{'block':>8} {'blocks':>6} {'kvswap ms':>10} {'loop ms':>9} {'pointers ms':>11} "
        f"{'memcpy ms':>9} {'loop/kvswap':>11} {'pointers/kvswap':>15} {'kvswap/memcpy':>13} "
        f"{'kvswap GiB/s':>12}"
    )
    for kib in args.block_kib:
        blocks = args.blocks or max(8, int(8 * 1024 // (kib * args.layers)))
        r = measure(kib, args.layers, blocks, args.repeats, args.seed)
        rows.append(r)
        s = r["seconds"]
        print(
            f"{kib:>6g}Ki {blocks:>6} {s['kvswap'] * 1e3:>10.3f} {s['loop'] * 1e3:>9.3f} "
            f"{s['pointers'] * 1e3:>11.3f} {s['memcpy'] * 1e3:>9.3f} {r['loop_over_kvswap']:>11.2f} "
            f"{r['pointers_over_kvswap']:>15.2f} {r['kvswap_over_memcpy']:>13.2f} "
            f"{r['kvswap_gib_s']:>12.2f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
