"""The engine loads and answers when ACL lacks optional functions from the
start: at least the batch API and the capture query (CANN 8.0-like); the
suite's `load` session takes every optional function away. Runs in its own
child process with KVSWAP_FAKE_ACL_ABSENT set before the extension loads:
tests/test_ascend_fake.py and scripts/check_engines.sh start it."""

from __future__ import annotations

import os

import pytest
import torch

import torch_kvswap
import extension_ops  # noqa: F401 - torch.ops.kvswap_test

NEEDED = {"aclrtMemcpyBatchAsync", "aclmdlRICaptureGetInfo", "aclmdlRICaptureBegin"}


def absent() -> set[str]:
    return {n for n in os.environ.get("KVSWAP_FAKE_ACL_ABSENT", "").split(",") if n}


def test_engine_loads_and_copies_without_batch_api_and_capture_query():
    if not NEEDED <= absent():
        pytest.skip(f"run with KVSWAP_FAKE_ACL_ABSENT naming at least {','.join(sorted(NEEDED))}")
    from fake_npu import load_fake

    fake = load_fake()  # no reset: the table is the one built at load
    assert "npu" in torch.ops.kvswap._engines()
    assert not torch.ops.kvswap_test.stream_capturing("npu", torch.device("npu:0"))
    src = torch.arange(4 * 256, dtype=torch.float32).reshape(4, 256).pin_memory()
    dst = torch.zeros(4, 256, device="npu:0")
    torch_kvswap.swap_blocks([src], [dst], torch.tensor([0, 3]), torch.tensor([2, 1]))
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu()[[2, 1]], src[[0, 3]])
    assert fake.calls("aclrtMemcpyBatchAsync") == 0 and fake.calls("aclmdlRICaptureGetInfo") == 0
    assert fake.calls("aclrtMemcpyAsync") == 2


def test_environment_report_says_which_optional_functions_are_absent():
    if not NEEDED <= absent():
        pytest.skip(f"run with KVSWAP_FAKE_ACL_ABSENT naming at least {','.join(sorted(NEEDED))}")
    from fake_npu import load_fake

    load_fake()
    report = dict(line.split("=", 1) for line in torch.ops.kvswap._engine_report(torch.device("npu:0")))
    assert report["batch_api"].startswith("absent (aclrtMemcpyBatchAsync)")
    assert report["capture_query"].startswith("absent (aclmdlRICaptureGetInfo)")
    for name, function in (
        ("pin_in_place", "aclrtHostRegisterV2"),
        ("pin_check", "aclrtPointerGetAttributes"),
    ):
        assert report[name].startswith("absent" if function in absent() else function), report


def test_host_registration_without_the_optional_functions():
    """Without aclrtHostRegisterV2 the engine says so (the offloader then uses
    the pinned allocator); with it but without aclrtPointerGetAttributes the
    registration's own answer stands."""
    if not NEEDED <= absent():
        pytest.skip("run in the load session")
    from fake_npu import load_fake

    fake = load_fake()
    raw = torch.empty(3 * 4096, dtype=torch.uint8)
    buf = raw[-raw.data_ptr() % 4096 :][: 2 * 4096]
    if "aclrtHostRegisterV2" in absent():
        with pytest.raises(NotImplementedError, match="no aclrtHostRegisterV2"):
            torch.ops.kvswap._host_register(buf, torch.device("npu:0"), True)
        return
    torch.ops.kvswap._host_register(buf, torch.device("npu:0"), True)
    assert fake.kind(buf.data_ptr()) == "pinned"
    assert fake.calls("aclrtPointerGetAttributes") == (0 if "aclrtPointerGetAttributes" in absent() else 2)
    torch.ops.kvswap._host_register(buf, torch.device("npu:0"), False)


def test_errors_read_without_the_recent_error_message():
    if "aclGetRecentErrMsg" not in absent():
        pytest.skip("run with aclGetRecentErrMsg absent")
    from fake_npu import load_fake

    fake = load_fake()
    src, dst = torch.zeros(2, 256, device="npu:0"), torch.zeros(2, 256, device="npu:0")
    fake.fail("aclrtMemcpyAsync", 107000, fake.calls("aclrtMemcpyAsync") + 1)
    try:
        with pytest.raises(RuntimeError, match=r": ACL error 107000; copies 0\.\.0 may have been queued"):
            torch_kvswap.swap_blocks([src], [dst], torch.tensor([0]), torch.tensor([1]))
    finally:
        fake.fail("aclrtMemcpyAsync", 0, -1)
