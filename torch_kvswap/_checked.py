"""Checked mode: turns silent KV-cache corruption into errors that name the bug.

Off by default. On with ``KVSWAP_CHECK=1`` in the environment (read at
import), :func:`set_checked`, or ``with torch_kvswap.checked():``. In it:

* the pointer op refuses descriptors outside every registered region of the
  side its direction says, overlapping destinations, and chains (one
  descriptor reading what another writes); the checks run in the C++ core
  (``csrc/core/checked.cpp``), before any copy is submitted;
* block ids on the device are read back and checked on the CUDA kernel path
  too (not during graph capture, where one warning says they were not);
* a :class:`~torch_kvswap.KVCacheOffloader` built while the mode is on (or
  with ``check=True``) tracks each host block's state and refuses jobs that
  break its contract (:class:`OffloaderChecks`).

The mode is **process-wide**, not per thread: copies are issued on threads
the caller does not own (the offloader's lane workers, a serving engine's
worker threads), and a thread-local switch would silently leave those
unchecked. ``checked()`` blocks nest and may be entered from several
threads; the mode is on while any of them is open (or the environment or
:func:`set_checked` turned it on). The switch is an eager call: enter it
around compiled code, not inside it. The checks run in the ops' eager
kernels, which a compiled graph calls, so ``torch.compile(fullgraph=True)``
traces the same graph either way.

What each check catches, and its cost: docs/checked.md.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["checked", "set_checked", "is_checked", "register_region", "Region", "OffloaderChecks"]

_lock = threading.Lock()
_open_blocks = 0  # checked() blocks currently open, in any thread
_switched_on = os.environ.get("KVSWAP_CHECK", "").strip() not in ("", "0")


def _apply() -> None:
    torch.ops.kvswap._set_checked(_switched_on or _open_blocks > 0)


def set_checked(on: bool) -> None:
    """Turn checked mode on or off for the whole process, as ``KVSWAP_CHECK``
    does at import (open ``checked()`` blocks keep it on until they close).
    For integrations that read a configuration flag."""
    global _switched_on
    with _lock:
        _switched_on = bool(on)
        _apply()


def is_checked() -> bool:
    """Whether checked mode is on now."""
    return bool(torch.ops.kvswap._get_checked())


@contextlib.contextmanager
def checked() -> Iterator[None]:
    """Checked mode for the duration of the block, process-wide (see the module doc)."""
    global _open_blocks
    with _lock:
        _open_blocks += 1
        _apply()
    try:
        yield
    finally:
        with _lock:
            _open_blocks -= 1
            _apply()


class Region:
    """A registered region; :meth:`unregister` (or leaving a ``with`` block) drops it."""

    def __init__(self, region_id: int, label: str, side: str) -> None:
        self.id, self.label, self.side = region_id, label, side

    def unregister(self) -> bool:
        """Drop the region; False when it was gone already (unregistered, or its memory freed)."""
        return bool(torch.ops.kvswap._unregister_region(self.id))

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc) -> None:
        self.unregister()

    def __repr__(self) -> str:
        return f"Region({self.id}, {self.side}, {self.label!r})"


def register_region(tensor: torch.Tensor, *, side: str | None = None, label: str | None = None) -> Region:
    """Tell checked mode that the pointer op may copy from and to the memory of ``tensor``.

    Args:
        tensor: the buffer (any device, any layout); its region is every byte
            from its first element to its last.
        side: ``"host"`` (the host end of host<->device copies) or
            ``"device"``; by default ``"host"`` for a CPU tensor, else
            ``"device"``. Pass ``"device"`` for a CPU tensor that stands in
            for device memory (a cache on a machine with no accelerator).
        label: the name errors give the region; default: its shape and dtype.

    The region is held weakly: it does not keep the memory alive, and it is
    dropped once the memory is freed. ``KVCacheOffloader`` registers its
    caches and mirrors itself.
    """
    if side is None:
        side = "host" if tensor.device.type == "cpu" else "device"
    if label is None:
        label = f"{side} tensor {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
    return Region(int(torch.ops.kvswap._register_region(tensor, side, label)), label, side)


def _unregister_all(ids: list[int]) -> None:
    for i in ids:
        torch.ops.kvswap._unregister_region(i)


# --- the offloader's contract -------------------------------------------------

_EMPTY = -1  # no pending job
_LOAD_LANES = ("load", "expedited")
_NOT_SEEN = "(not yet reported finished by get_finished() nor waited for)"


class OffloaderChecks:
    """The contract of one :class:`~torch_kvswap.KVCacheOffloader`, tracked per host sub-block.

    Each host sub-block of each KV-cache group is *empty*, *being stored*
    (a store job writes it and the caller has not seen it finish), *stored*,
    or *being loaded* (stored, and pending loads read it). The caller sees a
    job finish when ``get_finished`` reports it or ``wait`` returns for it.
    Jobs of one lane run in order; jobs of different lanes do not, so a job
    may not touch what a pending job of another lane writes, nor write what
    one reads. Refused at submission, before anything is queued:

    * a load of a sub-block that is empty, or whose store the caller has not
      seen finish (vLLM #47282: loads racing stores);
    * a load into device blocks that a pending store still reads, or that a
      pending load of the other load lane still writes;
    * a store into a sub-block that a pending load still reads;
    * a store of device blocks that a pending load is still writing.

    Groups that share a cache tensor share its host mirror and its device
    memory; groups whose tensors are different views of one allocation (a
    hybrid model's groups overlaid on one buffer) share device memory. A job
    conflicts with a pending job of another group wherever their blocks share
    a byte: device blocks are compared through their addresses, whatever the
    views. Jobs are tracked as objects, not by id: a caller may reuse an id
    once the job is reported, while another thread's ``wait`` for the old job
    still returns. All methods are called under the offloader's table lock.
    """

    def __init__(self, offloader: Any) -> None:
        self.factor = offloader.factor
        groups = offloader.groups
        self._group_of = {id(members): g for g, members in enumerate(groups)}
        # groups whose host rows are the same memory: they share a tensor, so a mirror
        self._related = [
            [h for h, other in enumerate(groups) if set(members) & set(other)] for members in groups
        ]
        self._overlays = _DeviceOverlays(offloader.device_tensors, groups)
        rows = offloader.num_host_blocks * self.factor
        ng, nd = len(groups), offloader.num_device_blocks
        self._stored = np.zeros((ng, rows), dtype=bool)
        self._storing = np.full((ng, rows), _EMPTY, dtype=np.int64)  # latest pending store
        self._reading = np.zeros((ng, rows), dtype=np.int32)  # pending loads reading
        self._store_reading = np.zeros((ng, nd), dtype=np.int32)  # device blocks pending stores read
        # device blocks pending loads write, per load lane
        self._writing = {lane: np.zeros((ng, nd), dtype=np.int32) for lane in _LOAD_LANES}
        # pending job id -> the job and [(group, host rows, device ids)]
        self._jobs: dict[int, tuple[Any, list[tuple[int, np.ndarray, np.ndarray]]]] = {}

    def _where(self, row: int, g: int) -> str:
        return f"host block {row // self.factor} (sub-block {row % self.factor}, group {g})"

    def _pending(self, lanes: tuple[str, ...], related: list[int], ids: np.ndarray, device: bool) -> int:
        """A pending job of ``lanes`` whose host rows (device=False) or device blocks include
        one of ``ids``."""
        for job_id, (job, parts) in self._jobs.items():
            if job.lane not in lanes:
                continue
            for g, host, dev in parts:
                if g in related and np.intersect1d(dev if device else host, ids).size:
                    return job_id
        raise AssertionError("the tracker's counts and its jobs disagree")

    def _first_hit(
        self, busy: np.ndarray, ids: np.ndarray, h: int, lanes: tuple[str, ...], device: bool
    ) -> tuple[int, int] | None:
        """The first of ``ids`` that ``busy`` marks, and the pending job of ``lanes`` (group
        ``h``) that uses it."""
        hit = np.flatnonzero(busy)
        if not hit.size:
            return None
        return int(ids[hit[0]]), self._pending(lanes, [h], ids[hit[:1]], device=device)

    def _device_block(self, block: int, g: int, h: int) -> str:
        return f"device block {block} (group {g})" if g == h else f"device block {block} of group {h}"

    def _refuse_store(self, job_id: int, g: int, host: np.ndarray, dev: np.ndarray) -> None:
        """A store of group ``g`` may not write host rows that a pending load
        reads, nor read device blocks that one writes (in any group whose
        memory overlaps)."""
        for h in self._related[g]:
            found = self._first_hit(self._reading[h, host] > 0, host, h, _LOAD_LANES, device=False)
            if found:
                row, other = found
                raise ValueError(
                    f"checked mode: store job {job_id} writes {self._where(row, g)}, "
                    f"which load job {other} still reads {_NOT_SEEN}; the load would copy a mix "
                    f"of old and new data. Store after job {other} is reported"
                )
        for h, blocks in self._overlays.blocks(g, dev):
            writing = sum(self._writing[lane][h, blocks] for lane in _LOAD_LANES)
            found = self._first_hit(writing > 0, blocks, h, _LOAD_LANES, device=True)
            if found:
                block, other = found
                raise ValueError(
                    f"checked mode: store job {job_id} reads {self._device_block(block, g, h)}, "
                    f"which load job {other} is still writing {_NOT_SEEN}; the store would save "
                    f"a half-loaded block. Store after job {other} is reported"
                )

    def _refuse_load(self, job_id: int, lane: str, g: int, host: np.ndarray, dev: np.ndarray) -> None:
        """A load of group ``g`` may not read host rows that a pending store
        writes, nor write device blocks that one reads or that a pending load
        of the other load lane writes (in any group whose memory overlaps)."""
        for h in self._related[g]:
            self._refuse_load_of_storing(job_id, g, h, host)
        other_lane = "expedited" if lane == "load" else "load"
        for h, blocks in self._overlays.blocks(g, dev):
            found = self._first_hit(self._store_reading[h, blocks] > 0, blocks, h, ("store",), device=True)
            if found:
                block, other = found
                raise ValueError(
                    f"checked mode: load job {job_id} writes {self._device_block(block, g, h)}, "
                    f"which store job {other} still reads {_NOT_SEEN}; jobs of different lanes "
                    "are not ordered, so the store may save the loaded bytes instead of the "
                    f"block's. Load after job {other} is reported (wait for it first)"
                )
            found = self._first_hit(
                self._writing[other_lane][h, blocks] > 0, blocks, h, (other_lane,), device=True
            )
            if found:
                block, other = found
                raise ValueError(
                    f"checked mode: load job {job_id} writes {self._device_block(block, g, h)}, "
                    f"which load job {other} of the {other_lane} lane is still writing "
                    f"{_NOT_SEEN}; loads of different lanes are not ordered, so the block may "
                    f"end up with either's bytes. Load after job {other} is reported"
                )

    def _refuse_load_of_storing(self, job_id: int, g: int, h: int, host: np.ndarray) -> None:
        hit = np.flatnonzero(self._storing[h, host] != _EMPTY)
        if hit.size:
            row = int(host[hit[0]])
            other = int(self._storing[h, row])
            raise ValueError(
                f"checked mode: load job {job_id} reads {self._where(row, g)}, "
                f"whose store job {other} has not been reported "
                "finished by get_finished() nor waited for; jobs of different lanes are not "
                "ordered, so the load may copy the block before the store has "
                f"written it. Load after job {other} is reported"
            )

    def admit(self, job: Any) -> None:
        """Checks a job about to be queued and records it; raises ValueError naming the jobs."""
        is_store = job.is_store
        parts = []
        for c in job.copies:
            g = self._group_of[id(c.tensors)]
            host, dev = (c.dst_ids, c.src_ids) if is_store else (c.src_ids, c.dst_ids)
            parts.append((g, host.numpy(), dev.numpy()))
        for g, host, dev in parts:
            if is_store:
                self._refuse_store(job.job_id, g, host, dev)
            else:
                self._refuse_load(job.job_id, job.lane, g, host, dev)
            if not is_store:
                hit = np.flatnonzero(~self._stored[g, host])
                if hit.size:
                    row = int(host[hit[0]])
                    raise ValueError(
                        f"checked mode: load job {job.job_id} reads {self._where(row, g)}, which "
                        "holds nothing: no store into it was seen to finish, so the load "
                        "would fill the device blocks with whatever the mirror held (an id "
                        "off by one, or a block never stored?)"
                    )
        self._count(job, parts, 1)
        if is_store:
            for g, host, _ in parts:
                self._storing[g, host] = job.job_id
                self._stored[g, host] = False  # in flux until reported
        self._jobs[job.job_id] = (job, parts)

    def _count(self, job: Any, parts: list[tuple[int, np.ndarray, np.ndarray]], step: int) -> None:
        """Counts a pending job's reads and writes in (step=1) or out (step=-1)."""
        for g, host, dev in parts:
            if job.is_store:
                np.add.at(self._store_reading[g], dev, step)  # a store may read a block twice
            else:
                np.add.at(self._reading[g], host, step)
                self._writing[job.lane][g, dev] += step  # a job's destinations are distinct

    def observed(self, jobs: list[Any]) -> None:
        """Records that ``wait`` returned for ``jobs``: the caller has seen them finish."""
        for job in jobs:
            self.finish(job, job.error is None)

    def finish(self, job: Any, ok: bool) -> None:
        """Records that the caller saw ``job`` finish: ``get_finished`` reported it, or
        ``wait`` returned for it (a store that failed leaves its sub-blocks empty). Once
        per job; later calls do nothing, and so does a call for a job whose id
        a newer job has taken (a ``wait`` on another thread returning late)."""
        entry = self._jobs.get(job.job_id)
        if entry is None or entry[0] is not job:
            return
        del self._jobs[job.job_id]
        _, parts = entry
        self._count(job, parts, -1)
        if job.is_store:
            for g, host, _ in parts:
                mine = host[self._storing[g, host] == job.job_id]  # not overwritten by a later store
                self._storing[g, mine] = _EMPTY
                self._stored[g, mine] = ok


class _DeviceOverlays:
    """Which device blocks of each group share bytes with given blocks of
    another group (or the same group), from the cache tensors' addresses: a
    tensor in both groups maps a block to itself; two views of one allocation
    map a block to every block of the other view that it overlaps."""

    def __init__(self, tensors: list[torch.Tensor], groups: list[list[int]]) -> None:
        def layout(t: torch.Tensor) -> tuple[Any, int, int, int, int]:
            es = t.element_size()
            block = t[0].numel() * es if t.shape[0] else 0
            return t.device, t.data_ptr(), t.stride(0) * es, block, t.shape[0]

        layouts = [layout(t) for t in tensors]

        def overlaps(i: int, j: int) -> bool:
            (da, a0, sa, la, na), (db, b0, sb, lb, nb) = layouts[i], layouts[j]
            if da != db or not (la and lb and na and nb):
                return False
            a_lo, a_hi = min(a0, a0 + (na - 1) * sa), max(a0, a0 + (na - 1) * sa) + la
            b_lo, b_hi = min(b0, b0 + (nb - 1) * sb), max(b0, b0 + (nb - 1) * sb) + lb
            return a_lo < b_hi and b_lo < a_hi

        self._layouts = layouts
        # (g, h) -> [(i, j)]: tensor i of g against tensor j of h, i == j meaning the same tensor
        self._pairs: list[list[list[tuple[int, int]]]] = [
            [[(i, j) for i in mine for j in theirs if i == j or overlaps(i, j)] for theirs in groups]
            for mine in groups
        ]

    def blocks(self, g: int, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``[(h, blocks of h)]``: for each group ``h`` whose memory overlaps
        blocks ``ids`` of group ``g``, the blocks of ``h`` they share bytes with."""
        out = []
        for h, pairs in enumerate(self._pairs[g]):
            if pairs:
                found = [ids if i == j else self._overlapping(i, j, ids) for i, j in pairs]
                blocks = found[0] if len(found) == 1 else np.unique(np.concatenate(found))
                if blocks.size:
                    out.append((h, blocks))
        return out

    def _overlapping(self, i: int, j: int, ids: np.ndarray) -> np.ndarray:
        """The blocks of tensor ``j`` that share a byte with blocks ``ids`` of tensor ``i``."""
        _, a0, sa, la, _ = self._layouts[i]
        _, b0, sb, lb, nb = self._layouts[j]
        start = a0 + ids.astype(np.int64) * sa  # first byte of each block of i
        if sb <= 0:  # every block of j at one place (or reversed): compare each with each
            every = b0 + np.arange(nb, dtype=np.int64) * sb
            hit = (start[:, None] < every[None, :] + lb) & (every[None, :] < start[:, None] + la)
            return np.flatnonzero(hit.any(axis=0))
        # block y of j overlaps [start, start + la) when b0 + y*sb < start + la
        # and start < b0 + y*sb + lb
        lo = np.maximum(np.floor_divide(start - b0 - lb, sb) + 1, 0)
        hi = np.minimum(-np.floor_divide(b0 - start - la, sb) - 1, nb - 1)
        count = np.maximum(hi - lo + 1, 0)
        first = np.repeat(lo, count)
        step = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        return np.unique(first + step)


def attach(offloader: Any, check: bool | None) -> OffloaderChecks | None:
    """Registers an offloader's caches (device side) and mirrors (host side) as
    regions, dropped when the offloader is collected (the mirrors' also when
    their memory is freed); returns its contract tracker when ``check`` is
    True, or None and checked mode is on now; else None."""
    ids = []
    for i, t in enumerate(offloader.device_tensors):
        if t.numel():
            ids.append(int(torch.ops.kvswap._register_region(t, "device", f"device cache {i}")))
    for i, t in enumerate(offloader.host_tensors):
        if t.numel():
            ids.append(int(torch.ops.kvswap._register_region(t, "host", f"host mirror {i}")))
    weakref.finalize(offloader, _unregister_all, ids).atexit = False  # nothing to drop at exit
    if check is None:
        check = is_checked()
    return OffloaderChecks(offloader) if check else None


_apply()
