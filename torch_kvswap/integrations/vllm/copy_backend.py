"""A copy backend for vLLM's ``SimpleCPUOffloadConnector``, over ``torch.ops.kvswap.swap_blocks``.

vLLM's simple CPU offload worker (``vllm/v1/simple_kv_offload/worker.py``,
0.32 and 0.33) hands every transfer to a copy backend with three methods:

* ``init(gpu_caches, cpu_caches, device, load_stream, store_stream)``: the
  device regions and their host mirrors, ``{name: [num_blocks, ...]}`` with
  the same names, dtypes and bytes per block on both sides;
* ``launch_copy(src_blocks, dst_blocks, is_store, event_idx, events_list,
  wait_event=None)``: copy block ``src_blocks[i]`` of every region to block
  ``dst_blocks[i]`` of its mirror (a store) or back (a load), after
  ``wait_event``; append ``(event_idx, event)`` to ``events_list``, which the
  worker polls with ``event.query()`` and drains with ``event.synchronize()``;
* ``shutdown()``.

:class:`KVSwapCopyBackend` is a drop-in for vLLM's ``DmaCopyBackend`` (CUDA,
``cuMemcpyBatchAsync`` through ctypes) and vllm-ascend's ``NPUDmaCopyBackend``
(``torch.ops._C_ascend.swap_blocks_batch`` on ``torch.npu`` streams): one
``swap_blocks`` call per launch moves every region's blocks, on CUDA, Ascend
NPU or the host engine. It needs no vLLM import; it is driven only through
these three methods.

Differences from those backends, all on the safe side:

* On an accelerator the copy is issued on the given stream in ``launch_copy``
  itself (the op builds its descriptors in C++, so there is no per-block
  Python work to hide on a thread) and the event is in ``events_list`` when
  ``launch_copy`` returns: a flush right after a launch waits for it. vLLM's
  backends append it later from their copy thread.
* With no accelerator (``device.type == "cpu"``) ``launch_copy`` waits for
  ``wait_event`` and copies on the calling thread (the host engine spreads
  the copy over torch's intra-op threads), as vLLM's synchronous
  ``CpuCopyBackend`` does; the event it appends is a finished
  :class:`HostEvent`. On the host the copy and the model compete for the same
  cores, so a copy thread would buy no overlap, and handing each launch to one
  costs a thread wake-up, milliseconds on a loaded machine.
* A copy that fails raises :class:`CopyFailed` from ``launch_copy`` instead
  of being skipped, naming the event, the direction, the blocks and the
  cause; an asynchronous device error surfaces from the event's
  ``query()``/``synchronize()``, which vLLM's worker calls every step.
* ``launch_copy`` after ``shutdown()`` raises; ``shutdown()`` waits for the
  copies in flight and is idempotent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ... import ops

__all__ = ["KVSwapCopyBackend", "HostEvent", "CopyFailed"]


class CopyFailed(RuntimeError):
    """A block copy of the backend failed; the message names the event, the copy and the cause."""


class HostEvent:
    """The event of a host-engine copy, finished when it is made (the copy ran
    in ``launch_copy``): ``query()`` is ``True``, ``synchronize()`` returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _describe(is_store: bool, event_idx: int, src: torch.Tensor, dst: torch.Tensor) -> str:
    def ids(t: torch.Tensor) -> str:
        v = t.tolist()
        return str(v) if len(v) <= 8 else f"[{', '.join(map(str, v[:8]))}, ... {len(v)} ids]"

    side = ("device", "host") if is_store else ("host", "device")
    return (
        f"{'store' if is_store else 'load'} event {event_idx}: {side[0]} blocks {ids(src)} -> "
        f"{side[1]} blocks {ids(dst)}"
    )


