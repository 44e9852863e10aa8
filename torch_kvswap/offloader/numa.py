"""The NUMA node a device's host mirrors belong on, and the binding that puts
a range of host memory there before its first touch.

A device's node is its PCI function's ``numa_node`` in sysfs
(``/sys/bus/pci/devices/<domain:bus:device.function>/numa_node``; ``-1``: the
platform does not say). The root of that tree is ``KVSWAP_SYSFS_ROOT`` when
set, so the lookup can be checked against a tree of files anywhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

MPOL_PREFERRED = 1  # linux/mempolicy.h: the node first, others when it is full
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}  # asm/unistd_64.h, asm-generic/unistd.h
_MAX_NODES = 1024  # the node mask's bits (at least the kernel's MAX_NUMNODES)


def sysfs_root() -> Path:
    return Path(os.environ.get("KVSWAP_SYSFS_ROOT", "/sys"))


def pci_bus_id(device: torch.device) -> str | None:
    """The device's PCI address, ``dddd:bb:dd.f``; None where the runtime
    does not say (CPU, or a runtime without the property)."""
    module = getattr(torch, device.type, None) if device.type in ("cuda", "npu") else None
    if module is None or not module.is_available():
        return None
    props = module.get_device_properties(device.index or 0)
    if not all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return None
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def node_of(bus_id: str | None, root: Path | None = None) -> int | None:
    """The NUMA node sysfs gives for the PCI function ``bus_id``; None when
    there is no answer (no id, no entry, or ``-1``)."""
    if bus_id is None:
        return None
    path = (root or sysfs_root()) / "bus" / "pci" / "devices" / bus_id.lower() / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_count(root: Path | None = None) -> int:
    """NUMA nodes with memory online (``devices/system/node/has_memory``, a
    list such as ``0-1,3``); 1 where sysfs does not say."""
    try:
        text = ((root or sysfs_root()) / "devices" / "system" / "node" / "has_memory").read_text()
    except OSError:
        return 1
    count = 0
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            count += int(hi or lo) - int(lo) + 1
    return max(count, 1)


def mbind(address: int, length: int, node: int) -> None:
    """Prefers ``node`` for the pages of ``[address, address + length)`` not
    yet touched (``mbind(2)``, ``MPOL_PREFERRED``: a full node spills rather
    than failing the allocation)."""
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        raise OSError(f"mbind: no system call number known for {platform.machine()}")
    if not 0 <= node < _MAX_NODES:
        raise ValueError(f"numa_node must be in 0..{_MAX_NODES - 1}, got {node}")
    mask = (ctypes.c_ulong * (_MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))))()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask[node // bits] = 1 << (node % bits)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(length),
        ctypes.c_int(MPOL_PREFERRED),
        mask,
        ctypes.c_ulong(_MAX_NODES + 1),
        ctypes.c_uint(0),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mbind of {length} bytes to NUMA node {node} failed: {os.strerror(err)}")


def choose_node(
    device: torch.device,
    numa_node: int | bool | None,
    bus_id: Callable[[torch.device], str | None] = pci_bus_id,
) -> int | None:
    """The node to bind ``device``'s mirrors to: ``numa_node`` when it is an
    int (the override), none when it is ``False``; by default (``None``) the
    device's own node, where sysfs lists more than one node with memory."""
    if numa_node is False:
        return None
    if numa_node is not None:
        if isinstance(numa_node, bool) or not isinstance(numa_node, int) or numa_node < 0:
            raise ValueError(
                f"numa_node must be a node number >= 0, False (no binding) or None "
                f"(the device's node), got {numa_node!r}"
            )
        return numa_node
    if device.type == "cpu" or node_count() < 2:
        return None  # one node: nothing to choose
    return node_of(bus_id(device))
