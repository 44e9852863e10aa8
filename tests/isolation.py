"""Runs a malformed call in a child process, so that a crash fails one test.

The child is forked from a forkserver that imported torch_kvswap once, so each
call costs milliseconds. Case functions take no arguments: they build their
inputs in the child, because raw addresses are only valid in the process that
owns the memory.

A call that does not finish within its timeout fails fast with a message
naming it; its child is killed and the pool rebuilt, so the next call does not
queue behind a hung one.
"""

from __future__ import annotations

import functools
import multiprocessing
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from collections.abc import Callable

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


def _discard_pool() -> None:
    """Kills the pool's child (which may be hung) and forgets the pool."""
    global _executor
    executor, _executor = _executor, None
    if executor is None:
        return
    for process in list(getattr(executor, "_processes", {}).values()):
        process.kill()
    executor.shutdown(wait=False, cancel_futures=True)


def describe(fn: Callable[[], object]) -> str:
    if isinstance(fn, functools.partial):
        args = ", ".join(repr(a) for a in fn.args)
        return f"{describe(fn.func)}({args})"
    return getattr(fn, "__qualname__", repr(fn))


def run_isolated(fn: Callable[[], object], timeout: float = 60.0) -> Outcome:
    try:
        return _pool().submit(_call, fn).result(timeout=timeout)
    except BrokenProcessPool:
        _discard_pool()
        return Outcome(None, f"{describe(fn)}: child process died (crash or abort)", crashed=True)
    except FutureTimeout:
        _discard_pool()
        return Outcome(
            None,
            f"{describe(fn)} did not finish within {timeout:g} s; its child "
            "process was killed and the pool rebuilt",
            crashed=True,
        )
    except Exception:  # noqa: BLE001
        _discard_pool()
        return Outcome(None, f"{describe(fn)}: {traceback.format_exc()}", crashed=True)
