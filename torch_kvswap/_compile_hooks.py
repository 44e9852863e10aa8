"""The two places where torch_kvswap reaches into torch's internals for torch.compile.

This is the package's most fragile code: both hooks use private torch APIs
that may change in any release. Importing torch_kvswap installs them, after
the fake kernels (fake_kernels.py) are registered.
tests/test_compile_hooks.py checks, on the running torch, that each hook is
installed or correctly not needed; scripts/test_torch_matrix.sh runs it on
every release of the test matrix (2.10.0, 2.15.0; scripts/test.sh on
2.13.0, scripts/test_vllm.sh on 2.14.0).

1. ``torch.library._register_effectful_op`` with
   ``torch._higher_order_ops.effects._EffectType.ORDERED``, for
   ``kvswap::swap_blocks_batch``. Why: the pointer op returns nothing and its
   schema marks nothing mutated (what it writes is named by addresses, not
   tensors), so without an effect torch.compile deletes it as dead code or
   moves it. Both names exist on every declared release (2.10 and newer); a
   torch without them fails at import, visibly, rather than compiling graphs
   that lose copies.

2. The eager kernel of ``auto_functionalized_v2``
   (``torch._higher_order_ops.auto_functionalize``), which is
   ``auto_functionalized_v2.py_kernels[DispatchKey.CompositeExplicitAutograd]``:
   it is wrapped, and the higher-order op's ``_dispatch_cache`` cleared so the
   wrapper is used, to pass ``_only_clone_these_bases=()`` for
   ``kvswap::swap_blocks`` when no caller chose. Why: backends without
   Inductor (aot_eager, cudagraphs) would otherwise clone every destination
   base, a whole host cache, on every call (docs/ops.md, "Backends without
   Inductor"; the comment above the hook says why it is safe). Installed only
   where that kernel takes the ``_only_clone_these_bases`` keyword; the tests
   require it from torch 2.13 on. Elsewhere ``DESTINATIONS_IN_PLACE_WITHOUT_INDUCTOR``
   is False and the first trace of the op warns once.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch

_ORDERED_EFFECT_OPS = ("kvswap::swap_blocks_batch",)


def _register_ordered_effect(qualname: str) -> None:
    """Marks an op as an ordered side effect for torch.compile, so that it is
    kept and ordered although it returns nothing and mutates nothing visible."""
    from torch._higher_order_ops.effects import _EffectType

    op = getattr(getattr(torch.ops, qualname.split("::")[0]), qualname.split("::")[1]).default
    torch.library._register_effectful_op(op, _EffectType.ORDERED)


for _qualname in _ORDERED_EFFECT_OPS:
    _register_ordered_effect(_qualname)


# --- swap_blocks writes its destinations in place under every backend --------
#
# Under torch.compile the tensor op is functionalized: AOTAutograd records it
# as the higher-order op auto_functionalized_v2, whose eager implementation
# clones every destination base (a whole host cache) on every call, runs the
# op on the clones and copies them back. Inductor's re-inplacing pass removes
# that clone; backends without Inductor (aot_eager, and cudagraphs, which
# runs the same AOT graph) have no such pass, so a call that copies one block
# into a 16 MiB host cache also cloned and copied back 16 MiB
# (docs/ops.md, "Backends without Inductor").
#
# The clone is never needed for this op in those graphs: they run node by
# node in program order, so every node that reads a destination's old value
# has run before the op, and every later reader reads the op's result, which
# the clone would only hand back. The op's own checks make its reads and
# writes of one call disjoint, as in eager mode. So for kvswap::swap_blocks,
# and for calls where nobody chose which bases to clone (Inductor's
# decomposition passes its own choice and calls the implementation
# directly), the eager implementation is told to clone nothing. Every other
# op keeps torch's behaviour.


def _keep_swap_blocks_in_place() -> bool:
    """Wraps auto_functionalized_v2's eager kernel; False where this torch lacks it."""
    try:
        from torch._C import DispatchKey
        from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

        dense = auto_functionalized_v2.py_kernels[DispatchKey.CompositeExplicitAutograd]
    except (ImportError, AttributeError, KeyError):
        return False
    if getattr(dense, "_kvswap_in_place", False):
        return True
    if "_only_clone_these_bases" not in inspect.signature(dense).parameters:
        return False
    swap_blocks = torch.ops.kvswap.swap_blocks.default

    @functools.wraps(dense)
    def in_place_for_swap_blocks(_mutable_op, _only_clone_these_bases=None, **kwargs):
        if _mutable_op is swap_blocks and _only_clone_these_bases is None:
            _only_clone_these_bases = ()
        return dense(_mutable_op, _only_clone_these_bases=_only_clone_these_bases, **kwargs)

    in_place_for_swap_blocks._kvswap_in_place = True  # type: ignore[attr-defined]
    auto_functionalized_v2.py_kernels[DispatchKey.CompositeExplicitAutograd] = in_place_for_swap_blocks
    auto_functionalized_v2._dispatch_cache.clear()
    return True


@functools.cache
def warn_destinations_cloned() -> None:
    """Warns once, from the first trace of swap_blocks, where hook 2 is missing."""
    warnings.warn(
        f"torch_kvswap: on torch {torch.__version__}, kvswap::swap_blocks cannot be kept in place "
        "under torch.compile backends without Inductor (aot_eager, cudagraphs): they clone every "
        "destination cache on every call. backend='inductor' (the default) writes in place.",
        RuntimeWarning,
        stacklevel=2,
    )


#: Whether swap_blocks writes its destinations in place under aot_eager and
#: cudagraphs too (Inductor always does). Tested by
#: tests/test_compile.py::test_tensor_op_writes_in_place_under_every_backend.
DESTINATIONS_IN_PLACE_WITHOUT_INDUCTOR = _keep_swap_blocks_in_place()
