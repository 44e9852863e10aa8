"""Every malformed call raises a clear error naming the argument; none crashes.

Each call runs in a child process, so a crash fails its own test instead of
ending the run.
"""

from __future__ import annotations

import re

import pytest
import torch

import torch_kvswap
from isolation import run_isolated
from malformed_cases import CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_call_raises(name):
    fn, error_type, pattern = CASES[name]
    outcome = run_isolated(fn)
    assert not outcome.crashed, f"{name}: {outcome.message}"
    assert outcome.error_type == error_type.__name__, (name, outcome)
    assert re.search(pattern, outcome.message), (name, outcome.message)


def test_a_bad_descriptor_stops_the_whole_batch_before_any_copy():
    src = torch.arange(1, 65, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    sp = torch.tensor([src.data_ptr(), src.data_ptr() + 32])
    dp = torch.tensor([dst.data_ptr(), 0])  # second destination is null
    with pytest.raises(ValueError, match=r"dst_ptrs\[1\] is null"):
        torch_kvswap.swap_blocks_batch(sp, dp, torch.tensor([32, 32]), 0)
    assert torch.equal(dst, torch.zeros(64, dtype=torch.uint8))


def test_a_bad_block_id_stops_the_whole_copy_before_any_block_moves():
    src, dst = [torch.ones(4, 2), torch.ones(4, 2)], [torch.zeros(4, 2), torch.zeros(2, 2)]
    with pytest.raises(IndexError, match=r"dst_caches\[1\]"):
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 1]), torch.tensor([0, 3]))
    assert torch.equal(dst[0], torch.zeros(4, 2))


def test_malformed_call_fails_at_trace_time_under_compile(fresh_compile):
    @torch.compile(fullgraph=True)
    def bad(block_ids):
        return torch_kvswap.expand_block_ids(block_ids, 4, 4)

    with pytest.raises(Exception, match=r"skip_count must be in \[0, 4\)"):
        bad(torch.tensor([1, 2]))
