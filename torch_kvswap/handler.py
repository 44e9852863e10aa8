"""KVCacheOffloader: host mirrors of a paged KV cache and asynchronous block transfers.

The class an offloading connector builds on: it owns a host mirror of every
KV-cache tensor, turns "store these device blocks into those host blocks" (and
the reverse) into :func:`torch_kvswap.swap_blocks` calls (one per KV-cache
group that the job touches), and tracks the jobs until they finish.

Lifecycle::

    offloader = KVCacheOffloader(caches, device_block_size=16, host_block_size=32,
                                 num_host_blocks=1024)
    offloader.store(job_id=1, device_block_ids=[4, 9], host_block_ids=[7])
    offloader.load(job_id=2, host_block_ids=[3], device_block_ids=[0, 1])
    for result in offloader.get_finished():  # never blocks
        ...
    offloader.wait({2})                       # blocks until job 2 is done
    offloader.shutdown()                      # drains, frees; idempotent

A host block holds ``factor = host_block_size // device_block_size``
consecutive device-block-sized *sub-blocks*. A job may start at any sub-block
of its first host block (``offsets``) and end at any sub-block of its last
one, in both directions; see :meth:`KVCacheOffloader.store`.

Ordering (see docs/handler.md):

* One lane per kind of job: stores, loads and expedited loads, each with its
  own stream (with no accelerator: its own worker thread). Jobs of one lane
  run and finish in submission order; an expedited load never queues behind
  an ordinary load.
* At submission, every job waits for the work already queued on the current
  compute stream, so a store reads finished KV data and a load does not
  overwrite blocks that queued compute still reads.
* There is no ordering *between* lanes, as in the reference design: load a
  host block only after its store was reported finished.

Threads: every public method may be called from any thread. An internal lock
guards the job tables and is never held while a copy is launched or waited
for, so ``get_finished`` on another thread is never held up by a submission,
``wait`` or ``shutdown``.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

from . import _checked, ops

logger = logging.getLogger("torch_kvswap")

__all__ = ["KVCacheOffloader", "TransferResult", "HostBlocks", "DeviceBlocks"]

BlockIds = Union[Sequence[int], np.ndarray, torch.Tensor]
_PAGE = 4096  # host mirrors start on page boundaries and never share a page
# Host buffers the runtime may still count as registered, kept for the life of
# the process: an unregistration failed at shutdown, or a registration that
# could not be confirmed could not be undone either (_allocate_mirrors).
_STILL_REGISTERED: list[torch.Tensor] = []
_LANES = ("store", "load", "expedited")
# Offloaders not yet shut down. At interpreter exit each is shut down: its
# in-flight jobs finish and its worker threads stop before the interpreter
# tears down, instead of being cut off inside a copy (which aborts the
# process: "terminate called without an active exception").
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_live() -> None:
    for offloader in list(_LIVE):
        try:
            offloader.shutdown()
        except Exception:  # noqa: BLE001 - exit goes on; the others still shut down
            logger.exception("kvswap: shutting down an offloader at exit failed")


@dataclass(frozen=True)
class TransferResult:
    """What ``get_finished`` reports for one job."""

    job_id: int
    success: bool
    transfer_size: int  #: bytes moved (every tensor of every group); 0 when the job failed
    transfer_time: float  #: seconds, from the copy's start to its end
    transfer_type: tuple[str, str]  #: (source medium, destination medium)
    error: str | None = None  #: why the job failed, when it did


@dataclass(frozen=True)
class HostBlocks:
    """Typed spec: host block ids (each ``factor`` device blocks)."""

    block_ids: BlockIds

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclass(frozen=True)
class DeviceBlocks:
    """Typed spec: device block ids, optionally split by KV-cache group.

    ``group_sizes[g]`` ids belong to group ``g`` (in group order) and
    ``offsets[g]`` is the sub-block of the first host block where group ``g``
    starts; both default to the single-group, reference behaviour.
    """

    block_ids: BlockIds
    group_sizes: Sequence[int] | None = None
    offsets: Sequence[int] | None = None

    @staticmethod
    def medium() -> str:
        return "DEVICE"


def _is_host_spec(spec: Any) -> bool:
    medium = getattr(spec, "medium", None)
    name = medium() if callable(medium) else type(spec).__name__
    return str(name).upper().startswith("CPU")


def _as_ids(block_ids: BlockIds, name: str) -> np.ndarray:
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().cpu().numpy()
    if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__len__"):
        raise TypeError(f"{name} must be a 1-D sequence of integer block ids (list, numpy array "
                        f"or CPU tensor), got {type(block_ids).__name__} {block_ids!r}")
    arr = np.asarray(block_ids)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integer block ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of integer block ids, got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _as_job_id(job_id: Any, name: str = "job_id") -> int:
    if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(job_id).__name__} {job_id!r}")
    return int(job_id)


def _as_job_ids(job_ids: Iterable[int]) -> set[int]:
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise TypeError(f"job_ids must be an iterable of int job ids (a set, list or generator), "
                        f"got {type(job_ids).__name__} {job_ids!r}")
    return {_as_job_id(j, "job_ids entry") for j in job_ids}


def _check_range(ids: np.ndarray, limit: int, name: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise IndexError(f"{name}[{bad}] = {int(ids[bad])} is out of range: valid ids are "
                         f"0..{limit - 1}")


def _flatten_caches(caches: Mapping[str, Any] | Sequence[Any],
                    kv_stacked: bool | None) -> tuple[list[torch.Tensor], list[str]]:
    """Per-layer caches -> the tensors whose dim 0 indexes blocks, and a name
    for each (its key, with K or V where an entry holds both)."""
    if isinstance(caches, Mapping):
        items = [(repr(k), v) for k, v in caches.items()]
    else:
        items = [(f"device_caches[{i}]", v) for i, v in enumerate(caches)]
    if not items:
        raise ValueError("device_caches is empty")
    out: list[torch.Tensor] = []
    names: list[str] = []
    for key, v in items:
        if isinstance(v, (tuple, list)):
            out.extend(v)  # (key, value) per layer
            names.extend(f"{key} {'KV'[j] if len(v) == 2 else j}" for j in range(len(v)))
        elif isinstance(v, torch.Tensor):
            stacked = kv_stacked if kv_stacked is not None else (v.dim() >= 3 and v.shape[0] == 2)
            out.extend([v[0], v[1]] if stacked else [v])
            names.extend([f"{key} K", f"{key} V"] if stacked else [key])
        else:
            raise TypeError(f"device_caches entry {key} is {type(v).__name__}; expected a tensor or "
                            "a (key, value) tuple of tensors")
    for t, name in zip(out, names):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"device_caches entry {name} is {type(t).__name__}; expected a tensor")
    first, first_name = out[0], names[0]
    for t, name in zip(out, names):
        if t.device != first.device:
            raise ValueError(f"cache {name} is on {t.device}, but {first_name} is on {first.device}")
        if t.dim() < 1:
            raise ValueError(f"cache {name} is a 0-d tensor; dim 0 must index blocks")
        if t.shape[0] != first.shape[0]:
            raise ValueError(f"cache {name} has {t.shape[0]} blocks, but {first_name} has "
                             f"{first.shape[0]}; every cache tensor needs the same number of blocks")
        expected = 1
        for d in range(t.dim() - 1, 0, -1):
            if t.shape[d] != 1 and t.stride(d) != expected:
                raise ValueError(f"cache {name}: each block must be contiguous in memory, but dim {d} "
                                 f"of shape {tuple(t.shape)} has stride {t.stride(d)} (expected "
                                 f"{expected})")
            expected *= t.shape[d]
    return out, names


def _check_groups(groups: Sequence[Sequence[int]] | None, num_tensors: int) -> list[list[int]]:
    if groups is None:
        return [list(range(num_tensors))]
    out = []
    if len(groups) == 0:
        raise ValueError("groups must list at least one KV-cache group")
    for g, members in enumerate(groups):
        members = [int(i) for i in members]
        if not members:
            raise ValueError(f"groups[{g}] is empty: every group needs at least one cache tensor")
        for i in members:
            if not 0 <= i < num_tensors:
                raise ValueError(f"groups[{g}] names cache tensor {i}; valid indices are "
                                 f"0..{num_tensors - 1}")
        if len(set(members)) != len(members):
            raise ValueError(f"groups[{g}] names a cache tensor twice: {members}")
        out.append(members)
    return out


def _check_groups_do_not_alias(tensors: list[torch.Tensor], names: list[str],
                               groups: list[list[int]]) -> None:
    """No two cache tensors of one group share a byte of their blocks: a
    group is one swap_blocks call, whose pairs may not alias (the core would
    refuse every load into them). Blocks interleaved on one stride (K and V
    views of a ``[num_blocks, 2, ...]`` cache) are distinct memory."""
    def extent(i: int) -> tuple[int, int]:
        t = tensors[i]
        block = t[0].numel() * t.element_size()
        start = t.data_ptr()
        return start, start + (t.shape[0] - 1) * t.stride(0) * t.element_size() + block

    for g, members in enumerate(groups):
        spans = sorted((extent(i) + (i,) for i in members if tensors[i].numel()), key=lambda e: e[0])
        for k, (a0, a1, a) in enumerate(spans):
            for b0, _b1, b in spans[k + 1:]:
                if b0 >= a1:
                    break
                ta, tb = tensors[a], tensors[b]
                stride = ta.stride(0) * ta.element_size()
                if stride > 0 and stride == tb.stride(0) * tb.element_size():
                    delta = (b0 - a0) % stride
                    if delta >= ta[0].numel() * ta.element_size() and \
                            delta + tb[0].numel() * tb.element_size() <= stride:
                        continue  # interleaved: every block of one sits in the other's gaps
                raise ValueError(f"caches {names[a]} and {names[b]} share memory (groups[{g}] holds "
                                 "both); a load would write the same bytes twice in one call. Give "
                                 "each cache tensor its own memory")


@dataclass
class _Copy:
    """One swap_blocks call: the tensors of one group and that group's ids."""

    tensors: list[int]
    src_ids: torch.Tensor
    dst_ids: torch.Tensor


