"""The offloader's memory: the device caches flattened into the tensors whose
dim 0 indexes blocks, the KV-cache groups over them, and the page-aligned host
mirrors laid out in one exact-size buffer (host_memory.py allocates, binds,
pre-faults and pins it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import numa
from .host_memory import DEFAULT_CHUNK_BYTES, PAGE, STILL_REGISTERED, HostMemory, chunks, unregister_chunks

_PAGE = PAGE  # host mirrors start on page boundaries and never share a page
_STILL_REGISTERED = STILL_REGISTERED  # kept for the life of the process (host_memory)


def flatten_caches(
    caches: Mapping[str, Any] | Sequence[Any], kv_stacked: bool | None
) -> tuple[list[torch.Tensor], list[str]]:
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
            raise TypeError(
                f"device_caches entry {key} is {type(v).__name__}; expected a tensor or "
                "a (key, value) tuple of tensors"
            )
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
            raise ValueError(
                f"cache {name} has {t.shape[0]} blocks, but {first_name} has "
                f"{first.shape[0]}; every cache tensor needs the same number of blocks"
            )
        expected = 1
        for d in range(t.dim() - 1, 0, -1):
            if t.shape[d] != 1 and t.stride(d) != expected:
                raise ValueError(
                    f"cache {name}: each block must be contiguous in memory, but dim {d} "
                    f"of shape {tuple(t.shape)} has stride {t.stride(d)} (expected "
                    f"{expected})"
                )
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
                raise ValueError(
                    f"groups[{g}] names cache tensor {i}; valid indices are 0..{num_tensors - 1}"
                )
        if len(set(members)) != len(members):
            raise ValueError(f"groups[{g}] names a cache tensor twice: {members}")
        out.append(members)
    return out


def check_groups_do_not_alias(tensors: list[torch.Tensor], names: list[str], groups: list[list[int]]) -> None:
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
            for b0, _b1, b in spans[k + 1 :]:
                if b0 >= a1:
                    break
                ta, tb = tensors[a], tensors[b]
                stride = ta.stride(0) * ta.element_size()
                if stride > 0 and stride == tb.stride(0) * tb.element_size():
                    delta = (b0 - a0) % stride
                    if (
                        delta >= ta[0].numel() * ta.element_size()
                        and delta + tb[0].numel() * tb.element_size() <= stride
                    ):
                        continue  # interleaved: every block of one sits in the other's gaps
                raise ValueError(
                    f"caches {names[a]} and {names[b]} share memory (groups[{g}] holds "
                    "both); a load would write the same bytes twice in one call. Give "
                    "each cache tensor its own memory"
                )


def pinned_host_buffer(
    nbytes: int, device: torch.device, pin: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A page-aligned, zeroed host buffer of exactly ``nbytes``, on the
    device's NUMA node: ``(allocation, buffer, registered)``. With ``pin`` it
    is page-locked in place, in chunks of at most
    :data:`~.host_memory.DEFAULT_CHUNK_BYTES`, before this returns; where the
    runtime refuses, ``RuntimeError`` names the size and why (never the
    pinned allocator's power-of-two rounding)."""
    memory = HostMemory(nbytes, device, pin, numa_node=numa.choose_node(device, None))
    memory.wait()
    return memory.buffer._base, memory.buffer, bool(pin)


def mirror_layout(block_bytes: list[int], rows: int) -> tuple[list[int], int]:
    """Each mirror's byte offset in the buffer (page-aligned), and the total."""
    offsets, total = [], 0
    for bb in block_bytes:
        offsets.append(total)
        total += -(-rows * bb // _PAGE) * _PAGE
    return offsets, total


def allocate_mirrors(
    tensors: list[torch.Tensor],
    block_bytes: list[int],
    rows: int,
    device: torch.device,
    pin: bool,
    *,
    numa_node: int | bool | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[HostMemory, list[torch.Tensor]]:
    """Zeroed host mirrors of ``rows`` blocks of each of ``tensors``, in one
    exact-size buffer (:class:`~.host_memory.HostMemory`, registering in the
    background when ``pin``), each on a page boundary: ``(memory, mirrors)``.
    ``numa_node``: :func:`~.numa.choose_node`'s override."""
    offsets, total = mirror_layout(block_bytes, rows)
    memory = HostMemory(
        total, device, pin, numa_node=numa.choose_node(device, numa_node), chunk_bytes=chunk_bytes
    )
    mirrors = [
        memory.buffer[off : off + rows * bb].view(t.dtype).view(rows, *t.shape[1:])
        for t, off, bb in zip(tensors, offsets, block_bytes)
    ]
    return memory, mirrors


def unregister_mirrors(
    buffer: torch.Tensor, device: torch.device, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> None:
    """Undoes :func:`pinned_host_buffer`'s registration of ``buffer``, chunk by
    chunk; where the runtime refuses, logs it and keeps ``buffer`` (a view, so
    its whole allocation) for the life of the process."""
    unregister_chunks(buffer, device, chunks(buffer.numel(), chunk_bytes))
