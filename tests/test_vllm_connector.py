"""vLLM 0.33's own OffloadingConnector (worker role) drives KVSwapOffloadingSpec on CPU caches.

Random store and load jobs go through the connector exactly as vLLM's model
runner calls it (bind_connector_metadata, handle_preemptions, start_load_kv,
wait_for_save, get_finished, build_connector_worker_meta); every loaded byte is
compared with a plain reference model of the host chunks, and the byte counts
vLLM records are compared with what each job moves.

Runs in the vLLM environment made by scripts/test_vllm.sh; skipped elsewhere.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import vllm  # noqa: F401
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
except Exception as exc:
    if os.environ.get("KVSWAP_REQUIRE_VLLM") == "1":  # scripts/test_vllm.sh: never skip
        raise
    pytest.skip(
        f"vLLM 0.33 is not importable here ({type(exc).__name__}: {exc}); run bash scripts/test_vllm.sh",
        allow_module_level=True,
    )

import torch_kvswap
from torch_kvswap.integrations import vllm as kvswap_vllm
from vllm_helpers import BLOCK_TOKENS, LAYERS, per_layer_kv_cache_config, vllm_config
from vllm_helpers import offloading_config as vllms_offloading_config

NUM_BLOCKS = 48


def attention_spec(sliding: bool):
    kw = dict(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float16)
    return SlidingWindowSpec(sliding_window=64, **kw) if sliding else FullAttentionSpec(**kw)


def build(layout: str, blocks_per_chunk: int, num_chunks: int = 40):
    """A worker-role OffloadingConnector over CPU caches for `layout`.

    Returns (connector, caches by layer, layer names per group)."""
    page = attention_spec(False).page_size_bytes
    if layout == "one":
        groups = [LAYERS]
        tensors = {
            name: torch.zeros(NUM_BLOCKS, 2, BLOCK_TOKENS, 2, 64, dtype=torch.float16) for name in LAYERS
        }
        placement = [[name] for name in LAYERS]
    elif layout == "hybrid_shared":
        # Full attention (layers 0, 2) and sliding window (1, 3) overlay one
        # allocation: layers 0 and 1 share a tensor, as do 2 and 3.
        groups = [[LAYERS[0], LAYERS[2]], [LAYERS[1], LAYERS[3]]]
        shared = [torch.zeros(NUM_BLOCKS, 2, BLOCK_TOKENS, 2, 64, dtype=torch.float16) for _ in range(2)]
        tensors = {LAYERS[0]: shared[0], LAYERS[1]: shared[0], LAYERS[2]: shared[1], LAYERS[3]: shared[1]}
        placement = [[LAYERS[0], LAYERS[1]], [LAYERS[2], LAYERS[3]]]
    elif layout == "disjoint":
        groups = [[LAYERS[0], LAYERS[1]], [LAYERS[2], LAYERS[3]]]
        tensors = {
            name: torch.zeros(NUM_BLOCKS, 2, BLOCK_TOKENS, 2, 64, dtype=torch.float16) for name in LAYERS
        }
        placement = [[name] for name in LAYERS]
    else:
        raise ValueError(layout)
    total = page * NUM_BLOCKS * len(placement)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=total, layers=names, layer_stride=page * NUM_BLOCKS, block_stride=page)
            for names in placement
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(names, attention_spec(sliding=g > 0)) for g, names in enumerate(groups)
        ],
    )
    # cpu_bytes_to_use for exactly num_chunks chunks (vLLM's own sizing).
    bytes_per_chunk = -(-(total // NUM_BLOCKS) * blocks_per_chunk // 4096) * 4096
    extra = {
        "spec_name": "KVSwapOffloadingSpec",
        "spec_module_path": "torch_kvswap.integrations.vllm",
        "cpu_bytes_to_use": num_chunks * bytes_per_chunk,
        "blocks_per_chunk": blocks_per_chunk,
    }
    config = vllm_config(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    with set_current_vllm_config(config):
        connector = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches(tensors)
    return connector, tensors, groups


@dataclass
class Stored:
    """A finished store: group g's logical blocks first..first+n-1 in `chunks`."""

    group: int
    first: int  # logical block index of the first block (its block_indices entry)
    chunks: list[int]
    data: list[dict[str, torch.Tensor]]  # per block: layer -> bytes


