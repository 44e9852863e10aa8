"""Every malformed call raises a clear error naming the argument; none crashes.

Each call runs in a child process, so a crash fails its own test instead of
ending the run. The dry runs (_plan_swap_blocks, kvswap_test.plan_swap_blocks_batch)
refuse every malformed call exactly as the ops do.
"""

from __future__ import annotations

import functools
import re
import time

import pytest
import torch

import torch_kvswap
from isolation import run_isolated
from malformed_cases import CASES, has_dry_run, run_case


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_call_raises(name):
    _, error_type, pattern = CASES[name]
    outcome = run_isolated(functools.partial(run_case, name))
    assert not outcome.crashed, f"{name}: {outcome.message}"
    assert outcome.error_type == error_type.__name__, (name, outcome)
    assert re.search(pattern, outcome.message), (name, outcome.message)
    if has_dry_run(name):  # a copy op: the error says that none of its copies ran
        assert outcome.message.rstrip().endswith("(nothing was copied)"), (name, outcome.message)


def _without_addresses(message: str) -> str:
    # Each run allocates its own buffers: addresses differ between runs.
    return re.sub(r"0x[0-9a-f]+|\d{9,}", "<address>", message)


@pytest.mark.parametrize("name", sorted(n for n in CASES if has_dry_run(n)))
def test_dry_run_refuses_exactly_like_the_op(name):
    real = run_isolated(functools.partial(run_case, name, False))
    dry = run_isolated(functools.partial(run_case, name, True))
    assert not dry.crashed, f"{name}: {dry.message}"
    assert real.error_type is not None, (name, real)
    assert (dry.error_type, _without_addresses(dry.message)) == (
        real.error_type,
        _without_addresses(real.message),
    )


def test_a_call_that_hangs_fails_fast_and_the_next_one_runs():
    outcome = run_isolated(functools.partial(time.sleep, 60), timeout=1)
    assert outcome.crashed
    assert "sleep(60) did not finish within 1 s" in outcome.message
    started = time.monotonic()
    outcome = run_isolated(functools.partial(run_case, "expand_factor_zero"), timeout=30)
    assert outcome.error_type == "ValueError", outcome
    assert time.monotonic() - started < 30


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
