"""The offloader's memory: the device caches flattened into the tensors whose
dim 0 indexes blocks, the KV-cache groups over them, and the page-aligned host
mirrors (allocated, pinned and unpinned here)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

logger = logging.getLogger("torch_kvswap")

_PAGE = 4096  # host mirrors start on page boundaries and never share a page
# Host buffers the runtime may still count as registered, kept for the life of
# the process: an unregistration failed at shutdown, or a registration that
# could not be confirmed could not be undone either (pinned_host_buffer).
_STILL_REGISTERED: list[torch.Tensor] = []


def flatten_caches(caches: Mapping[str, Any] | Sequence[Any],
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


def check_groups(groups: Sequence[Sequence[int]] | None, num_tensors: int) -> list[list[int]]:
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


def check_groups_do_not_alias(tensors: list[torch.Tensor], names: list[str],
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



def pinned_host_buffer(nbytes: int, device: torch.device, pin: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A page-aligned host buffer of ``nbytes`` (uninitialised):
    ``(allocation, buffer, registered)``. With ``pin`` it is pinned in place
    (``registered``), else, where the runtime refuses that, taken from the
    pinned allocator, which rounds up to a power of two. An allocation whose
    registration could be neither confirmed nor undone is kept in
    ``_STILL_REGISTERED``, never freed."""
    # Slack of one page, then a page-aligned view: the buffer's first and
    # last pages belong to its owner alone (in-place registration pins
    # whole pages).
    allocation = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    start = -allocation.data_ptr() % _PAGE
    buffer = allocation[start:start + nbytes]
    registered = False
    if pin:
        try:
            torch.ops.kvswap._host_register(buffer, device, True)
            registered = True
        except (NotImplementedError, RuntimeError) as exc:
            logger.warning("kvswap: cannot pin %d host bytes in place (%s); using the pinned "
                           "allocator, which rounds up to a power of two", nbytes, exc)
            if "may still be registered" in str(exc):
                # The engine could not undo a registration: freeing the
                # memory would hand registered pages back to the allocator.
                _STILL_REGISTERED.append(allocation)
            allocation = torch.empty(nbytes + _PAGE, dtype=torch.uint8, pin_memory=True)
            start = -allocation.data_ptr() % _PAGE
            buffer = allocation[start:start + nbytes]
    return allocation, buffer, registered


def allocate_mirrors(tensors: list[torch.Tensor], block_bytes: list[int], rows: int,
                     device: torch.device, pin: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], bool]:
    """Zeroed host mirrors of ``rows`` blocks of each of ``tensors``, in one
    allocation (:func:`pinned_host_buffer`), each on a page boundary:
    ``(allocation, page-aligned buffer, mirrors, registered)``;
    ``registered``: pinned in place (else pinned by the allocator, if ``pin``)."""
    offsets, total = [], 0
    for bb in block_bytes:
        offsets.append(total)
        total += -(-rows * bb // _PAGE) * _PAGE
    allocation, buffer, registered = pinned_host_buffer(total, device, pin)
    mirrors = []
    for t, off, bb in zip(tensors, offsets, block_bytes):
        view = buffer[off:off + rows * bb].view(t.dtype).view(rows, *t.shape[1:])
        view.zero_()
        mirrors.append(view)
    return allocation, buffer, mirrors, registered


def unregister_mirrors(buffer: torch.Tensor, device: torch.device) -> None:
    """Undoes an in-place registration of ``buffer``; where the runtime
    refuses, logs it and keeps ``buffer`` (a view, so its whole allocation)
    for the life of the process."""
    try:
        torch.ops.kvswap._host_register(buffer, device, False)
    except (NotImplementedError, RuntimeError) as exc:
        # The runtime still counts the range as registered: keep its
        # memory for the life of the process rather than hand it back
        # to the allocator, and release everything else.
        _STILL_REGISTERED.append(buffer)
        logger.error("kvswap: unregistering %d host bytes at shutdown failed (%s); the "
                     "buffer is kept for the life of the process", buffer.numel(), exc)
