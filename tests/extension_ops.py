"""The test extension's ops (``torch.ops.kvswap_test``; tests/fake_cuda/test_extension.cpp),
loaded once per process, with fake kernels for those that stand in for a
``kvswap`` op: a dry run or an alternative path must refuse a meta tensor, as
any other call, exactly as the op does.

Import this module, not ``torch_kvswap._fake_cuda``, wherever a test calls a
``kvswap_test`` op (child processes included).
"""

from __future__ import annotations

import torch

import torch_kvswap._fake_cuda  # noqa: F401 - defines torch.ops.kvswap_test
from torch_kvswap import fake_kernels


@torch.library.register_fake("kvswap_test::plan_swap_blocks_batch")
def _plan_swap_blocks_batch_fake(src_ptrs, dst_ptrs, sizes, direction):
    fake_kernels._swap_blocks_batch_fake(src_ptrs, dst_ptrs, sizes, direction)
    return fake_kernels._plan_fake()


torch.library.register_fake("kvswap_test::expand_block_ids_aten")(fake_kernels._expand_block_ids_fake)
