"""How torch_kvswap builds and installs: which engines a build chooses and
why, the refusal of a build that could not match the running torch, the
version guard on import, and the environment report.

The whole install paths (isolated pip, sdist -> wheel -> clean venv, the
torch release matrix) run in scripts/check_install.sh and
scripts/test_torch_matrix.sh, which .ci/run calls; these tests pin down the
decisions those paths depend on.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import torch_kvswap
from torch_kvswap import _loader, envreport

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kvswap_setup", ROOT / "setup.py")
setup_py = importlib.util.module_from_spec(_spec)
sys.modules["kvswap_setup"] = setup_py  # dataclasses look their module up
_spec.loader.exec_module(setup_py)  # defines the build logic; setup() runs only as __main__
from setup_helpers import build_command  # noqa: E402  (setup.py put the tree on the path)
from setup_helpers import engines as build_engines  # noqa: E402

NVCC_13_0 = ["7.5", "8.0", "8.6", "8.7", "8.8", "8.9", "9.0", "10.0", "10.3", "11.0", "12.0", "12.1"]


def facts(**kw) -> build_engines.Facts:
    base = dict(
        torch_version="2.15.0+cu130",
        torch_cuda="13.0",
        cuda_home="/usr/local/cuda",
        nvcc_version="13.0",
        nvcc_archs=NVCC_13_0,
        visible_gpus=0,
        torch_npu_root=None,
        cuda_headers="/usr/local/cuda/include",
        env={},
    )
    base.update(kw)
    return build_engines.Facts(**base)


# ---------------------------------------------------------------- CUDA engine


def test_cuda_engine_on_a_machine_with_nvcc_and_no_gpu_builds_for_the_default_archs():
    d = build_engines.decide_cuda(facts())
    assert d.build and d.arch_list == "8.0;9.0;10.0;12.0+PTX"


def test_nvcc_arch_listing_is_read_as_torch_arch_names():
    listing = "compute_75\ncompute_80\ncompute_90\ncompute_100\ncompute_120\ncompute_121\n"
    assert build_engines.parse_gpu_archs(listing) == ["7.5", "8.0", "9.0", "10.0", "12.0", "12.1"]


def test_default_archs_drop_what_nvcc_cannot_target_and_keep_ptx_on_the_newest():
    d = build_engines.decide_cuda(
        facts(torch_cuda="12.4", nvcc_version="12.4", nvcc_archs=["5.0", "7.5", "8.0", "8.6", "8.9", "9.0"])
    )
    assert d.build and d.arch_list == "8.0;9.0+PTX"


def test_no_default_arch_that_nvcc_supports_means_not_built_with_the_reason():
    d = build_engines.decide_cuda(facts(nvcc_archs=["5.0", "6.0"]))
    assert not d.build and "targets none of" in d.reason and "TORCH_CUDA_ARCH_LIST" in d.enable


def test_torch_cuda_arch_list_overrides_the_default():
    d = build_engines.decide_cuda(facts(env={"TORCH_CUDA_ARCH_LIST": "9.0"}))
    assert d.build and d.arch_list == "9.0"


def test_a_visible_gpu_leaves_the_arch_choice_to_torch():
    d = build_engines.decide_cuda(facts(visible_gpus=1))
    assert d.build and d.arch_list is None


def test_cpu_torch_skips_the_cuda_engine_and_says_how_to_enable_it():
    d = build_engines.decide_cuda(facts(torch_version="2.13.0+cpu", torch_cuda=None))
    assert not d.build and "2.13.0+cpu is not a CUDA build" in d.reason and "CUDA build of torch" in d.enable


def test_cpu_torch_with_the_cuda_engine_forced_builds_it():
    d = build_engines.decide_cuda(facts(torch_cuda=None, env={"KVSWAP_BUILD_CUDA": "1"}))
    assert d.build and d.forced


def test_nvcc_of_another_major_version_than_torch_skips_the_engine():
    d = build_engines.decide_cuda(facts(torch_cuda="12.8", nvcc_version="13.0"))
    assert not d.build and "differ in major version" in d.reason and "12.x" in d.enable


def test_nvcc_of_another_minor_version_builds():
    assert build_engines.decide_cuda(facts(torch_cuda="13.2", nvcc_version="13.0")).build


def test_no_toolkit_skips_the_engine():
    d = build_engines.decide_cuda(facts(cuda_home=None, nvcc_version=None))
    assert not d.build and "no CUDA toolkit" in d.reason


def test_cuda_home_skips_a_folder_without_the_runtime_headers(tmp_path):
    # nvcc on the path may be a wrapper script in /usr/local/bin, which makes
    # torch guess /usr/local; the toolkit is where the headers are.
    def toolkit(path: Path, headers: bool) -> str:
        (path / "bin").mkdir(parents=True)
        (path / "bin" / "nvcc").write_text("")
        if headers:
            (path / "include").mkdir()
            (path / "include" / "cuda_runtime_api.h").write_text("")
        return str(path)

    wrapper_prefix = toolkit(tmp_path / "usr-local", headers=False)
    real = toolkit(tmp_path / "cuda-13.0", headers=True)
    assert build_engines.find_cuda_home(wrapper_prefix, env={"CUDA_PATH": real}) == real
    assert build_engines.find_cuda_home(real, env={}) == real
    assert build_engines.find_cuda_home(wrapper_prefix, env={"CUDA_HOME": wrapper_prefix}) in (
        None,
        "/usr/local/cuda",
    )


def test_kvswap_build_cuda_0_skips_the_engine():
    d = build_engines.decide_cuda(facts(env={"KVSWAP_BUILD_CUDA": "0"}))
    assert not d.build and d.reason == "KVSWAP_BUILD_CUDA=0"


def test_a_forced_engine_that_cannot_be_built_stops_the_build():
    cuda = build_engines.decide_cuda(facts(cuda_home=None, nvcc_version=None, env={"KVSWAP_BUILD_CUDA": "1"}))
    with pytest.raises(
        SystemExit, match="KVSWAP_BUILD_CUDA=1 but the engine cannot be built: no CUDA toolkit"
    ):
        build_engines.refuse_impossible_forced(cuda, build_engines.decide_npu(facts()))


# ---------------------------------------------------------------- Ascend engine, fakes


def test_ascend_engine_builds_when_torch_npu_is_installed_even_without_nvcc(tmp_path):
    f = facts(
        torch_version="2.13.0", torch_cuda=None, cuda_home=None, nvcc_version=None, torch_npu_root=tmp_path
    )
    assert build_engines.decide_npu(f).build and not build_engines.decide_cuda(f).build


def test_ascend_engine_without_torch_npu_names_the_matching_release():
    d = build_engines.decide_npu(facts(torch_version="2.14.0+cpu"))
    assert not d.build and d.reason == "torch_npu is not installed" and "torch-npu==2.14.0" in d.enable


def test_forced_ascend_engine_without_torch_npu_stops_the_build():
    npu = build_engines.decide_npu(facts(env={"KVSWAP_BUILD_NPU": "1"}))
    with pytest.raises(SystemExit, match="KVSWAP_BUILD_NPU=1 but the engine cannot be built"):
        build_engines.refuse_impossible_forced(build_engines.decide_cuda(facts()), npu)


def _cxx(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["g++", *args], cwd=cwd, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_ascend_build_finds_acl_headers_where_torch_npu_2_10_0_post4_keeps_them(tmp_path):
    # torch-npu 2.10.0.post4 ships CANN's headers only under include/third_party/acl/inc.
    acl = tmp_path / "torch_npu" / "include" / "third_party" / "acl" / "inc" / "acl"
    acl.mkdir(parents=True)
    (acl / "acl_rt.h").write_text("#define KVSWAP_TEST_ACL_RT 1\n")
    (tmp_path / "probe.cpp").write_text("#include <acl/acl_rt.h>\nstatic_assert(KVSWAP_TEST_ACL_RT == 1);\n")
    ext = setup_py.npu_extension(build_engines.Decision(True), tmp_path / "torch_npu")
    out = _cxx(
        "-std=c++17", "-fsyntax-only", *(f"-I{d}" for d in ext.include_dirs), "probe.cpp", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("readelf") is None, reason="needs g++, readelf"
)
def test_ascend_build_depends_on_libtorch_npu_only_where_the_engine_calls_into_it(tmp_path):
    # Before torch_npu 2.13 the engine calls NPUStream::stream() (csrc/ascend/acl_real.cpp);
    # from 2.13 on it references nothing of libtorch_npu and must not depend on it.
    lib = tmp_path / "torch_npu" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "npu.cpp").write_text("int kvswap_test_npu_stream() { return 1; }\n")
    (tmp_path / "calls.cpp").write_text(
        "int kvswap_test_npu_stream();\nint f() { return kvswap_test_npu_stream(); }\n"
    )
    (tmp_path / "plain.cpp").write_text("int g() { return 2; }\n")
    built = _cxx(
        "-shared",
        "-fPIC",
        "-Wl,-soname,libtorch_npu.so",
        "npu.cpp",
        "-o",
        str(lib / "libtorch_npu.so"),
        cwd=tmp_path,
    )
    assert built.returncode == 0, built.stderr
    ext = setup_py.npu_extension(build_engines.Decision(True), tmp_path / "torch_npu")
    needed = {}
    for name in ("calls", "plain"):
        # setuptools' order: objects, libraries, -o, then extra_link_args. --no-as-needed first:
        # some toolchains pass --as-needed by default (Debian's), others do not.
        linked = _cxx(
            "-shared",
            "-fPIC",
            "-Wl,--no-as-needed",
            f"{name}.cpp",
            "-o",
            f"{name}.so",
            *ext.extra_link_args,
            cwd=tmp_path,
        )
        assert linked.returncode == 0, linked.stderr
        dynamic = subprocess.run(
            ["readelf", "-d", f"{name}.so"], cwd=tmp_path, capture_output=True, text=True, check=True
        ).stdout
        needed[name] = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic)
    assert "libtorch_npu.so" in needed["calls"]
    assert "libtorch_npu.so" not in needed["plain"] and needed["plain"]


def _ascend_compile_pairs() -> list[tuple[str, str, str]]:
    script = (ROOT / "scripts" / "check_engines.sh").read_text()
    listed = re.search(r"^NPU_PAIRS=\((.*)\)$", script, re.M)
    assert listed, "scripts/check_engines.sh lists its torch / torch-npu pairs in NPU_PAIRS=(...)"
    return [tuple(p.split()) for p in re.findall(r'"([^"]+)"', listed.group(1))]


def test_ascend_compile_check_includes_the_oldest_supported_torch_and_the_docs_name_every_pair():
    pairs = _ascend_compile_pairs()
    assert min(setup_py.release(t)[:2] for t, _, _ in pairs) == setup_py.MIN_TORCH
    docs = (ROOT / "docs" / "ascend.md").read_text()
    readme = (ROOT / "README.md").read_text().replace("\n   ", " ")
    for torch_v, npu_v, std in pairs:
        assert std in ("c++17", "c++20")
        assert f"{torch_v} / {npu_v}" in docs and f"{torch_v} / {npu_v}" in readme, (torch_v, npu_v)


def test_test_fakes_are_built_only_when_asked():
    assert not build_engines.decide_fakes(facts()).build
    assert build_engines.decide_fakes(facts(env={"KVSWAP_BUILD_FAKES": "1"})).build
    assert not build_engines.decide_fakes(facts(env={"KVSWAP_BUILD_FAKES": "1"}, cuda_headers=None)).build


# ---------------------------------------------------------------- build summary


def test_build_summary_has_one_line_per_engine_with_reason_and_remedy():
    info = {
        "torch": "2.13.0+cpu",
        "cuda_arch_list": None,
        "engines": {
            "host": {"built": True},
            "cuda": {"built": False, "reason": "torch 2.13.0+cpu is not a CUDA build", "enable": "install X"},
            "npu": {
                "built": False,
                "reason": "torch_npu is not installed",
                "enable": "pip install torch-npu",
            },
        },
    }
    lines = build_command.summary_lines(info)
    assert lines[0] == "torch_kvswap: built against torch 2.13.0+cpu"
    assert lines[1].endswith("(_C): built")
    assert "not built: torch 2.13.0+cpu is not a CUDA build; to enable: install X" in lines[2]
    assert "not built: torch_npu is not installed; to enable: pip install torch-npu" in lines[3]
    assert len(lines) == 4


def test_setup_py_and_the_package_share_one_install_command_version_parse_and_engine_summary():
    from torch_kvswap import _build_shared, envreport

    assert setup_py.INSTALL_COMMAND == _loader.INSTALL_COMMAND == "pip install --no-build-isolation ."
    # setup.py loads the module by its path (it cannot import the package): the same file's functions.
    for used in (setup_py.release, build_command.summary_lines):
        assert used.__code__.co_filename == str(ROOT / "torch_kvswap" / "_build_shared.py")
    assert _loader.release is _build_shared.release and envreport.engine_state is _build_shared.engine_state


def test_the_shared_build_module_imports_only_the_standard_library_at_module_level():
    import ast

    tree = ast.parse((ROOT / "torch_kvswap" / "_build_shared.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported and imported <= set(sys.stdlib_module_names), imported


def test_release_reads_versions_with_torchs_vendored_packaging_where_packaging_is_missing(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_packaging(name, *args, **kwargs):
        if name == "packaging.version":
            raise ImportError("No module named 'packaging'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_packaging)
    assert setup_py.release("2.10") == (2, 10, 0)


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.10.0.post4", (2, 10, 0)),
        ("2.15.0", (2, 15, 0)),
        ("12.8", (12, 8, 0)),
        ("2.10", (2, 10, 0)),
        ("70.1.0", (70, 1, 0)),
        ("2.14.0a0+git1234", (2, 14, 0)),
        ("0.11.1.dev123+g456.d20251010", (0, 11, 1)),
        ("13", (13, 0, 0)),
    ],
)
def test_release_reads_major_minor_patch_without_the_local_tag(version, expected):
    assert setup_py.release(version) == expected


def test_release_compares_a_short_version_equal_to_its_full_form():
    assert setup_py.release("2.10") == setup_py.release("2.10.0") == setup_py.release("2.10.0+cu128")
    assert setup_py.release("70.1") >= (70, 1) and not setup_py.release("70.0.9") >= (70, 1)


@pytest.mark.parametrize("version", ["", "unknown", "2.x"])
def test_release_names_a_string_that_is_not_a_version(version):
    with pytest.raises(ValueError, match=f"{version!r} is not a version string"):
        setup_py.release(version)


def test_an_engine_entry_reads_built_with_its_architectures_or_not_built_with_reason_and_remedy():
    from torch_kvswap._build_shared import engine_state

    assert engine_state("host", {"built": True}) == "built"
    assert engine_state("cuda", {"built": True}, "9.0;10.0") == "built for 9.0;10.0"
    assert engine_state("npu", {"built": True}, "9.0") == "built"
    assert (
        engine_state("npu", {"built": False, "reason": "no torch_npu", "enable": "pip install torch-npu"})
        == "not built: no torch_npu; to enable: pip install torch-npu"
    )


def test_this_build_recorded_the_running_torch_and_every_engine():
    info = _loader.build_info()
    assert info is not None, "setup.py writes torch_kvswap/_build_info.json next to the extensions"
    assert info["torch"] == torch.__version__
    assert set(info["engines"]) == {"host", "cuda", "npu", "fake_cuda"}
    assert info["engines"]["host"]["built"]
    for key, entry in info["engines"].items():
        assert entry["built"] or (entry["reason"] and entry["enable"]), key


# ---------------------------------------------------------------- refusing isolated builds


def _run_setup_with_stub_torch(
    tmp_path: Path, torch_init: str, folder: str = "stub"
) -> subprocess.CompletedProcess:
    stub = tmp_path / folder / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(torch_init)
    env = {**os.environ, "PYTHONPATH": str(stub.parent)}
    return subprocess.run(
        [sys.executable, str(ROOT / "setup.py"), "--name"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_build_without_an_importable_torch_stops_with_the_install_command(tmp_path):
    proc = _run_setup_with_stub_torch(tmp_path, "raise ImportError('hidden by build isolation')")
    assert proc.returncode != 0
    assert "pip install --no-build-isolation ." in proc.stderr and "build isolation" in proc.stderr


def test_a_torch_inside_pips_isolated_build_environment_is_refused(tmp_path):
    proc = _run_setup_with_stub_torch(tmp_path, "__version__ = '2.15.0'\n", folder="pip-build-env-x1/overlay")
    assert proc.returncode != 0 and "pip install --no-build-isolation ." in proc.stderr


def test_a_torch_older_than_the_oldest_supported_release_is_refused(tmp_path):
    proc = _run_setup_with_stub_torch(tmp_path, "__version__ = '2.9.1'\n")
    assert proc.returncode != 0 and "needs torch >= 2.10" in proc.stderr and "2.9.1" in proc.stderr


def test_declared_torch_range_starts_at_min_torch():
    assert setup_py.MIN_TORCH == (2, 10)
    assert "torch>=2.10" in (ROOT / "README.md").read_text()


def test_the_package_metadata_declares_the_torch_setup_py_builds_against():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = f"torch>={'.'.join(map(str, setup_py.MIN_TORCH))}"
    assert floor in project["dependencies"]
    assert project["name"] == "torch_kvswap" and "dynamic" not in project


# ---------------------------------------------------------------- version guard


def test_version_guard_names_both_releases_and_the_rebuild_command(tmp_path):
    with pytest.raises(ImportError) as err:  # an installed copy: no setup.py beside it
        _loader.check_built_against("2.13.0+cpu", "2.15.0", tmp_path / "site-packages" / "torch_kvswap")
    msg = str(err.value)
    assert "built against torch 2.13.0+cpu" in msg and "torch 2.15.0 is installed" in msg
    assert "pip install --no-build-isolation ." in msg


def test_version_guard_accepts_the_same_release_of_another_build_variant():
    _loader.check_built_against("2.13.0+cpu", "2.13.0")
    _loader.check_built_against("2.15.0", "2.15.0+cu130")


def other_torch(kind: str) -> str:
    """A torch release that is not the running one: the minor release before
    it ("older") or its next patch release ("patch"). On torch 2.13.0: 2.12.0
    and 2.13.1 (a fixed "2.12.0" was the running torch on 2.12.0)."""
    major, minor, patch = setup_py.release(torch.__version__)
    return f"{major}.{minor - 1}.0" if kind == "older" else f"{major}.{minor}.{patch + 1}"


@pytest.mark.parametrize("kind", ["older", "patch"])
def test_extension_built_for_another_torch_fails_to_import_with_the_version_message(tmp_path, kind):
    other = other_torch(kind)
    # The real package, its compiled extensions included, with the record of
    # the build saying another release: what a user gets after upgrading torch.
    pkg = tmp_path / "torch_kvswap"
    shutil.copytree(
        Path(torch_kvswap.__file__).parent, pkg, ignore=shutil.ignore_patterns("_fake_cuda*", "__pycache__")
    )
    info = json.loads((pkg / "_build_info.json").read_text())
    info["torch"] = other
    (pkg / "_build_info.json").write_text(json.dumps(info))
    proc = subprocess.run(
        [sys.executable, "-c", "import torch_kvswap"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: torch_kvswap was built against torch " + other), proc.stderr
    assert f"torch {torch.__version__} is installed" in last and "--no-build-isolation" in last


# ---------------------------------------------------------------- environment report


def test_environment_report_runs_from_outside_the_tree_and_reports_the_host_engine(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch_kvswap"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    rows = dict(re.match(r"^  (\S.*?)\s{2,}(\S.*)$", line).groups() for line in proc.stdout.splitlines()[1:])
    assert rows["torch"].startswith(torch.__version__)
    assert rows["built against"] == f"torch {torch.__version__}"
    assert rows["engine host"] == "loaded"
    assert rows["imported from"] == f"{ROOT / 'torch_kvswap'} (a source tree, built in place)"
    assert rows["files"] == "every extension file here is one the build made (_build_info.json)"
    if not torch.cuda.is_available():
        assert rows["copies run on"] == "the host engine, for every copy (no CUDA or NPU device visible)"
        if torch_kvswap.ENGINES["cuda"]:  # a CUDA build of torch on a machine without a GPU
            assert rows["engine cuda"] == "loaded, unused: no CUDA device visible"
    if torch.version.cuda is None:
        assert rows["engine cuda"].startswith(f"not built: torch {torch.__version__} is not a CUDA build")
    assert rows["torch_npu"] == "not installed" or "torch_npu" in rows
    # said once: "copies run on" says when no device is visible, and each visible one has its rows
    no_device = not any(envreport.visible_devices().values())
    assert sum("no CUDA or NPU device visible" in v for v in rows.values()) == no_device
    assert "vLLM" in rows


def test_engine_report_is_for_accelerators():
    with pytest.raises(ValueError, match="device must be an accelerator, got cpu"):
        torch.ops.kvswap._engine_report(torch.device("cpu"))


def test_an_old_setuptools_without_wheel_is_refused_with_the_fix(monkeypatch):
    # A new Python 3.11 venv: setuptools 65, no `wheel`: pip would fail with
    # "invalid command 'bdist_wheel'".
    import setuptools

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(setuptools, "__version__", "65.5.0")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wheel" else real_find_spec(name, *a)
    )
    with pytest.raises(
        SystemExit,
        match=r'pip install "setuptools>=70.1" ninja numpy torch, then pip install '
        r'--no-build-isolation \.',
    ):
        setup_py.require_wheel_support()
    monkeypatch.setattr(setuptools, "__version__", "70.1.0")
    setup_py.require_wheel_support()


def test_the_readme_and_the_install_page_give_the_one_install_line():
    line = f"{setup_py.PREREQUISITES} && {setup_py.INSTALL_COMMAND}"
    for page in ("README.md", "docs/install.md"):
        lines = (ROOT / page).read_text().splitlines()
        assert [ln for ln in lines if ln.startswith("pip install ")] == [line], page


def _resolve(python: Path, requirements: list[str]) -> dict[str, str]:
    """What ``pip install REQUIREMENTS`` would install in that venv (a dry run
    against the package index): {name: version}."""
    run = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", *requirements],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}


def test_the_install_line_keeps_setuptools_within_what_the_installed_torch_requires(tmp_path):
    # torch 2.11 and 2.12 require setuptools < 82, and a new venv's setuptools
    # (65 on Python 3.11) or none is too old to build: pip must pick a
    # setuptools that torch accepts, and leave torch alone. A stand-in torch
    # distribution (its metadata only) carries the requirement.
    import shlex

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dist = Path(site) / "torch-2.12.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.12.1\nRequires-Dist: setuptools<82\n"
    )
    (dist / "INSTALLER").write_text("pip\n")
    (dist / "RECORD").write_text("")
    words = shlex.split(setup_py.PREREQUISITES)
    assert words[:2] == ["pip", "install"]
    chosen = _resolve(python, words[2:])
    assert "torch" not in chosen and (70, 1) <= setup_py.release(chosen["setuptools"]) < (82,), chosen
    # Without `torch` in the line pip takes the newest setuptools, breaking torch's requirement.
    unaware = _resolve(python, [w for w in words[2:] if w != "torch"])
    assert setup_py.release(unaware["setuptools"]) >= (82,), unaware


# ---------------------------------------------------------------- what the build says first


def test_the_build_says_what_it_will_compile_with_the_architectures_and_a_duration():
    engines = [
        build_engines.Engine("host", "torch_kvswap._C", build_engines.Decision(True), None),
        build_engines.Engine("cuda", "torch_kvswap._C_cuda", build_engines.Decision(True), None),
        build_engines.Engine(
            "npu", "torch_kvswap._C_npu", build_engines.Decision(False, "no torch_npu"), None
        ),
        build_engines.Engine(
            "fake_cuda", "torch_kvswap._fake_cuda", build_engines.Decision(True), None, True
        ),
    ]
    lines = build_command.plan_lines(
        "2.15.0+cu130", engines, {"torch_kvswap._C", "torch_kvswap._C_cuda"}, "8.0;9.0;10.0;12.0+PTX"
    )
    (host_lo, host_hi), (arch_lo, arch_hi) = (
        build_command.ROUGH_MINUTES["host"],
        build_command.ROUGH_MINUTES["cuda"],
    )
    assert lines[0].startswith(
        f"torch_kvswap: building against torch 2.15.0+cu130; from scratch about "
        f"{host_lo + 4 * arch_lo}-{host_hi + 4 * arch_hi} min on 2 CPUs"
    )
    assert lines[1:] == [
        f"  host engine (_C): about {host_lo}-{host_hi} min",
        f"  CUDA engine (_C_cuda) for 4 architecture(s), 8.0;9.0;10.0;12.0+PTX (TORCH_CUDA_ARCH_LIST"
        f"=<your GPU's, e.g. 9.0> builds one): about {4 * arch_lo}-{4 * arch_hi} min",
    ]
    one = build_command.plan_lines("2.15.0", engines[:2], {"torch_kvswap._C", "torch_kvswap._C_cuda"}, "9.0")
    assert one[2] == f"  CUDA engine (_C_cuda) for 1 architecture(s), 9.0: about {arch_lo}-{arch_hi} min"


# ---------------------------------------------------------------- what the build says as it goes


def test_an_extension_is_stale_when_its_file_is_missing_or_older_than_a_source(tmp_path):
    target, source = tmp_path / "_C.so", tmp_path / "core.h"
    source.write_text("x")
    assert build_command.is_stale(target, [str(source)])  # never built
    target.write_text("x")
    os.utime(source, (1000, 1000))
    os.utime(target, (1000, 1000))
    assert not build_command.is_stale(target, [str(source)])  # same time: setuptools' newer_group skips it
    os.utime(source, (1001, 1001))
    assert build_command.is_stale(target, [str(source)])
    assert build_command.is_stale(target, [str(tmp_path / "gone.h")])  # a missing source counts as newer


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0.0 s"),
        (8.24, "8.2 s"),
        (59.94, "59.9 s"),
        (60, "1 min 00 s"),
        (185.9, "3 min 05 s"),
        (3600, "60 min 00 s"),
    ],
)
def test_elapsed_times_read_in_seconds_then_minutes(seconds, text):
    assert build_command.elapsed(seconds) == text


def _included(path: Path) -> set[Path]:
    """Every file of the tree that `path` includes with quotes, transitively
    (a quoted include is looked for beside the file that names it first)."""
    found: set[Path] = set()
    todo = [path]
    while todo:
        current = todo.pop()
        for name in re.findall(r'^#include "([^"]+)"', current.read_text(), re.M):
            dep = (current.parent / name).resolve()
            if dep.is_file() and dep not in found:
                found.add(dep)
                todo.append(dep)
    return found


@pytest.mark.parametrize("make", ["core", "npu", "fake_cuda"])
def test_every_file_an_extension_includes_is_a_dependency_so_changing_it_rebuilds(make):
    ext = {
        "core": lambda: setup_py.core_extension(),
        "npu": lambda: setup_py.npu_extension(build_engines.Decision(True), Path("/opt/torch_npu")),
        "fake_cuda": lambda: setup_py.fake_cuda_extension("/usr/local/cuda/include"),
    }[make]()
    declared = {(ROOT / f).resolve() for f in [*ext.sources, *ext.depends]}
    included = set().union(*(_included(ROOT / f) for f in ext.sources))
    assert included and included <= declared, sorted(map(str, included - declared))


TINY_SETUP = """
import os
import sys
import time
sys.path.insert(0, {root!r})
import torch
torch.__version__ = os.environ.get("TINY_TORCH", torch.__version__)  # as if another torch were installed
from setuptools import Extension, setup
from setup_helpers.build_command import BuildWithSummary
from setup_helpers.engines import Decision, Engine

