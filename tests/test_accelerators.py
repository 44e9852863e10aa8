"""The ops on a real accelerator: CUDA GPUs and Ascend NPUs.

Every test skips with the reason when its device (or its kvswap engine) is
missing, and runs as it is where one is present: ``bash scripts/test.sh -k
accelerators`` on a GPU or NPU machine. ``scripts/gpu_check.sh`` runs the CUDA
half and a benchmark in one go.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import torch_kvswap
from conftest import accelerator_or_skip
from reference import swap_blocks_ref

KINDS = ["cuda", "npu"]
BLOCK_BYTES = [2048, 16384, 262144]
DTYPES = [torch.bfloat16, torch.float16, torch.int8]


def graph_api(kind: str):
    return torch.cuda.CUDAGraph if kind == "cuda" else torch.npu.NPUGraph


def graph_context(kind: str, graph):
    return torch.cuda.graph(graph) if kind == "cuda" else torch.npu.graph(graph)


def caches(block_bytes: int, dtype, num_blocks: int, where, pairs: int = 2, seed: int = 0):
    elems = block_bytes // dtype.itemsize
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(pairs):
        t = torch.randint(-100, 100, (num_blocks, elems), generator=g).to(dtype)
        if where == "host":
            out.append(t.pin_memory())
        else:
            out.append(t.to(where))
    return out


def synced(device):
    torch.accelerator.synchronize()
    return device


@contextlib.contextmanager
def using_copy_method(method: str):
    torch_kvswap.set_copy_method(method)
    try:
        yield method
    finally:
        torch_kvswap.set_copy_method("auto")


@pytest.fixture(params=["auto", "dma", "kernel"])
def copy_method(request):
    if request.param == "kernel" and "cuda" not in torch.ops.kvswap._engines():
        pytest.skip("copy method 'kernel' needs the CUDA engine, which has the only copy kernel")
    with using_copy_method(request.param):
        yield request.param


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("block_bytes", BLOCK_BYTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_matches_the_cpu_reference(kind, direction, block_bytes, dtype, copy_method):
    device = accelerator_or_skip(kind)
    if copy_method == "kernel" and kind != "cuda":
        pytest.skip("only the CUDA engine has a kernel path")
    src_where = "host" if direction == "h2d" else device
    dst_where = "host" if direction == "d2h" else device
    src = caches(block_bytes, dtype, 12, src_where, seed=1)
    dst = caches(block_bytes, dtype, 9, dst_where, seed=2)
    sid, did = torch.tensor([11, 0, 5, 6, 7]), torch.tensor([8, 2, 3, 4, 0])
    expected = swap_blocks_ref(src, dst, sid, did)
    torch_kvswap.swap_blocks(src, dst, sid, did)
    synced(device)
    for got, want in zip(dst, expected):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("direction", list(torch_kvswap.Direction))
def test_pointer_op_on_the_current_stream(kind, direction):
    device = accelerator_or_skip(kind)
    src_where = "host" if direction == torch_kvswap.Direction.HOST_TO_DEVICE else device
    dst_where = "host" if direction == torch_kvswap.Direction.DEVICE_TO_HOST else device
    (src,) = caches(4096, torch.uint8, 8, src_where, pairs=1, seed=3)
    (dst,) = caches(4096, torch.uint8, 8, dst_where, pairs=1, seed=4)
    want = dst.cpu().clone()
    want[[6, 1]] = src.cpu()[[2, 3]]
    sp = torch.tensor([src.data_ptr() + 2 * 4096, src.data_ptr() + 3 * 4096])
    dp = torch.tensor([dst.data_ptr() + 6 * 4096, dst.data_ptr() + 1 * 4096])
    stream = torch.Stream(device=device)
    with stream:
        torch_kvswap.swap_blocks_batch(sp, dp, torch.tensor([4096, 4096]), direction)
    stream.synchronize()
    assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("kind", KINDS)
def test_opcheck_on_device(kind):
    device = accelerator_or_skip(kind)
    src = caches(2048, torch.bfloat16, 6, device, seed=5)
    dst = caches(2048, torch.bfloat16, 6, "host", seed=6)
    results = torch.library.opcheck(
        torch.ops.kvswap.swap_blocks.default, (src, dst, torch.tensor([0, 5]), torch.tensor([1, 2]))
    )
    assert set(results.values()) == {"SUCCESS"}, results
    results = torch.library.opcheck(
        torch.ops.kvswap.expand_block_ids.default, (torch.tensor([1, 4], device=device), 4, 1)
    )
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_store_sees_device_writes(kind, fresh_compile):
    device = accelerator_or_skip(kind)
    dev = caches(4096, torch.float16, 8, device, pairs=1, seed=7)
    host = caches(4096, torch.float16, 8, "host", pairs=1, seed=8)

    @torch.compile(fullgraph=True)
    def step(d, h, ids):
        d[0].mul_(3)
        torch_kvswap.swap_blocks(d, h, ids, ids)

    want = dev[0].cpu() * 3
    step(dev, host, torch.tensor([1, 4]))
    synced(device)
    assert torch.equal(host[0][[1, 4]], want[[1, 4]])


@pytest.mark.parametrize("kind", KINDS)
def test_graph_replay_repeats_the_captured_dma_copies(kind):
    """DMA path under capture: a replay copies the blocks captured, whatever the ids hold later."""
    device = accelerator_or_skip(kind)
    with using_copy_method("dma"):
        dev = caches(4096, torch.float32, 8, device, pairs=1, seed=9)
        host = caches(4096, torch.float32, 8, "host", pairs=1, seed=10)
        sid, did = torch.tensor([3]), torch.tensor([5])
        graph = graph_api(kind)()
        torch.accelerator.synchronize()
        with graph_context(kind, graph):
            torch_kvswap.swap_blocks(dev, host, sid, did)
        dev[0][3].fill_(42.0)
        sid[0] = 1  # a host-side change after capture does not reach the graph
        graph.replay()
        synced(device)
        assert bool((host[0][5] == 42.0).all())


def test_cuda_graph_replay_reads_ids_from_device_memory_on_the_kernel_path():
    device = accelerator_or_skip("cuda")
    with using_copy_method("kernel"):
        dev = caches(2048, torch.float32, 16, device, pairs=2, seed=11)
        host = caches(2048, torch.float32, 16, "host", pairs=2, seed=12)
        sid = torch.tensor([0, 1], device=device)
        did = torch.tensor([0, 1], device=device)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            torch_kvswap.swap_blocks(dev, host, sid, did)
        sid.copy_(torch.tensor([7, 9]))
        did.copy_(torch.tensor([12, 3]))
        graph.replay()
        torch.cuda.synchronize()
        for d, h in zip(dev, host):
            assert torch.equal(h[12], d[7].cpu()) and torch.equal(h[3], d[9].cpu())


def test_cuda_kernel_path_skips_device_ids_out_of_range():
    device = accelerator_or_skip("cuda")
    with using_copy_method("kernel"):
        dev = caches(2048, torch.float32, 4, device, pairs=1, seed=13)
        host = caches(2048, torch.float32, 4, "host", pairs=1, seed=14)
        before = host[0].clone()
        torch_kvswap.swap_blocks(
            dev, host, torch.tensor([0, 9], device=device), torch.tensor([4, 1], device=device)
        )
        torch.cuda.synchronize()
        assert torch.equal(host[0], before)  # both ids out of range for one side


def test_cuda_kernel_path_rejects_pageable_host_caches():
    device = accelerator_or_skip("cuda")
    with using_copy_method("kernel"):
        dev = caches(2048, torch.float32, 4, device, pairs=1)
        pageable = [torch.zeros(4, 512)]
        with pytest.raises(ValueError, match="pinned host memory"):
            torch_kvswap.swap_blocks(dev, pageable, torch.tensor([0]), torch.tensor([1]))


@pytest.mark.parametrize("pairs", [1, 16])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_cuda_kernel_path_with_4096_host_ids(pairs, direction):
    """Host ids ride in the kernel's parameters: 4,096 of them take 2 launches of 32 KiB
    parameters on CUDA 12.1+ and sm_70+ (9 of 4 KiB otherwise); every block must land."""
    device = accelerator_or_skip("cuda")
    with using_copy_method("kernel"):
        dev = caches(256, torch.uint8, 4096, device, pairs=pairs, seed=17)
        host = caches(256, torch.uint8, 4096, "host", pairs=pairs, seed=18)
        g = torch.Generator().manual_seed(19)
        sid, did = torch.randperm(4096, generator=g), torch.randperm(4096, generator=g)
        src, dst = (host, dev) if direction == "h2d" else (dev, host)
        want = [d.cpu().index_copy(0, did, s.cpu()[sid]) for s, d in zip(src, dst)]
        torch_kvswap.swap_blocks(src, dst, sid, did)
        torch.cuda.synchronize()
        assert all(torch.equal(d.cpu(), w) for d, w in zip(dst, want))


def test_cuda_pinned_host_cache_freed_after_the_call_is_not_reused_mid_copy():
    """The copy's stream is recorded with torch's pinned allocator: a transient pinned
    tensor freed right after the call is not handed out again before the copy ran."""
    device = accelerator_or_skip("cuda")
    with using_copy_method("dma"):
        (dev,) = caches(1 << 20, torch.uint8, 64, device, pairs=1, seed=20)
        data = torch.randint(0, 255, (64, 1 << 20), dtype=torch.uint8)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # keep the stream busy: the copy is queued behind it
            host = data.pin_memory()
            torch_kvswap.swap_blocks([host], [dev], torch.arange(64), torch.arange(64))
            del host
            reuse = torch.empty_like(data).pin_memory()
            reuse.fill_(7)
        stream.synchronize()
        assert torch.equal(dev.cpu(), data)


def npu_pins_in_place(device) -> bool:
    """Whether this CANN can page-lock memory in place (aclrtHostRegisterV2)."""
    raw = torch.empty(2 * 4096, dtype=torch.uint8)
    probe = raw[(-raw.data_ptr()) % 4096 :][:4096]
    try:
        torch.ops.kvswap._host_register(probe, device, True)
    except NotImplementedError:
        return False
    torch.ops.kvswap._host_register(probe, device, False)
    return True


@pytest.mark.parametrize("kind", KINDS)
def test_offloader_pins_host_mirrors_in_place(kind):
    device = accelerator_or_skip(kind)
    if kind == "npu" and not npu_pins_in_place(device):
        pytest.skip("this CANN has no aclrtHostRegisterV2: the offloader refuses unpinnable mirrors")
    kv = {f"l{i}": torch.zeros(2, 64, 16, 8, 64, dtype=torch.bfloat16, device=device) for i in range(4)}
    off = torch_kvswap.KVCacheOffloader(kv, 16, 32, num_host_blocks=40)
    try:
        off.host_memory.wait()
        assert off.pinned and off.host_memory.registered == [(0, off.host_bytes)]
        assert off.host_bytes < off.host_bytes_needed + 4096 * len(off.device_tensors)
    finally:
        off.shutdown()


def test_npu_tensor_op_refuses_pageable_host_caches():
    device = accelerator_or_skip("npu")
    dev = caches(2048, torch.float32, 4, device, pairs=1)
    with pytest.raises(ValueError, match=r"dst_caches\[0\] is in pageable host memory"):
        torch_kvswap.swap_blocks(dev, [torch.zeros(4, 512)], torch.tensor([0]), torch.tensor([1]))


def test_npu_batches_over_4096_descriptors_land():
    """More descriptors than one aclrtMemcpyBatchAsync takes: the engine splits."""
    device = accelerator_or_skip("npu")
    (src,) = caches(64, torch.uint8, 10000, "host", pairs=1, seed=15)
    (dst,) = caches(64, torch.uint8, 10000, device, pairs=1, seed=16)
    ids = torch.arange(0, 10000, 2)  # 5000 blocks no merge can join
    torch_kvswap.swap_blocks([src], [dst], ids, ids)
    synced(device)
    assert torch.equal(dst.cpu()[ids], src[ids])


@pytest.mark.parametrize("method", ["auto", "dma", "kernel"])
@pytest.mark.parametrize("id_place", ["host", "device"])
@pytest.mark.parametrize("block_bytes", [2048, 65536])
def test_cuda_capture_on_every_path(method, id_place, block_bytes):
    """Host ids: a replay copies the blocks of capture time; device ids: the blocks named at replay.
    `dma` with device ids is refused under capture (it would read them back)."""
    device = accelerator_or_skip("cuda")
    with using_copy_method(method):
        dev = caches(block_bytes, torch.uint8, 8, device, pairs=2, seed=15)
        host = caches(block_bytes, torch.uint8, 8, "host", pairs=2, seed=16)
        where = device if id_place == "device" else "cpu"
        sid, did = torch.tensor([2, 3], device=where), torch.tensor([0, 1], device=where)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        if method == "dma" and id_place == "device":
            with pytest.raises(ValueError, match="illegal while the stream"):
                with torch.cuda.graph(graph):
                    torch_kvswap.swap_blocks(dev, host, sid, did)
            return
        with torch.cuda.graph(graph):
            torch_kvswap.swap_blocks(dev, host, sid, did)
        sid.copy_(torch.tensor([6, 7]))
        did.copy_(torch.tensor([4, 5]))
        graph.replay()
        torch.cuda.synchronize()
        want_s, want_d = ([2, 3], [0, 1]) if id_place == "host" else ([6, 7], [4, 5])
        for d, h in zip(dev, host):
            assert torch.equal(h[want_d], d.cpu()[want_s])


def test_gpu_check_budgets_fit_two_shots_in_one_lease():
    """scripts/gpu_check.sh runs on a GPU machine lent for 15 minutes in all, start-ups
    included: one run takes at most 270 s, build included, so that a second shot
    (--only the failed steps) fits after a fix. Its step budgets must sum within that
    total, so that no step's budget is cut by the ones before it; the bench and the
    report keep their slots."""
    import json
    import pathlib
    import subprocess

    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    out = subprocess.run(
        ["bash", str(script), "--budgets"],
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    budgets = json.loads(out.stdout)
    steps = budgets["steps"]
    assert list(steps) == ["preflight", "build", "tests", "probe", "bench", "memcheck", "racecheck", "report"]
    assert sum(steps.values()) <= budgets["total"] <= 270, budgets
    assert budgets["guarded"] == ["bench", "report"] and steps["bench"] >= 30 and steps["report"] >= 5
