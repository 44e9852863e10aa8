"""What a caller hands the offloader and what it gets back: block-id specs and
job results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class TransferResult:
    """What ``get_finished`` reports for one job."""

    job_id: int
    success: bool
    transfer_size: int  #: bytes moved (every tensor of every group); 0 when the job failed
    transfer_time: float  #: seconds, from the copy's start to its end
    transfer_type: tuple[str, str]  #: (source medium, destination medium)
    error: str | None = None  #: why the job failed, when it did


@dataclass(frozen=True)
class HostBlocks:
    """Typed spec: host block ids (each ``factor`` device blocks)."""

    block_ids: BlockIds

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclass(frozen=True)
class DeviceBlocks:
    """Typed spec: device block ids, optionally split by KV-cache group.

    ``group_sizes[g]`` ids belong to group ``g`` (in group order) and
    ``offsets[g]`` is the sub-block of the first host block where group ``g``
    starts; both default to the single-group, reference behaviour.
    """

    block_ids: BlockIds
    group_sizes: Sequence[int] | None = None
    offsets: Sequence[int] | None = None

    @staticmethod
    def medium() -> str:
        return "DEVICE"


def is_host_spec(spec: Any) -> bool:
    """Whether ``spec`` names host (CPU) blocks: its ``medium()``, else its type's name."""
    medium = getattr(spec, "medium", None)
    name = medium() if callable(medium) else type(spec).__name__
    return str(name).upper().startswith("CPU")