ext = Extension("torch_kvswap._C", ["tiny.cpp"], depends=["tiny.h"], language="c++",
                extra_compile_args=os.environ.get("TINY_FLAGS", "").split())
BuildWithSummary.engines = [Engine("host", "torch_kvswap._C", Decision(True, forced=True), ext)]
setup(name="tiny", ext_modules=[ext], cmdclass={{"build_ext": BuildWithSummary}})
"""


def _build_in_place(tree: Path, *, inplace: bool = True, **extra_env: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KVSWAP_VERBOSE_BUILD"} | extra_env
    proc = subprocess.run(
        [sys.executable, "setup.py", "--quiet", "build_ext", *(["--inplace"] if inplace else [])],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # torch's own log lines (a CUDA build without a GPU warns) are not the build's
    return "".join(
        line
        for line in (proc.stdout + proc.stderr).splitlines(keepends=True)
        if not re.match(r"[WIE]\d{4} ", line)
    )


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory) -> tuple[Path, str]:
    """A project of one small extension built in place by the package's build
    command, and what that first build printed."""
    tree = tmp_path_factory.mktemp("tiny")
    (tree / "torch_kvswap").mkdir()
    (tree / "setup.py").write_text(TINY_SETUP.format(root=str(ROOT)))
    (tree / "tiny.h").write_text("#define TINY 1\n")
    (tree / "tiny.cpp").write_text('#include "tiny.h"\nint tiny() { return TINY; }\n')
    return tree, _build_in_place(tree)


def _so(tree: Path) -> Path:
    return next((tree / "torch_kvswap").glob("_C*.so"))


def test_a_build_says_as_each_extension_starts_and_ends_with_its_elapsed_time(tiny_build):
    lines = tiny_build[1].splitlines()
    assert lines[0].startswith("torch_kvswap: building against torch "), lines
    start = lines.index("torch_kvswap: compiling the host engine (_C) ...")
    end = next(
        i
        for i, line in enumerate(lines)
        if re.fullmatch(r"torch_kvswap: the host engine \(_C\) compiled in \d+\.\d s", line)
    )
    assert start < end < lines.index(f"torch_kvswap: built against torch {torch.__version__}"), lines


def test_a_build_says_how_many_files_of_all_it_has_compiled(tiny_build):
    lines = tiny_build[1].splitlines()
    start = lines.index("torch_kvswap: compiling the host engine (_C) ...")
    progress = [i for i, line in enumerate(lines) if "files compiled" in line]
    assert progress and start < progress[0], lines
    assert re.fullmatch(
        r"torch_kvswap:   host engine \(_C\): 1 of 1 files compiled \(\d+\.\d s\)", lines[progress[-1]]
    ), lines


def test_progress_says_each_status_line_once_as_the_log_grows(tmp_path):
    log, out = tmp_path / "build.log", io.StringIO()
    log.write_bytes(b"[1/9] from an earlier extension\n")
    with build_command.CompileProgress(log, "host engine (_C)", out, poll_s=0.01) as progress:
        with open(log, "ab") as f:
            f.write(b"[1/3] c++ -c a.cpp\nwarning: something\n[2/3] c++ -c b")  # b's line is not complete
            f.flush()
            progress.read()
            f.write(b".cpp\n[3/3] c++ -shared\n")
    said = re.findall(r"(\d+) of (\d+) files", out.getvalue())
    assert said == [("1", "3"), ("2", "3"), ("3", "3")], out.getvalue()


def test_a_build_for_another_torch_in_the_clone_leaves_the_in_place_build_up_to_date(tiny_build):
    """`pip install .` from another venv builds the wheel's objects in a
    folder of that torch's: this torch's in-place build has nothing to do."""
    tree = tiny_build[0]
    _build_in_place(tree)
    out = _build_in_place(tree, inplace=False, TINY_TORCH="9.9.9")
    assert "torch_kvswap: compiling the host engine (_C) ..." in out, out
    assert sorted(p.name for p in (tree / "build").glob("temp.*/torch-*")) == sorted(
        [f"torch-{torch.__version__}", "torch-9.9.9"]
    )
    assert "nothing to compile" in _build_in_place(tree)


def test_an_in_place_build_for_another_torch_compiles_again(tiny_build):
    """The tree's extensions were built for the torch its build record names:
    under another torch they are rebuilt, and again when switching back."""
    tree = tiny_build[0]
    _build_in_place(tree)
    assert "compiling the host engine (_C)" in _build_in_place(tree, TINY_TORCH="9.9.9")
    assert "compiling the host engine (_C)" in _build_in_place(tree)
    assert "nothing to compile" in _build_in_place(tree)


def test_a_rebuild_that_compiles_nothing_prints_no_banner(tiny_build):
    tree = tiny_build[0]
    _build_in_place(tree)  # whatever an earlier test changed
    built = _so(tree).stat().st_mtime_ns
    out = _build_in_place(tree)
    assert out == (
        "torch_kvswap: nothing to compile, each extension is newer than its sources: host engine (_C) "
        f"(torch {torch.__version__})\n"
    ), out
    assert _so(tree).stat().st_mtime_ns == built  # not even linked anew


def test_a_rebuild_that_compiles_nothing_needs_no_copy_in_build(tiny_build):
    # A wheel build drops the test fakes from build/; the in-place extension
    # stays, and the next in-place build must not look for build/'s copy.
    tree = tiny_build[0]
    _build_in_place(tree)
    for copy in (tree / "build").glob("lib*/torch_kvswap/_C*.so"):
        copy.unlink()
    assert "nothing to compile" in _build_in_place(tree)
    assert _so(tree).is_file()


def test_a_changed_header_rebuilds_its_extension(tiny_build):
    tree = tiny_build[0]
    later = _so(tree).stat().st_mtime + 5
    os.utime(tree / "tiny.h", (later, later))
    out = _build_in_place(tree)
    assert "torch_kvswap: compiling the host engine (_C) ..." in out and "from scratch" in out, out
    assert _so(tree).stat().st_mtime >= later - 5


def test_changed_compiler_flags_rebuild_an_extension_newer_than_its_sources(tiny_build):
    tree = tiny_build[0]
    out = _build_in_place(tree, TINY_FLAGS="-DTINY_VARIANT=2")
    assert "torch_kvswap: compiling the host engine (_C) ..." in out, out
    assert "nothing to compile" in _build_in_place(tree, TINY_FLAGS="-DTINY_VARIANT=2")


# ---------------------------------------------------------------- nothing stale installed


def _copy_of_the_package(dest: Path) -> Path:
    """The real package, compiled extensions and build record included."""
    pkg = dest / "torch_kvswap"
    shutil.copytree(Path(torch_kvswap.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return pkg


def _ext_file(pkg: Path, stem: str) -> Path:
    return next(p for p in pkg.iterdir() if p.name.startswith(stem + ".") and p.suffix == ".so")


def test_a_build_leaves_out_every_extension_file_it_did_not_build(tmp_path, capsys):
    for name in (
        "_C.cpython-311-x86_64-linux-gnu.so",
        "_fake_cuda.cpython-311-x86_64-linux-gnu.so",
        "_C_npu.cpython-311-x86_64-linux-gnu.so",
        "ops.py",
        "_build_info.json",
    ):
        (tmp_path / name).write_text("x")
    removed = build_command.remove_stale_extensions(tmp_path, {"_C.cpython-311-x86_64-linux-gnu.so"})
    assert removed == ["_C_npu.cpython-311-x86_64-linux-gnu.so", "_fake_cuda.cpython-311-x86_64-linux-gnu.so"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "_C.cpython-311-x86_64-linux-gnu.so",
        "_build_info.json",
        "ops.py",
    ]
    assert "not built by it: _C_npu" in capsys.readouterr().err


def test_an_engine_file_the_build_record_does_not_list_is_not_loaded_and_is_reported(tmp_path):
    # An install whose folder holds a CUDA engine that its build did not
    # build (left by an earlier build, maybe for another torch): the import
    # must not load it, and the report must name it.
    pkg = _copy_of_the_package(tmp_path)
    info = json.loads((pkg / "_build_info.json").read_text())
    stale = _ext_file(pkg, "_C").name.replace("_C.", "_C_cuda.", 1)
    shutil.copy(_ext_file(pkg, "_C"), pkg / stale)
    info["engines"]["cuda"] = {
        "module": "torch_kvswap._C_cuda",
        "built": False,
        "test_only": False,
        "reason": "no CUDA toolkit found",
        "enable": "install it",
    }
    (pkg / "_build_info.json").write_text(json.dumps(info))
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import torch_kvswap as k, torch_kvswap.envreport as r\n"
        "print(k.ENGINES['cuda']); print(k._loader.ENGINE_ERRORS['torch_kvswap._C_cuda'])\n"
        "print(dict(r.engine_rows())['files']); print(r.package_row()[1])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    loaded, error, files, where = proc.stdout.splitlines()
    assert where == f"{pkg} (an installed copy)"
    assert loaded == "False"
    assert error == "a leftover file that the last build did not build (no CUDA toolkit found); not loaded"
    assert files == f"not built by the recorded build, leftovers: {stale}"


def test_the_record_of_this_build_matches_the_extension_files_beside_it():
    info = _loader.build_info()
    assert info is not None and _loader.unrecorded_extensions(info) == []
    for key, entry in info["engines"].items():
        if entry["built"]:
            assert (_loader.PACKAGE_DIR / entry["file"]).is_file(), key


# ---------------------------------------------------------------- a shadowed import


def _clone_with_the_package_built_for(tmp_path: Path, other: str) -> Path:
    """A stand-in clone (setup.py and csrc/ beside the package) whose in-place
    build says it was compiled against torch `other`."""
    clone = tmp_path / "clone"
    pkg = _copy_of_the_package(clone)
    (clone / "setup.py").write_text("")
    (clone / "csrc").mkdir()
    info = json.loads((pkg / "_build_info.json").read_text())
    info["torch"] = other
    (pkg / "_build_info.json").write_text(json.dumps(info))
    return clone


def test_a_clone_imported_from_its_root_names_its_folder_and_the_fix(tmp_path):
    other = other_torch("older")
    clone = _clone_with_the_package_built_for(tmp_path, other)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", "import torch_kvswap"],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: torch_kvswap was built against torch {other}"), proc.stderr
    assert f"imported from {clone / 'torch_kvswap'}, the package folder of the source tree {clone}" in last
    assert "because Python puts the current directory first on its path" in last
    assert "run from another directory" in last
    assert f"cd {clone} && {sys.executable} setup.py build_ext --inplace" in last
    assert "`bash scripts/test.sh`" in last
    assert "--no-build-isolation" not in last  # reinstalling does not fix a shadowing clone


def test_an_installed_copy_built_for_another_torch_names_its_folder_and_the_install_command(tmp_path):
    msg = _loader.rebuild_hint(tmp_path / "site-packages" / "torch_kvswap", cwd=tmp_path)
    assert msg.startswith(f"This copy was imported from {tmp_path / 'site-packages' / 'torch_kvswap'}.")
    assert "pip install --no-build-isolation ." in msg


def test_a_clone_on_the_path_from_elsewhere_is_not_called_the_current_directory(tmp_path):
    clone = _clone_with_the_package_built_for(tmp_path, other_torch("older"))
    msg = _loader.rebuild_hint(clone / "torch_kvswap", cwd=tmp_path)
    assert f"the source tree {clone}." in msg and "current directory" not in msg
    assert "rebuild this tree in place" in msg


def test_lint_checks_a_new_cpp_file_before_it_is_added_to_git(tmp_path):
    # A copy of what scripts/lint.sh reads, as a git repository whose one C++
    # file is unformatted and not yet added: the check must name it. The
    # tree's lint venv is reused when there is one (CI's first step made it);
    # otherwise lint.sh makes one, seconds from uv's cache.
    for rel in [
        "scripts/lint.sh",
        "scripts/venv.sh",
        ".clang-format",
        "pyproject.toml",
        "requirements/lint.txt",
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    if (ROOT / ".venv-lint" / "bin" / "clang-format").exists():
        (tmp_path / ".venv-lint").symlink_to(ROOT / ".venv-lint")
    (tmp_path / ".gitignore").write_text(".venv-lint\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "new.cpp").write_text("int  f( ){return 1;}\n")
    proc = subprocess.run(
        ["bash", "scripts/lint.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "new.cpp" in proc.stdout + proc.stderr
    assert "clang-format --dry-run --Werror (1 files)" in proc.stdout


def test_ci_finds_and_ends_the_processes_a_step_left_running():
    """scripts/leftovers.sh, which .ci/run runs after every step: a process
    whose environment holds the step's token is listed (exit 1) and, with
    --kill, ended; one without it is left alone."""
    script = str(ROOT / "scripts" / "leftovers.sh")
    token = f"test-{os.getpid()}-{time.monotonic_ns()}"
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    tagged = subprocess.Popen(sleeper, env={**os.environ, "KVSWAP_CI_STEP": token})
    other = subprocess.Popen(sleeper, env={**os.environ, "KVSWAP_CI_STEP": token + "-other"})
    env = {**os.environ, "KVSWAP_LEFTOVER_GRACE_S": "1"}
    try:
        time.sleep(0.5)  # exec'd, so /proc/<pid>/environ is the child's
        listed = subprocess.run(["bash", script, token], capture_output=True, text=True, timeout=60, env=env)
        assert listed.returncode == 1 and [ln.split()[0] for ln in listed.stdout.splitlines()] == [
            str(tagged.pid)
        ], listed
        assert tagged.poll() is None  # listing alone ends nothing
        killed = subprocess.run(
            ["bash", script, token, "--kill"], capture_output=True, text=True, timeout=60, env=env
        )
        assert killed.returncode == 1
        assert tagged.wait(timeout=10) == -9 and other.poll() is None
        after = subprocess.run(["bash", script, token], capture_output=True, text=True, timeout=60, env=env)
        assert (after.returncode, after.stdout) == (0, "")
    finally:
        for proc in (tagged, other):
            proc.kill()
            proc.wait()


def test_a_process_that_ends_within_the_grace_period_is_not_a_leftover():
    token = f"test-{os.getpid()}-{time.monotonic_ns()}"
    ending = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(1.5)"], env={**os.environ, "KVSWAP_CI_STEP": token}
    )
    try:
        time.sleep(0.5)
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "leftovers.sh"), token],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KVSWAP_LEFTOVER_GRACE_S": "10"},
        )
        assert (done.returncode, done.stdout) == (0, "")
    finally:
        ending.kill()
        ending.wait()


def test_every_ci_step_is_checked_for_processes_it_left_running():
    run = (ROOT / ".ci" / "run").read_text()
    assert 'KVSWAP_CI_STEP="$token" "$@"' in run and 'bash scripts/leftovers.sh "$token" --kill' in run