@dataclass
class Harness:
    connector: object
    caches: dict
    groups: list
    bpc: int
    rng: random.Random
    free_chunks: list = field(default_factory=list)
    busy: dict = field(default_factory=dict)  # device block -> job id
    stores: dict = field(default_factory=dict)  # job id -> (Stored, expected bytes)
    loads: dict = field(default_factory=dict)  # job id -> ([(group, dev ids, Stored slice)], bytes, sync)
    stored: list = field(default_factory=list)  # finished Stored
    next_job: int = 0
    store_bytes: list = field(default_factory=list)
    load_bytes: list = field(default_factory=list)
    checked_blocks: int = 0

    def block_bytes(self, g: int) -> int:
        return sum(self.caches[name][0].numel() * 2 for name in self.groups[g])

    def free_device_blocks(self, n: int, taken: list[int] = ()) -> list[int]:
        free = [b for b in range(NUM_BLOCKS) if b not in self.busy and b not in taken]
        return self.rng.sample(free, n) if len(free) >= n else []

    def forward(self) -> None:
        """The model writes every device block no job reads or fills."""
        for b in range(NUM_BLOCKS):
            if b in self.busy:
                continue
            for names in self.groups:
                for name in names:
                    self.caches[name][b] = torch.randn(self.caches[name][b].shape).half()

    def new_store(self) -> tuple[int, TransferJob] | None:
        sizes, indices, dev_all, chunks_all, records = [], [], [], [], []
        for g in range(len(self.groups)):
            n = self.rng.choice([0, 1, 2, self.bpc, self.bpc + 1, 2 * self.bpc + 1])
            first = self.rng.randrange(0, 4 * self.bpc)
            n_chunks = -(-(n + first % self.bpc) // self.bpc) if n else 0
            dev = self.free_device_blocks(n, dev_all) if n else []
            if len(dev) != n or len(self.free_chunks) < n_chunks:
                n, dev, n_chunks = 0, [], 0
            chunks = [self.free_chunks.pop() for _ in range(n_chunks)]
            data = [{name: self.caches[name][d].clone() for name in self.groups[g]} for d in dev]
            sizes.append(n)
            indices.append(first)
            dev_all += dev
            chunks_all += chunks
            if n:
                records.append(Stored(g, first, chunks, data))
        if not dev_all:
            return None
        job = self.next_job
        self.next_job += 1
        for d in dev_all:
            self.busy[d] = job
        nbytes = sum(n * self.block_bytes(g) for g, n in enumerate(sizes))
        self.stores[job] = (records, nbytes, dev_all)
        return job, TransferJob(
            f"s{job}", GPULoadStoreSpec(dev_all, sizes, indices), CPULoadStoreSpec(chunks_all)
        )

    def new_load(self, sync: bool) -> tuple[int, TransferJob] | None:
        sizes, indices, dev_all, chunks_all, parts = [], [], [], [], []
        for g in range(len(self.groups)):
            candidates = [s for s in self.stored if s.group == g]
            if not candidates or self.rng.random() < 0.3:
                sizes.append(0)
                indices.append(0)
                continue
            src = self.rng.choice(candidates)
            n_total = len(src.data)
            a = self.rng.randrange(n_total)
            b = self.rng.randrange(a + 1, n_total + 1)
            dev = self.free_device_blocks(b - a, dev_all)
            if not dev:
                sizes.append(0)
                indices.append(0)
                continue
            first = src.first + a
            off0 = src.first % self.bpc
            c0 = (off0 + a) // self.bpc
            c1 = (off0 + b - 1) // self.bpc
            sizes.append(b - a)
            indices.append(first)
            dev_all += dev
            chunks_all += src.chunks[c0 : c1 + 1]
            parts.append((g, dev, src.data[a:b]))
        if not dev_all:
            return None
        job = self.next_job
        self.next_job += 1
        for d in dev_all:
            self.busy[d] = job
        nbytes = sum(n * self.block_bytes(g) for g, n in enumerate(sizes))
        self.loads[job] = (parts, nbytes, dev_all)
        return job, TransferJob(
            f"l{job}", CPULoadStoreSpec(chunks_all), GPULoadStoreSpec(dev_all, sizes, indices), sync=sync
        )

    def check_load(self, job: int) -> None:
        parts, _, dev_all = self.loads.pop(job)
        for g, dev, data in parts:
            for d, want in zip(dev, data):
                for name in self.groups[g]:
                    got = self.caches[name][d]
                    assert torch.equal(got.view(torch.uint8), want[name].view(torch.uint8)), (
                        f"load job {job}: device block {d} of {name} differs from the stored bytes"
                    )
                    self.checked_blocks += 1
        for d in dev_all:
            del self.busy[d]

    def finish_store(self, job: int) -> None:
        records, _, dev_all = self.stores.pop(job)
        self.stored += records
        for d in dev_all:
            del self.busy[d]

    def collect(self) -> None:
        self.connector.get_finished(set())
        meta = self.connector.build_connector_worker_meta()
        if meta is None:
            return
        store_sizes = iter(meta.transfer_stats.store.sizes)
        load_sizes = iter(meta.transfer_stats.load.sizes)
        for job in meta.completed_jobs:
            if job in self.stores:
                assert next(store_sizes) == self.stores[job][1], f"store job {job}: vLLM's byte count"
                self.store_bytes.append(self.stores[job][1])
                self.finish_store(job)
            else:
                assert next(load_sizes) == self.loads[job][1], f"load job {job}: vLLM's byte count"
                self.load_bytes.append(self.loads[job][1])
                self.check_load(job)

    def step(self) -> None:
        loads, stores, flush = {}, {}, None
        for _ in range(self.rng.randint(0, 2)):
            made = self.new_load(sync=self.rng.random() < 0.4)
            if made:
                loads[made[0]] = made[1]
        for _ in range(self.rng.randint(0, 2)):
            made = self.new_store()
            if made:
                stores[made[0]] = made[1]
        in_flight_stores = [j for j in self.stores if j not in stores]
        if in_flight_stores and self.rng.random() < 0.2:
            flush = set(self.rng.sample(in_flight_stores, k=min(2, len(in_flight_stores))))
        meta = OffloadingConnectorMetadata(load_jobs=loads, store_jobs=stores, jobs_to_flush=flush)
        c = self.connector
        c.bind_connector_metadata(meta)
        if flush:
            c.handle_preemptions(meta)
        c.start_load_kv(None)
        # Sync loads are finished when start_load_kv returns: check them now.
        for job, entry in loads.items():
            if entry.sync:
                assert job in self.loads
        self.forward()
        c.wait_for_save()
        self.collect()
        c.clear_connector_metadata()

    def drain(self) -> None:
        flush = set(self.stores)
        meta = OffloadingConnectorMetadata(load_jobs={}, store_jobs={}, jobs_to_flush=flush)
        self.connector.bind_connector_metadata(meta)
        self.connector.handle_preemptions(meta)
        self.connector.connector_worker.worker.wait(set(self.loads))
        self.collect()
        self.connector.clear_connector_metadata()
        assert not self.stores and not self.loads


def chunk_pool(rng: random.Random, n: int) -> list[int]:
    pool = list(range(n))
    rng.shuffle(pool)
    return pool


@pytest.mark.parametrize("layout", ["one", "hybrid_shared", "disjoint"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
def test_vllm_connector_moves_random_jobs_byte_exact(layout, blocks_per_chunk):
    rng = random.Random(f"{layout}-{blocks_per_chunk}")
    connector, caches, groups = build(layout, blocks_per_chunk, num_chunks=400)
    worker = connector.connector_worker.worker
    assert type(worker).__name__ == "KVSwapOffloadingWorker"
    assert worker.offloader.num_host_blocks == 400
    h = Harness(connector, caches, groups, blocks_per_chunk, rng, free_chunks=chunk_pool(rng, 400))
    try:
        for _ in range(60):
            h.step()
        h.drain()
    finally:
        connector.shutdown()
    assert h.checked_blocks > 50 and len(h.store_bytes) > 20 and len(h.load_bytes) > 10


@pytest.mark.parametrize("layout", ["one", "disjoint"])
def test_unaligned_first_and_last_chunks_both_directions(layout):
    # Offsets 0 and bpc-1, partial chunks of one block, at both ends.
    bpc = 4
    connector, caches, groups = build(layout, bpc, num_chunks=64)
    rng = random.Random(5)
    h = Harness(connector, caches, groups, bpc, rng, free_chunks=list(range(64))[::-1])
    try:
        for first, n in [(0, 1), (3, 1), (3, 2), (1, 4), (3, 6), (0, 4), (2, 9)]:
            h.forward()
            dev = h.free_device_blocks(n * len(groups))
            sizes = [n] * len(groups)
            per = -(-(n + first % bpc) // bpc)
            chunks = [h.free_chunks.pop() for _ in range(per * len(groups))]
            job = h.next_job
            h.next_job += 1
            records = []
            for g in range(len(groups)):
                d = dev[g * n : (g + 1) * n]
                records.append(
                    Stored(
                        g,
                        first,
                        chunks[g * per : (g + 1) * per],
                        [{name: caches[name][b].clone() for name in groups[g]} for b in d],
                    )
                )
            for b in dev:
                h.busy[b] = job
            h.stores[job] = (records, sum(n * h.block_bytes(g) for g in range(len(groups))), dev)
            meta = OffloadingConnectorMetadata(
                load_jobs={},
                store_jobs={
                    job: TransferJob(
                        "r", GPULoadStoreSpec(dev, sizes, [first] * len(groups)), CPULoadStoreSpec(chunks)
                    )
                },
                jobs_to_flush=None,
            )
            connector.bind_connector_metadata(meta)
            connector.start_load_kv(None)
            connector.wait_for_save()
            connector.clear_connector_metadata()
            h.drain()
            # Load every single block back on its own (offset = its position),
            # then the whole run, as sync (expedited) loads.
            for s in [r for r in h.stored if r.first == first][-len(groups) :]:
                for a in range(len(s.data)):
                    pos = (first % bpc) + a
                    dst = h.free_device_blocks(1)
                    job = h.next_job
                    h.next_job += 1
                    h.busy[dst[0]] = job
                    sizes = [1 if g == s.group else 0 for g in range(len(groups))]
                    h.loads[job] = ([(s.group, dst, s.data[a : a + 1])], h.block_bytes(s.group), dst)
                    meta = OffloadingConnectorMetadata(
                        load_jobs={
                            job: TransferJob(
                                "r",
                                CPULoadStoreSpec([s.chunks[pos // bpc]]),
                                GPULoadStoreSpec(
                                    dst, sizes, [first + a if g == s.group else 0 for g in range(len(groups))]
                                ),
                                sync=True,
                            )
                        },
                        store_jobs={},
                    )
                    connector.bind_connector_metadata(meta)
                    connector.start_load_kv(None)
                    connector.wait_for_save()
                    h.collect()
                    connector.clear_connector_metadata()
        assert not h.loads
    finally:
        connector.shutdown()


def test_a_failed_job_raises_naming_the_job_the_copy_and_the_cause():
    connector, caches, groups = build("one", 2, num_chunks=8)
    worker = connector.connector_worker.worker
    real = worker.offloader._copy

    def broken(job):
        raise RuntimeError("simulated copy failure")

    worker.offloader._copy = broken
    try:
        meta = OffloadingConnectorMetadata(
            load_jobs={},
            store_jobs={7: TransferJob("r", GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0]))},
            jobs_to_flush={7},
        )
        connector.bind_connector_metadata(meta)
        connector.handle_preemptions(meta)
        # Not vLLM's `assert success` (gone under python -O): the worker raises.
        with pytest.raises(
            kvswap_vllm.TransferFailed,
            match=r"vLLM offloading job 7 failed: store of device blocks \[1, 2\] -> "
            r"host chunks \[0\]: RuntimeError: simulated copy failure",
        ):
            connector.get_finished(set())
    finally:
        worker.offloader._copy = real
        connector.shutdown()


def test_a_failed_load_names_its_blocks_and_chunks():
    connector, caches, groups = build("one", 2, num_chunks=8)
    worker = connector.connector_worker.worker
    worker.offloader._copy = lambda job: (_ for _ in ()).throw(OSError("bad host page"))
    try:
        worker.submit_load(3, CPULoadStoreSpec([5, 6]), GPULoadStoreSpec([9, 10, 11], [3], [1]))
        worker.wait({3})
        with pytest.raises(
            kvswap_vllm.TransferFailed,
            match=r"job 3 failed: load of device blocks \[9, 10, 11\] <- host chunks "
            r"\[5, 6\]: OSError: bad host page",
        ):
            worker.get_finished()
    finally:
        connector.shutdown()


def build_scheduler_connector(extra: dict) -> None:
    """vLLM's OffloadingConnector, scheduler role, with the plug-in's spec and `extra` keys."""
    config = vllm_config(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "KVSwapOffloadingSpec",
            "spec_module_path": "torch_kvswap.integrations.vllm",
            "cpu_bytes_to_use": 1 << 20,
            **extra,
        },
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, attention_spec(False))],
    )
    with set_current_vllm_config(config):
        OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"canonical_layout": True}, "does not support canonical_layout"),
        ({"secondary_tiers": []}, r"does not support kv_connector_extra_config keys \['secondary_tiers'\]"),
        ({"cpu_bytes_to_use_typo": 1}, r"keys \['cpu_bytes_to_use_typo'\]"),
    ],
)
def test_unsupported_keys_are_refused_when_the_spec_is_built(extra, message):
    with pytest.raises(ValueError, match=message):
        build_scheduler_connector(extra)


