"""Malformed calls of every op, one function each, with the error each must raise.

They run in a child process (see isolation.py): each builds its own inputs.
CASES maps a case name to (function, expected exception type, message regex).

The swap_blocks and swap_blocks_batch cases also run through the ops' dry
runs (_plan_swap_blocks, kvswap_test.plan_swap_blocks_batch): run_case(name, dry_run=True)
sends the same call there, and test_malformed.py checks that both refuse it
with the same error.
"""

from __future__ import annotations

import torch

import torch_kvswap  # noqa: F401
import extension_ops  # noqa: F401 - torch.ops.kvswap_test

ops = torch.ops.kvswap
I64 = torch.int64
_dry_run = False  # set by run_case


def _batch_op():
    return torch.ops.kvswap_test.plan_swap_blocks_batch if _dry_run else ops.swap_blocks_batch


def _swap_op():
    return ops._plan_swap_blocks if _dry_run else ops.swap_blocks


def run_case(name: str, dry_run: bool = False) -> None:
    """Runs case `name` through its op, or through the op's dry run."""
    global _dry_run
    if dry_run and not has_dry_run(name):
        raise ValueError(f"{name} has no dry run")
    _dry_run = dry_run
    try:
        CASES[name][0]()
    finally:
        _dry_run = False


def has_dry_run(name: str) -> bool:
    return name.startswith(("batch_", "swap_"))


def _arena(n=256):
    return torch.zeros(n, dtype=torch.uint8)


def _ptr_args(src=None, dst=None, sizes=None):
    a, b = _arena(), _arena()
    src = torch.tensor([a.data_ptr(), a.data_ptr() + 64], dtype=I64) if src is None else src
    dst = torch.tensor([b.data_ptr(), b.data_ptr() + 64], dtype=I64) if dst is None else dst
    sizes = torch.tensor([32, 32], dtype=I64) if sizes is None else sizes
    return (a, b), src, dst, sizes


def _batch(direction=0, **kw):
    keep, src, dst, sizes = _ptr_args(**kw)
    _batch_op()(src, dst, sizes, direction)
    return keep


def _one(src_addr, dst_addr, size, direction=0):
    def t(v):
        return torch.tensor([v], dtype=I64)

    _batch_op()(t(src_addr), t(dst_addr), t(size), direction)


def _caches(n_src=8, n_dst=8, shape=(4, 2), dtype=torch.float32):
    return [torch.zeros(n_src, *shape, dtype=dtype)], [torch.zeros(n_dst, *shape, dtype=dtype)]


def _ids(*v):
    return torch.tensor(v, dtype=I64)


def _swap(src=None, dst=None, sid=None, did=None):
    s, d = _caches()
    _swap_op()(
        s if src is None else src,
        d if dst is None else dst,
        _ids(0, 1) if sid is None else sid,
        _ids(2, 3) if did is None else did,
    )


# --- swap_blocks_batch -------------------------------------------------------


def batch_src_int32():
    _batch(src=torch.tensor([1, 2], dtype=torch.int32))


def batch_dst_float():
    _batch(dst=torch.tensor([1.0, 2.0]))


def batch_sizes_int32():
    _batch(sizes=torch.tensor([1, 2], dtype=torch.int32))


def batch_src_2d():
    _batch(src=torch.ones(2, 1, dtype=I64))


def batch_sizes_0d():
    _batch(sizes=torch.tensor(4, dtype=I64))


def batch_dst_short():
    a = _arena()
    _batch(dst=torch.tensor([a.data_ptr()], dtype=I64))


def batch_sizes_long():
    _batch(sizes=torch.tensor([1, 1, 1], dtype=I64))


def batch_src_on_meta():
    _batch(src=torch.empty(2, dtype=I64, device="meta"))


def batch_negative_size():
    _batch(sizes=torch.tensor([8, -4], dtype=I64))


def batch_null_src():
    b = _arena()
    _one(0, b.data_ptr(), 16)


def batch_null_dst():
    a = _arena()
    _one(a.data_ptr(), 0, 16)


def batch_unknown_direction():
    _batch(direction=3)


def batch_negative_direction():
    _batch(direction=-1)


def batch_address_wraps():
    b = _arena()
    _one(-16, b.data_ptr(), 64)


