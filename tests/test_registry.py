"""The op library is complete: every op has a fake kernel, the right effects, and kernels."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops import effects
from torch._higher_order_ops.effects import _EffectType
from torch._library.simple_registry import singleton as simple_registry

import torch_kvswap

PUBLIC = ["kvswap::swap_blocks_batch", "kvswap::swap_blocks", "kvswap::expand_block_ids"]


def effect_of(op):
    """The side effect torch.compile records for an op (torch >= 2.10 has an
    accessor; older releases keep the SIDE_EFFECTS table)."""
    get = getattr(effects, "_get_effect", None)
    return get(op) if get is not None else effects.SIDE_EFFECTS.get(op)


def kvswap_ops() -> list[str]:
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("kvswap::"))


def takes_tensors(qualname: str) -> bool:
    ns, name = qualname.split("::")
    schema = getattr(getattr(torch.ops, ns), name).default._schema
    return any("Tensor" in str(a.type) for a in schema.arguments)


#: The private ops of the `kvswap` namespace: each one the package's Python
#: calls. Engines register none (they install a table in the core) and the
#: ops only tests use are the test extension's (`kvswap_test`).
PRIVATE = [
    "kvswap::_engine_report",
    "kvswap::_engines",
    "kvswap::_get_checked",
    "kvswap::_get_copy_method",
    "kvswap::_host_register",
    "kvswap::_plan_swap_blocks",
    "kvswap::_register_region",
    "kvswap::_set_checked",
    "kvswap::_set_copy_method",
    "kvswap::_unregister_region",
]


def test_public_ops_are_registered():
    assert set(PUBLIC) <= set(kvswap_ops())


def test_the_namespace_holds_the_public_ops_and_what_the_package_calls():
    assert kvswap_ops() == sorted(PUBLIC + PRIVATE)


def test_an_engine_built_for_another_interface_is_refused_at_import():
    ops = torch.ops.kvswap_test
    version = ops.interface_version()
    assert ops.import_registry(version) == ""
    assert ops.import_registry(version + 1) == (
        f"torch_kvswap: this engine was built for engine interface {version + 1} but the core "
        f"(torch_kvswap._C) has {version}; rebuild torch_kvswap"
    )


def test_an_engine_whose_setup_fails_fails_its_import_with_the_reason():
    before = torch.ops.kvswap._engines()
    assert (
        torch.ops.kvswap_test.install_failing_engine("privateuseone") == "the engine's setup failed (tests)"
    )
    assert torch.ops.kvswap._engines() == before


def test_an_engine_without_submit_is_refused():
    before = torch.ops.kvswap._engines()
    with pytest.raises(ValueError, match=r"kvswap: the engine engine without submit \(tests\) has no submit"):
        torch.ops.kvswap_test.install_without_submit("privateuseone")
    assert torch.ops.kvswap._engines() == before


def test_no_engine_can_serve_a_device_type_the_core_does_not_know():
    with pytest.raises(
        NotImplementedError, match="kvswap has no engine for device type meta; supported: cpu"
    ):
        torch.ops.kvswap_test.spy_install("meta", True)
    dst = torch.zeros(2, 2)  # and the host engine still serves the CPU
    torch_kvswap.swap_blocks([torch.arange(4.0).view(2, 2)], [dst], torch.tensor([1]), torch.tensor([0]))
    assert dst.tolist() == [[2.0, 3.0], [0.0, 0.0]]


@pytest.mark.parametrize("qualname", PRIVATE)
def test_every_private_op_is_called_by_the_package(qualname):
    from pathlib import Path

    package = Path(torch_kvswap.__file__).parent
    # fake_kernels.py names every op it fakes; that is not a call.
    sources = [p for p in package.rglob("*.py") if p.name != "fake_kernels.py"]
    call = f"torch.ops.kvswap.{qualname.split('::')[1]}("
    assert any(call in p.read_text() for p in sources), qualname


@pytest.mark.parametrize("qualname", kvswap_ops())
def test_every_op_taking_tensors_has_a_fake_kernel(qualname):
    if not takes_tensors(qualname):
        # One reason for all such ops (the op is in the test id), so the
        # run's skip summary counts them on one line.
        pytest.skip("the op takes no tensors: no fake kernel needed, nothing to trace")
    assert simple_registry.find(qualname).fake_impl.kernel is not None, qualname


def test_pointer_op_is_an_ordered_side_effect():
    assert effect_of(torch.ops.kvswap.swap_blocks_batch.default) == _EffectType.ORDERED


def test_tensor_op_declares_its_destinations_mutated_and_nothing_else():
    schema = torch.ops.kvswap.swap_blocks.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["dst_caches"]
    assert effect_of(torch.ops.kvswap.swap_blocks.default) is None


def test_pointer_op_marks_no_argument_mutated():
    # It only reads the descriptor tensors; the memory it writes is not an argument.
    schema = torch.ops.kvswap.swap_blocks_batch.default._schema
    assert all(a.alias_info is None for a in schema.arguments)


@pytest.mark.parametrize(
    "qualname", ["kvswap::swap_blocks", "kvswap::swap_blocks_batch", "kvswap::expand_block_ids"]
)
def test_host_kernels_are_registered(qualname):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU")


def test_the_host_engine_serves_the_cpu_from_the_start():
    assert "cpu" in torch.ops.kvswap._engines()


def test_engines_report_what_loaded():
    assert set(torch_kvswap.ENGINES) == {"cuda", "npu"}
    assert all(isinstance(v, bool) for v in torch_kvswap.ENGINES.values())


def test_import_without_the_compiled_core_says_how_to_build(tmp_path):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    package = Path(torch_kvswap.__file__).parent
    copy = tmp_path / "torch_kvswap"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # Without the editable install's finder, which would find the built copy.
    script = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
        "if 'editable' not in type(f).__module__.lower() "
        "and 'editable' not in str(getattr(f, '__name__', '')).lower()]; "
        "import torch_kvswap"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode != 0
    assert "torch_kvswap._C) is not built" in result.stderr
    assert "pip install --no-build-isolation" in result.stderr


@pytest.mark.parametrize("method", ["auto", "dma", "kernel"])
def test_copy_method_round_trips(method, request):
    if method == "kernel":
        request.getfixturevalue("fake_cuda")  # an engine with a copy kernel
    try:
        torch_kvswap.set_copy_method(method)
        assert torch_kvswap.get_copy_method() == method
    finally:
        torch_kvswap.set_copy_method("auto")


def test_unknown_copy_method_is_rejected():
    with pytest.raises(ValueError, match="method must be 'auto', 'dma' or 'kernel', got 'fast'"):
        torch_kvswap.set_copy_method("fast")
    assert torch_kvswap.get_copy_method() == "auto"


def test_kernel_copy_method_without_a_kernel_engine_is_an_error():
    if "cuda" in torch.ops.kvswap._engines():  # pragma: no cover - a GPU kit
        pytest.skip("a CUDA engine is loaded")
    with pytest.raises(NotImplementedError, match=r"copy method 'kernel' needs an engine with a copy kernel"):
        torch_kvswap.set_copy_method("kernel")
    assert torch_kvswap.get_copy_method() == "auto"


def test_host_copies_ignore_the_copy_method(fake_cuda):
    # The host engine has one path; "kernel" only applies to accelerator caches.
    src, dst = [torch.arange(8.0).view(4, 2)], [torch.zeros(4, 2)]
    try:
        torch_kvswap.set_copy_method("kernel")
        torch_kvswap.swap_blocks(src, dst, torch.tensor([3]), torch.tensor([0]))
    finally:
        torch_kvswap.set_copy_method("auto")
    assert dst[0][0].tolist() == [6.0, 7.0]


def test_pinning_host_memory_needs_an_accelerator_engine():
    with pytest.raises(NotImplementedError, match="device must be an accelerator"):
        torch.ops.kvswap._host_register(torch.zeros(16, dtype=torch.uint8), torch.device("cpu"), True)
    if "cuda" not in torch.ops.kvswap._engines():
        with pytest.raises(NotImplementedError, match="no engine for cuda:0"):
            torch.ops.kvswap._host_register(torch.zeros(16, dtype=torch.uint8), torch.device("cuda", 0), True)


def test_an_engine_that_fails_to_load_is_recorded_and_the_import_goes_on(monkeypatch):
    # A broken engine extension leaves the host engine usable and says why.
    from torch_kvswap import _loader

    monkeypatch.setattr(_loader, "ENGINE_ERRORS", {})
    with pytest.warns(RuntimeWarning, match=r"torch_kvswap: json could not be loaded"):
        assert _loader._load_optional("json", "kvswap_no_such_prerequisite") is False
    assert "ModuleNotFoundError" in _loader.ENGINE_ERRORS["json"]
    assert _loader._load_optional("kvswap_no_such_engine", None) is False  # not built: no error
    assert "kvswap_no_such_engine" not in _loader.ENGINE_ERRORS