def test_kvswap_check_key_is_accepted_and_turns_checked_mode_on():
    try:
        build_scheduler_connector({"kvswap_check": True})
        assert torch_kvswap.is_checked()
    finally:
        torch_kvswap.set_checked(False)


def test_kv_offloading_size_sizes_the_host_mirrors():
    # vLLM's --kv-offloading-size (GiB): it selects the OffloadingConnector
    # and sets cpu_bytes_to_use; the extra config names only the spec.
    config = vllm_config(
        {"kv_offloading_size": 0.001, "kv_offloading_backend": "native"},
        kv_connector_extra_config={
            "spec_name": "KVSwapOffloadingSpec",
            "spec_module_path": "torch_kvswap.integrations.vllm",
            "blocks_per_chunk": 1,
        },
    )
    assert config.kv_transfer_config.kv_connector == "OffloadingConnector"
    page = attention_spec(False).page_size_bytes
    kv_cache_config = per_layer_kv_cache_config(attention_spec(False), NUM_BLOCKS)
    with set_current_vllm_config(config):
        connector = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches(
        {name: torch.zeros(NUM_BLOCKS, 2, BLOCK_TOKENS, 2, 64, dtype=torch.float16) for name in LAYERS}
    )
    try:
        off = connector.connector_worker.worker.offloader
        want = int(0.001 * 2**30) // (-(-4 * page // 4096) * 4096)
        assert off.num_host_blocks == connector.connector_worker.spec.num_chunks == want > 0
        assert off.host_bytes_needed <= 0.001 * 2**30
    finally:
        connector.shutdown()


