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

Ordering (see docs/offloader.md; the lanes are in lanes.py, the planning in
planning.py, the host mirrors in caches.py, strict mode's record in
strict.py):

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

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .. import _checked, ops
from .caches import (
    allocate_mirrors,
    check_groups,
    check_groups_do_not_alias,
    flatten_caches,
    unregister_mirrors,
)
from .host_memory import DEFAULT_CHUNK_BYTES, HostMemory
from .lanes import Job, Lanes
from .planning import Planner, as_ids, as_job_id
from .specs import BlockIds, TransferResult, is_host_spec
from .strict import StoreRecord

__all__ = ["KVCacheOffloader"]


def _copier(offloader: KVCacheOffloader) -> Callable[[Job], None]:
    """The lanes' copy function: the offloader's ``_copy``, looked up at each
    call through a weak reference, so the lanes and their threads never keep
    the offloader alive."""
    owner = weakref.ref(offloader)

    def copy(job: Job) -> None:
        offloader = owner()
        if offloader is None:
            raise RuntimeError("the KVCacheOffloader was collected before this job ran")
        offloader._copy(job)

    return copy


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
        numa_node: the NUMA node to place the mirrors on (bound before their
            first touch); ``False``: no binding; default: the device's own
            node where the machine has more than one.
        register_chunk_bytes: the most bytes one page-locking call takes
            (a multiple of 4096; default 64 GiB). Registration runs in the
            background; the first job waits for it to end
            (:attr:`host_memory` reports the times).

    The host mirrors have the device caches' per-block layout, in one
    allocation whose start and every mirror start on a 4 KiB page boundary,
    pinned in place at its exact size; where the engine cannot pin in place,
    the first job is refused with the size and why (the pinned allocator's
    power-of-two rounding would waste up to half).
    """

    def __init__(
        self,
        device_caches: Mapping[str, Any] | Sequence[Any],
        device_block_size: int,
        host_block_size: int,
        num_host_blocks: int | None = None,
        *,
        kv_stacked: bool | None = None,
        pin_memory: bool | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        host_bytes: int | None = None,
        check: bool | None = None,
        strict: bool = False,
        numa_node: int | bool | None = None,
        register_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if device_block_size < 1 or host_block_size < 1 or host_block_size % device_block_size:
            raise ValueError(
                f"host_block_size ({host_block_size}) must be a positive multiple of "
                f"device_block_size ({device_block_size})"
            )
        self.factor = host_block_size // device_block_size
        self._take_caches(device_caches, kv_stacked, groups)
        self.num_host_blocks = self._count_host_blocks(num_host_blocks, host_bytes)
        self._planner = Planner(
            self.factor, self.groups, self.num_device_blocks, self.num_host_blocks, self.group_block_bytes
        )
        on_accelerator = self.device.type != "cpu"
        if pin_memory and not on_accelerator:
            raise ValueError(
                "pin_memory=True needs caches on an accelerator; these are on cpu, "
                "where the host engine copies pageable memory directly"
            )
        #: whether the host mirrors are page-locked (in place, in the background)
        self.pinned = False
        #: the mirrors' memory: its NUMA node, and how long allocating,
        #: pre-faulting, registering and waiting for registration took
        self.host_memory: HostMemory | None = None
        self._registered = False  # pinned in place in one call by a subclass's _allocate_mirrors
        self._numa_node, self._register_chunk_bytes = numa_node, register_chunk_bytes
        self._allocation, self._buffer, self.host_tensors = self._allocate_mirrors(
            on_accelerator if pin_memory is None else pin_memory
        )
        self._checks = _checked.attach(self, check)  # regions always; the tracker when checked
        #: whether loads of never-stored host sub-blocks and waits on unknown ids are refused
        self.strict = bool(strict)
        trackers = [] if self._checks is None else [self._checks]
        if self.strict:
            trackers.append(StoreRecord(self.cache_names, self.num_host_blocks * self.factor, self.factor))
        medium = {"cuda": "GPU", "npu": "NPU"}.get(self.device.type, self.device.type.upper() + "_DEVICE")
        self._lanes = Lanes(self.device, medium, on_accelerator, _copier(self), trackers)
        self._released = False  # the mirrors, once, by the first shutdown() to stop the lanes
        self._release_lock = threading.Lock()

    def _take_caches(
        self,
        device_caches: Mapping[str, Any] | Sequence[Any],
        kv_stacked: bool | None,
        groups: Sequence[Sequence[int]] | None,
    ) -> None:
        """The flattened cache tensors, their groups and their block sizes."""
        self.device_tensors, self.cache_names = flatten_caches(device_caches, kv_stacked)
        self.groups = check_groups(groups, len(self.device_tensors))
        check_groups_do_not_alias(self.device_tensors, self.cache_names, self.groups)
        self.device = self.device_tensors[0].device
        self.num_device_blocks = self.device_tensors[0].shape[0]
        self._block_bytes = [t[0].numel() * t.element_size() for t in self.device_tensors]
        #: bytes of one device block across every cache tensor
        self.bytes_per_device_block = sum(self._block_bytes)
        #: bytes of one device block across the tensors of each group
        self.group_block_bytes = [sum(self._block_bytes[i] for i in g) for g in self.groups]

    def _count_host_blocks(self, num_host_blocks: int | None, host_bytes: int | None) -> int:
        if (num_host_blocks is None) == (host_bytes is None):
            raise ValueError("give exactly one of num_host_blocks and host_bytes")
        if host_bytes is not None:
            num_host_blocks = int(host_bytes) // (self.factor * self.bytes_per_device_block)
            if num_host_blocks < 1:
                raise ValueError(
                    f"host_bytes ({host_bytes}) is less than one host block "
                    f"({self.factor * self.bytes_per_device_block} bytes)"
                )
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        return int(num_host_blocks)

    # -- host mirrors ----------------------------------------------------------

    def _allocate_mirrors(self, pin: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """``(allocation, buffer, mirrors)``; sets ``pinned`` and ``host_memory``
        (subclasses that carve the mirrors from other memory override this)."""
        self.host_memory, mirrors = allocate_mirrors(
            self.device_tensors,
            self._block_bytes,
            self.num_host_blocks * self.factor,
            self.device,
            pin,
            numa_node=self._numa_node,
            chunk_bytes=self._register_chunk_bytes,
        )
        self.pinned = bool(pin)
        return self.host_memory.buffer._base, self.host_memory.buffer, mirrors

    def _wait_for_mirrors(self) -> None:
        """Blocks until the mirrors are page-locked: a job hands swap_blocks
        whole mirrors, and the core checks each host tensor at both ends."""
        if self.host_memory is not None and not self.host_memory.settled:
            self.host_memory.wait()

    def _submit(
        self,
        job_id: int,
        lane: str,
        src: np.ndarray,
        dst: np.ndarray,
        offsets: int | Sequence[int] | None,
        group_sizes: Sequence[int] | None,
    ) -> bool:
        self._wait_for_mirrors()
        is_store = lane == "store"
        device, host = (src, dst) if is_store else (dst, src)
        copies, num_bytes = self._planner.plan(is_store, device, host, offsets, group_sizes)
        self._lanes.submit(Job(job_id, lane, num_bytes, copies))
        return True

    def _copy(self, job: Job) -> None:
        """A job's copies: one :func:`~torch_kvswap.swap_blocks` call per group."""
        src, dst = (
            (self.device_tensors, self.host_tensors)
            if job.is_store
            else (self.host_tensors, self.device_tensors)
        )
        for c in job.copies:
            ops.swap_blocks([src[i] for i in c.tensors], [dst[i] for i in c.tensors], c.src_ids, c.dst_ids)

    def _release_mirrors(self) -> None:
        if self.host_memory is not None:
            self.host_memory.release()
            self.host_memory = None
        if self._registered:
            self._registered = False
            unregister_mirrors(self._buffer, self.device, chunk_bytes=max(self._buffer.numel(), 1))
        self.host_tensors = []
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._allocation = self._buffer

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

    def store(
        self,
        job_id: int,
        device_block_ids: BlockIds,
        host_block_ids: BlockIds,
        *,
        offsets: int | Sequence[int] | None = None,
        group_sizes: Sequence[int] | None = None,
    ) -> bool:
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
        return self._submit(
            as_job_id(job_id),
            "store",
            as_ids(device_block_ids, "device_block_ids"),
            as_ids(host_block_ids, "host_block_ids"),
            offsets,
            group_sizes,
        )

    def load(
        self,
        job_id: int,
        host_block_ids: BlockIds,
        device_block_ids: BlockIds,
        *,
        offsets: int | Sequence[int] | None = None,
        group_sizes: Sequence[int] | None = None,
        expedited: bool = False,
    ) -> bool:
        """Host -> device: the reverse of :meth:`store`, with the same
        ``offsets`` and ``group_sizes`` rules. With ``offsets=None`` a load
        moves whole host blocks (``len(device_block_ids) == factor * len(host_block_ids)``).
        ``expedited=True`` runs it on its own lane, so it never queues behind
        ordinary loads (for loads the caller waits on right away)."""
        return self._submit(
            as_job_id(job_id),
            "expedited" if expedited else "load",
            as_ids(host_block_ids, "host_block_ids"),
            as_ids(device_block_ids, "device_block_ids"),
            offsets,
            group_sizes,
        )

    def transfer_async(self, job_id: int, spec: tuple[Any, Any], *, expedited: bool = False) -> bool:
        """Reference-compatible entry: ``spec = (src_spec, dst_spec)``, each with
        ``block_ids``; the spec whose ``medium()`` is ``"CPU"`` is the host side
        (vLLM's ``CPULoadStoreSpec``/``GPULoadStoreSpec``, or :class:`HostBlocks`
        and :class:`DeviceBlocks`). A device spec with ``group_sizes`` and
        ``block_indices`` (vLLM's) or ``offsets`` (:class:`DeviceBlocks`) gets
        explicit offsets: ``block_indices[g] % factor``."""
        src_spec, dst_spec = spec
        src_host, dst_host = is_host_spec(src_spec), is_host_spec(dst_spec)
        if src_host == dst_host:
            raise ValueError(
                "spec must pair one host (CPU) side with one device side, got "
                f"{type(src_spec).__name__} -> {type(dst_spec).__name__}"
            )
        device_spec = dst_spec if src_host else src_spec
        group_sizes = getattr(device_spec, "group_sizes", None)
        offsets = getattr(device_spec, "offsets", None)
        block_indices = getattr(device_spec, "block_indices", None)
        if offsets is None and block_indices is not None:
            offsets = [int(b) % self.factor for b in block_indices]
        if dst_host:
            return self.store(
                job_id, src_spec.block_ids, dst_spec.block_ids, offsets=offsets, group_sizes=group_sizes
            )
        return self.load(
            job_id,
            src_spec.block_ids,
            dst_spec.block_ids,
            offsets=offsets,
            group_sizes=group_sizes,
            expedited=expedited,
        )

    # -- completion ----------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs that finished since the last call: stores, then
        loads, then expedited loads, each in submission order. Never blocks.

        With no accelerator, a call that finds nothing finished while jobs are
        pending yields the processor once (``os.sched_yield``, which also
        releases the GIL), so a caller polling in a tight loop does not starve
        the copy threads."""
        return self._lanes.get_finished()

    def wait(self, job_ids: Iterable[int], *, strict: bool | None = None) -> None:
        """Block until every listed job has finished (it stays reportable by
        ``get_finished``). Ids that are not pending (already reported, or never
        submitted) are ignored, as in the reference; ``strict=True`` (default:
        the offloader's ``strict``) raises ``KeyError`` for them instead.
        ``job_ids`` is an iterable of ints (``wait({1})``, not ``wait(1)``)."""
        self._lanes.wait(job_ids, self.strict if strict is None else strict)

    def pending(self) -> list[int]:
        """Job ids submitted and not yet reported by ``get_finished``."""
        return self._lanes.pending()

    def shutdown(self) -> None:
        """Finish every in-flight job, stop the workers and release the host
        mirrors. Results stay available from ``get_finished``. Idempotent and
        safe to interrupt (Ctrl-C): the next call, or exit, finishes the
        shutdown. In a forked child it returns at once: the jobs, the workers
        and the mirrors are the parent's."""
        if not self._lanes.shutdown():
            return
        with self._release_lock:  # two threads' shutdown() release the mirrors once
            released, self._released = self._released, True
        if not released:
            self._release_mirrors()

    def __enter__(self) -> KVCacheOffloader:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
