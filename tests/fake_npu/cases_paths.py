"""Every path of the Ascend engine x direction x capture, on the fake runtime.

Run by tests/test_ascend_fake.py in a child process (see conftest.py here).
Each case checks three things: which ACL functions served the copy (the
path), that nothing lands before the stream is synchronized (copies are
queued, not done), and that the data is right afterwards.
"""

from __future__ import annotations

import pytest
import torch

import torch_kvswap
from npu_cases import ABSENT_8_0, cann, device_blocks, host_blocks
from npu_cases import fake  # noqa: F401 - the fixture
from reference import swap_blocks_ref

BLOCK = 2048
SID, DID = [11, 0, 5, 6, 7], [8, 2, 3, 4, 0]

# name -> (absent functions, can capture, path outside capture)
CANNS = {
    "8.5-like": ([], True, "batch"),
    "8.0-like": (ABSENT_8_0, False, "each"),
    "no-capture-query": (["aclmdlRICaptureGetInfo"], True, "each"),  # state unknown
    "no-capture-api": (["aclmdlRICaptureGetInfo", "aclmdlRICaptureBegin"], False, "batch"),
}
DIRECTIONS = ["h2d", "d2h", "d2d"]


def caches(direction):
    src = host_blocks(12, BLOCK, 1) if direction == "h2d" else device_blocks(12, BLOCK, 1)
    dst = host_blocks(9, BLOCK, 2) if direction == "d2h" else device_blocks(9, BLOCK, 2)
    return src, dst


def expected_path(cann_name, direction, capturing):
    _, _, outside = CANNS[cann_name]
    if direction == "d2d" or capturing:
        return "each"
    return outside


def used_path(fake):
    batch, each = fake.calls("aclrtMemcpyBatchAsync"), fake.calls("aclrtMemcpyAsync")
    assert (batch == 0) != (each == 0), (batch, each)
    return "batch" if batch else "each"


def copy(op, src, dst, direction):
    if op == "tensor":
        torch_kvswap.swap_blocks([src], [dst], torch.tensor(SID), torch.tensor(DID))
        return
    code = {"h2d": 0, "d2h": 1, "d2d": 2}[direction]
    sp = torch.tensor([src.data_ptr() + i * BLOCK for i in SID])
    dp = torch.tensor([dst.data_ptr() + i * BLOCK for i in DID])
    torch_kvswap.swap_blocks_batch(sp, dp, torch.full((len(SID),), BLOCK), code)


@pytest.mark.parametrize("op", ["tensor", "pointer"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("cann_name", list(CANNS))
def test_copies_are_queued_and_land_at_sync(fake, cann_name, direction, op):
    cann(fake, CANNS[cann_name][0])
    src, dst = caches(direction)
    want = swap_blocks_ref([src], [dst], SID, DID)[0]
    before = dst.cpu().clone()
    copy(op, src, dst, direction)
    assert used_path(fake) == expected_path(cann_name, direction, capturing=False)
    assert fake.pending(0, 0) > 0, "the copies were done at once instead of queued"
    if direction == "d2h":
        assert torch.equal(dst, before), "host memory changed before the stream was synchronized"
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("op", ["tensor", "pointer"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("cann_name", [n for n, (_, can, _) in CANNS.items() if can])
def test_captured_copies_run_only_at_replay(fake, cann_name, direction, op):
    cann(fake, CANNS[cann_name][0])
    src, dst = caches(direction)
    torch.accelerator.synchronize()
    fake.capture_begin(0, 0)
    copy(op, src, dst, direction)
    graph = fake.capture_end(0, 0)
    assert used_path(fake) == expected_path(cann_name, direction, capturing=True)
    assert fake.pending(0, 0) == 0 and fake.graph_size(graph) > 0
    # The graph copies the captured addresses: new source data shows at replay.
    if direction == "h2d":
        src.add_(1)
    else:
        src.copy_(src.cpu() + 1)
    want = swap_blocks_ref([src], [dst], SID, DID)[0]
    fake.replay(graph, 0, 0)
    torch.accelerator.synchronize()
    assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_batch_path_names_the_device_of_the_copy(fake, direction):
    """Device memory of npu:1 is described with device id 1 (CANN checks it)."""
    src = host_blocks(4, BLOCK, 1) if direction == "h2d" else device_blocks(4, BLOCK, 1, "npu:1")
    dst = device_blocks(4, BLOCK, 2, "npu:1") if direction == "h2d" else host_blocks(4, BLOCK, 2)
    want = swap_blocks_ref([src], [dst], [0, 2], [3, 1])[0]
    torch_kvswap.swap_blocks([src], [dst], torch.tensor([0, 2]), torch.tensor([3, 1]))
    assert fake.calls("aclrtMemcpyBatchAsync") == 2  # the stream's first batch holds one entry
    assert fake.pending(1, 0) > 0 and fake.pending(0, 0) == 0
    torch.accelerator.synchronize(1)
    assert torch.equal(dst.cpu(), want)


def test_copies_go_to_the_current_stream(fake):
    src, dst = host_blocks(4, BLOCK, 1), device_blocks(4, BLOCK, 2)
    side = torch.Stream(device="npu:0")
    with side:
        torch_kvswap.swap_blocks([src], [dst], torch.tensor([1]), torch.tensor([2]))
    assert fake.pending(0, side.stream_id) > 0 and fake.pending(0, 0) == 0
    side.synchronize()
    assert torch.equal(dst.cpu()[2], src[1])


def test_environment_report_names_the_functions_found(fake):
    report = dict(line.split("=", 1) for line in torch.ops.kvswap._engine_report(torch.device("npu:0")))
    assert report == {
        "batch_api": "aclrtMemcpyBatchAsync found",
        "capture_query": "aclmdlRICaptureGetInfo found",
        "pin_in_place": "aclrtHostRegisterV2(ACL_HOST_REG_PINNED) found",
        "pin_check": "aclrtPointerGetAttributes found",
    }


def test_environment_report_follows_the_cann_release(fake):
    cann(fake, ABSENT_8_0)
    report = dict(line.split("=", 1) for line in torch.ops.kvswap._engine_report(torch.device("npu:0")))
    assert report["batch_api"].startswith("absent") and report["capture_query"].startswith("absent")
