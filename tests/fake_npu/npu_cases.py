"""The fixture and helpers of the fake-ACL cases (tests/fake_npu/cases_*.py).

These cases run only in the child pytest that tests/test_ascend_fake.py
starts: loading the fake backend makes ``npu`` torch's accelerator for the
whole process. Importing this file loads no fake runtime. (Not a conftest.py: the
parent suite imports tests/conftest.py as ``conftest``.)
"""

from __future__ import annotations

import pytest
import torch

import torch_kvswap
import extension_ops  # noqa: F401 - torch.ops.kvswap_test

ABSENT_8_0 = [
    "aclrtMemcpyBatchAsync",
    "aclrtHostRegisterV2",
    "aclmdlRICaptureGetInfo",
    "aclmdlRICaptureBegin",
]  # CANN 8.0-like: none of the newer functions
FEATURE_NOT_SUPPORT = 207000
RT_PARAM_INVALID = 107000
MEMCPY_HOST_TO_DEVICE = 1  # aclrtMemcpyKind ACL_MEMCPY_HOST_TO_DEVICE [hdr acl_rt.h]


@pytest.fixture
def fake():
    """The fake runtime, reset before and after each case (faults, counts,
    captures, queued copies, the engine's latches)."""
    from fake_npu import load_fake

    ext = load_fake()
    ext.reset()
    yield ext
    ext.reset()


def cann(ext, absent):
    """Makes the engine see a CANN without the functions `absent` (the
    table is read on every call; the fixture's reset restores it)."""
    ext.set_absent(list(absent))


def host_blocks(n, block_bytes, seed, pinned=True):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 255, (n, block_bytes), dtype=torch.uint8, generator=g)
    return t.pin_memory() if pinned else t


def device_blocks(n, block_bytes, seed, device="npu:0"):
    return host_blocks(n, block_bytes, seed, pinned=False).to(device)


def aligned_host_buffer(nbytes):
    """A pageable CPU tensor whose data starts on a 4 KiB page."""
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 4096
    return raw[off : off + nbytes]


def pointer_copy(src, dst, pairs, code, *, block):
    """kvswap::swap_blocks_batch, direction `code`, of `block`-byte blocks:
    block s of `src` to block d of `dst` for each (s, d) of `pairs`."""
    sp = torch.tensor([src.data_ptr() + s * block for s, _ in pairs])
    dp = torch.tensor([dst.data_ptr() + d * block for _, d in pairs])
    torch_kvswap.swap_blocks_batch(sp, dp, torch.full((len(pairs),), block), code)


def scattered(n):
    """n (src, dst) block pairs that no merge can join: blocks 0, 2, 4, ..."""
    return [(2 * i, 2 * i) for i in range(n)]
