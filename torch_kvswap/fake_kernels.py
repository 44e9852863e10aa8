"""Fake (meta) kernels of every ``kvswap`` operator.

This is the one place where torch.compile learns what each op does to shapes.
What it must know about the pointer op's side effect goes through a torch
internal, in _compile_hooks.py. The checks mirror the C++ core's with ``torch._check`` so that
a malformed call fails at trace time as it would in eager mode.
"""

from __future__ import annotations

import math

import torch


def _refuse_unless(cond, message) -> None:
    """torch._check for the copy ops: a refused call copies nothing, and says so
    as the C++ core does ("... (nothing was copied)")."""
    torch._check(cond, lambda: f"{message()} (nothing was copied)")


def _check_descriptor(t: torch.Tensor, name: str, n) -> None:
    _refuse_unless(t.dtype == torch.int64, lambda: f"{name} must be int64, got {t.dtype}")
    _refuse_unless(t.dim() == 1, lambda: f"{name} must be 1-D, got {t.dim()}-D")
    _refuse_unless(t.device.type == "cpu", lambda: f"{name} must be a CPU tensor, got {t.device}")
    _refuse_unless(t.shape[0] == n, lambda: f"{name} must have the same length as src_ptrs")


@torch.library.register_fake("kvswap::swap_blocks_batch")
def _swap_blocks_batch_fake(src_ptrs, dst_ptrs, sizes, direction):
    _refuse_unless(direction in (0, 1, 2), lambda: f"direction must be 0, 1 or 2, got {direction}")
    _check_descriptor(src_ptrs, "src_ptrs", src_ptrs.shape[0] if src_ptrs.dim() == 1 else -1)
    _check_descriptor(dst_ptrs, "dst_ptrs", src_ptrs.shape[0])
    _check_descriptor(sizes, "sizes", src_ptrs.shape[0])


def _check_one_device(caches, name: str) -> None:
    for i, t in enumerate(caches):
        _refuse_unless(
            t.device == caches[0].device,
            lambda: (
                f"{name}[{i}] is on {t.device} but {name}[0] is on "
                f"{caches[0].device}; all tensors of one list share a device"
            ),
        )


def _refuse_meta_ids_on_real_caches(named: dict[str, torch.Tensor]) -> None:
    """Meta tensors reach this kernel in eager mode too (the Meta key wins the
    dispatch) and carry no values: with real tensors beside them nothing
    would be copied. ``named``: each argument's tensors by name."""
    from torch._subclasses.fake_tensor import FakeTensor

    meta = [n for n, t in named.items() if t.device.type == "meta"]
    real = [(n, t) for n, t in named.items() if t.device.type != "meta" and not isinstance(t, FakeTensor)]
    _refuse_unless(
        not (meta and real),
        lambda: (
            f"{meta[0]} is on the meta device and holds no values, but {real[0][0]} is a real "
            f"tensor on {real[0][1].device}: pass the block ids as int64 CPU tensors and every "
            "cache on the device that holds it"
        ),
    )


#: Before torch 2.13, Inductor writes the second of two destinations that
#: share one storage (the K and V halves of a stacked cache) at the first's
#: place even with static shapes, as it does for any custom op that mutates
#: such views (docs/ops.md, "What compiles, and what is refused";
#: tests/test_compile_matrix.py). Releases before 2.13 therefore refuse them.
SHARED_DESTINATIONS_COMPILE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def _refuse_shared_destinations(dst_caches) -> None:
    from torch.multiprocessing.reductions import StorageWeakRef

    if SHARED_DESTINATIONS_COMPILE:
        return
    first: dict = {}
    for i, d in enumerate(dst_caches):
        j = first.setdefault(StorageWeakRef(d.untyped_storage()).cdata, i)
        _refuse_unless(
            j == i,
            lambda: (
                f"dst_caches[{j}] and dst_caches[{i}] share one storage (two halves of one stacked "
                f"cache), and torch {torch.__version__}'s torch.compile writes such views at the "
                "wrong place (fixed in torch 2.13). Keep K and V in separate tensors, call "
                "swap_blocks outside the compiled region, or use torch 2.13 or newer"
            ),
        )


class DynamicStorageOffsetError(IndexError):
    """A destination whose storage offset (its index into its storage) is a
    symbol under torch.compile. An ``IndexError`` because torch.compile, from
    torch 2.13, hands an ``IndexError`` raised while tracing to the caller as
    raised, so the refusal is the first line the caller reads; before 2.13 it
    arrives inside Dynamo's ``TorchRuntimeError``. Eager calls never raise it."""