def batch_self_overlap():
    a = _arena()
    _one(a.data_ptr(), a.data_ptr() + 8, 64)


def batch_overlap_by_one_byte():
    a = _arena()
    _one(a.data_ptr() + 63, a.data_ptr(), 64)


def batch_total_overflows():
    # Byte counts 2^62 + (2^62 - 1) + 2 pass one by one but sum past int64.
    def signed(v):  # addresses above 2^63 as the int64 values data_ptr() gives
        return v - (1 << 64) if v >= (1 << 63) else v

    big = 1 << 62
    src = [4096, 4096 + big, 8192]
    dst = [1 << 63, (1 << 63) + big, 16384]
    sizes = [big, big - 1, 2]
    _batch_op()(
        torch.tensor([signed(v) for v in src], dtype=I64),
        torch.tensor([signed(v) for v in dst], dtype=I64),
        torch.tensor(sizes, dtype=I64),
        0,
    )


# --- swap_blocks ---------------------------------------------------------------


def swap_list_lengths():
    s, d = _caches()
    _swap(dst=d + d)


def swap_dtype_mismatch():
    s, _ = _caches()
    _swap(src=s, dst=[torch.zeros(8, 4, 2, dtype=torch.float16)])


def swap_block_bytes_mismatch():
    _swap(dst=[torch.zeros(8, 4, 3)])


def swap_non_contiguous_block():
    _swap(src=[torch.zeros(8, 2, 4).transpose(1, 2)])


def swap_zero_dim_cache():
    _swap(src=[torch.tensor(1.0)], dst=[torch.tensor(2.0)])


def swap_src_id_equal_to_num_blocks():
    _swap(sid=_ids(0, 8))


def swap_dst_id_equal_to_num_blocks():
    _swap(did=_ids(7, 8))


def swap_negative_src_id():
    _swap(sid=_ids(-1, 0))


def swap_negative_dst_id():
    _swap(did=_ids(0, -1))


def _uneven_pairs():
    # The second pair has fewer blocks on both sides: 4 of 8.
    return [torch.zeros(8, 4), torch.zeros(4, 4)], [torch.zeros(8, 4), torch.zeros(4, 4)]


def swap_src_id_equal_to_num_blocks_of_second_tensor():
    src, dst = _uneven_pairs()
    _swap(src=src, dst=dst, sid=_ids(0, 4), did=_ids(0, 1))


def swap_dst_id_equal_to_num_blocks_of_second_tensor():
    src, dst = _uneven_pairs()
    _swap(src=src, dst=dst, sid=_ids(0, 1), did=_ids(3, 4))


def swap_dst_id_out_of_range_for_second_tensor():
    src = [torch.zeros(8, 4), torch.zeros(8, 4)]
    dst = [torch.zeros(8, 4), torch.zeros(4, 4)]
    _swap(src=src, dst=dst, did=_ids(1, 5))


def swap_id_lengths():
    _swap(sid=_ids(0, 1, 2))


def swap_ids_int32():
    _swap(sid=torch.tensor([0, 1], dtype=torch.int32))


def swap_ids_2d():
    _swap(did=_ids(2, 3).reshape(1, 2))


def swap_duplicate_dst_ids():
    _swap(sid=_ids(0, 1, 2), did=_ids(5, 6, 5))


def swap_read_and_write_same_block():
    cache = torch.zeros(8, 4)
    _swap(src=[cache], dst=[cache], sid=_ids(1, 2), did=_ids(2, 3))


def swap_overlapping_views():
    buf = torch.zeros(40)
    # Source block 1 (elements 4..7) and destination block 0 (elements 2..5) share bytes.
    _swap(src=[buf[:32].view(8, 4)], dst=[buf[2:34].view(8, 4)], sid=_ids(1), did=_ids(0))


def swap_dst_blocks_overlap():
    _swap(src=[torch.zeros(8, 4)], dst=[torch.zeros(1, 4).expand(8, 4)], did=_ids(2, 3))


def swap_src_devices_differ():
    _swap(
        src=[torch.zeros(8, 4), torch.zeros(8, 4, device="meta")], dst=[torch.zeros(8, 4), torch.zeros(8, 4)]
    )


