"""The offloader: :class:`KVCacheOffloader` keeps host mirrors of a paged KV
cache and moves blocks between them and the device asynchronously.

- ``offloader.py``: the class (construction, host mirrors, store/load);
- ``planning.py``: a job's block ids, checked, turned into its copies;
- ``lanes.py``: the lanes (streams or worker threads) and completion;
- ``caches.py``: cache flattening, KV-cache groups, mirror allocation;
- ``specs.py``: the spec and result types.
"""

from .offloader import KVCacheOffloader
from .specs import DeviceBlocks, HostBlocks, TransferResult

__all__ = ["KVCacheOffloader", "TransferResult", "HostBlocks", "DeviceBlocks"]