def _refuse_dynamic_storage_offset(dst_caches) -> None:
    """Inductor's clone of a mutated input whose storage offset is dynamic
    regenerates the view at offset 0 (its sym_storage_offset of a graph input
    lowers to 0): the copy would land in the wrong bytes."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    for i, d in enumerate(dst_caches):
        if not is_concrete_int(d.storage_offset()):
            raise DynamicStorageOffsetError(
                f"dst_caches[{i}] starts at a storage offset that torch.compile treats as dynamic "
                f"({d.storage_offset()}), as a half of one stacked [num_blocks, 2, ...] or "
                "[2, num_blocks, ...] cache does under dynamic shapes; Inductor would write it at "
                "the wrong offset. Compile with dynamic=False, or keep K and V in separate tensors "
                "(nothing was copied)"
            )


@torch.library.register_fake("kvswap::swap_blocks")
def _swap_blocks_fake(src_caches, dst_caches, src_block_ids, dst_block_ids):
    _refuse_shared_destinations(dst_caches)
    _refuse_dynamic_storage_offset(dst_caches)

    _refuse_unless(
        len(src_caches) == len(dst_caches),
        lambda: f"src_caches has {len(src_caches)} tensors but dst_caches has {len(dst_caches)}",
    )
    _check_one_device(src_caches, "src_caches")
    _check_one_device(dst_caches, "dst_caches")
    _refuse_meta_ids_on_real_caches(
        {
            **{f"src_caches[{i}]": c for i, c in enumerate(src_caches)},
            **{f"dst_caches[{i}]": c for i, c in enumerate(dst_caches)},
            "src_block_ids": src_block_ids,
            "dst_block_ids": dst_block_ids,
        }
    )
    for i, (s, d) in enumerate(zip(src_caches, dst_caches)):
        _refuse_unless(
            s.dtype == d.dtype, lambda: f"src_caches[{i}] is {s.dtype} but dst_caches[{i}] is {d.dtype}"
        )
        _refuse_unless(
            s.dim() >= 1 and d.dim() >= 1,
            lambda: f"src_caches[{i}] and dst_caches[{i}] need a block dimension",
        )
        _refuse_unless(
            math.prod(s.shape[1:]) == math.prod(d.shape[1:]),
            lambda: f"src_caches[{i}] and dst_caches[{i}] differ in bytes per block",
        )
    for name, ids in (("src_block_ids", src_block_ids), ("dst_block_ids", dst_block_ids)):
        _refuse_unless(ids.dtype == torch.int64, lambda: f"{name} must be int64, got {ids.dtype}")
        _refuse_unless(ids.dim() == 1, lambda: f"{name} must be 1-D")
    _refuse_unless(
        src_block_ids.shape[0] == dst_block_ids.shape[0],
        lambda: "src_block_ids and dst_block_ids must have the same length",
    )


@torch.library.register_fake("kvswap::expand_block_ids")
def _expand_block_ids_fake(block_ids, block_size_factor, skip_count=0):
    torch._check(block_ids.dtype == torch.int64, lambda: f"block_ids must be int64, got {block_ids.dtype}")
    torch._check(block_ids.dim() == 1, lambda: f"block_ids must be 1-D, got {block_ids.dim()}-D")
    torch._check(block_size_factor >= 1, lambda: f"block_size_factor must be >= 1, got {block_size_factor}")
    torch._check(
        0 <= skip_count < block_size_factor,
        lambda: f"skip_count must be in [0, {block_size_factor}), got {skip_count}",
    )
    n = block_ids.shape[0]
    # skip_count < f, so n*f - skip_count is negative only for n == 0.
    length = torch.sym_max(n * block_size_factor - skip_count, 0)
    return block_ids.new_empty((length,))


@torch.library.register_fake("kvswap::_host_register")
def _host_register_fake(buffer, device, pin):
    return None


@torch.library.register_fake("kvswap::_register_region")
def _register_region_fake(region, side, label):
    # Registration changes a process-wide table; a graph could not replay it.
    raise RuntimeError(
        "torch_kvswap.register_region is an eager call: register regions "
        "outside torch.compile (checked mode's checks run in the eager kernels)"
    )


def _plan_fake():
    # The number of descriptors after merging depends on the ids' values.
    ctx = torch.library.get_ctx()
    n = ctx.new_dynamic_size()
    return tuple(torch.empty((n,), dtype=torch.int64) for _ in range(3))


# The dry runs check their arguments exactly as the ops they stand for.
@torch.library.register_fake("kvswap::_plan_swap_blocks")
def _plan_swap_blocks_fake(src_caches, dst_caches, src_block_ids, dst_block_ids):
    _swap_blocks_fake(src_caches, dst_caches, src_block_ids, dst_block_ids)
    return _plan_fake()
