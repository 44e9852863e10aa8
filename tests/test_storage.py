"""swap_blocks refuses a block that lies outside its tensor's storage as it is now.

torch checks a view against its storage only when the view is made; a storage
resized or freed afterwards (``untyped_storage().resize_``) keeps the view's
sizes, and ``c[1000]`` then raises ``setStorage: ... out of bounds for storage
of size ...``. The op refuses such a block the same way, on every path (eager,
the dry run, compiled, checked mode) and before anything is copied.
"""

from __future__ import annotations

import pytest
import torch

import torch_kvswap
from helpers import ids
from isolation import run_isolated

BLOCK = 256  # float32 elements per block: 1 KiB
BLOCK_BYTES = BLOCK * 4
PLAN = torch.ops.kvswap._plan_swap_blocks.default


def cache(blocks: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((blocks, BLOCK), fill)


def shrink(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    t.untyped_storage().resize_(nbytes)
    return t


STORAGES = {
    "freed": 0,  # resize_(0)
    "shrunk": 64 * BLOCK_BYTES,  # blocks 0..63 remain
}


def pairs_with(kind: str, side: str):
    """Two cache pairs: pair 0 intact, pair 1 with its `side` cache's storage resized."""
    src = [cache(2048, 1.0), cache(2048, 2.0)]
    dst = [cache(2048), cache(2048)]
    bad = src[1] if side == "src" else dst[1]
    shrink(bad, STORAGES[kind])
    return src, dst


def call(how: str, src, dst, sid, did):
    if how == "swap_blocks":
        torch_kvswap.swap_blocks(src, dst, sid, did)
    elif how == "plan":
        PLAN(src, dst, sid, did)
    else:
        with torch_kvswap.checked():
            torch_kvswap.swap_blocks(src, dst, sid, did)


@pytest.mark.parametrize("how", ["swap_blocks", "plan", "checked"])
@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("kind", ["freed", "shrunk"])
def test_block_outside_a_resized_storage_is_refused_and_nothing_copied(how, side, kind):
    src, dst = pairs_with(kind, side)
    before = dst[0].clone()
    name = "src_block_ids" if side == "src" else "dst_block_ids"
    block = 1000
    sid, did = (ids([block]), ids([1])) if side == "src" else (ids([1]), ids([block]))
    size = STORAGES[kind]
    with pytest.raises(RuntimeError) as info:
        call(how, src, dst, sid, did)
    message = str(info.value)
    assert f"{name}[0] = {block}: block {block} of {side}_caches[1] needs bytes " in message
    assert f"{block * BLOCK_BYTES}..{(block + 1) * BLOCK_BYTES - 1} of its storage" in message
    assert f"out of bounds for storage of size {size}" in message
    assert "resized or freed" in message
    assert "overlap" not in message
    assert torch.equal(dst[0], before)  # the intact pair copied nothing either


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("offset", [0, 3])
def test_last_block_within_the_storage_copies_and_the_next_is_refused(side, offset):
    # 64 whole blocks and part of a 65th from the view's first byte.
    base_src, base_dst = cache(2048 + offset, 5.0), cache(2048 + offset)
    src, dst = base_src[offset:], base_dst[offset:]
    shrunk = base_src if side == "src" else base_dst
    shrink(shrunk, (offset + 64) * BLOCK_BYTES + BLOCK_BYTES - 4)
    last, first_out = 63, 64
    pick = (lambda b: (ids([b]), ids([0]))) if side == "src" else (lambda b: (ids([0]), ids([b])))
    torch_kvswap.swap_blocks([src], [dst], *pick(last))
    got = dst[0] if side == "src" else dst[last]
    assert torch.equal(got, torch.full((BLOCK,), 5.0))
    before = (
        base_dst.untyped_storage().nbytes(),
        dst[: min(dst.untyped_storage().nbytes() // BLOCK_BYTES, 8)].clone(),
    )
    with pytest.raises(RuntimeError, match=rf"block {first_out} of {side}_caches\[0\].* out of bounds"):
        torch_kvswap.swap_blocks([src], [dst], *pick(first_out))
    assert torch.equal(dst[: before[1].shape[0]], before[1])


@pytest.mark.parametrize("side", ["src", "dst"])
def test_storage_grown_and_moved_is_copied_in_its_new_memory(side):
    src, dst = cache(16), cache(16)
    src.copy_(torch.arange(16.0).repeat_interleave(BLOCK).view(16, BLOCK))
    grown = src if side == "src" else dst
    old_ptr = grown.data_ptr()
    grown.untyped_storage().resize_(1 << 24)  # torch reallocates and keeps the bytes
    if grown.data_ptr() == old_ptr:  # pragma: no cover - the allocator grew it in place
        pytest.skip("the storage did not move")
    torch_kvswap.swap_blocks([src], [dst], ids([3, 15]), ids([0, 9]))
    assert torch.equal(dst[0], src[3]) and torch.equal(dst[9], src[15])
    assert dst[0, 0].item() == 3.0 and dst[9, 0].item() == 15.0


def test_stride_zero_cache_needs_its_one_block_in_storage():
    one = cache(1, 7.0)
    src = one.expand(32, BLOCK)  # every block is the same bytes
    dst = cache(32)
    torch_kvswap.swap_blocks([src], [dst], ids([31]), ids([2]))
    assert torch.equal(dst[2], torch.full((BLOCK,), 7.0))
    shrink(one, BLOCK_BYTES - 4)
    with pytest.raises(RuntimeError, match=r"block 0 of src_caches\[0\] needs bytes 0\.\.1023"):
        torch_kvswap.swap_blocks([src], [dst], ids([0]), ids([3]))


def test_zero_byte_blocks_need_no_storage():
    src, dst = torch.zeros(8, 4, 0), torch.zeros(8, 4, 0)
    shrink(src, 0)
    torch_kvswap.swap_blocks([src], [dst], ids([7]), ids([0]))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("side", ["src", "dst"])
def test_compiled_call_refuses_a_block_outside_its_storage(fresh_compile, backend, side):
    @torch.compile(backend=backend, fullgraph=True)
    def f(src, dst, sid, did):
        torch_kvswap.swap_blocks(src, dst, sid, did)

    src, dst = [cache(2048, 1.0)], [cache(2048)]
    f(src, dst, ids([5]), ids([7]))  # compiled before the storage shrinks
    assert torch.equal(dst[0][7], src[0][5])
    shrink(src[0] if side == "src" else dst[0], 64 * BLOCK_BYTES)
    before = dst[0][:64].clone()
    sid, did = (ids([1, 900]), ids([2, 3])) if side == "src" else (ids([1, 2]), ids([2, 900]))
    # aot_eager clones each destination before the op (torch's
    # auto_functionalized_v2): torch's clone refuses the shrunk one first.
    who = "setStorage: " if (side, backend) == ("dst", "aot_eager") else "block 900 of "
    with pytest.raises(RuntimeError, match=who + r".*out of bounds for storage of size 65536"):
        f(src, dst, sid, did)
    assert torch.equal(dst[0][:64], before)


def offloader_with_freed_device_cache() -> None:
    """Runs in a child process: a store and a load whose device cache storage
    was freed both finish as failed jobs, with the storage error as the reason."""
    caches = {f"layer.{i}": torch.randn(2, 64, 4, 2, 8) for i in range(2)}
    with torch_kvswap.KVCacheOffloader(
        caches, device_block_size=4, host_block_size=8, num_host_blocks=8
    ) as offloader:
        caches["layer.1"].untyped_storage().resize_(0)
        offloader.store(job_id=1, device_block_ids=[10, 11], host_block_ids=[0])
        offloader.wait({1})
        offloader.load(job_id=2, host_block_ids=[0], device_block_ids=[10, 11])
        offloader.wait({2})
        results = {r.job_id: r for r in offloader.get_finished()}
    for job in (1, 2):
        r = results[job]
        if r.success:
            raise AssertionError(f"job {job} succeeded with a freed device cache")
        if "out of bounds for storage of size 0" not in str(getattr(r, "error", "")):
            raise AssertionError(f"job {job}: no storage error in {r!r}")


def test_offloader_reports_a_freed_device_cache_as_a_failed_job():
    outcome = run_isolated(offloader_with_freed_device_cache)
    assert not outcome.crashed, outcome.message
    assert outcome.error_type is None, outcome.message


@pytest.mark.parametrize("id_place", ["host", "device"])
@pytest.mark.parametrize("method", ["auto", "dma"])
@pytest.mark.parametrize("size", [0, 4096])
def test_device_to_host_copy_refuses_a_block_outside_the_host_storage(fake_cuda, id_place, method, size):
    # The fake CUDA engine: its descriptor path, with host ids or device ids read back.
    F = fake_cuda
    torch_kvswap.set_copy_method(method)
    src = [F.device_copy(torch.ones(64, 256, dtype=torch.uint8), 0)]
    dst = [shrink(torch.zeros(64, 256, dtype=torch.uint8), size)]
    sid, did = ids([0]), ids([20])
    if id_place == "device":
        sid, did = F.device_copy(sid, 0), F.device_copy(did, 0)
    with pytest.raises(
        RuntimeError, match=rf"block 20 of dst_caches\[0\] needs bytes 5120\.\.5375 .* size {size}"
    ):
        torch_kvswap.swap_blocks(src, dst, sid, did)


# Every other tensor an op reads is checked against its storage too: block
# ids, the pointer op's descriptors, expand_block_ids' input. A shrunk one
# would be read past its storage's end (a freed one has no data at all).
BIG = 1 << 22  # int64 elements: 32 MiB, so a read past a 16-byte storage leaves the heap


def shrunk_ids(n: int = BIG) -> torch.Tensor:
    return shrink(torch.zeros(n, dtype=torch.int64), 16)


def ids_call(which: str, checked: bool) -> None:
    src, dst = [cache(8, 1.0)], [cache(8)]
    sid, did = torch.arange(BIG) % 8, torch.arange(BIG) % 8
    if which == "src_block_ids":
        sid = shrunk_ids()
    else:
        did = shrunk_ids()
    with torch_kvswap.checked() if checked else torch.no_grad():
        torch_kvswap.swap_blocks(src, dst, sid, did)


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("which", ["src_block_ids", "dst_block_ids"])
def test_block_ids_past_their_storage_are_refused(which, checked):
    with pytest.raises(
        RuntimeError, match=rf"{which} \(shape \[{BIG}\].*out of bounds for storage of size 16"
    ):
        ids_call(which, checked)
    with pytest.raises(RuntimeError, match=rf"{which} .*out of bounds for storage of size 16"):
        sid = shrunk_ids() if which == "src_block_ids" else torch.arange(BIG) % 8
        did = shrunk_ids() if which == "dst_block_ids" else torch.arange(BIG) % 8
        PLAN([cache(8, 1.0)], [cache(8)], sid, did)


@pytest.mark.parametrize("which", ["src_ptrs", "dst_ptrs", "sizes"])
def test_descriptors_past_their_storage_are_refused(which):
    args = {name: torch.zeros(BIG, dtype=torch.int64) for name in ("src_ptrs", "dst_ptrs", "sizes")}
    args[which] = shrunk_ids()
    with pytest.raises(RuntimeError, match=rf"{which} .*out of bounds for storage of size 16"):
        torch_kvswap.swap_blocks_batch(args["src_ptrs"], args["dst_ptrs"], args["sizes"], 0)


def test_expand_block_ids_input_past_its_storage_is_refused():
    with pytest.raises(RuntimeError, match=r"block_ids .*out of bounds for storage of size 16"):
        torch.ops.kvswap.expand_block_ids(shrunk_ids(), 2)


def test_ids_within_a_shrunk_storage_still_work():
    # The bound is the elements the view spans, not the storage's first size.
    ids_ = torch.arange(64, dtype=torch.int64) % 8
    view, one_more = ids_[:16], ids_[:17]
    shrink(ids_, 16 * 8)
    expected = [b * 2 + k for b in range(8) for k in (0, 1)] * 2
    assert torch.ops.kvswap.expand_block_ids(view, 2).tolist() == expected
    with pytest.raises(RuntimeError, match=r"block_ids \(shape \[17\].*needs bytes 0\.\.135"):
        torch.ops.kvswap.expand_block_ids(one_more, 2)
