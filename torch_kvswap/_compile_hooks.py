"""The one place where torch_kvswap reaches into torch's internals for torch.compile.

``torch.library._register_effectful_op`` with
``torch._higher_order_ops.effects._EffectType.ORDERED``, for
``kvswap::swap_blocks_batch``, when the package loads. Why: the pointer op
returns nothing and its schema marks nothing mutated (what it writes is named
by addresses, not tensors), so without an effect torch.compile deletes it as
dead code or moves it. Both names exist on every declared release (2.10 and
newer); a torch without them fails at import, visibly, rather than compiling
graphs that lose copies. tests/test_compile_hooks.py checks it on the running
torch; scripts/test_torch_matrix.sh runs it on 2.10.0 and 2.15.0,
scripts/test.sh on 2.13.0, scripts/test_vllm.sh on 2.14.0.

Nothing of torch is replaced: under backends without Inductor (aot_eager,
cudagraphs) torch's own ``auto_functionalized_v2`` clones every destination
of ``kvswap::swap_blocks`` on every call (docs/ops.md, "Backends without
Inductor").
"""

from __future__ import annotations

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
