"""torch_kvswap's hooks into torch internals (_compile_hooks.py) on the running torch.

Each hook is installed, or, where this torch lacks what it needs, correctly
reported as not installed. scripts/test_torch_matrix.sh runs this file on
every torch release of the test matrix, so a release that moves one of the
internals fails here by name before anything compiles wrongly.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch._C import DispatchKey

import torch_kvswap
from torch_kvswap import _compile_hooks
from torch_kvswap._build_shared import release

from test_registry import effect_of


def eager_kernel():
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

    return auto_functionalized_v2.py_kernels[DispatchKey.CompositeExplicitAutograd]


def torch_takes_a_clone_choice() -> bool:
    """Whether this torch's eager auto_functionalized_v2 (torch's own, under
    any wrapper of torch_kvswap's) takes the keyword the in-place hook passes."""
    kernel = eager_kernel()
    kernel = getattr(kernel, "__wrapped__", kernel)
    return "_only_clone_these_bases" in inspect.signature(kernel).parameters


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


def test_in_place_hook_is_installed_exactly_where_torch_allows_it():
    installed = getattr(eager_kernel(), "_kvswap_in_place", False)
    assert installed == _compile_hooks.DESTINATIONS_IN_PLACE_WITHOUT_INDUCTOR
    assert installed == torch_takes_a_clone_choice()
    if release(torch.__version__)[:2] >= (2, 13):
        assert installed, f"torch {torch.__version__}: the in-place hook did not install"


def test_installing_the_in_place_hook_again_wraps_nothing_twice():
    before = eager_kernel()
    assert (
        _compile_hooks._keep_swap_blocks_in_place() == _compile_hooks.DESTINATIONS_IN_PLACE_WITHOUT_INDUCTOR
    )
    assert eager_kernel() is before


def test_the_in_place_hook_keeps_torchs_signature():
    if not _compile_hooks.DESTINATIONS_IN_PLACE_WITHOUT_INDUCTOR:
        pytest.skip(f"torch {torch.__version__}: no in-place hook to inspect")
    kernel = eager_kernel()
    assert inspect.signature(kernel) == inspect.signature(kernel.__wrapped__)


def test_tracing_warns_only_where_the_hook_is_missing(fresh_compile):
    _compile_hooks.warn_destinations_cloned.cache_clear()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(s, d, si, di):
        torch_kvswap.swap_blocks([s], [d], si, di)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(torch.ones(2, 4), torch.zeros(4, 4), torch.tensor([0]), torch.tensor([3]))
    cloned = [w for w in caught if "cannot be kept in place" in str(w.message)]
    assert len(cloned) == (0 if _compile_hooks.DESTINATIONS_IN_PLACE_WITHOUT_INDUCTOR else 1)