@dataclass
class _Job:
    job_id: int
    lane: str
    num_bytes: int
    # Kept alive until the job is reported: the copies read them.
    copies: list[_Copy]
    start_event: Any = None
    end_event: Any = None
    # Stream path: set once the events are recorded (or the launch failed).
    launched: threading.Event = field(default_factory=threading.Event)
    # Worker path: set when the copy returned; stream path: when the launch failed.
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    error: str | None = None

    @property
    def is_store(self) -> bool:
        return self.lane == "store"

    def finished(self) -> bool:
        if self.done.is_set():
            return True
        if not self.launched.is_set():
            return False
        try:
            return bool(self.end_event.query())
        except Exception as exc:  # noqa: BLE001 - an asynchronous device error
            self.error = self.error or f"{type(exc).__name__}: {exc}"
            return True


class KVCacheOffloader:
    """Host mirrors of a paged KV cache and asynchronous store/load jobs.

    Args:
        device_caches: the KV cache, per layer: ``{name: tensor}`` with dim 0
            indexing blocks, ``{name: (key, value)}``, or ``{name: kv}`` with
            ``kv`` of shape ``[2, num_blocks, ...]`` (a sequence of the same
            also works). Every block must be contiguous in memory; every
            tensor on one device with the same number of blocks; any dtype.
        device_block_size: tokens per device block.
        host_block_size: tokens per host block; a multiple of
            ``device_block_size`` (``factor = host_block_size // device_block_size``).
        num_host_blocks: host blocks to allocate. Give this or ``host_bytes``.
        kv_stacked: whether a tensor entry is a stacked ``[2, num_blocks, ...]``
            cache; by default, a tensor of 3 or more dims whose dim 0 is 2.
        pin_memory: page-lock the host mirrors for asynchronous DMA; default:
            when the caches are on an accelerator.
        groups: KV-cache groups, as lists of indices into the flattened cache
            tensors (:attr:`device_tensors`, in ``device_caches`` order, a
            ``(key, value)`` pair or a stacked tensor giving two). A job names
            the block ids of each group; a group's ids apply to its tensors
            only. Groups may share tensors (hybrid models whose groups overlay
            one allocation). Default: one group of every tensor.
        host_bytes: instead of ``num_host_blocks``: the most host memory to
            use; ``num_host_blocks = host_bytes // (factor * bytes_per_device_block)``,
            which must be at least 1. Page-alignment padding (under 4 KiB per
            tensor plus 4 KiB) comes on top.
        check: track each host block and refuse jobs that break the contract
            (docs/checked.md); default: whether checked mode is on now.
        strict: refuse, before any copy, a load that reads a host sub-block no
            store has written (by default such a load copies the mirror's
            zeros and succeeds, as in the reference), and make :meth:`wait`
            raise ``KeyError`` for ids that are not pending. A bit per host
            sub-block and cache tensor; far cheaper than checked mode.

    The host mirrors have the device caches' per-block layout, in one
    allocation whose start and every mirror start on a 4 KiB page boundary,
    pinned at its exact size where the engine supports it (the pinned
    allocator's power-of-two rounding would waste up to half).
    """

    def __init__(self, device_caches: Mapping[str, Any] | Sequence[Any], device_block_size: int,
                 host_block_size: int, num_host_blocks: int | None = None, *,
                 kv_stacked: bool | None = None, pin_memory: bool | None = None,
                 groups: Sequence[Sequence[int]] | None = None,
                 host_bytes: int | None = None, check: bool | None = None,
                 strict: bool = False) -> None:
        if device_block_size < 1 or host_block_size < 1 or host_block_size % device_block_size:
            raise ValueError(f"host_block_size ({host_block_size}) must be a positive multiple of "
                             f"device_block_size ({device_block_size})")
        self.factor = host_block_size // device_block_size
        self.device_tensors, self.cache_names = _flatten_caches(device_caches, kv_stacked)
        self.groups = _check_groups(groups, len(self.device_tensors))
        _check_groups_do_not_alias(self.device_tensors, self.cache_names, self.groups)
        self.device = self.device_tensors[0].device
        self.num_device_blocks = self.device_tensors[0].shape[0]
        self._block_bytes = [t[0].numel() * t.element_size() for t in self.device_tensors]
        #: bytes of one device block across every cache tensor
        self.bytes_per_device_block = sum(self._block_bytes)
        #: bytes of one device block across the tensors of each group
        self.group_block_bytes = [sum(self._block_bytes[i] for i in g) for g in self.groups]
        if (num_host_blocks is None) == (host_bytes is None):
            raise ValueError("give exactly one of num_host_blocks and host_bytes")
        if host_bytes is not None:
            num_host_blocks = int(host_bytes) // (self.factor * self.bytes_per_device_block)
            if num_host_blocks < 1:
                raise ValueError(f"host_bytes ({host_bytes}) is less than one host block "
                                 f"({self.factor * self.bytes_per_device_block} bytes)")
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        self.num_host_blocks = int(num_host_blocks)
        on_accelerator = self.device.type != "cpu"
        if pin_memory and not on_accelerator:
            raise ValueError("pin_memory=True needs caches on an accelerator; these are on cpu, "
                             "where the host engine copies pageable memory directly")
        #: whether the host mirrors are page-locked; _registered: pinned in place by us
        self.pinned = False
        self._registered = False
        self._allocation, self._buffer, self.host_tensors = self._allocate_mirrors(
            on_accelerator if pin_memory is None else pin_memory)
        self._checks = _checked.attach(self, check)  # regions always; the tracker when checked
        #: whether loads of never-stored host sub-blocks and waits on unknown ids are refused
        self.strict = bool(strict)
        # strict: which host sub-block rows of which tensor a store has been submitted for
        self._stored = np.zeros((len(self.device_tensors), self.num_host_blocks * self.factor),
                                dtype=bool) if self.strict else None
        self._device_medium = {"cuda": "GPU", "npu": "NPU"}.get(self.device.type,
                                                               self.device.type.upper() + "_DEVICE")

        self._lock = threading.Lock()  # the job tables; never held across a launch or a wait
        # One submission lock per lane keeps launch order equal to table order.
        self._lane_locks = {lane: threading.Lock() for lane in _LANES}
        self._pending: dict[int, _Job] = {}  # submitted, not yet reported
        self._fifo: dict[str, collections.deque[_Job]] = {lane: collections.deque() for lane in _LANES}
        self._closed = False
        self._event_pool: list[Any] = []
        if on_accelerator:
            self._streams = {lane: torch.Stream(device=self.device) for lane in _LANES}
            self._workers = None
        else:
            self._streams = None
            self._queues = {lane: queue.SimpleQueue() for lane in _LANES}
            self._workers = {
                lane: threading.Thread(target=self._worker_loop, args=(self._queues[lane],),
                                       name=f"kvswap-{lane}", daemon=True)
                for lane in _LANES}
            for w in self._workers.values():
                w.start()
        _LIVE.add(self)  # shut down at interpreter exit (_shutdown_live)

    # -- host mirrors ----------------------------------------------------------

    def _allocate_mirrors(self, pin: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        rows = self.num_host_blocks * self.factor
        offsets, total = [], 0
        for bb in self._block_bytes:
            offsets.append(total)
            total += -(-rows * bb // _PAGE) * _PAGE
        # Slack of one page, then a page-aligned view: the buffer's first and
        # last pages belong to this offloader alone (in-place registration
        # pins whole pages).
        allocation = torch.empty(total + _PAGE, dtype=torch.uint8)
        start = -allocation.data_ptr() % _PAGE
        buffer = allocation[start:start + total]
        if pin:
            try:
                torch.ops.kvswap._host_register(buffer, self.device, True)
                self._registered = True
            except (NotImplementedError, RuntimeError) as exc:
                logger.warning("kvswap: cannot pin %d host bytes in place (%s); using the pinned "
                               "allocator, which rounds up to a power of two", total, exc)
                if "may still be registered" in str(exc):
                    # The engine could not undo a registration: freeing the
                    # memory would hand registered pages back to the allocator.
                    _STILL_REGISTERED.append(allocation)
                allocation = torch.empty(total + _PAGE, dtype=torch.uint8, pin_memory=True)
                start = -allocation.data_ptr() % _PAGE
                buffer = allocation[start:start + total]
            self.pinned = True
        mirrors = []
        for t, off, bb in zip(self.device_tensors, offsets, self._block_bytes):
            view = buffer[off:off + rows * bb].view(t.dtype).view(rows, *t.shape[1:])
            view.zero_()
            mirrors.append(view)
        return allocation, buffer, mirrors

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory held for the mirrors, alignment slack included."""
        return self._allocation.numel()

    @property
    def host_bytes_needed(self) -> int:
        """Bytes the mirrors need without alignment padding."""
        return self.num_host_blocks * self.factor * self.bytes_per_device_block

    @property
    def buffer(self) -> torch.Tensor:
        """The page-aligned uint8 host buffer that holds every mirror (CPU)."""
        return self._buffer

    # -- submission ------------------------------------------------------------

    def store(self, job_id: int, device_block_ids: BlockIds, host_block_ids: BlockIds, *,
              offsets: int | Sequence[int] | None = None,
              group_sizes: Sequence[int] | None = None) -> bool:
        """Device -> host: copy device blocks into consecutive host sub-blocks.

        Args:
            job_id: any int not pending (submitted and not yet reported).
            device_block_ids: 1-D integer ids (list, numpy or CPU tensor), each
                ``< num_device_blocks``; group by group when there are groups.
            host_block_ids: 1-D integer host block ids, each ``< num_host_blocks``.
            offsets: the sub-block (``0 <= offset < factor``) of its first host
                block where each group starts, one per group (an int for one
                group). Group ``g`` with ``n`` device blocks then spans
                ``ceil((offset + n) / factor)`` host blocks and may end mid
                block. ``None`` keeps the reference rule: a store ends on a
                host block boundary and skips the first ``-n % factor``
                sub-blocks.
            group_sizes: device ids per group (sum = ``len(device_block_ids)``);
                ``None`` for one group. Groups come in :attr:`groups` order.

        Returns ``True`` once the job is queued; raises before any copy on bad
        input. The copy is ordered after the work queued on the current stream.
        """
        return self._submit(_as_job_id(job_id), "store", _as_ids(device_block_ids, "device_block_ids"),
                            _as_ids(host_block_ids, "host_block_ids"), offsets, group_sizes)

    def load(self, job_id: int, host_block_ids: BlockIds, device_block_ids: BlockIds, *,
             offsets: int | Sequence[int] | None = None,
             group_sizes: Sequence[int] | None = None, expedited: bool = False) -> bool:
        """Host -> device: the reverse of :meth:`store`, with the same
        ``offsets`` and ``group_sizes`` rules. With ``offsets=None`` a load
        moves whole host blocks (``len(device_block_ids) == factor * len(host_block_ids)``).
        ``expedited=True`` runs it on its own lane, so it never queues behind
        ordinary loads (for loads the caller waits on right away)."""
        return self._submit(_as_job_id(job_id), "expedited" if expedited else "load",
                            _as_ids(host_block_ids, "host_block_ids"),
                            _as_ids(device_block_ids, "device_block_ids"), offsets, group_sizes)

    def transfer_async(self, job_id: int, spec: tuple[Any, Any], *, expedited: bool = False) -> bool:
        """Reference-compatible entry: ``spec = (src_spec, dst_spec)``, each with
        ``block_ids``; the spec whose ``medium()`` is ``"CPU"`` is the host side
        (vLLM's ``CPULoadStoreSpec``/``GPULoadStoreSpec``, or :class:`HostBlocks`
        and :class:`DeviceBlocks`). A device spec with ``group_sizes`` and
        ``block_indices`` (vLLM's) or ``offsets`` (:class:`DeviceBlocks`) gets
        explicit offsets: ``block_indices[g] % factor``."""
        src_spec, dst_spec = spec
        src_host, dst_host = _is_host_spec(src_spec), _is_host_spec(dst_spec)
        if src_host == dst_host:
            raise ValueError("spec must pair one host (CPU) side with one device side, got "
                             f"{type(src_spec).__name__} -> {type(dst_spec).__name__}")
        device_spec = dst_spec if src_host else src_spec
        group_sizes = getattr(device_spec, "group_sizes", None)
        offsets = getattr(device_spec, "offsets", None)
        block_indices = getattr(device_spec, "block_indices", None)
        if offsets is None and block_indices is not None:
            offsets = [int(b) % self.factor for b in block_indices]
        if dst_host:
            return self.store(job_id, src_spec.block_ids, dst_spec.block_ids, offsets=offsets,
                              group_sizes=group_sizes)
        return self.load(job_id, src_spec.block_ids, dst_spec.block_ids, offsets=offsets,
                         group_sizes=group_sizes, expedited=expedited)

    def _plan(self, is_store: bool, device: np.ndarray, host: np.ndarray,
              offsets: int | Sequence[int] | None,
              group_sizes: Sequence[int] | None) -> tuple[list[_Copy], int]:
        """Checks a job and returns its copies (one per non-empty group) and bytes."""
        f, ng = self.factor, len(self.groups)
        _check_range(device, self.num_device_blocks, "device_block_ids")
        _check_range(host, self.num_host_blocks, "host_block_ids")
        if group_sizes is None:
            if ng != 1:
                raise ValueError(f"group_sizes is required: this offloader has {ng} groups")
            sizes = [len(device)]
        else:
            sizes = [int(n) for n in group_sizes]
            if len(sizes) != ng or any(n < 0 for n in sizes) or sum(sizes) != len(device):
                raise ValueError(f"group_sizes {sizes} must give {ng} non-negative counts that "
                                 f"sum to len(device_block_ids) = {len(device)}")
        if offsets is not None:
            offs = [int(offsets)] if isinstance(offsets, (int, np.integer)) else [int(o) for o in offsets]
            if len(offs) != ng:
                raise ValueError(f"offsets has {len(offs)} entries; this offloader has {ng} groups")
            for g, o in enumerate(offs):
                if not 0 <= o < f:
                    raise ValueError(f"offsets[{g}] = {o} is out of range: valid offsets are "
                                     f"0..{f - 1} (factor {f})")
        spans = []  # (skip, host blocks) per group
        for g, n in enumerate(sizes):
            if offsets is not None:
                skip = offs[g]
                spans.append((skip, -(-(n + skip) // f) if n else 0))
            elif is_store:
                spans.append((-n % f, -(-n // f)))
            else:
                if n % f:
                    raise ValueError(f"load of {len(host)} host blocks fills {len(host) * f} device "
                                     f"blocks (factor {f}), got {len(device)} device block ids; "
                                     "without offsets, loads move whole host blocks")
                spans.append((0, n // f))
        needed = sum(h for _, h in spans)
        if needed != len(host):
            if offsets is None and not is_store:
                raise ValueError(f"load of {len(host)} host blocks fills {len(host) * f} device "
                                 f"blocks (factor {f}), got {len(device)} device block ids; "
                                 "without offsets, loads move whole host blocks")
            raise ValueError(f"{'store' if is_store else 'load'} of {len(device)} device blocks "
                             f"needs {needed} host blocks (factor {f}), got {len(host)}")
        copies, num_bytes, d0, h0 = [], 0, 0, 0
        for g, (n, (skip, n_host)) in enumerate(zip(sizes, spans)):
            if n:
                dev = torch.from_numpy(np.ascontiguousarray(device[d0:d0 + n]))
                subs = ops.expand_block_ids(torch.from_numpy(host[h0:h0 + n_host]), f, skip)[:n]
                src, dst = (dev, subs) if is_store else (subs, dev)
                copies.append(_Copy(self.groups[g], src, dst))
                num_bytes += n * self.group_block_bytes[g]
            d0, h0 = d0 + n, h0 + n_host
        self._check_distinct_destinations(copies)
        return copies, num_bytes

    @staticmethod
    def _check_distinct_destinations(copies: list[_Copy]) -> None:
        """No destination block of any tensor is written twice by one job."""
        for i, a in enumerate(copies):
            if len(torch.unique(a.dst_ids)) != len(a.dst_ids):
                raise ValueError("destination block ids repeat within one job")
            for b in copies[i + 1:]:
                if set(a.tensors) & set(b.tensors) and \
                        np.intersect1d(a.dst_ids.numpy(), b.dst_ids.numpy()).size:
                    raise ValueError("destination block ids repeat within one job (two groups "
                                     "that share a cache tensor write the same block)")

    def _submit(self, job_id: int, lane: str, src: np.ndarray, dst: np.ndarray,
                offsets: int | Sequence[int] | None, group_sizes: Sequence[int] | None) -> bool:
        is_store = lane == "store"
        device, host = (src, dst) if is_store else (dst, src)
        copies, num_bytes = self._plan(is_store, device, host, offsets, group_sizes)
        job = _Job(job_id, lane, num_bytes, copies)
        with self._lane_locks[lane]:  # launch order == table order, per lane
            with self._lock:
                if self._closed:
                    raise RuntimeError("KVCacheOffloader is shut down")
                if job.job_id in self._pending:
                    raise ValueError(f"job id {job.job_id} is already in flight or not yet reported")
                if self._checks is not None:
                    self._checks.admit(job)  # refuses before anything is queued
                if self._stored is not None:
                    self._track_stored(job)
                self._pending[job.job_id] = job
                self._fifo[lane].append(job)
            # Launched outside the table lock: get_finished never waits on a launch.
            if self._workers is not None:
                self._queues[lane].put(job)
            else:
                try:
                    self._launch_on_stream(job)
                except Exception as exc:  # noqa: BLE001 - never leave a job unfinishable
                    self._fail(job, exc)
                    job.done.set()
                finally:
                    job.launched.set()
        return True

    def _track_stored(self, job: _Job) -> None:
        """strict: a store marks the host rows it writes (a failed one unmarks
        them, _report); a load may read only marked rows."""
        if job.is_store:
            for c in job.copies:
                self._stored[np.ix_(c.tensors, c.dst_ids.numpy())] = True
            return
        for c in job.copies:
            rows = c.src_ids.numpy()
            stored = self._stored[np.ix_(c.tensors, rows)]
            if not stored.all():
                t, j = (int(x[0]) for x in np.nonzero(~stored))
                row = int(rows[j])
                raise ValueError(
                    f"load (job {job.job_id}) reads host block {row // self.factor} (sub-block "
                    f"{row % self.factor}) of cache {self.cache_names[c.tensors[t]]}, which no store "
                    "has written; strict=True refuses loads of never-stored host blocks (nothing "
                    "was copied)")

    def _copy(self, job: _Job) -> None:
        src, dst = (self.device_tensors, self.host_tensors) if job.is_store else \
            (self.host_tensors, self.device_tensors)
        for c in job.copies:
            ops.swap_blocks([src[i] for i in c.tensors], [dst[i] for i in c.tensors],
                            c.src_ids, c.dst_ids)

    def _launch_on_stream(self, job: _Job) -> None:
        stream = self._streams[job.lane]
        job.start_event, job.end_event = self._get_event(), self._get_event()
        # Wait for queued compute: a store must read finished KV data, and a
        # load must not overwrite blocks that queued compute still reads.
        stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            job.start_event.record(stream)
            try:
                self._copy(job)
            except Exception as exc:  # noqa: BLE001 - reported as a failed job
                self._fail(job, exc)
            job.end_event.record(stream)

    def _worker_loop(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                self._copy(job)
            except Exception as exc:  # noqa: BLE001 - reported as a failed job
                self._fail(job, exc)
            job.seconds = time.perf_counter() - t0
            job.done.set()

    def _fail(self, job: _Job, exc: BaseException) -> None:
        job.error = f"{type(exc).__name__}: {exc}"
        logger.error("kvswap: job %d (%s) failed: %s", job.job_id, job.lane, job.error)

    def _get_event(self):
        with self._lock:
            if self._event_pool:
                return self._event_pool.pop()
        return torch.Event(device=self.device, enable_timing=True)

    # -- completion --------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs that finished since the last call: stores, then
        loads, then expedited loads, each in submission order. Never blocks.

        With no accelerator, a call that finds nothing finished while jobs are
        pending yields the processor once (``os.sched_yield``, which also
        releases the GIL), so a caller polling in a tight loop does not starve
        the copy threads."""
        results = []
        with self._lock:
            for lane in _LANES:
                fifo = self._fifo[lane]
                while fifo and fifo[0].finished():
                    results.append(self._report(fifo.popleft()))
            idle = not results and self._workers is not None and bool(self._pending)
        if idle:
            os.sched_yield()
        return results

    def _report(self, job: _Job) -> TransferResult:
        seconds = job.seconds
        if job.launched.is_set() and not job.done.is_set():
            try:
                seconds = job.start_event.elapsed_time(job.end_event) * 1e-3
            except Exception as exc:  # noqa: BLE001 - an asynchronous device error
                job.error = job.error or f"{type(exc).__name__}: {exc}"
            self._event_pool += [job.start_event, job.end_event]
        del self._pending[job.job_id]
        if self._stored is not None and job.is_store and job.error is not None:
            for c in job.copies:  # a failed store may have written part of its rows
                self._stored[np.ix_(c.tensors, c.dst_ids.numpy())] = False
        kind = (self._device_medium, "CPU") if job.is_store else ("CPU", self._device_medium)
        ok = job.error is None
        if self._checks is not None:
            self._checks.finish(job, ok)
        return TransferResult(job.job_id, ok, job.num_bytes if ok else 0, seconds, kind, job.error)

    def wait(self, job_ids: Iterable[int], *, strict: bool | None = None) -> None:
        """Block until every listed job has finished (it stays reportable by
        ``get_finished``). Ids that are not pending (already reported, or never
        submitted) are ignored, as in the reference; ``strict=True`` (default:
        the offloader's ``strict``) raises ``KeyError`` for them instead.
        ``job_ids`` is an iterable of ints (``wait({1})``, not ``wait(1)``)."""
        wanted = _as_job_ids(job_ids)
        strict = self.strict if strict is None else strict
        with self._lock:
            missing = wanted - self._pending.keys()
            if strict and missing:
                raise KeyError(f"job ids not pending: {sorted(missing)}")
            jobs = [self._pending[j] for j in wanted - missing]
        for job in jobs:
            if self._workers is not None:
                job.done.wait()
                continue
            job.launched.wait()
            if not job.done.is_set():
                try:
                    job.end_event.synchronize()
                except Exception as exc:  # noqa: BLE001 - reported by get_finished
                    job.error = job.error or f"{type(exc).__name__}: {exc}"
        if self._checks is not None:
            with self._lock:
                self._checks.observed(jobs)  # the caller has seen them finish

    def pending(self) -> list[int]:
        """Job ids submitted and not yet reported by ``get_finished``."""
        with self._lock:
            return list(self._pending)

    def shutdown(self) -> None:
        """Finish every in-flight job, stop the workers and release the host
        mirrors. Results stay available from ``get_finished``. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _LIVE.discard(self)
        # A submission that passed the closed check is in the table now.
        for lock in self._lane_locks.values():
            with lock:
                pass
        with self._lock:
            jobs = list(self._pending.values())
        self.wait((j.job_id for j in jobs), strict=False)
        if self._workers is not None:
            for lane, worker in self._workers.items():
                self._queues[lane].put(None)
                worker.join()
        if self._registered:
            self._registered = False
            try:
                torch.ops.kvswap._host_register(self._buffer, self.device, False)
            except (NotImplementedError, RuntimeError) as exc:
                # The runtime still counts the range as registered: keep its
                # memory for the life of the process rather than hand it back
                # to the allocator, and release everything else.
                _STILL_REGISTERED.append(self._allocation)
                logger.error("kvswap: unregistering %d host bytes at shutdown failed (%s); the "
                             "buffer is kept for the life of the process", self._buffer.numel(), exc)
        self.host_tensors = []
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._allocation = self._buffer

    def __enter__(self) -> KVCacheOffloader:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
