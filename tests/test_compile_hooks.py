"""torch_kvswap's one hook into torch internals (_compile_hooks.py) on the running torch.

scripts/test_torch_matrix.sh runs this file on every torch release of the test
matrix, so a release that moves the private effect API fails here by name
before anything compiles wrongly. Nothing of torch is replaced: torch's own
kernel of auto_functionalized_v2 is the one registered.
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey

from torch_kvswap import _compile_hooks

from test_registry import effect_of


def test_the_private_effect_api_exists_on_this_torch():
    from torch._higher_order_ops.effects import _EffectType

    assert callable(torch.library._register_effectful_op)
    assert _EffectType.ORDERED is not None


def test_every_ordered_effect_op_is_registered():
    assert _compile_hooks._ORDERED_EFFECT_OPS == ("kvswap::swap_blocks_batch",)
    for qualname in _compile_hooks._ORDERED_EFFECT_OPS:
        ns, name = qualname.split("::")
        op = getattr(getattr(torch.ops, ns), name).default
        assert effect_of(op) is not None, qualname


def test_torchs_own_auto_functionalized_kernel_is_left_in_place():
    from torch._higher_order_ops import auto_functionalize

    kernel = auto_functionalize.auto_functionalized_v2.py_kernels[DispatchKey.CompositeExplicitAutograd]
    assert kernel.__module__ == auto_functionalize.__name__, kernel
    assert not hasattr(kernel, "__wrapped__"), kernel
