"""torch_kvswap: batched KV-cache block copies between accelerator and host memory.

Operators (namespace ``kvswap``), also as typed wrappers here:

* :func:`swap_blocks_batch` — copies from arrays of raw addresses and byte
  counts; the drop-in for offload handlers built around raw pointers.
* :func:`swap_blocks` — the same copy from cache tensors and block ids; safe
  inside ``torch.compile`` graphs.
* :func:`expand_block_ids` — host block ids to device sub-block ids.

:class:`KVCacheOffloader` owns host mirrors, streams and events around them.

Checked mode (:func:`checked`, ``KVSWAP_CHECK=1``; docs/checked.md) turns
silent KV-cache corruption into errors: the pointer op's descriptors must lie
in regions registered with :func:`register_region`, and the offloader refuses
jobs that break its contract.

Importing the package loads the compiled core (with the host engine) and every
accelerator engine that was built.
"""

from __future__ import annotations

import torch  # noqa: F401 - the extensions need libtorch loaded first

from . import _loader

_loader.load_core()
ENGINES = _loader.load_engines()

from . import fake_kernels  # noqa: E402,F401 - registers the fake kernels
from . import _compile_hooks  # noqa: E402,F401 - the effects and hooks torch.compile needs
from .ops import (  # noqa: E402
    Direction,
    expand_block_ids,
    get_copy_method,
    set_copy_method,
    swap_blocks,
    swap_blocks_batch,
)
from ._checked import Region, checked, is_checked, register_region, set_checked  # noqa: E402
from .offloader import DeviceBlocks, HostBlocks, KVCacheOffloader, TransferResult  # noqa: E402

__all__ = [
    "DeviceBlocks",
    "Direction",
    "ENGINES",
    "HostBlocks",
    "KVCacheOffloader",
    "Region",
    "TransferResult",
    "checked",
    "expand_block_ids",
    "get_copy_method",
    "is_checked",
    "register_region",
    "set_checked",
    "set_copy_method",
    "swap_blocks",
    "swap_blocks_batch",
]
__version__ = "0.1.0"
