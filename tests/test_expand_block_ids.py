"""kvswap::expand_block_ids — host block ids to device sub-block ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_kvswap
from helpers import ids
from reference import expand_block_ids_ref

OP = torch.ops.kvswap.expand_block_ids.default


def test_reference_example():
    assert torch_kvswap.expand_block_ids(ids([0, 1, 3]), 4).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        12,
        13,
        14,
        15,
    ]


def test_skip_count_drops_leading_sub_blocks_of_the_first_block_only():
    assert torch_kvswap.expand_block_ids(ids([2, 5]), 4, 3).tolist() == [11, 20, 21, 22, 23]


def test_factor_one_is_the_identity():
    x = ids([9, 0, 4])
    out = torch_kvswap.expand_block_ids(x, 1)
    assert out.tolist() == [9, 0, 4] and out.data_ptr() != x.data_ptr()


def test_empty_input_gives_empty_output_even_with_a_skip():
    out = torch_kvswap.expand_block_ids(ids([]), 4, 2)
    assert out.shape == (0,) and out.dtype == torch.int64


def test_non_contiguous_input():
    table = ids([[1, 100], [3, 200], [7, 300]])
    assert torch_kvswap.expand_block_ids(table[:, 0], 2, 1).tolist() == [3, 6, 7, 14, 15]


def test_largest_id_that_fits_in_int64():
    f = 4
    top = (2**63 - 1 - (f - 1)) // f
    assert torch_kvswap.expand_block_ids(ids([top]), f).tolist()[-1] == top * f + f - 1
    with pytest.raises(ValueError, match=rf"block_ids\[0\] = {top + 1} times block_size_factor 4 overflows"):
        torch_kvswap.expand_block_ids(ids([top + 1]), f)


@settings(max_examples=200, deadline=None)
@given(
    block_ids=st.lists(st.integers(0, 2**40), max_size=64),
    factor=st.integers(1, 17),
    data=st.data(),
)
def test_matches_numpy_reference(block_ids, factor, data):
    skip = data.draw(st.integers(0, factor - 1))
    got = OP(ids(block_ids), factor, skip).numpy()
    np.testing.assert_array_equal(got, expand_block_ids_ref(block_ids, factor, skip))


@pytest.mark.parametrize("factor,skip", [(1, 0), (2, 1), (4, 0), (4, 3), (16, 5)])
def test_opcheck(factor, skip):
    results = torch.library.opcheck(OP, (ids([0, 7, 3, 12]), factor, skip))
    assert set(results.values()) == {"SUCCESS"}, results


# The accelerator path (ATen tensor ops), served on the CPU as
# kvswap::_expand_block_ids_aten so that its values are checked here too.
ATEN_PATH = torch.ops.kvswap_test.expand_block_ids_aten.default


@settings(max_examples=100, deadline=None)
@given(
    block_ids=st.lists(st.integers(0, 2**40), max_size=64),
    factor=st.integers(1, 17),
    data=st.data(),
)
def test_accelerator_path_matches_numpy_reference(block_ids, factor, data):
    skip = data.draw(st.integers(0, factor - 1))
    got = ATEN_PATH(ids(block_ids), factor, skip)
    assert got.dtype == torch.int64 and got.is_contiguous()
    np.testing.assert_array_equal(got.numpy(), expand_block_ids_ref(block_ids, factor, skip))


@pytest.mark.parametrize(
    "block_ids,factor,skip",
    [
        ([0, 1, 3], 4, 0),
        ([2, 5], 4, 3),
        ([], 4, 2),
        ([9], 1, 0),
    ],
)
def test_accelerator_path_gives_what_the_host_path_gives(block_ids, factor, skip):
    assert ATEN_PATH(ids(block_ids), factor, skip).tolist() == OP(ids(block_ids), factor, skip).tolist()


def test_accelerator_path_reads_any_stride():
    table = ids([[1, 100], [3, 200], [7, 300]])
    assert ATEN_PATH(table[:, 0], 2, 1).tolist() == [3, 6, 7, 14, 15]


@pytest.mark.parametrize(
    "block_ids,factor,skip,error,message",
    [
        ([1, -3], 4, 0, ValueError, r"block_ids contains -3; block ids must be >= 0"),
        (
            [0, 2**62],
            4,
            0,
            ValueError,
            r"block_ids contains 4611686018427387904; times block_size_factor 4 overflows",
        ),
        ([1], 0, 0, ValueError, r"block_size_factor must be >= 1, got 0"),
        ([1], 4, 4, ValueError, r"skip_count must be in \[0, block_size_factor\) = \[0, 4\), got 4"),
    ],
)
def test_accelerator_path_checks_like_the_host_path(block_ids, factor, skip, error, message):
    with pytest.raises(error, match=message):
        ATEN_PATH(ids(block_ids), factor, skip)


def test_accelerator_path_keeps_the_largest_id_that_fits():
    f = 4
    top = (2**63 - 1 - (f - 1)) // f
    assert ATEN_PATH(ids([top]), f).tolist()[-1] == top * f + f - 1
    with pytest.raises(ValueError, match="overflows int64"):
        ATEN_PATH(ids([top + 1]), f)


@pytest.mark.parametrize("factor", [2**40, 2**63 - 1])
@pytest.mark.parametrize("skip", ["none", "largest"])
def test_no_ids_give_no_sub_blocks_on_both_paths_whatever_the_factor(factor, skip):
    # The accelerator path once allocated arange(factor) before looking at the ids.
    skip_count = 0 if skip == "none" else factor - 1
    for path in (OP, ATEN_PATH):
        out = path(ids([]), factor, skip_count)
        assert out.shape == (0,) and out.dtype == torch.int64