def swap_pairs_chain_through_one_cache():
    x, y, z = torch.arange(32.0).view(8, 4), torch.zeros(8, 4), torch.zeros(8, 4)
    _swap(src=[x, y], dst=[y, z], sid=_ids(0, 1), did=_ids(1, 2))  # y[1] written and read


def swap_pairs_writing_one_cache():
    _swap(src=[torch.ones(8, 4), torch.ones(8, 4)], dst=[torch.zeros(8, 4)] * 2)


# --- expand_block_ids ----------------------------------------------------------


def expand_factor_zero():
    ops.expand_block_ids(_ids(1, 2), 0)


def expand_negative_skip():
    ops.expand_block_ids(_ids(1, 2), 4, -1)


def expand_skip_equal_to_factor():
    ops.expand_block_ids(_ids(1, 2), 4, 4)


def expand_negative_id():
    ops.expand_block_ids(_ids(1, -3), 4)


def expand_int32():
    ops.expand_block_ids(torch.tensor([1], dtype=torch.int32), 2)


def expand_2d():
    ops.expand_block_ids(_ids(1, 2).reshape(2, 1), 2)


def expand_overflow():
    ops.expand_block_ids(_ids(0, 2**62), 4)


CASES = {
    "batch_src_int32": (batch_src_int32, TypeError, r"src_ptrs must be int64, got torch\.int32"),
    "batch_dst_float": (batch_dst_float, TypeError, r"dst_ptrs must be int64, got torch\.float32"),
    "batch_sizes_int32": (batch_sizes_int32, TypeError, r"sizes must be int64"),
    "batch_src_2d": (batch_src_2d, ValueError, r"src_ptrs must be 1-D, got 2-D"),
    "batch_sizes_0d": (batch_sizes_0d, ValueError, r"sizes must be 1-D, got 0-D"),
    "batch_dst_short": (batch_dst_short, ValueError, r"dst_ptrs has 1 entries but src_ptrs has 2"),
    "batch_sizes_long": (batch_sizes_long, ValueError, r"sizes has 3 entries but src_ptrs has 2"),
    "batch_src_on_meta": (batch_src_on_meta, RuntimeError, r"src_ptrs must be a CPU tensor"),
    "batch_negative_size": (batch_negative_size, ValueError, r"sizes\[1\] is -4"),
    "batch_null_src": (batch_null_src, ValueError, r"src_ptrs\[0\] is null"),
    "batch_null_dst": (batch_null_dst, ValueError, r"dst_ptrs\[0\] is null"),
    "batch_unknown_direction": (batch_unknown_direction, ValueError, r"direction must be 0 .* got 3"),
    "batch_negative_direction": (batch_negative_direction, ValueError, r"direction must be 0 .* got -1"),
    "batch_address_wraps": (batch_address_wraps, ValueError, r"src_ptrs\[0\] \+ sizes\[0\] overflows"),
    "batch_self_overlap": (batch_self_overlap, ValueError, r"descriptor 0: source .* overlap"),
    "batch_overlap_by_one_byte": (batch_overlap_by_one_byte, ValueError, r"descriptor 0: source .* overlap"),
    "batch_total_overflows": (
        batch_total_overflows,
        ValueError,
        r"total byte count overflows int64 at index 2",
    ),
    "swap_list_lengths": (swap_list_lengths, ValueError, r"src_caches has 1 tensors but dst_caches has 2"),
    "swap_dtype_mismatch": (
        swap_dtype_mismatch,
        TypeError,
        r"src_caches\[0\] is torch\.float32 but dst_caches\[0\] is torch\.float16",
    ),
    "swap_block_bytes_mismatch": (
        swap_block_bytes_mismatch,
        ValueError,
        r"src_caches\[0\] has 32 bytes per block .* dst_caches\[0\] has 48",
    ),
    "swap_non_contiguous_block": (
        swap_non_contiguous_block,
        ValueError,
        r"src_caches\[0\]: each block must be contiguous",
    ),
    "swap_zero_dim_cache": (swap_zero_dim_cache, ValueError, r"src_caches\[0\] must have a block dimension"),
    "swap_src_id_equal_to_num_blocks": (
        swap_src_id_equal_to_num_blocks,
        IndexError,
        r"src_block_ids\[1\] = 8 is out of range for src_caches\[0\], which has 8 blocks",
    ),
    "swap_dst_id_equal_to_num_blocks": (
        swap_dst_id_equal_to_num_blocks,
        IndexError,
        r"dst_block_ids\[1\] = 8 is out of range for dst_caches\[0\], which has 8 blocks",
    ),
    "swap_negative_src_id": (swap_negative_src_id, IndexError, r"src_block_ids\[0\] = -1 is out of range"),
    "swap_negative_dst_id": (
        swap_negative_dst_id,
        IndexError,
        r"dst_block_ids\[1\] = -1 is out of range for dst_caches\[0\]",
    ),
    "swap_src_id_equal_to_num_blocks_of_second_tensor": (
        swap_src_id_equal_to_num_blocks_of_second_tensor,
        IndexError,
        r"src_block_ids\[1\] = 4 is out of range for src_caches\[1\], which has 4 blocks",
    ),
    "swap_dst_id_equal_to_num_blocks_of_second_tensor": (
        swap_dst_id_equal_to_num_blocks_of_second_tensor,
        IndexError,
        r"dst_block_ids\[1\] = 4 is out of range for dst_caches\[1\], which has 4 blocks",
    ),
    "swap_dst_id_out_of_range_for_second_tensor": (
        swap_dst_id_out_of_range_for_second_tensor,
        IndexError,
        r"dst_block_ids\[1\] = 5 is out of range for dst_caches\[1\], which has 4 blocks",
    ),
    "swap_id_lengths": (swap_id_lengths, ValueError, r"src_block_ids has 3 ids but dst_block_ids has 2"),
    "swap_ids_int32": (swap_ids_int32, TypeError, r"src_block_ids must be int64, got torch\.int32"),
    "swap_ids_2d": (swap_ids_2d, ValueError, r"dst_block_ids must be 1-D"),
    "swap_duplicate_dst_ids": (
        swap_duplicate_dst_ids,
        ValueError,
        r"dst_block_ids\[0\] and dst_block_ids\[2\] are both 5",
    ),
    "swap_read_and_write_same_block": (
        swap_read_and_write_same_block,
        ValueError,
        r"src_block_ids\[1\] = 2 is also a destination block",
    ),
    "swap_overlapping_views": (
        swap_overlapping_views,
        ValueError,
        r"dst_caches\[0\] block 0 \(dst_block_ids\[0\], written\) and src_caches\[0\] block 1 "
        r"\(src_block_ids\[0\], read\) share the bytes .*: a byte may not be both read and written",
    ),
    "swap_dst_blocks_overlap": (
        swap_dst_blocks_overlap,
        ValueError,
        r"dst_caches\[0\]: blocks overlap in memory",
    ),
    "swap_pairs_chain_through_one_cache": (
        swap_pairs_chain_through_one_cache,
        ValueError,
        r"dst_caches\[0\] block 1 .*written.* and src_caches\[1\] block 1 "
        r".*read.* share the bytes",
    ),
    "swap_pairs_writing_one_cache": (
        swap_pairs_writing_one_cache,
        ValueError,
        r"dst_caches\[0\] block \d .* and dst_caches\[1\] block \d .* share the bytes",
    ),
    "swap_src_devices_differ": (
        swap_src_devices_differ,
        RuntimeError,
        r"src_caches\[1\] is on meta but src_caches\[0\] is on cpu",
    ),
    "expand_factor_zero": (expand_factor_zero, ValueError, r"block_size_factor must be >= 1, got 0"),
    "expand_negative_skip": (
        expand_negative_skip,
        ValueError,
        r"skip_count must be in \[0, block_size_factor\) = \[0, 4\), got -1",
    ),
    "expand_skip_equal_to_factor": (expand_skip_equal_to_factor, ValueError, r"got 4"),
    "expand_negative_id": (expand_negative_id, ValueError, r"block_ids\[1\] is -3"),
    "expand_int32": (expand_int32, TypeError, r"block_ids must be int64, got torch\.int32"),
    "expand_2d": (expand_2d, ValueError, r"block_ids must be 1-D"),
    "expand_overflow": (
        expand_overflow,
        ValueError,
        r"block_ids\[1\] = 4611686018427387904 times block_size_factor 4 overflows int64",
    ),
}
