"""The engine loads and answers when ACL lacks the batch API and the capture
query from the start (CANN 8.0-like). Runs in its own child process with
KVSWAP_FAKE_ACL_ABSENT set before the extension loads: tests/test_ascend_fake.py
and scripts/check_engines.sh start it."""

from __future__ import annotations

import os

import pytest
import torch

import torch_kvswap

ABSENT = "aclrtMemcpyBatchAsync,aclmdlRICaptureGetInfo,aclmdlRICaptureBegin"


def test_engine_loads_and_copies_without_batch_api_and_capture_query():
    if os.environ.get("KVSWAP_FAKE_ACL_ABSENT") != ABSENT:
        pytest.skip(f"run with KVSWAP_FAKE_ACL_ABSENT={ABSENT}")
    from fake_npu import load_fake

    fake = load_fake()  # no reset: the table is the one built at load
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kvswap::_submit", "PrivateUse1")
    assert not torch.ops.kvswap._stream_capturing(torch.device("npu:0"))
    src = torch.arange(4 * 256, dtype=torch.float32).reshape(4, 256).pin_memory()
    dst = torch.zeros(4, 256, device="npu:0")
    torch_kvswap.swap_blocks([src], [dst], torch.tensor([0, 3]), torch.tensor([2, 1]))
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[[2, 1]], src[[0, 3]])
    assert fake.calls("aclrtMemcpyBatchAsync") == 0 and fake.calls("aclmdlRICaptureGetInfo") == 0
    assert fake.calls("aclrtMemcpyAsync") == 2
