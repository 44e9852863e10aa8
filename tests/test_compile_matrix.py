"""swap_blocks under torch.compile: every backend, shape mode and cache layout.

Each call is compared byte for byte with a plain Python loop on clones, guard
bytes included (blocks the call does not name, the other half of a stacked
cache); a refused call must leave every byte of the destination as it was.
"""

from __future__ import annotations

import pytest
import torch

import torch_kvswap
from torch_kvswap.fake_kernels import SHARED_DESTINATIONS_COMPILE

BACKENDS = ["eager", "aot_eager", "inductor"]  # "eager": the op called without torch.compile
MODES = ["static", "recompile", "dynamic", "mark_dynamic"]
LAYOUTS = ["separate", "num_blocks_2", "2_num_blocks", "mla"]
WIDTH = 4
SOURCE_BLOCKS = 4

# The calls each mode makes, in order: (num_blocks of the cache, number of ids).
CALLS = {
    "static": [(8, 2), (8, 3), (8, 0)],  # compiled with dynamic=False
    "recompile": [(8, 2), (16, 3), (16, 0)],  # default shapes: the new size recompiles dynamic
    "dynamic": [(8, 2), (16, 3), (16, 0)],  # dynamic=True
    "mark_dynamic": [(8, 2), (16, 3), (16, 0)],  # dim 0 of every destination marked dynamic
}


def expected(backend: str, mode: str, layout: str, call: int) -> str:
    """The spec: "exact" (the bytes eager mode writes), or refused with nothing
    written: "refused: shared" (two destinations in one storage, before torch
    2.13), "refused: dynamic offset" (a destination that starts inside a
    storage, at an offset torch.compile treats as dynamic). Every compile
    backend refuses alike: the checks run at trace time."""
    if backend == "eager" or layout in ("separate", "mla"):
        return "exact"
    if not SHARED_DESTINATIONS_COMPILE:
        return "refused: shared"
    if mode == "static" or (mode == "recompile" and call == 0):
        return "exact"
    return "refused: dynamic offset"


REFUSALS = {
    "refused: shared": r"dst_caches\[0\] and dst_caches\[1\] share one storage.*Keep K and V "
    r"in separate tensors",
    "refused: dynamic offset": r"dst_caches\[1\] starts at a storage offset that torch.compile "
    r"treats as dynamic.*Compile with dynamic=False, or keep K and V "
    r"in separate tensors",
}


def wholes(layout: str, num_blocks: int) -> list[torch.Tensor]:
    """The cache tensors as allocated, filled with bytes no source holds."""
    shapes = {
        "separate": [(num_blocks, WIDTH)] * 2,
        "num_blocks_2": [(num_blocks, 2, WIDTH)],
        "2_num_blocks": [(2, num_blocks, WIDTH)],
        "mla": [(num_blocks, WIDTH)],
    }[layout]
    return [-torch.arange(1, 1 + torch.Size(s).numel(), dtype=torch.float32).view(s) for s in shapes]


def destinations(layout: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if layout == "num_blocks_2":
        return [tensors[0][:, 0], tensors[0][:, 1]]
    if layout == "2_num_blocks":
        return [tensors[0][0], tensors[0][1]]
    return list(tensors)


def ids(n: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([3, 0, 2][:n], dtype=torch.int64)
    dst = torch.tensor([num_blocks - 1, 2, 5][:n], dtype=torch.int64)
    return src, dst


def reference(srcs, dsts, src_ids, dst_ids) -> None:
    for s, d in zip(srcs, dsts):
        for s_id, d_id in zip(src_ids.tolist(), dst_ids.tolist()):
            d[d_id].copy_(s[s_id])


def call_under(backend: str, mode: str):
    def copy(srcs, dsts, src_ids, dst_ids):
        torch_kvswap.swap_blocks(srcs, dsts, src_ids, dst_ids)

    if backend == "eager":
        return copy
    dynamic = {"static": False, "dynamic": True}.get(mode)
    return torch.compile(copy, backend=backend, fullgraph=True, dynamic=dynamic)


def as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in tensors]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_swap_blocks_is_exact_or_refused_with_nothing_written(backend, mode, layout, fresh_compile):
    fn = call_under(backend, mode)
    for call, (num_blocks, n) in enumerate(CALLS[mode]):
        caches = wholes(layout, num_blocks)
        dsts = destinations(layout, caches)
        srcs = [
            torch.arange(SOURCE_BLOCKS * WIDTH, dtype=torch.float32).view(-1, WIDTH) + 100 * i
            for i in range(len(dsts))
        ]
        src_ids, dst_ids = ids(n, num_blocks)
        if mode == "mark_dynamic":
            for d in dsts:
                torch._dynamo.mark_dynamic(d, 0)
        want = [t.clone() for t in caches]
        reference(srcs, destinations(layout, want), src_ids, dst_ids)
        before = as_bytes(caches)
        outcome = expected(backend, mode, layout, call)
        where = f"call {call} ({num_blocks} blocks, {n} ids): expected {outcome}"
        if outcome == "exact":
            fn(srcs, dsts, src_ids, dst_ids)
            assert all(torch.equal(a, b) for a, b in zip(as_bytes(caches), as_bytes(want))), where
        else:
            with pytest.raises(Exception, match="(?s)" + REFUSALS[outcome]):
                fn(srcs, dsts, src_ids, dst_ids)
            assert all(torch.equal(a, b) for a, b in zip(as_bytes(caches), before)), where


def test_before_torch_2_13_two_destinations_in_one_storage_are_refused(fresh_compile, monkeypatch):
    monkeypatch.setattr(torch_kvswap.fake_kernels, "SHARED_DESTINATIONS_COMPILE", False)
    fn = torch.compile(
        lambda s, d, i, j: torch_kvswap.swap_blocks(s, d, i, j),
        backend="aot_eager",
        fullgraph=True,
        dynamic=False,
    )
    kv = wholes("num_blocks_2", 8)
    before = as_bytes(kv)
    srcs = [torch.zeros(SOURCE_BLOCKS, WIDTH), torch.ones(SOURCE_BLOCKS, WIDTH)]
    with pytest.raises(Exception, match="(?s)" + REFUSALS["refused: shared"]):
        fn(srcs, destinations("num_blocks_2", kv), *ids(2, 8))
    assert all(torch.equal(a, b) for a, b in zip(as_bytes(kv), before))
