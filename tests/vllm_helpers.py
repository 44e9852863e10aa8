"""Helpers shared by the vLLM plug-in tests.

Imported as ``vllm_helpers`` (pytest puts tests/ on the path, as for
``helpers``).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

#: The plug-in's modules whose classes subclass vLLM's: each imports vLLM
#: (and checks its interface) when it is first imported.
PLUGIN_CLASS_MODULES = tuple(
    f"torch_kvswap.integrations.vllm.{name}"
    for name in ("offloading_spec", "tiering_spec", "simple_connector", "handler_class")
)


def forget_plugin_classes(monkeypatch) -> None:
    """Makes the next lookup of a plug-in class import its module afresh, on
    the vLLM installed now (a stand-in, or the real one under another
    version): the modules built before are put back when the test ends."""
    for name in PLUGIN_CLASS_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # recorded, to be put back (or removed) after the test
        del sys.modules[name]


# -- /dev/shm: the host regions vLLM's SharedOffloadRegion maps -------------------

#: Where vLLM's SharedOffloadRegion keeps its file (one per engine).
SHM_REGIONS = "/dev/shm/vllm_offload_*"


def shm_regions() -> set[str]:
    """The /dev/shm files of vLLM's shared host regions now."""
    import glob

    return set(glob.glob(SHM_REGIONS))


def left_behind(before: set[str]) -> list[str]:
    """The region files made since `before` that still exist."""
    return sorted(shm_regions() - before)


def _no_region_left_behind():
    before = shm_regions()
    yield
    import gc

    gc.collect()  # a worker dropped without shutdown releases its map by its finalizer
    assert not left_behind(before), f"/dev/shm files left behind: {left_behind(before)}"


try:  # a fixture for the tests that build engines or tiering specs (pytest is not needed here otherwise)
    import pytest as _pytest

    no_region_left_behind = _pytest.fixture(_no_region_left_behind)
except ImportError:  # pragma: no cover
    pass


# -- vLLM's configuration objects for the 4-layer test model ------------------------
# (vLLM is imported inside each helper: the vLLM-free tests import this module too)

MODEL = str(Path(__file__).parent / "data" / "llama-4layer")
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
BLOCK_TOKENS = 16  # tokens per device block of the configs below


def vllm_config(cache: dict | None = None, **transfer):
    """vLLM's ``VllmConfig`` of the test model (float16, 1024 tokens,
    ``BLOCK_TOKENS``-token blocks and the ``cache`` fields of its
    ``CacheConfig``) with ``KVTransferConfig(**transfer)``."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="float16", max_model_len=1024),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, **(cache or {})),
        kv_transfer_config=KVTransferConfig(**transfer),
    )


def per_layer_kv_cache_config(spec, num_blocks: int, layers=LAYERS):
    """vLLM's ``KVCacheConfig`` of one group of ``layers`` (attention
    ``spec``), each layer in its own allocation, in the installed vLLM's terms
    (0.27/0.28: ``shared_by``, no placement; 0.29 on: ``layers`` and their
    strides)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    page = spec.page_size_bytes
    if "layer_stride" in KVCacheTensor.__dataclass_fields__:
        tensors = [
            KVCacheTensor(
                size=page * num_blocks * len(layers),
                layers=[name],
                layer_stride=page * num_blocks,
                block_stride=page,
            )
            for name in layers
        ]
    else:
        tensors = [KVCacheTensor(size=page * num_blocks, shared_by=[name]) for name in layers]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)],
    )


def offloading_config(config, kv_cache_config, tp: int, rank: int, **fields):
    """vLLM's own ``OffloadingConfig`` of ``config``, as worker ``rank`` of
    ``tp``, with ``fields`` replaced."""
    import dataclasses

    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config

    with set_current_vllm_config(config):
        base = build_offloading_config(config, kv_cache_config)
    parallel = dataclasses.replace(base.parallel, rank=rank, world_size=tp, tp_size=tp)
    return dataclasses.replace(base, parallel=parallel, **fields)


# -- vLLM's metrics ----------------------------------------------------------------------


def counters(llm, prefix: str) -> dict[str, float]:
    """vLLM's own metrics of ``llm`` whose names start with `prefix`:
    counters summed over labels (``name[label]``), histograms as ``name_sum``."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith(prefix) and hasattr(m, "value"):
            key = m.name + "".join(
                f"[{v}]" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")
            )
            out[key] = out.get(key, 0) + m.value
        elif m.name.startswith(prefix) and hasattr(m, "sum"):
            out[m.name + "_sum"] = out.get(m.name + "_sum", 0) + m.sum
    return out


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (another process
    may take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
