"""swap_blocks bumps its destinations' version counters, as copy_ does.

Autograd saves tensors for backward and checks their versions when backward
runs: a tensor overwritten in place after it was saved makes backward raise
("modified by an inplace operation") instead of computing with the new values.
"""

from __future__ import annotations

import pytest
import torch

import torch_kvswap
from helpers import ids


def overwrite(how: str, z: torch.Tensor) -> None:
    src = torch.full((1, z.shape[1]), 9.0)
    if how == "copy_":
        z[0].copy_(src[0])
    else:
        torch_kvswap.swap_blocks([src], [z], ids([0]), ids([0]))


def outcome(fn) -> str:
    """The grads fn's backward computes, or its error's first words."""
    try:
        return repr(fn().tolist())
    except RuntimeError as exc:
        return " ".join(str(exc).split()[:12])


def test_each_destination_version_goes_up():
    src, dst = [torch.ones(4, 3), torch.ones(4, 3)], [torch.zeros(4, 3), torch.zeros(4, 3)]
    before = [t._version for t in dst]
    torch_kvswap.swap_blocks(src, dst, ids([1]), ids([2]))
    assert all(t._version >= v + 1 for t, v in zip(dst, before))
    assert [t._version for t in src] == [0, 0]


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_overwriting_a_tensor_saved_for_backward_behaves_as_copy_does(fresh_compile, backend):
    def forward(x, z):
        return (x * z).sum()  # saves z for x's gradient

    compiled = forward if backend is None else torch.compile(forward, backend=backend, fullgraph=True)

    def run(how):
        x = torch.ones(3, 4, requires_grad=True)
        z = torch.arange(12.0).view(3, 4)
        loss = compiled(x, z)
        overwrite(how, z)
        loss.backward()
        return x.grad

    expected = outcome(lambda: run("copy_"))
    assert outcome(lambda: run("swap_blocks")) == expected
    if backend is None:
        assert "has been modified by" in expected


@pytest.mark.filterwarnings("ignore:Error detected in MulBackward0")  # the refusal's own trace
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_overwrite_inside_a_compiled_graph_behaves_as_copy_does(fresh_compile, backend):
    def make(how):
        @torch.compile(backend=backend, fullgraph=True)
        def f(x, z):
            loss = (x * z).sum()
            overwrite(how, z)
            return loss

        return f

    def run(how):
        x = torch.ones(3, 4, requires_grad=True)
        z = torch.arange(12.0).view(3, 4)
        make(how)(x, z).backward()
        return x.grad

    assert outcome(lambda: run("swap_blocks")) == outcome(lambda: run("copy_"))


def test_inference_tensors_are_copied_without_a_version():
    with torch.inference_mode():
        dst = torch.zeros(4, 3)
        torch_kvswap.swap_blocks([torch.ones(4, 3)], [dst], ids([0]), ids([1]))
    assert dst.is_inference()
    torch_kvswap.swap_blocks([torch.ones(4, 3)], [dst], ids([0]), ids([2]))
    assert dst.sum().item() == 6.0
    # A normal tensor written inside inference mode still counts the write.
    normal = torch.zeros(4, 3)
    with torch.inference_mode():
        torch_kvswap.swap_blocks([torch.ones(4, 3)], [normal], ids([0]), ids([3]))
    assert normal._version >= 1 and normal.sum().item() == 3.0