def test_a_kv_offloading_size_too_small_is_named_as_the_flag():
    # vLLM writes --kv-offloading-size into cpu_bytes_to_use itself: the error
    # names the flag the user gave, not kv_connector_extra_config
    config = vllm_config(
        {"kv_offloading_size": 0.000001, "kv_offloading_backend": "native"},
        kv_connector_extra_config={
            "spec_name": "KVSwapOffloadingSpec",
            "spec_module_path": "torch_kvswap.integrations.vllm",
            "blocks_per_chunk": 1,
        },
    )
    kv_cache_config = per_layer_kv_cache_config(attention_spec(False), NUM_BLOCKS)
    with set_current_vllm_config(config):
        connector = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    with pytest.raises(
        ValueError,
        match=r"^--kv-offloading-size 1e-06 \(GiB\) holds no chunk of this model's "
        r"KV cache \(1 blocks of every cache tensor\): raise it$",
    ):
        connector.register_kv_caches(
            {name: torch.zeros(NUM_BLOCKS, 2, BLOCK_TOKENS, 2, 64, dtype=torch.float16) for name in LAYERS}
        )


def test_host_memory_comes_from_cpu_bytes_to_use():
    connector, caches, groups = build("disjoint", 4, num_chunks=10)
    try:
        off = connector.connector_worker.worker.offloader
        spec = connector.connector_worker.spec
        assert off.num_host_blocks == spec.num_chunks == 10
        assert off.host_bytes_needed <= spec.extra_config["cpu_bytes_to_use"]
        assert off.buffer.data_ptr() % 4096 == 0
        assert off.groups == [[0, 1], [2, 3]]
    finally:
        connector.shutdown()


