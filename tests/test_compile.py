"""The ops under torch.compile(fullgraph=True): kept, ordered, in place, no graph breaks."""

from __future__ import annotations

import re

import torch
from torch._inductor.utils import run_and_get_code

import torch_kvswap


def rotation_descriptors(slots: torch.Tensor, scratch: torch.Tensor):
    """Four pointer-op calls that rotate three slots through a scratch slot.

    Run in program order once, they turn (a, b, c) into (b, c, a); run in any
    other order, or a different number of times, they give something else.
    """
    row = slots.stride(0) * slots.element_size()
    s = [slots.data_ptr() + i * row for i in range(3)]
    t = scratch.data_ptr()
    steps = [(s[0], t), (s[1], s[0]), (s[2], s[1]), (t, s[2])]
    size = torch.tensor([row], dtype=torch.int64)
    return [(torch.tensor([a], dtype=torch.int64), torch.tensor([b], dtype=torch.int64), size)
            for a, b in steps]


def test_pointer_op_runs_once_per_call_in_program_order(fresh_compile):
    slots = torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4])
    scratch = torch.zeros(4)
    steps = rotation_descriptors(slots, scratch)

    def rotate(x):
        y = x + 1  # real work around the side effects
        for src, dst, size in steps:
            torch_kvswap.swap_blocks_batch(src, dst, size, torch_kvswap.Direction.DEVICE_TO_DEVICE)
        return y * 2

    compiled = torch.compile(rotate, fullgraph=True)
    out = compiled(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 4.0))
    assert slots[:, 0].tolist() == [2.0, 3.0, 1.0]
    compiled(torch.ones(3))
    assert slots[:, 0].tolist() == [3.0, 1.0, 2.0]


def test_pointer_op_survives_when_its_result_is_unused(fresh_compile):
    src, dst = torch.arange(8.0), torch.zeros(8)
    args = (torch.tensor([src.data_ptr()]), torch.tensor([dst.data_ptr()]), torch.tensor([32]))

    @torch.compile(fullgraph=True)
    def only_side_effect():
        torch.ops.kvswap.swap_blocks_batch(*args, 0)

    only_side_effect()
    assert torch.equal(dst, src)


def test_tensor_op_sees_earlier_writes_and_writes_the_destination_in_place(fresh_compile):
    # An unusual destination shape makes a clone of it easy to spot in the code.
    src = torch.ones(6, 5)
    dst = torch.zeros(37, 5)
    dst_address = dst.data_ptr()
    src_ids, dst_ids = torch.tensor([0, 2]), torch.tensor([30, 36])

    def step(s, d, si, di):
        s.mul_(10)  # written in the graph, then read by the op
        torch_kvswap.swap_blocks([s], [d], si, di)
        return d.sum()

    compiled = torch.compile(step, fullgraph=True)
    total, codes = run_and_get_code(compiled, src, dst, src_ids, dst_ids)
    assert total.item() == 100.0  # two blocks of five tens
    assert torch.equal(dst[30], torch.full((5,), 10.0)) and torch.equal(dst[36], torch.full((5,), 10.0))
    assert dst.data_ptr() == dst_address
    code = "\n".join(codes)
    assert "kvswap.swap_blocks.default" in code
    assert not re.search(r"empty_strided\w*\(\(37, 5\)", code), "the destination was cloned"


def test_tensor_op_has_no_graph_breaks():
    src, dst = [torch.ones(4, 2)], [torch.zeros(4, 2)]

    def step(s, d, si, di):
        torch_kvswap.swap_blocks(s, d, si, di)
        return d[0] + 1

    explanation = torch._dynamo.explain(step)(src, dst, torch.tensor([1]), torch.tensor([2]))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_pointer_op_has_no_graph_breaks():
    src, dst = torch.ones(4), torch.zeros(4)
    args = (torch.tensor([src.data_ptr()]), torch.tensor([dst.data_ptr()]), torch.tensor([16]))

    def step(x):
        torch_kvswap.swap_blocks_batch(*args, 1)
        return x + 1

    explanation = torch._dynamo.explain(step)(torch.ones(2))
    assert explanation.graph_break_count == 0


def test_expand_block_ids_with_symbolic_shapes(fresh_compile):
    @torch.compile(fullgraph=True, dynamic=True)
    def expand_then_count(block_ids, factor: int, skip: int):
        out = torch_kvswap.expand_block_ids(block_ids, factor, skip)
        return out, out.shape[0]

    for n, f, skip in [(3, 4, 1), (5, 4, 0), (7, 2, 1), (0, 4, 2)]:
        block_ids = torch.arange(n, dtype=torch.int64)
        out, length = expand_then_count(block_ids, f, skip)
        assert length == max(0, n * f - skip)
        expected = [b * f + k for b in range(n) for k in range(f)][skip:] if n else []
        assert out.tolist() == expected


def test_handler_style_pipeline_compiles(fresh_compile):
    """expand_block_ids feeding swap_blocks, the offload handler's pattern."""
    device_cache = torch.randn(16, 3)
    host_cache = torch.zeros(8, 3)

    @torch.compile(fullgraph=True)
    def store(dev, host, host_blocks):
        dev_ids = torch_kvswap.expand_block_ids(host_blocks, 2)
        torch_kvswap.swap_blocks([dev], [host], dev_ids, torch.arange(dev_ids.shape[0]))

    store(device_cache, host_cache, torch.tensor([1, 5]))
    assert torch.equal(host_cache[:4], device_cache[[2, 3, 10, 11]])


def test_tensor_op_with_an_empty_cache_traces_like_eager(fresh_compile):
    # A cache with zero blocks is legal when no ids are given.
    src, dst = [torch.zeros(0, 4)], [torch.zeros(3, 4)]

    @torch.compile(fullgraph=True)
    def step(s, d, si, di):
        torch_kvswap.swap_blocks(s, d, si, di)
        return d[0].sum()

    empty = torch.empty(0, dtype=torch.int64)
    assert step(src, dst, empty, empty).item() == 0.0