class KVSwapCopyBackend:
    """vLLM simple-offload copy backend over ``torch_kvswap.swap_blocks`` (see the module doc)."""

    def __init__(self) -> None:
        self._device_caches: list[torch.Tensor] = []
        self._host_caches: list[torch.Tensor] = []
        self._streams: dict[bool, Any] = {}
        self._initialized = False
        self._closed = False

    def init(
        self,
        gpu_caches: Mapping[str, torch.Tensor],
        cpu_caches: Mapping[str, torch.Tensor],
        device: torch.device,
        load_stream: Any,
        store_stream: Any,
    ) -> None:
        """Bind the device regions and their host mirrors.

        Args:
            gpu_caches: ``{name: tensor}`` on ``device``, dim 0 indexing
                blocks, each block contiguous.
            cpu_caches: ``{name: tensor}`` on the host with the same names,
                dtype and bytes per block (any number of blocks); pinned for
                asynchronous copies on an accelerator.
            device: the caches' device (``cuda``, ``npu``, ``cpu``, ...).
            load_stream, store_stream: ``torch.Stream``s of ``device`` (or of
                its own stream class, e.g. ``torch.cuda.Stream``); ignored on
                the host, where the copies run in ``launch_copy``.
        """
        if self._initialized:
            raise RuntimeError("KVSwapCopyBackend.init was already called")
        if set(gpu_caches) != set(cpu_caches):
            raise ValueError(
                f"gpu_caches and cpu_caches must name the same regions: "
                f"{sorted(set(gpu_caches) ^ set(cpu_caches))} are in only one"
            )
        if not gpu_caches:
            raise ValueError("gpu_caches is empty: nothing to copy")
        for name, dev in gpu_caches.items():
            host = cpu_caches[name]
            if host.device.type != "cpu":
                raise ValueError(f"cpu_caches[{name!r}] is on {host.device}, expected the host")
            per_dev, per_host = math.prod(dev.shape[1:]), math.prod(host.shape[1:])
            if dev.dtype != host.dtype or per_dev != per_host:
                raise ValueError(
                    f"gpu_caches[{name!r}] ({dev.dtype}, {per_dev} elements per block) "
                    f"and cpu_caches[{name!r}] ({host.dtype}, {per_host}) must have the "
                    "same dtype and block size"
                )
        self._device_caches = list(gpu_caches.values())
        self._host_caches = [cpu_caches[name] for name in gpu_caches]
        self.device = torch.device(device)
        if self.device.type != "cpu":
            self._streams = {True: store_stream, False: load_stream}
        self._initialized = True

    def launch_copy(
        self,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        is_store: bool,
        event_idx: int,
        events_list: list[tuple[int, Any]],
        wait_event: Any = None,
    ) -> None:
        """Copy ``src_blocks[i]`` -> ``dst_blocks[i]`` of every region, device to
        host when ``is_store``, else host to device, after ``wait_event``
        (``None``: no wait); appends ``(event_idx, event)`` to ``events_list``
        before returning. Raises :class:`CopyFailed` if the copy (on the
        host) or its launch (on an accelerator) fails."""
        if not self._initialized or self._closed:
            raise RuntimeError(
                f"KVSwapCopyBackend: {'store' if is_store else 'load'} event "
                f"{event_idx} launched {'after shutdown' if self._closed else 'before init'}"
            )
        src = torch.as_tensor(src_blocks, dtype=torch.int64).reshape(-1)
        dst = torch.as_tensor(dst_blocks, dtype=torch.int64).reshape(-1)
        src_caches, dst_caches = (
            (self._device_caches, self._host_caches) if is_store else (self._host_caches, self._device_caches)
        )
        try:
            if not self._streams:
                if wait_event is not None:
                    wait_event.synchronize()
                ops.swap_blocks(src_caches, dst_caches, src, dst)
                event = HostEvent()
            else:
                stream = self._streams[is_store]
                with stream:
                    if wait_event is not None:
                        stream.wait_event(wait_event)
                    ops.swap_blocks(src_caches, dst_caches, src, dst)
                    event = stream.record_event()
        except Exception as exc:
            raise CopyFailed(
                f"kvswap: {_describe(is_store, event_idx, src, dst)} failed: {type(exc).__name__}: {exc}"
            ) from exc
        events_list.append((event_idx, event))

    def shutdown(self) -> None:
        """Wait for the copies in flight and stop; idempotent. ``launch_copy``
        afterwards raises."""
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            stream.synchronize()