def test_the_spec_is_found_through_vllms_factory():
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    cls = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "KVSwapOffloadingSpec", "spec_module_path": "torch_kvswap.integrations.vllm"}
    )
    assert cls is kvswap_vllm.KVSwapOffloadingSpec
    assert kvswap_vllm.check_vllm().OffloadingWorker.__name__ == "OffloadingWorker"


# -- MLA under tensor parallelism: vLLM's one-copy shared host region ---------------


def offloading_config(
    tp: int, rank: int, replicated: bool, engine_id: str, cpu_bytes: int, blocks_per_chunk: int = 2
):
    """vLLM's own OffloadingConfig for this model, as worker `rank` of `tp`."""
    config = vllm_config(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config={
            "spec_name": "KVSwapOffloadingSpec",
            "spec_module_path": "torch_kvswap.integrations.vllm",
            "cpu_bytes_to_use": cpu_bytes,
            "blocks_per_chunk": blocks_per_chunk,
        },
    )
    return vllms_offloading_config(
        config,
        per_layer_kv_cache_config(attention_spec(False), NUM_BLOCKS),
        tp,
        rank,
        replicated_layout=replicated,
    )


@pytest.fixture
def cuda_like_platform(monkeypatch):
    """vLLM's CPUOffloadingSpec uses its shared region on CUDA (and XPU) only."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: True)


@pytest.mark.parametrize("tp", [4, 8])
def test_mla_under_tp_holds_as_many_chunks_as_vllms_own_spec(cuda_like_platform, tp):
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    cpu_bytes = 64 << 20
    for replicated in (True, False):
        config = offloading_config(tp, 0, replicated, "capacity", cpu_bytes)
        ours, theirs = kvswap_vllm.KVSwapOffloadingSpec(config), CPUOffloadingSpec(config)
        assert ours.replicated_layout == theirs.replicated_layout == replicated
        assert ours.num_chunks == theirs.num_chunks > 0
    one_copy = kvswap_vllm.KVSwapOffloadingSpec(offloading_config(tp, 0, True, "c", cpu_bytes)).num_chunks
    per_rank = kvswap_vllm.KVSwapOffloadingSpec(offloading_config(tp, 0, False, "c", cpu_bytes)).num_chunks
    assert one_copy >= tp * per_rank


def test_replicated_workers_share_one_host_copy(cuda_like_platform, monkeypatch):
    """Four TP workers (threads here, processes in vLLM) map vLLM's one-copy
    region: what rank 0 stores, rank 3 loads, byte-exact; the region is
    cpu_bytes_to_use at most, and every rank holds vLLM's chunk count."""
    import threading
    import uuid

    from vllm.v1.kv_offload.cpu import spec as cpu_spec

    tp, cpu_bytes, bpc = 4, 8 << 20, 2
    barrier = threading.Barrier(tp, timeout=60)
    monkeypatch.setattr(cpu_spec, "_all_workers_barrier", barrier.wait)
    captured = {}
    real_get_worker = kvswap_vllm.KVSwapOffloadingSpec.get_worker

    def capture(self, kv_caches):
        captured["kv_caches"] = kv_caches
        return real_get_worker(self, kv_caches)

    monkeypatch.setattr(kvswap_vllm.KVSwapOffloadingSpec, "get_worker", capture)
    connector, caches, groups = build("one", bpc, num_chunks=4)
    connector.shutdown()
    engine_id = f"kvswap-test-{uuid.uuid4().hex[:8]}"
    workers, errors = [None] * tp, []

    def start(rank):
        try:
            spec = kvswap_vllm.KVSwapOffloadingSpec(
                offloading_config(tp, rank, True, engine_id, cpu_bytes, bpc)
            )
            workers[rank] = spec.get_worker(captured["kv_caches"])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=start, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    try:
        theirs = cpu_spec.CPUOffloadingSpec(offloading_config(tp, 0, True, engine_id, cpu_bytes, bpc))
        region = workers[0].shared_region
        assert region.total_size_bytes <= cpu_bytes
        for w in workers:
            assert w.offloader.num_host_blocks == theirs.num_chunks
        for name in LAYERS:
            caches[name].copy_(torch.randn(caches[name].shape).half())
        want = {name: caches[name][[3, 4, 5]].clone() for name in LAYERS}
        workers[0].submit_store(1, GPULoadStoreSpec([3, 4, 5], [3], [0]), CPULoadStoreSpec([6, 7]))
        workers[0].wait({1})
        assert [r.job_id for r in workers[0].get_finished()] == [1]
        for name in LAYERS:
            caches[name].zero_()
        workers[3].submit_load(2, CPULoadStoreSpec([6, 7]), GPULoadStoreSpec([10, 11, 12], [3], [0]))
        workers[3].wait({2})
        assert [r.job_id for r in workers[3].get_finished()] == [2]
        for name in LAYERS:
            assert torch.equal(caches[name][[10, 11, 12]], want[name]), name
    finally:
        for w in workers:
            if w is not None:
                w.shutdown()
