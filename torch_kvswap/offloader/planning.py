"""Job planning: a job's block ids, checked, turned into its copies (one
:func:`torch_kvswap.swap_blocks` call per KV-cache group the job touches).
Everything here raises before anything is queued."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import ops
from .specs import BlockIds


@dataclass
class Copy:
    """One swap_blocks call: the tensors of one group and that group's ids."""

    tensors: list[int]
    src_ids: torch.Tensor
    dst_ids: torch.Tensor


def as_ids(block_ids: BlockIds, name: str) -> np.ndarray:
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().cpu().numpy()
    if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__len__"):
        raise TypeError(
            f"{name} must be a 1-D sequence of integer block ids (list, numpy array "
            f"or CPU tensor), got {type(block_ids).__name__} {block_ids!r}"
        )
    arr = np.asarray(block_ids)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integer block ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of integer block ids, got shape {arr.shape}")
    return np.array(arr, dtype=np.int64)  # a copy: the caller may reuse its array once a call returns


def as_job_id(job_id: Any, name: str = "job_id") -> int:
    if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(job_id).__name__} {job_id!r}")
    return int(job_id)


def as_job_ids(job_ids: Iterable[int]) -> set[int]:
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise TypeError(
            f"job_ids must be an iterable of int job ids (a set, list or generator), "
            f"got {type(job_ids).__name__} {job_ids!r}"
        )
    return {as_job_id(j, "job_ids entry") for j in job_ids}


def check_range(ids: np.ndarray, limit: int, name: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise IndexError(f"{name}[{bad}] = {int(ids[bad])} is out of range: valid ids are 0..{limit - 1}")


class Planner:
    """Plans the jobs of one offloader: its factor, groups and block counts."""

    def __init__(
        self,
        factor: int,
        groups: list[list[int]],
        num_device_blocks: int,
        num_host_blocks: int,
        group_block_bytes: list[int],
    ) -> None:
        self.factor, self.groups = factor, groups
        self.num_device_blocks, self.num_host_blocks = num_device_blocks, num_host_blocks
        self.group_block_bytes = group_block_bytes

    def plan(
        self,
        is_store: bool,
        device: np.ndarray,
        host: np.ndarray,
        offsets: int | Sequence[int] | None,
        group_sizes: Sequence[int] | None,
    ) -> tuple[list[Copy], int]:
        """Checks a job and returns its copies (one per non-empty group) and bytes."""
        check_range(device, self.num_device_blocks, "device_block_ids")
        check_range(host, self.num_host_blocks, "host_block_ids")
        sizes = self._sizes(len(device), group_sizes)
        offs = None if offsets is None else self._offsets(offsets)
        spans = self._spans(is_store, sizes, offs, len(device), len(host))
        copies, num_bytes = self._copies(is_store, device, host, sizes, spans)
        check_distinct_destinations(copies)
        return copies, num_bytes

    def _sizes(self, num_device: int, group_sizes: Sequence[int] | None) -> list[int]:
        ng = len(self.groups)
        if group_sizes is None:
            if ng != 1:
                raise ValueError(f"group_sizes is required: this offloader has {ng} groups")
            return [num_device]
        sizes = [int(n) for n in group_sizes]
        if len(sizes) != ng or any(n < 0 for n in sizes) or sum(sizes) != num_device:
            raise ValueError(
                f"group_sizes {sizes} must give {ng} non-negative counts that "
                f"sum to len(device_block_ids) = {num_device}"
            )
        return sizes

    def _offsets(self, offsets: int | Sequence[int]) -> list[int]:
        f, ng = self.factor, len(self.groups)
        offs = [int(offsets)] if isinstance(offsets, (int, np.integer)) else [int(o) for o in offsets]
        if len(offs) != ng:
            raise ValueError(f"offsets has {len(offs)} entries; this offloader has {ng} groups")
        for g, o in enumerate(offs):
            if not 0 <= o < f:
                raise ValueError(
                    f"offsets[{g}] = {o} is out of range: valid offsets are 0..{f - 1} (factor {f})"
                )
        return offs

    def _spans(
        self, is_store: bool, sizes: list[int], offs: list[int] | None, num_device: int, num_host: int
    ) -> list[tuple[int, int]]:
        """(skip, host blocks) per group; their host blocks must add up to ``num_host``."""
        f = self.factor

        def whole() -> ValueError:
            return ValueError(
                f"load of {num_host} host blocks fills {num_host * f} device blocks "
                f"(factor {f}), got {num_device} device block ids; without offsets, "
                "loads move whole host blocks"
            )

        spans = []
        for g, n in enumerate(sizes):
            if offs is not None:
                skip = offs[g]
                spans.append((skip, -(-(n + skip) // f) if n else 0))
            elif is_store:
                spans.append((-n % f, -(-n // f)))
            else:
                if n % f:
                    raise whole()
                spans.append((0, n // f))
        needed = sum(h for _, h in spans)
        if needed != num_host:
            if offs is None and not is_store:
                raise whole()
            raise ValueError(
                f"{'store' if is_store else 'load'} of {num_device} device blocks "
                f"needs {needed} host blocks (factor {f}), got {num_host}"
            )
        return spans

    def _copies(
        self,
        is_store: bool,
        device: np.ndarray,
        host: np.ndarray,
        sizes: list[int],
        spans: list[tuple[int, int]],
    ) -> tuple[list[Copy], int]:
        """Every group's copy from one expansion of the job's host ids: a
        group's sub-blocks are consecutive in it, from sub-block ``skip`` of
        the group's first host block on."""
        f = self.factor
        subs = ops.expand_block_ids(torch.from_numpy(host), f, 0)  # pragma: no mutate (0 is the default)
        dev = torch.from_numpy(np.ascontiguousarray(device))
        copies, num_bytes, d0, s0 = [], 0, 0, 0
        for g, (n, (skip, n_host)) in enumerate(zip(sizes, spans)):
            if n:
                src, dst = (dev[d0 : d0 + n], subs[s0 + skip : s0 + skip + n])
                if not is_store:
                    src, dst = dst, src
                copies.append(Copy(self.groups[g], src, dst))
                num_bytes += n * self.group_block_bytes[g]
            d0, s0 = d0 + n, s0 + n_host * f
        return copies, num_bytes


def check_distinct_destinations(copies: list[Copy]) -> None:
    """No destination block of any tensor is written twice by one job."""
    dsts = [c.dst_ids.numpy() for c in copies]
    for i, (a, ids) in enumerate(zip(copies, dsts)):
        ordered = np.sort(ids)
        if (ordered[1:] == ordered[:-1]).any():
            raise ValueError("destination block ids repeat within one job")
        for b, other in zip(copies[i + 1 :], dsts[i + 1 :]):
            if set(a.tensors) & set(b.tensors) and np.intersect1d(ids, other).size:
                raise ValueError(
                    "destination block ids repeat within one job (two groups "
                    "that share a cache tensor write the same block)"
                )
