"""A bool passed as swap_blocks_batch's direction is refused (vLLM's signature differs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_kvswap import Direction, swap_blocks_batch


@pytest.mark.parametrize("flag", [True, False, np.bool_(True)])
def test_a_bool_direction_is_refused_with_vllms_signature_explained(flag):
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)

    def ptrs(t):
        return torch.tensor([t.data_ptr()], dtype=torch.int64)

    with pytest.raises(TypeError, match=r"got the bool .*is_src_access_order_any.*Direction.HOST_TO_DEVICE"):
        swap_blocks_batch(ptrs(src), ptrs(dst), torch.tensor([64]), flag)
    assert not dst.any()  # refused before any byte moved


def test_an_int_or_direction_still_copies():
    src = torch.arange(64, dtype=torch.uint8)
    for direction in (Direction.HOST_TO_DEVICE, 1):
        dst = torch.zeros(64, dtype=torch.uint8)
        swap_blocks_batch(
            torch.tensor([src.data_ptr()]), torch.tensor([dst.data_ptr()]), torch.tensor([64]), direction
        )
        assert torch.equal(dst, src)
