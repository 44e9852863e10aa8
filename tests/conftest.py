"""Shared fixtures of the torch_kvswap test suite."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import torch_kvswap  # loads the ops

# The test extension (tests/fake_cuda/; built in place with the tree): the
# `kvswap_test` ops that reach engines and the core's internals. A GPU kit's
# build leaves it out, and its tests use none of them.
with contextlib.suppress(ImportError):
    import extension_ops  # noqa: F401

# Hypothesis draws the same examples on every run (CI, the mutation check),
# so a failure reproduces and a mutant is killed or not, never by luck.
# KVSWAP_HYPOTHESIS_RANDOM=1 draws fresh examples instead, for a separate
# exploratory run: `KVSWAP_HYPOTHESIS_RANDOM=1 bash scripts/test.sh -k matches`.
settings.register_profile(
    "deterministic",
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "random", derandomize=False, database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("random" if os.environ.get("KVSWAP_HYPOTHESIS_RANDOM") == "1" else "deterministic")


@pytest.fixture
def fresh_compile():
    """torch.compile with Inductor's FX graph cache off and dynamo reset.

    The FX graph cache keys on op names, not schemas: it can hand back a graph
    built for an older schema of the same op name.
    """
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False):
        yield
    torch._dynamo.reset()


@pytest.fixture
def fake_cuda_devices() -> int:
    """How many devices the `fake_cuda` fixture's runtime has; a test module
    overrides this fixture to get more."""
    return 1


@pytest.fixture
def fake_cuda(fake_cuda_devices):
    """The CUDA engine on the fake CUDA runtime (tests/fake_cuda), installed
    in the core for CUDA devices for one test, with `fake_cuda_devices`
    devices; yields its ops (torch.ops.kvswap_fake_cuda). Afterwards the copy
    method is back to "auto" and the core holds no CUDA engine again."""
    try:
        import torch_kvswap._fake_cuda
    except ImportError as exc:  # pragma: no cover - built by scripts/env.sh
        pytest.skip(f"torch_kvswap._fake_cuda is not built ({exc})")
    F = torch.ops.kvswap_fake_cuda
    F.install()
    F.reset(fake_cuda_devices)
    try:
        yield F
    finally:
        torch_kvswap.set_copy_method("auto")
        F.uninstall()


def accelerator_or_skip(kind: str) -> torch.device:
    """The accelerator `kind` ('cuda' or 'npu') with its kvswap engine, or a skip saying what is missing."""
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            pytest.skip(f"no Ascend NPU stack: torch_npu cannot be imported ({exc})")
        if not torch.npu.is_available():
            pytest.skip("torch_npu is installed but no NPU device is visible")
        engine = "torch_kvswap._C_npu"
    elif kind == "cuda":
        if not torch.cuda.is_available():
            pytest.skip(
                "no CUDA GPU: torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})"
            )
        engine = "torch_kvswap._C_cuda"
    else:
        raise ValueError(kind)
    if torch_kvswap._loader.engine_for(kind) is None:
        reason = torch_kvswap._loader.ENGINE_ERRORS.get(engine, "it was not built")
        pytest.fail(
            f"a {kind} device is present but the kvswap {kind} engine ({engine}) is not registered: {reason}"
        )
    return torch.device(kind, 0)


# ---------------------------------------------------------------- skip reasons
# A machine without an accelerator skips some 200 tests. Their `s` marks are
# left out of the progress line (only passes and failures show there), and the
# run ends with each reason once, counted, instead of a wall of `s` and no why.


def pytest_report_teststatus(report, config):
    if report.skipped and not hasattr(report, "wasxfail"):
        return "skipped", "", "SKIPPED"
    return None


def skip_reason(report) -> str:
    """The reason of a skipped test's report, without pytest's 'Skipped: '."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def grouped_skips(reports) -> list[tuple[int, str]]:
    """(count, reason) for each distinct reason, the most frequent first."""
    counts: dict[str, int] = {}
    for report in reports:
        reason = skip_reason(report)
        counts[reason] = counts.get(reason, 0) + 1
    return sorted(((n, reason) for reason, n in counts.items()), key=lambda item: (-item[0], item[1]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reports = [r for r in terminalreporter.stats.get("skipped", []) if not hasattr(r, "wasxfail")]
    if not reports:
        return
    terminalreporter.section("skip reasons", sep="-")
    for n, reason in grouped_skips(reports):
        terminalreporter.write_line(f"{n} skipped: {reason}")
