"""The ops under torch.compile(fullgraph=True): kept, ordered, in place, no graph breaks."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import torch_kvswap
from torch_kvswap.fake_kernels import SHARED_DESTINATIONS_COMPILE


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
    return [
        (torch.tensor([a], dtype=torch.int64), torch.tensor([b], dtype=torch.int64), size) for a, b in steps
    ]


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


# Backends that functionalize the tensor op: Inductor re-inplaces it;
# aot_eager (and cudagraphs, which runs the same graph) run torch's own
# auto_functionalized_v2, which clones every destination base on every call
# (docs/ops.md, "Backends without Inductor": the cost, measured).
BACKENDS = ["inductor", "aot_eager"]


def assert_clones(backend: str, clones: list[int], destination_elements: int) -> None:
    """Inductor clones no destination; aot_eager clones each whole destination
    base per call (torch's behaviour, which torch_kvswap leaves alone)."""
    whole = [n for n in clones if n >= destination_elements]
    if backend == "inductor":
        assert not whole, f"inductor cloned {clones} elements per call"
    else:
        assert destination_elements in whole, f"{backend} cloned {clones} elements per call"


def clone_sizes_during(fn, *args) -> tuple[object, list[int]]:
    """fn(*args), and the element count of every aten::clone that ran during it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn(*args)
    sizes = []
    for event in prof.events():
        if event.name == "aten::clone" and event.input_shapes and event.input_shapes[0] is not None:
            sizes.append(math.prod(event.input_shapes[0]))
    return result, sizes


_ALLOCATION = re.compile(r"\bempty(?:_strided)?\w*\(\s*[\(\[]([^)\]]*)[\)\]]")


def allocated_sizes(code: str) -> list[int | None]:
    """Element counts of every buffer Inductor's generated code allocates
    (empty / empty_strided in any spelling; None for a symbolic size)."""
    sizes: list[int | None] = []
    for match in _ALLOCATION.finditer(code):
        dims = [d.strip() for d in match.group(1).split(",") if d.strip()]
        sizes.append(math.prod(int(d) for d in dims) if all(d.isdigit() for d in dims) else None)
    return sizes


def test_allocated_sizes_reads_every_spelling():
    code = (
        "buf0 = empty_strided_cpu((185, ), (1, ), torch.float32)\n"
        "buf1 = empty_strided_cuda((37, 5), (5, 1), torch.float32)\n"
        "buf2 = empty_strided((), (), device='cpu')\nbuf3 = torch.empty([4, s0])"
    )
    assert allocated_sizes(code) == [185, 185, 1, None]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_op_sees_earlier_writes_and_writes_the_destination_in_place(backend, fresh_compile):
    src = torch.ones(6, 5)
    dst = torch.zeros(37, 5)
    src_ids, dst_ids = torch.tensor([0, 2]), torch.tensor([30, 36])

    def step(s, d, si, di):
        s.mul_(10)  # written in the graph, then read by the op
        torch_kvswap.swap_blocks([s], [d], si, di)
        return d.sum()

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    if backend == "inductor":
        _, codes = run_and_get_code(compiled, src, dst, src_ids, dst_ids)
        code = "\n".join(codes)
        assert "kvswap.swap_blocks.default" in code
        # A clone of the destination, in whatever shape Inductor allocates it
        # ((37, 5), or flat (185,)), is a buffer as large as the destination.
        sizes = allocated_sizes(code)
        assert all(n is not None and n < dst.numel() for n in sizes), (
            f"the generated code allocates {sizes} elements; the destination has {dst.numel()}"
        )
    else:
        compiled(src, dst, src_ids, dst_ids)
    src.fill_(1.0)
    dst.zero_()
    total, clones = clone_sizes_during(compiled, src, dst, src_ids, dst_ids)
    assert total.item() == 100.0  # two blocks of five tens
    assert torch.equal(dst[30], torch.full((5,), 10.0)) and torch.equal(dst[36], torch.full((5,), 10.0))
    assert dst.sum().item() == 100.0
    assert_clones(backend, clones, dst.numel())


@pytest.mark.skipif(
    not SHARED_DESTINATIONS_COMPILE,
    reason="before torch 2.13 two destinations in one storage are refused at once (test_compile_matrix.py)",
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_op_writes_in_place_under_inductor_and_is_cloned_under_aot_eager(backend, fresh_compile):
    # The halves of a stacked [2, num_blocks, ...] cache are views of one
    # base: Inductor clones neither the base nor a half; aot_eager clones the base.
    kv = torch.zeros(2, 64, 16)
    src = torch.arange(8 * 16, dtype=torch.float32).view(8, 16)

    def store(s, kv, si, di):
        torch_kvswap.swap_blocks([s, s], [kv[0], kv[1]], si, di)

    compiled = torch.compile(store, backend=backend, fullgraph=True)
    compiled(src, kv, torch.tensor([0, 1]), torch.tensor([0, 1]))  # compiles; same shapes as below
    _, clones = clone_sizes_during(compiled, src, kv, torch.tensor([3, 4]), torch.tensor([60, 7]))
    assert_clones(backend, clones, kv.numel())
    assert torch.equal(kv[0][60], src[3]) and torch.equal(kv[1][7], src[4])


@pytest.mark.skipif(
    not SHARED_DESTINATIONS_COMPILE,
    reason="before torch 2.13 two destinations in one storage are refused at once (test_compile_matrix.py)",
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_graphs_give_what_eager_mode_gives(backend, fresh_compile):
    # Reads of a destination before and after the op, another write to it in
    # the same graph, a base that is both read (one half) and written (the
    # other half) by the op: every backend agrees with eager mode.
    def step(s, kv, si, di):
        kv[1].mul_(2)
        before = kv[0].sum() + kv[1][5].sum()
        torch_kvswap.swap_blocks([s, kv[0][:8]], [kv[1], kv[0][8:]], si, di)
        return before, kv.sum(), kv[1][5].clone()

    def inputs():
        kv = torch.arange(2 * 16 * 4, dtype=torch.float32).view(2, 16, 4)
        return torch.full((16, 4), -1.0), kv, torch.tensor([2, 5]), torch.tensor([5, 7])

    s, kv, si, di = inputs()
    want = step(s, kv, si, di)
    want_kv = kv.clone()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for _ in range(2):  # the first call compiles
        s, kv, si, di = inputs()
        got = compiled(s, kv, si, di)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert torch.equal(kv, want_kv)


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


@pytest.mark.skipif(
    not SHARED_DESTINATIONS_COMPILE,
    reason="before torch 2.13 two destinations in one storage are refused at once (test_compile_matrix.py)",
)
def test_dynamic_storage_offset_of_a_destination_is_refused_and_nothing_lost(fresh_compile):
    # The V half of a [2, num_blocks, ...] cache starts at a storage offset that
    # becomes dynamic on a recompile after a size change; Inductor wrote it at offset 0.
    halves = torch.compile(
        lambda s0, s1, d0, d1, i, j: torch_kvswap.swap_blocks([s0, s1], [d0, d1], i, j), fullgraph=True
    )
    src = (torch.ones(4, 4), torch.full((4, 4), 2.0))
    one = torch.tensor([0])
    kv = torch.zeros(2, 8, 4)
    halves(*src, kv[0], kv[1], one, one)
    assert torch.equal(kv[:, 0], torch.stack(src)[:, 0])
    kv = torch.zeros(2, 16, 4)
    kv[1] = 7.0
    before = kv.clone()
    with pytest.raises(IndexError) as refused:
        halves(*src, kv[0], kv[1], one, one)
    assert torch.equal(kv, before)
    # The refusal is the first line the caller reads, not inside Dynamo's error.
    first = str(refused.value).splitlines()[0]
    assert first.startswith("dst_caches[1] starts at a storage offset that torch.compile treats as dynamic")
    assert first.endswith("keep K and V in separate tensors (nothing was copied)"), first
