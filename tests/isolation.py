"""Runs a malformed call in a child process, so that a crash fails one test.

The child is forked from a forkserver that imported torch_kvswap once, so each
call costs milliseconds. Case functions take no arguments: they build their
inputs in the child, because raw addresses are only valid in the process that
owns the memory.
"""

from __future__ import annotations

import multiprocessing
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable

_executor: ProcessPoolExecutor | None = None


@dataclass
class Outcome:
    error_type: str | None  # None: the call returned normally
    message: str
    crashed: bool = False


def _init_child() -> None:
    import torch_kvswap  # noqa: F401


def _call(fn: Callable[[], object]) -> Outcome:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return Outcome(type(exc).__name__, str(exc).split("\nException raised from")[0])
    return Outcome(None, "")


def _pool() -> ProcessPoolExecutor:
    global _executor
    if _executor is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch_kvswap"])
        _executor = ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_init_child)
    return _executor


def run_isolated(fn: Callable[[], object], timeout: float = 60.0) -> Outcome:
    global _executor
    try:
        return _pool().submit(_call, fn).result(timeout=timeout)
    except BrokenProcessPool:
        _executor = None
        return Outcome(None, "child process died (crash or abort)", crashed=True)
    except Exception:  # noqa: BLE001
        return Outcome(None, traceback.format_exc(), crashed=True)
