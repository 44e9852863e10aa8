"""vLLM's ``SimpleCPUOffloadConnector`` path, with :class:`~.copy_backend.KVSwapCopyBackend`
as its copy backend.

Select it in ``vllm serve`` with::

    --enable-prefix-caching --kv-transfer-config '{"kv_connector": "KVSwapSimpleCPUOffloadConnector",
      "kv_connector_module_path": "torch_kvswap.integrations.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}'

``KVSwapSimpleCPUOffloadConnector`` is vLLM's connector (scheduler side,
metadata, metrics: all vLLM's) with one worker change: the worker's KV regions
are mirrored in one page-aligned host buffer and every transfer goes through
``KVSwapCopyBackend`` (``torch_kvswap.swap_blocks``) on device-generic streams
and events (``torch.Stream``/``torch.Event`` of the caches' device), so the
same connector runs on CUDA, on Ascend NPU and on CPU (the host engine).

Of vLLM's ``SimpleCPUOffloadWorker`` this overrides only the methods that
name CUDA: ``register_kv_caches`` (CUDA streams, ``DmaCopyBackend``) and the
one that launches stores (the compute-done event on
``torch.cuda.current_stream()``): ``wait_for_save`` from vLLM 0.29 on;
``get_finished`` in 0.27 and 0.28, where it launches the step's loads and
stores (then ``wait_for_save`` is empty, as vLLM's). vLLM's own
``bind_connector_metadata``, ``start_load_kv``, ``get_finished`` (0.29 on),
``handle_preemptions`` and ``build_connector_worker_meta`` drive the backend.

This module needs no vLLM: it holds the worker's regions and host mirrors and
the connector's extra-config check. The classes that subclass vLLM's live in
:mod:`.simple_connector`, imported by :func:`build` when the package is asked
for one.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ...offloader.caches import _PAGE, pinned_host_buffer
from .compat import CHECK_KEY

__all__ = ["build", "kv_regions", "SUPPORTED_EXTRA_CONFIG", "check_extra_config", "copy_streams"]


#: ``kv_connector_extra_config`` keys the simple connector accepts: those
#: vLLM's SimpleCPUOffloadConnector reads for host memory (0.33's
#: ``num_cpu_blocks`` included) and ``kvswap_check``. Any other key (a typo,
#: or the disk backend's ``disk_path``, ...) is refused when the connector is
#: built.
SUPPORTED_EXTRA_CONFIG = frozenset(
    {
        "cpu_bytes_to_use",
        "cpu_bytes_to_use_per_rank",
        "lazy_offload",
        "num_cpu_blocks",
        "kv_offload_backend",
        CHECK_KEY,
    }
)


def check_extra_config(extra: Any) -> None:
    """Refuses unknown ``kv_connector_extra_config`` keys and a backend other
    than ``"cpu"``, naming them (vLLM itself ignores unknown keys: a typo
    such as ``cpu_byte_to_use`` would silently get its default 8 GiB)."""
    extra = dict(extra or {})
    backend = extra.get("kv_offload_backend", "cpu")
    if backend != "cpu":
        raise ValueError(
            "KVSwapSimpleCPUOffloadConnector copies to host memory only: "
            f"kv_offload_backend must be 'cpu', got {backend!r}"
        )
    unknown = sorted(set(extra) - SUPPORTED_EXTRA_CONFIG)
    if unknown:
        raise ValueError(
            f"KVSwapSimpleCPUOffloadConnector does not support kv_connector_extra_config "
            f"keys {unknown}; supported: {sorted(SUPPORTED_EXTRA_CONFIG)}"
        )


def copy_streams(device: torch.device) -> tuple[Any, Any]:
    """The load and store streams of an accelerator ``device``, at the lowest
    priority its streams have (as vLLM's worker makes its CUDA streams), so
    that copies yield to compute. The range comes from the device's own
    stream class (``torch.cuda.Stream``, ``torch.npu.Stream``:
    ``priority_range()`` is (lowest, highest)); default priority where it has
    none."""
    stream_cls = getattr(getattr(torch, device.type, None), "Stream", None)
    priority_range = getattr(stream_cls, "priority_range", None)
    low = int(priority_range()[0]) if priority_range is not None else 0
    return (torch.Stream(device=device, priority=low), torch.Stream(device=device, priority=low))


def kv_regions(kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """The distinct block-strided regions of vLLM's KV cache allocation.

    Each ``KVCacheTensor`` of ``kv_cache_config`` places its layers in one
    backing allocation: layer ``l``'s page of block ``b`` starts at byte
    ``offset + l * layer_stride + b * block_stride`` (vLLM's
    ``KVCacheTensor`` docstring). Returned: ``{name: int8 [num_blocks,
    block_stride]}`` views of that allocation (never copies), one per
    distinct start address:

    * layer-outermost (``layer_stride >= num_blocks * block_stride``): every
      layer's span holds ``layer_stride // (num_blocks * block_stride)``
      regions (one, or one per K/V half or head group), named
      ``layer`` or ``layer.i``;
    * block-outermost (one block packs every layer's page): one region whose
      blocks are the packed blocks, named after the first layer.

    Layers of different tensors that overlay the same bytes give one region.

    vLLM 0.27 and 0.28 describe a ``KVCacheTensor`` without its layers'
    placement (``size``, ``shared_by``, ``offset``, ``block_stride``); their
    regions are read from the cache tensors themselves
    (:func:`kv_regions_from_strides`).
    """
    tensors = list(kv_cache_config.kv_cache_tensors)
    if tensors and not hasattr(tensors[0], "layer_stride"):
        return kv_regions_from_strides(kv_caches, int(kv_cache_config.num_blocks))
    num_blocks = int(kv_cache_config.num_blocks)
    regions: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for kt in tensors:
        name = next((n for n in kt.layers if n in kv_caches), None)
        if name is None:
            continue
        cache = kv_caches[name]
        raw = torch.empty(0, dtype=torch.int8, device=cache.device).set_(cache.untyped_storage())
        stride, span = int(kt.block_stride), num_blocks * int(kt.block_stride)
        if int(kt.layer_stride) >= span:
            per_layer = int(kt.layer_stride) // span
            starts = [
                (
                    f"{layer}.{i}" if per_layer > 1 else layer,
                    int(kt.offset) + k * int(kt.layer_stride) + i * span,
                )
                for k, layer in enumerate(kt.layers)
                for i in range(per_layer)
            ]
        else:
            starts = [(name, int(kt.offset) - int(kt.offset) % stride)]
        for key, start in starts:
            if start + span > raw.numel():
                raise ValueError(
                    f"KV cache {name!r}: {kt.layers} place {span} bytes at offset "
                    f"{start}, past its {raw.numel()}-byte storage"
                )
            region = raw[start : start + span].view(num_blocks, stride)
            if region.data_ptr() in seen:
                continue
            seen.add(region.data_ptr())
            regions[key] = region
    return regions


def kv_regions_from_strides(kv_caches: dict[str, Any], num_blocks: int) -> dict[str, torch.Tensor]:
    """The block-strided regions of each distinct storage among ``kv_caches``
    (a value is a tensor, or a list of tensors on one storage), read from the
    tensor's strides: with ``page = storage bytes // num_blocks``, a
    dimension whose byte stride exceeds ``page`` is outside the blocks (K and
    V outermost: ``(2, num_blocks, ...)``), and each of its indices is one
    region ``name.i`` of ``[num_blocks, stride // num_blocks]`` bytes;
    without one, the storage is one region ``name`` of ``[num_blocks,
    page]`` (blocks outermost). Views, never copies."""
    regions: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in kv_caches.items():
        tensor = value if isinstance(value, torch.Tensor) else value[0]
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        raw = torch.empty(0, dtype=torch.int8, device=tensor.device).set_(storage)
        page = storage.nbytes() // num_blocks
        if page < 1:
            raise ValueError(
                f"KV cache {name!r}: its {storage.nbytes()}-byte storage holds less than "
                f"one byte per block of {num_blocks}"
            )
        el = tensor.element_size()
        outer = [d for d in range(tensor.dim()) if tensor.stride(d) * el > page]
        if not outer:
            regions[name] = raw[: num_blocks * page].view(num_blocks, page)
            continue
        seg = tensor.stride(outer[0]) * el
        for i in range(tensor.shape[outer[0]]):
            regions[f"{name}.{i}"] = raw[i * seg : (i + 1) * seg].view(num_blocks, -1)
    return regions


def _host_mirrors(
    regions: dict[str, torch.Tensor], num_blocks: int, device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor], bool]:
    """One page-aligned host buffer holding a ``[num_blocks, block_bytes]``
    mirror of each region, each mirror on a page boundary; on an accelerator
    pinned in place at its exact size (the offloader's
    :func:`~torch_kvswap.offloader.caches.pinned_host_buffer`). Returns
    (buffer, mirrors, registered)."""
    sizes = [-(-num_blocks * r.shape[1] // _PAGE) * _PAGE for r in regions.values()]
    _, buffer, registered = pinned_host_buffer(sum(sizes), device, pin=device.type != "cpu")
    buffer = buffer.view(torch.int8).zero_()  # the buffer's base keeps the whole allocation
    mirrors, offset = {}, 0
    for (name, region), size in zip(regions.items(), sizes):
        mirrors[name] = buffer[offset : offset + num_blocks * region.shape[1]].view(num_blocks, -1)
        offset += size
    return buffer, mirrors, registered


def build() -> dict[str, type]:
    """The plug-in classes by name, on the installed vLLM: importing their
    module (:mod:`.simple_connector`) checks vLLM's interface, once."""
    connector = importlib.import_module(f"{__package__}.simple_connector")
    return {
        "KVSwapSimpleCPUOffloadWorker": connector.KVSwapSimpleCPUOffloadWorker,
        "KVSwapSimpleCPUOffloadConnector": connector.KVSwapSimpleCPUOffloadConnector,
    }
