"""vLLM plug-ins: torch_kvswap under both of vLLM's KV offload paths.

* ``offloading_spec``: ``KVSwapOffloadingSpec`` for vLLM's ``OffloadingConnector``
  (``spec_name``/``spec_module_path`` in ``kv_connector_extra_config``), and
  ``tiering_spec``: ``KVSwapTieringOffloadingSpec``, vLLM's tiered offloading
  (disk, object store, peer tiers behind the host tier) over the same worker;
  ``offloading`` and ``host_layouts`` hold their vLLM-free parts.
* ``simple_connector``: ``KVSwapSimpleCPUOffloadConnector``, vLLM's
  ``SimpleCPUOffloadConnector`` with ``KVSwapCopyBackend`` as its copy backend
  (``kv_connector_module_path``); ``simple_offload`` holds its vLLM-free parts.
* ``handler_class``: ``KVSwapOffloadingHandler`` for vLLM 0.23's
  ``OffloadingHandler`` interface (``OffloadingWorker.register_handler``);
  ``offloading_handler`` holds its vLLM-free parts.
* ``copy_backend``: ``KVSwapCopyBackend`` itself, a drop-in for vLLM's
  ``DmaCopyBackend`` and vllm-ascend's ``NPUDmaCopyBackend``; needs no vLLM.
* ``compat``: the supported vLLM releases and the interface check both
  plug-ins share (``check_vllm``).

vLLM is imported only when a class that subclasses vLLM's is first looked up
here (``import torch_kvswap.integrations.vllm`` never imports it): the
modules that define those classes import vLLM, and this package imports them
from ``__getattr__``, so the classes stay reachable as
``torch_kvswap.integrations.vllm.<name>``; the
interface is checked then, and a vLLM outside the plug-in's range
(``compat.PLUGIN_RANGES``) or without its release's interface is refused
(``UnsupportedVLLM``); see docs/vllm.md.
"""

from __future__ import annotations

from .compat import SUPPORTED_RANGE, SUPPORTED_VLLM, UnsupportedVLLM, check_vllm
from .copy_backend import CopyFailed, HostEvent, KVSwapCopyBackend

__all__ = [
    "KVSwapOffloadingSpec",
    "KVSwapTieringOffloadingSpec",
    "KVSwapOffloadingWorker",
    "KVSwapOffloadingHandler",
    "KVSwapSimpleCPUOffloadConnector",
    "KVSwapSimpleCPUOffloadWorker",
    "KVSwapCopyBackend",
    "HostEvent",
    "CopyFailed",
    "TransferFailed",
    "SUPPORTED_RANGE",
    "SUPPORTED_VLLM",
    "UnsupportedVLLM",
    "check_vllm",
]

_OFFLOADING = ("KVSwapOffloadingSpec", "KVSwapOffloadingWorker", "KVSwapTieringOffloadingSpec")
_SIMPLE = ("KVSwapSimpleCPUOffloadConnector", "KVSwapSimpleCPUOffloadWorker")


def __getattr__(name: str) -> object:
    if name in _OFFLOADING:
        from . import offloading

        found = offloading.build()[name]
        if isinstance(found, ImportError):  # the tiering spec, refused on this vLLM
            raise type(found)(str(found)) from found
        return found
    if name in _SIMPLE:
        from . import simple_offload

        return simple_offload.build()[name]
    if name == "KVSwapOffloadingHandler":
        from . import offloading_handler

        return offloading_handler.build()[name]
    if name == "TransferFailed":
        from .offloading import TransferFailed

        return TransferFailed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
