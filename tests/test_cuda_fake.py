"""The CUDA engine's host logic against the fake CUDA runtime (CPU CI).

``torch_kvswap._fake_cuda`` compiles csrc/cuda/cuda_engine.cpp, the same source
as ``_C_cuda``, against the fake runtime of tests/fake_cuda/ (streams are
queues that run at a sync or an event query; capture records, instantiates
and replays; illegal calls fail and invalidate the capture as CUDA does). The
fixture installs it in the core for CUDA devices for one test and removes it after.
"CUDA" tensors are fake device memory; their bytes are read with
``host_view`` (stale until the stream that writes them has run).

Reached here: the public tensor op ``swap_blocks`` (core routing included),
``_host_register``, and the engine's entries as the core calls them, through
the test extension's ``kvswap_test`` ops: ``submit`` (the pointer op's engine
call: the pointer op itself picks its device from torch's current
accelerator, which a CPU build of torch does not have), ``copy_blocks``,
``stream_capturing``, ``host_mapped``. Not reached: KVCacheOffloader (its
streams and events are torch's CUDA objects); docs/cuda.md.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import torch_kvswap
from helpers import ids

try:
    import torch_kvswap._fake_cuda
except ImportError as exc:  # pragma: no cover - built by scripts/env.sh
    pytest.skip(
        f"torch_kvswap._fake_cuda is not built ({exc}); run bash scripts/test.sh", allow_module_level=True
    )

F = torch.ops.kvswap_fake_cuda
GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2  # cudaStreamCaptureMode


@pytest.fixture
def fake():
    F.install()
    F.reset(2)
    try:
        yield F
    finally:
        torch_kvswap.set_copy_method("auto")
        F.uninstall()


def warned(capfd, recwarn) -> str:
    """What the engine warned since the last call: TORCH_WARN reaches stderr,
    or becomes a Python warning, depending on the torch release."""
    text = capfd.readouterr().err + "".join(f"{w.message}\n" for w in recwarn)
    recwarn.clear()
    return text


def side_stream(device: int = 0) -> int:
    s = F.create_stream(device, False)
    F.set_stream(device, s)
    return s


def caches(block_bytes, blocks, where, pairs=2, seed=0, dtype=torch.uint8, device=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(pairs):
        t = torch.randint(0, 255, (blocks, block_bytes // dtype.itemsize), generator=g).to(dtype)
        if where == "device":
            out.append(F.device_copy(t, device))
        elif where == "pinned":
            out.append(F.pinned_copy(t))
        else:
            out.append(t)
    return out


def host_bytes(t):
    return F.host_view(t).clone() if t.device.type == "cuda" else t.clone()


def expected(src, dst, sid, did):
    out = [host_bytes(d) for d in dst]
    for s, o in zip(src, out):
        o[did] = host_bytes(s)[sid]
    return out


def placed_ids(values, where, device=0):
    """Block ids on the host, or (where == "device") in the fake device's memory."""
    t = ids(values)
    return F.device_copy(t, device) if where == "device" else t


def set_ids(t, values):
    """New values for an id tensor, in place (device ids: written to device memory)."""
    view = F.host_view(t) if t.device.type == "cuda" else t
    view.copy_(torch.tensor(values, dtype=torch.int64))


@contextlib.contextmanager
def captured(stream, mode=GLOBAL):
    """Captures on `stream`; yields a holder whose .graph is the instantiated graph."""

    class Holder:
        graph = None

    holder = Holder()
    assert F.begin_capture(stream, mode) == "cudaSuccess"
    try:
        yield holder
    finally:
        err, graph = F.end_capture(stream)
        holder.error = err
        if err == "cudaSuccess":
            holder.graph = F.instantiate(graph)


def no_sync_calls():
    log = F.call_log()
    return not [line for line in log if line.startswith(("cudaStreamSynchronize", "cudaMemcpy "))]


DIRECTIONS = {"h2d": ("pinned", "device"), "d2h": ("device", "pinned"), "d2d": ("device", "device")}


@pytest.mark.parametrize("method", ["auto", "dma", "kernel"])
@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("id_place", ["host", "device"])
@pytest.mark.parametrize("block_bytes", [2048, 65536])
def test_copies_land_on_the_stream_without_syncing(fake, method, direction, id_place, block_bytes):
    stream = side_stream()
    src_where, dst_where = DIRECTIONS[direction]
    src = caches(block_bytes, 6, src_where, seed=1)
    dst = caches(block_bytes, 5, dst_where, seed=2)
    sid, did = [5, 0, 1], [1, 4, 2]
    want = expected(src, dst, sid, did)
    before = [host_bytes(d) for d in dst]
    torch_kvswap.set_copy_method(method)
    sid_t, did_t = placed_ids(sid, id_place), placed_ids(did, id_place)  # alive until the kernel has run
    torch_kvswap.swap_blocks(src, dst, sid_t, did_t)
    # Nothing has run yet: the copies wait on the stream.
    assert all(torch.equal(host_bytes(d), b) for d, b in zip(dst, before))
    reads_ids_back = id_place == "device" and (method == "dma" or (method == "auto" and block_bytes >= 32768))
    assert no_sync_calls() or reads_ids_back
    assert F.synchronize(stream) == "cudaSuccess", (F.violations(), F.call_log())
    assert all(torch.equal(host_bytes(d), w) for d, w in zip(dst, want))
    assert F.violations() == []
    kernel = method == "kernel" or (method == "auto" and block_bytes < 32768)
    assert bool(F.launches()) == kernel
    assert F.last_error(True) == "cudaSuccess"


@pytest.mark.parametrize("method", ["auto", "dma", "kernel"])
@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("id_place", ["host", "device"])
@pytest.mark.parametrize("block_bytes", [2048, 65536])
def test_capture_and_replay(fake, method, direction, id_place, block_bytes):
    """Host ids: a replay copies the blocks of capture time. Device ids: the blocks the ids name at replay."""
    stream = side_stream()
    src_where, dst_where = DIRECTIONS[direction]
    src = caches(block_bytes, 6, src_where, seed=3)
    dst = caches(block_bytes, 5, dst_where, seed=4)
    sid_t, did_t = placed_ids([2, 3], id_place), placed_ids([0, 1], id_place)
    torch_kvswap.set_copy_method(method)
    if method == "dma" and id_place == "device":
        with captured(stream) as cap:
            with pytest.raises(ValueError, match="illegal while the stream"):
                torch_kvswap.swap_blocks(src, dst, sid_t, did_t)
        assert cap.error == "cudaSuccess"  # refused before any illegal call
        return
    with captured(stream) as cap:
        assert torch.ops.kvswap_test.stream_capturing("cuda", torch.device("cuda", 0))
        torch_kvswap.swap_blocks(src, dst, sid_t, did_t)
    assert cap.error == "cudaSuccess", cap.error
    assert not torch.ops.kvswap_test.stream_capturing("cuda", torch.device("cuda", 0))
    set_ids(sid_t, [4, 5])
    set_ids(did_t, [3, 2])
    replay_sid, replay_did = ([2, 3], [0, 1]) if id_place == "host" else ([4, 5], [3, 2])
    want = expected(src, dst, replay_sid, replay_did)
    assert F.launch_graph(cap.graph, stream) == "cudaSuccess"
    assert F.synchronize(stream) == "cudaSuccess"
    assert all(torch.equal(host_bytes(d), w) for d, w in zip(dst, want))
    # A second replay after another change of the ids.
    set_ids(sid_t, [0, 1])
    want = expected(src, dst, [2, 3] if id_place == "host" else [0, 1], replay_did)
    assert F.launch_graph(cap.graph, stream) == "cudaSuccess"
    assert F.synchronize(stream) == "cudaSuccess"
    assert all(torch.equal(host_bytes(d), w) for d, w in zip(dst, want))
    assert F.violations() == []


def test_capture_refuses_pageable_host_caches_before_any_illegal_call(fake):
    stream = side_stream()
    src = caches(4096, 4, "device", pairs=1)
    dst = caches(4096, 4, "pageable", pairs=1)
    with captured(stream) as cap:
        with pytest.raises(ValueError, match="pageable"):
            torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
    assert cap.error == "cudaSuccess"


def test_pageable_host_caches_take_the_dma_path_outside_capture(fake):
    stream = side_stream()
    src = caches(2048, 4, "device", pairs=1, seed=5)
    dst = caches(2048, 4, "pageable", pairs=1, seed=6)
    want = expected(src, dst, [3], [0])
    torch_kvswap.swap_blocks(src, dst, torch.tensor([3]), torch.tensor([0]))
    assert F.launches() == []
    F.synchronize(stream)
    assert torch.equal(dst[0], want[0])
    torch_kvswap.set_copy_method("kernel")
    with pytest.raises(ValueError, match="pinned host memory"):
        torch_kvswap.swap_blocks(src, dst, torch.tensor([3]), torch.tensor([0]))


@pytest.mark.parametrize("direction", [0, 1, 2])
@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("legacy", [False, True])
def test_pointer_op_engine_call(fake, direction, capture, legacy):
    """The engine's submit as the pointer op calls it: batch on a side stream, per descriptor on the
    legacy stream and under capture; a replay repeats the captured addresses."""
    stream = 0 if legacy else side_stream()
    src_where, dst_where = list(DIRECTIONS.values())[direction]
    (src,) = caches(4096, 8, src_where, pairs=1, seed=7)
    (dst,) = caches(4096, 8, dst_where, pairs=1, seed=8)
    want = host_bytes(dst)
    want[[6, 1]] = host_bytes(src)[[2, 3]]
    sp = torch.tensor([src.data_ptr() + 2 * 4096, src.data_ptr() + 3 * 4096])
    dp = torch.tensor([dst.data_ptr() + 6 * 4096, dst.data_ptr() + 1 * 4096])
    sizes = torch.tensor([4096, 4096])

    def submit():
        torch.ops.kvswap_test.submit("cuda", sp, dp, sizes, direction, 8192, torch.device("cuda", 0))

    if capture and legacy:
        return  # the legacy stream cannot capture
    if capture:
        with captured(stream) as cap:
            submit()
        assert cap.error == "cudaSuccess"
        sp.fill_(0)  # the graph holds the addresses of capture time
        F.launch_graph(cap.graph, stream)
    else:
        submit()
    assert F.synchronize(stream) == "cudaSuccess"
    assert torch.equal(host_bytes(dst), want)
    batched = F.count_calls("cudaMemcpyBatchAsync")
    assert batched == (0 if legacy or capture else 1)
    assert F.count_calls("cudaMemcpyAsync") == (0 if batched else 2)
    assert F.violations() == []


def test_pointer_op_on_pageable_memory_under_capture_is_the_runtimes_error(fake):
    stream = side_stream()
    (src,) = caches(4096, 2, "device", pairs=1)
    dst = torch.zeros(4096, dtype=torch.uint8)
    with captured(stream) as cap:
        with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnsupported"):
            torch.ops.kvswap_test.submit(
                "cuda",
                torch.tensor([src.data_ptr()]),
                torch.tensor([dst.data_ptr()]),
                torch.tensor([4096]),
                1,
                4096,
                torch.device("cuda", 0),
            )
        assert F.last_error(True) == "cudaSuccess"  # cleared by the engine
    assert cap.error == "cudaErrorStreamCaptureInvalidated"


def test_batch_arrays_are_held_until_the_copies_ran(fake):
    stream = side_stream()
    src = caches(4096, 8, "pinned", pairs=1, seed=9)
    dst = caches(4096, 8, "device", pairs=1, seed=10)
    F.set_fault("stalled", 1)
    for k in range(4):  # the pool would hand the same table back if it were released
        torch_kvswap.set_copy_method("dma")
        torch_kvswap.swap_blocks(src, dst, torch.tensor([k]), torch.tensor([7 - k]))
    assert F.in_flight(0) == 4
    F.set_fault("stalled", 0)
    assert F.synchronize(stream) == "cudaSuccess"
    assert F.in_flight(0) == 0
    assert F.violations() == []
    got = host_bytes(dst[0])
    for k in range(4):
        assert torch.equal(got[7 - k], src[0][k])


def test_batch_arrays_are_not_read_after_the_call(fake):
    """The other lifetime model: the runtime consumes the arrays during the call and the
    caller's copies are garbage afterwards (the fake overwrites them)."""
    stream = side_stream()
    src = caches(4096, 8, "device", pairs=2, seed=29)
    dst = caches(4096, 8, "pinned", pairs=2, seed=30)
    F.set_fault("scribble_arrays", 1)
    torch_kvswap.set_copy_method("dma")
    want = expected(src, dst, [1, 6, 3], [0, 2, 7])
    torch_kvswap.swap_blocks(src, dst, torch.tensor([1, 6, 3]), torch.tensor([0, 2, 7]))
    torch_kvswap.swap_blocks(src, dst, torch.tensor([2]), torch.tensor([5]))
    want = [w.index_copy(0, torch.tensor([5]), host_bytes(s)[[2]]) for w, s in zip(want, src)]
    assert F.synchronize(stream) == "cudaSuccess"
    assert all(torch.equal(d, w) for d, w in zip(dst, want))
    assert F.count_calls("cudaMemcpyBatchAsync") == 2


# --- review findings: one test each --------------------------------------------------


def test_finding_1_failed_calls_do_not_leave_the_last_error(fake):
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    F.set_fault("host_register_error", 2)  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cudaErrorMemoryAllocation"):
        torch.ops.kvswap._host_register(buffer, torch.device("cuda", 0), True)
    assert F.last_error(True) == "cudaSuccess"
    # cudaErrorNotReady from polling in-flight batches is recorded as the last error too.
    side_stream()
    src = caches(4096, 4, "pinned", pairs=1)
    dst = caches(4096, 4, "device", pairs=1)
    F.set_fault("stalled", 1)
    torch_kvswap.set_copy_method("dma")
    torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
    torch_kvswap.swap_blocks(src, dst, torch.tensor([1]), torch.tensor([2]))  # polls the first
    assert any(line.startswith("cudaEventQuery") and "NotReady" in line for line in F.call_log())
    assert F.last_error(True) == "cudaSuccess"


@pytest.mark.parametrize("answer", [801, 35, 36])  # not supported, insufficient driver, newer driver
def test_finding_2_an_unsupported_batch_api_latches_per_descriptor_copies(fake, answer, capfd, recwarn):
    stream0 = side_stream(0)
    stream1 = side_stream(1)
    src = caches(4096, 4, "pinned", pairs=1, seed=11)
    dst = caches(4096, 4, "device", pairs=1, seed=12)
    want = expected(src, dst, [0, 3], [2, 1])
    F.set_fault("batch_error", answer)
    torch_kvswap.set_copy_method("dma")
    warned(capfd, recwarn)
    torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 3]), torch.tensor([2, 1]))
    F.synchronize(stream0)
    assert torch.equal(host_bytes(dst[0]), want[0])
    assert not F.batch_enabled(0) and F.batch_enabled(1)
    torch_kvswap.swap_blocks(src, dst, torch.tensor([1]), torch.tensor([0]))
    assert F.count_calls("cudaMemcpyBatchAsync") == 1
    assert F.count_calls("cudaMemcpyAsync") == 3
    # Logged once per device.
    assert warned(capfd, recwarn).count("copying one descriptor at a time on that device") == 1
    F.synchronize(stream1)


@pytest.mark.parametrize(
    "fault,value",
    [
        ("driver_version", 12040),
        ("runtime_version", 12060),
        ("batch_absent", 1),
        ("fail:cudaDriverGetVersion", 3),
    ],
)
def test_finding_2_the_batch_api_is_resolved_at_run_time(fake, fault, value, capfd, recwarn):
    stream = side_stream()
    F.set_fault(fault, value)
    F.rebind()
    src = caches(4096, 4, "pinned", pairs=1, seed=13)
    dst = caches(4096, 4, "device", pairs=1, seed=14)
    want = expected(src, dst, [0, 3], [2, 1])
    torch_kvswap.set_copy_method("dma")
    warned(capfd, recwarn)
    torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 3]), torch.tensor([2, 1]))
    assert ("needs CUDA 12.8" in warned(capfd, recwarn)) == (fault != "batch_absent")
    assert F.count_calls("cudaMemcpyBatchAsync") == 0
    assert F.count_calls("cudaMemcpyAsync") == 2
    F.synchronize(stream)
    assert torch.equal(host_bytes(dst[0]), want[0])
    assert F.last_error(True) == "cudaSuccess"


def test_finding_3_one_attrs_entry_with_index_zero(fake):
    stream = side_stream()
    src = caches(4096, 16, "device", pairs=3, seed=15)
    dst = caches(4096, 16, "pinned", pairs=3, seed=16)
    torch_kvswap.set_copy_method("dma")
    for _ in range(2):  # the fake overwrites attrs after each call: they are rebuilt per call
        torch_kvswap.swap_blocks(src, dst, torch.tensor([1, 5, 9, 3]), torch.tensor([0, 2, 4, 6]))
    count, num_attrs, first_index, order = F.batches()[:4]
    assert (count, num_attrs, first_index, order) == (12, 1, 0, 1)  # 1 = cudaMemcpySrcAccessOrderStream
    assert F.synchronize(stream) == "cudaSuccess"


def test_finding_4_polling_in_flight_batches_leaves_another_threads_capture_valid(fake):
    stream = side_stream()
    other = F.create_stream(0, False)
    src = caches(4096, 4, "pinned", pairs=1)
    dst = caches(4096, 4, "device", pairs=1)
    torch_kvswap.set_copy_method("dma")
    started, copied, result = threading.Event(), threading.Event(), {}

    def capture_elsewhere():
        result["begin"] = F.begin_capture(other, GLOBAL)
        started.set()
        copied.wait(30)
        result["end"] = F.end_capture(other)[0]

    thread = threading.Thread(target=capture_elsewhere)
    thread.start()
    started.wait(30)
    try:
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
        torch_kvswap.swap_blocks(src, dst, torch.tensor([1]), torch.tensor([2]))  # polls the first
    finally:
        copied.set()
        thread.join()
    assert result == {"begin": "cudaSuccess", "end": "cudaSuccess"}
    assert F.synchronize(stream) == "cudaSuccess"


def test_finding_5_pointer_attributes_once_per_host_storage_with_the_device_current(fake):
    side_stream(1)
    assert F.current_device() == 0
    dev = caches(2048, 8, "device", pairs=4, device=1)
    mirror = F.pinned_copy(torch.zeros(4 * 8 * 2048, dtype=torch.uint8))
    host = [mirror[i * 8 * 2048 : (i + 1) * 8 * 2048].view(8, 2048) for i in range(4)]  # one storage
    torch_kvswap.set_copy_method("kernel")
    torch_kvswap.swap_blocks(dev, host, torch.tensor([1, 2]), torch.tensor([3, 4]))
    lines = [line for line in F.call_log() if line.startswith("cudaPointerGetAttributes")]
    assert len(lines) == 1, lines
    assert all("device=1" in line for line in lines), lines
    assert F.current_device() == 0  # restored


def test_finding_7_large_blocks_spread_over_many_thread_blocks(fake):
    stream = side_stream()
    src = caches(256 * 1024, 3, "device", pairs=1, seed=17)
    dst = caches(256 * 1024, 3, "pinned", pairs=1, seed=18)
    want = expected(src, dst, [2, 0], [0, 1])
    torch_kvswap.set_copy_method("kernel")
    torch_kvswap.swap_blocks(src, dst, torch.tensor([2, 0]), torch.tensor([0, 1]))
    grid_x, grid_y, n, slices = F.launches()[:4]
    assert (n, slices, grid_y) == (2, 16, 1)
    assert grid_x == 32  # 2 blocks x 16 slices of 16 KiB
    F.synchronize(stream)
    assert torch.equal(dst[0], want[0])


def test_finding_7_sizes_not_a_multiple_of_16_copy_in_16_byte_words(fake):
    stream = side_stream()
    bb = 2056  # 16 * 128 + 8
    src = caches(bb, 8, "device", pairs=1, seed=19)
    dst = caches(bb, 8, "pinned", pairs=1, seed=20)
    sid, did = [2, 4, 7], [0, 2, 5]  # source and destination 16-byte aligned alike
    want = expected(src, dst, sid, did)
    torch_kvswap.set_copy_method("kernel")
    torch_kvswap.swap_blocks(src, dst, torch.tensor(sid), torch.tensor(did))
    F.synchronize(stream)
    assert torch.equal(dst[0], want[0])
    widths = F.copy_widths()  # bytes by word width 1, 2, 4, 8, 16
    assert widths[4] >= 3 * 2048 and widths[0] < 3 * 32, widths


@pytest.mark.parametrize("sid,did", [([1, 2], [2, 1]), ([1, 3], [4, 2]), ([0, 5], [1, 4])])
@pytest.mark.parametrize("bb", [2050, 2052, 2056, 4096 + 3])
def test_kernel_copies_every_alignment_exactly(fake, sid, did, bb):
    stream = side_stream()
    src = caches(bb, 6, "device", pairs=2, seed=21)
    dst = caches(bb, 6, "pinned", pairs=2, seed=22)
    want = expected(src, dst, sid, did)
    torch_kvswap.set_copy_method("kernel")
    torch_kvswap.swap_blocks(src, dst, torch.tensor(sid), torch.tensor(did))
    F.synchronize(stream)
    assert all(torch.equal(d, w) for d, w in zip(dst, want))


# --- the capture findings of the issue -------------------------------------------------


def test_host_ids_on_the_kernel_path_under_capture_need_no_transfer(fake):
    """The old route moved host ids with ids.to(device): pageable and synchronizing."""
    stream = side_stream()
    src = caches(2048, 4, "pinned", seed=23)
    dst = caches(2048, 4, "device", seed=24)
    with captured(stream) as cap:
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 1]), torch.tensor([2, 3]))
    assert cap.error == "cudaSuccess"
    assert F.launches()[5:7] == [1, 1]  # ids inline in the parameters


def test_auto_routes_device_ids_under_capture_to_the_kernel(fake):
    """The old route refused device ids under capture for blocks of 32 KiB and more."""
    stream = side_stream()
    src = caches(65536, 4, "device", seed=25)
    dst = caches(65536, 4, "pinned", seed=26)
    sid, did = placed_ids([0, 1], "device"), placed_ids([2, 3], "device")
    with captured(stream) as cap:
        torch_kvswap.swap_blocks(src, dst, sid, did)
    assert cap.error == "cudaSuccess"
    assert len(F.launches()) == 7


@pytest.mark.parametrize("large,launches", [(False, 4), (True, 1)])
def test_many_pairs_and_ids_split_over_launches(fake, large, launches):
    """20 pairs, 500 host ids: in 4 KiB, 384 ids and 16 pairs per launch (2 x 2 launches);
    in 32 KiB all of them at once."""
    F.set_fault("large_params_absent", int(not large))
    F.rebind()
    stream = side_stream()
    src = caches(256, 600, "device", pairs=20, seed=27)
    dst = caches(256, 600, "pinned", pairs=20, seed=28)
    sid = torch.randperm(600)[:500]
    did = torch.randperm(600)[:500]
    want = expected(src, dst, sid, did)
    torch_kvswap.set_copy_method("kernel")
    torch_kvswap.swap_blocks(src, dst, sid, did)
    F.synchronize(stream)
    assert all(torch.equal(d, w) for d, w in zip(dst, want))
    assert len(F.launch_param_bytes()) == launches


def test_kernel_path_skips_device_ids_out_of_range(fake):
    stream = side_stream()
    src = caches(2048, 4, "device", pairs=1)
    dst = caches(2048, 4, "pinned", pairs=1)
    before = dst[0].clone()
    torch_kvswap.set_copy_method("kernel")
    sid, did = placed_ids([0, 9], "device"), placed_ids([4, 1], "device")
    torch_kvswap.swap_blocks(src, dst, sid, did)
    F.synchronize(stream)
    assert torch.equal(dst[0], before)


# --- errors: every failure names its call and leaves no last error ----------------------


@pytest.mark.parametrize(
    "api,method,match",
    [
        ("cudaMemcpyAsync", "dma", "descriptor 0"),
        ("cudaMemcpyBatchAsync", "dma", "cudaMemcpyBatchAsync failed"),
        ("cudaLaunchKernel", "kernel", "launching the block copy kernel"),
        ("cudaStreamIsCapturing", "dma", "cudaStreamIsCapturing|stream_is_capturing"),
        ("cudaEventRecord", "dma", "event_record"),
    ],
)
def test_runtime_failures_are_reported_and_cleared(fake, api, method, match):
    legacy = api == "cudaMemcpyAsync"
    if not legacy:
        side_stream()
    src = caches(4096, 4, "pinned", pairs=1)
    dst = caches(4096, 4, "device", pairs=1)
    F.set_fault("fail:" + api, 1)  # cudaErrorInvalidValue
    torch_kvswap.set_copy_method(method)
    with pytest.raises(RuntimeError, match=match):
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
    assert F.last_error(True) == "cudaSuccess"


def test_polling_failures_are_reported_and_cleared(fake):
    side_stream()
    src = caches(4096, 4, "pinned", pairs=1)
    dst = caches(4096, 4, "device", pairs=1)
    torch_kvswap.set_copy_method("dma")
    torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
    for api in ("cudaEventQuery", "cudaThreadExchangeStreamCaptureMode"):
        F.set_fault("fail:" + api, 1)
        with pytest.raises(RuntimeError, match="cudaEventQuery|thread_exchange_stream_capture_mode"):
            torch_kvswap.swap_blocks(src, dst, torch.tensor([1]), torch.tensor([2]))
        assert F.last_error(True) == "cudaSuccess"
        F.set_fault("fail:" + api, 0)


def test_event_creation_failure_is_reported(fake):
    stream = side_stream()
    src = caches(4096, 4, "pinned", pairs=1)
    dst = caches(4096, 4, "device", pairs=1)
    torch_kvswap.set_copy_method("dma")
    F.set_fault("stalled", 1)
    for _ in range(40):  # more batches in flight than the engine has spare events
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
    F.set_fault("fail:cudaEventCreateWithFlags", 1)
    with pytest.raises(RuntimeError, match="event_create"):
        for _ in range(40):
            torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
    assert F.last_error(True) == "cudaSuccess"
    F.set_fault("stalled", 0)
    assert F.synchronize(stream) == "cudaSuccess"


def test_a_failing_descriptor_of_a_batch_is_reported(fake):
    side_stream()
    src = caches(4096, 8, "device", pairs=1)
    dst = caches(4096, 8, "pinned", pairs=1)
    F.set_fault("batch_fail_at", 2)
    torch_kvswap.set_copy_method("dma")
    torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 2]), torch.tensor([1, 3]))  # 2 descriptors: fine
    with pytest.raises(RuntimeError, match="3 descriptors"):
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5]))
    assert F.last_error(True) == "cudaSuccess"


# --- errors say what was copied -----------------------------------------------------------


def test_a_per_copy_failure_names_the_descriptors_already_queued_and_they_land(fake):
    """The legacy default stream takes the per-descriptor path."""
    src = caches(4096, 8, "pinned", pairs=1)
    dst = caches(4096, 8, "device", pairs=1)
    want = expected(src, dst, torch.tensor([0, 2]), torch.tensor([1, 3]))
    torch_kvswap.set_copy_method("dma")
    F.set_fault("memcpy_fail_at", 2)
    with pytest.raises(
        RuntimeError,
        match=r"descriptor 2: .*descriptors 0\.\.1 of this call's 4 were queued "
        r"before the failure and will still run; descriptors 2\.\.3 were not",
    ):
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7]))
    assert F.synchronize(0) == "cudaSuccess"
    assert torch.equal(F.host_view(dst[0]), want[0])


def test_a_failure_of_the_first_copy_says_nothing_was_copied(fake):
    src = caches(4096, 8, "pinned", pairs=1)
    dst = caches(4096, 8, "device", pairs=1)
    before = F.host_view(dst[0]).clone()
    torch_kvswap.set_copy_method("dma")
    F.set_fault("memcpy_fail_at", 0)
    with pytest.raises(RuntimeError, match=r"descriptor 0: .*\(nothing was copied\)$"):
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 2]), torch.tensor([1, 3]))
    assert F.synchronize(0) == "cudaSuccess"
    assert torch.equal(F.host_view(dst[0]), before)


def test_an_engine_error_before_any_copy_says_nothing_was_copied(fake):
    side_stream()
    src = caches(4096, 4, "pinned", pairs=1)
    dst = caches(4096, 4, "device", pairs=1)
    torch_kvswap.set_copy_method("dma")
    F.set_fault("fail:cudaStreamIsCapturing", 1)
    with pytest.raises(RuntimeError, match=r"\(nothing was copied\)$"):
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))


def test_a_failed_batch_says_its_copies_may_have_been_queued(fake):
    side_stream()
    src = caches(4096, 8, "device", pairs=1)
    dst = caches(4096, 8, "pinned", pairs=1)
    F.set_fault("batch_fail_at", 2)
    torch_kvswap.set_copy_method("dma")
    with pytest.raises(RuntimeError, match=r"3 descriptors .*any of them may have been queued") as info:
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5]))
    assert "nothing was copied" not in str(info.value)


@pytest.mark.parametrize(
    "fail_at,match",
    [
        (0, r"\(nothing was copied\)$"),
        (
            1,
            r"ids 0\.\.383 of pairs 16\.\.19; earlier launches of this call were queued and will still run: "
            r"they copy ids 0\.\.383 of pairs 0\.\.15; the rest was not queued",
        ),
        (
            2,
            r"ids 384\.\.499 of pairs 0\.\.15; earlier launches of this call were queued and will still run: "
            r"they copy ids 0\.\.383 of every pair; the rest was not queued",
        ),
        (
            3,
            r"ids 384\.\.499 of pairs 16\.\.19; earlier launches .* they copy ids 0\.\.383 of every pair, "
            r"and ids 384\.\.499 of pairs 0\.\.15; the rest",
        ),
    ],
)
def test_a_kernel_launch_failure_names_the_launches_already_queued(fake, fail_at, match):
    """20 pairs, 500 host ids in 4 KiB parameters: 384 ids x 16 pairs per launch, 4 launches."""
    F.set_fault("large_params_absent", 1)
    F.rebind()
    stream = side_stream()
    src = caches(256, 600, "device", pairs=20, seed=27)
    dst = caches(256, 600, "pinned", pairs=20, seed=28)
    sid, did = torch.randperm(600)[:500], torch.randperm(600)[:500]
    torch_kvswap.set_copy_method("kernel")
    F.set_fault("launch_fail_at", fail_at)
    with pytest.raises(RuntimeError, match=match):
        torch_kvswap.swap_blocks(src, dst, sid, did)
    assert F.synchronize(stream) == "cudaSuccess"
    assert len(F.launches()) == 7 * fail_at  # seven numbers per launch record


def test_host_register_pins_in_place_and_releases(fake):
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    dev = torch.device("cuda", 0)

    class Ops:  # host_mapped of CPU tensors, as the core asks the engine
        @staticmethod
        def _host_mapped(tensors, device):
            return torch.ops.kvswap_test.host_mapped("cuda", tensors, device)

        _host_register = torch.ops.kvswap._host_register

    assert not Ops._host_mapped([buffer], dev)
    Ops._host_register(buffer, dev, True)
    assert Ops._host_mapped([buffer], dev)
    Ops._host_register(buffer, dev, False)
    assert not Ops._host_mapped([buffer], dev)
    with pytest.raises(RuntimeError, match="cudaErrorHostMemoryNotRegistered"):
        Ops._host_register(buffer, dev, False)
    assert F.last_error(True) == "cudaSuccess"
    F.set_fault("fail:cudaPointerGetAttributes", 1)
    assert not Ops._host_mapped([buffer], dev)
    assert F.last_error(True) == "cudaSuccess"


def test_engine_argument_checks(fake):
    dev = caches(2048, 4, "device", pairs=1)
    host = caches(2048, 4, "pinned", pairs=1)
    with pytest.raises(RuntimeError, match="device index 70 out of range"):
        torch.ops.kvswap_test.stream_capturing("cuda", torch.device("cuda", 70))
    kernel = torch.ops.kvswap_test.copy_blocks
    with pytest.raises(ValueError, match="no cache tensor is on a CUDA device"):
        kernel("cuda", host, host, torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="cannot index caches on cuda:0"):
        kernel("cuda", dev, host, placed_ids([0], "device", device=1), torch.tensor([1]))
    with pytest.raises(ValueError, match="contiguous 1-D int64"):
        kernel("cuda", dev, host, torch.tensor([0.0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="differ in length"):
        kernel("cuda", dev, host, torch.tensor([0, 1]), torch.tensor([1]))
    kernel("cuda", dev, host, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    assert F.launches() == []


def test_engine_overhead_against_a_no_op_runtime(fake):
    """docs/performance.md records a run of this measurement (bench_overhead)."""
    ns = F.bench_overhead(4096, 20000)
    batch_call, batch_many, each_call, each_many, noop_call, kernel_call, kernel_many = ns
    slope_each = (each_many - each_call) / 4095  # engine loop + one no-op runtime call
    per_descriptor_each = slope_each - noop_call
    per_descriptor_batch = (batch_many - batch_call) / 4095
    print(
        f"engine overhead (ns): batch call {batch_call:.0f}, per-descriptor call {each_call:.0f}, "
        f"kernel call {kernel_call:.0f}; per descriptor: batch {per_descriptor_batch:.2f}, "
        f"per-descriptor path {slope_each:.2f} with its runtime call, {per_descriptor_each:.2f} beyond "
        f"a separately timed no-op call ({noop_call:.2f}); "
        f"kernel per host id {(kernel_many - kernel_call) / 4095:.2f}"
    )
    # Loose bounds for a shared CI machine; the goals (1 us, 1 ns) are checked in performance.md.
    assert batch_call < 20_000 and each_call < 20_000


# --- descriptor tables held whatever fails after the submission ---------------------------


class StalledBatches:
    """Batches of one block each on a stalled side stream: nothing completes until a sync,
    so a table released early comes back from the pool for the next call and changes."""

    def __init__(self):
        self.stream = side_stream()
        (self.src,) = caches(4096, 8, "pinned", pairs=1, seed=31)
        (self.dst,) = caches(4096, 8, "device", pairs=1, seed=32)
        self.want = expected([self.src], [self.dst], [0, 1, 2, 3], [7, 6, 5, 4])[0]
        torch_kvswap.set_copy_method("dma")
        F.set_fault("stalled", 1)

    def copy(self, k):
        torch_kvswap.swap_blocks([self.src], [self.dst], torch.tensor([k]), torch.tensor([7 - k]))

    def finish(self):
        F.set_fault("stalled", 0)
        assert F.synchronize(self.stream) == "cudaSuccess"
        assert F.violations() == []  # no table changed before its copies ran
        assert torch.equal(host_bytes(self.dst), self.want)  # every submitted copy landed
        assert F.in_flight(0) == 0  # a batch without an event retires with a later one


@pytest.mark.parametrize("failing", ["cudaEventRecord", "cudaEventCreateWithFlags"])
def test_a_batch_whose_event_fails_stays_held(fake, failing):
    b = StalledBatches()
    F.set_fault("fail:" + failing, 1)
    calls = 0
    with pytest.raises(RuntimeError, match=r"(event_record|event_create).*The batch copy was queued"):
        # Events are recycled: creation fails once the spare ones are used up.
        for calls in range(1000):
            b.copy(calls % 4)  # the failing call was submitted, then its event failed
    F.set_fault("fail:" + failing, 0)
    assert F.in_flight(0) == calls + 1
    for k in (1, 2, 3):
        b.copy(k)
    assert F.in_flight(0) == calls + 4
    b.finish()


def test_a_batch_stays_held_when_polling_earlier_batches_fails(fake):
    b = StalledBatches()
    b.copy(0)
    F.set_fault("fail:cudaEventQuery", 1)
    with pytest.raises(RuntimeError, match="cudaEventQuery"):
        b.copy(1)  # submitted and recorded, then polling batch 0 failed
    F.set_fault("fail:cudaEventQuery", 0)
    assert F.in_flight(0) == 2
    for k in (2, 3):
        b.copy(k)
    b.finish()


# --- pinned host tensors: the allocator learns the copy's stream ----------------------------


@pytest.mark.parametrize("method", ["dma", "kernel"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_a_pinned_host_tensor_freed_while_its_copy_is_queued_is_not_reused(fake, method, direction):
    """torch's pinned allocator hands a freed block out again once the streams recorded on
    it have run past; without the record a queued copy reads or writes the next owner's data."""
    stream = side_stream()
    data = torch.randint(0, 255, (4, 4096), dtype=torch.uint8, generator=torch.Generator().manual_seed(33))
    (dev,) = caches(4096, 4, "device", pairs=1, seed=34)
    host = F.pinned_empty([4, 4096])
    host.copy_(data)
    torch_kvswap.set_copy_method(method)
    records = F.pinned_records()
    want = host_bytes(dev)
    if direction == "h2d":
        want[[2, 3]] = data[[0, 1]]
        torch_kvswap.swap_blocks([host], [dev], torch.tensor([0, 1]), torch.tensor([2, 3]))
    else:
        torch_kvswap.swap_blocks([dev], [host], torch.tensor([2, 3]), torch.tensor([0, 1]))
    assert F.pinned_records() == records + 1  # one host storage, one record
    address = host.data_ptr()
    del host  # freed while the copy is queued
    reuse = F.pinned_empty([4, 4096])
    assert reuse.data_ptr() != address  # the block is still the stream's
    reuse.fill_(0xEE)
    assert F.synchronize(stream) == "cudaSuccess"
    assert F.violations() == []
    assert bool((reuse == 0xEE).all())  # the new owner's bytes are its own
    assert torch.equal(host_bytes(dev), want)
    assert F.pinned_empty([4, 4096]).data_ptr() == address  # the stream ran past: free again


# --- the pointer query is safe whether or not it is legal under capture ----------------------


@pytest.mark.parametrize("unsafe", [0, 1])
def test_the_pointer_query_is_safe_under_capture_either_way(fake, unsafe):
    """No public source says whether cudaPointerGetAttributes is a "potentially unsafe" call
    under capture; with the fault it is, and only the relaxed mode keeps the capture valid."""
    F.set_fault("pointer_query_unsafe", unsafe)
    stream = side_stream()
    src = caches(2048, 4, "pinned", pairs=1, seed=35)
    dst = caches(2048, 4, "device", pairs=1, seed=36)
    with captured(stream, GLOBAL) as cap:
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 1]), torch.tensor([2, 3]))
    assert cap.error == "cudaSuccess", F.call_log()
    assert F.count_calls("cudaPointerGetAttributes") == 1
    want = expected(src, dst, [0, 1], [2, 3])
    assert F.launch_graph(cap.graph, stream) == "cudaSuccess"
    assert F.synchronize(stream) == "cudaSuccess"
    assert torch.equal(host_bytes(dst[0]), want[0])


def test_the_fake_refuses_the_pointer_query_under_global_capture_in_that_mode(fake):
    """The fault's rule itself: in global mode the query fails and invalidates the capture."""
    F.set_fault("pointer_query_unsafe", 1)
    stream = side_stream()
    buffer = F.pinned_copy(torch.zeros(4096, dtype=torch.uint8))
    with captured(stream, GLOBAL) as cap:
        assert F.pointer_query(buffer.data_ptr()) == "cudaErrorStreamCaptureUnsupported"
    assert cap.error == "cudaErrorStreamCaptureInvalidated"
    assert F.pointer_query(buffer.data_ptr()) == "cudaSuccess"  # legal outside capture


@pytest.mark.parametrize(
    "fault,value,batch", [(None, 0, True), ("runtime_version", 12060, False), ("batch_absent", 1, False)]
)
def test_environment_report_says_what_the_engine_uses_on_the_device(fake, fault, value, batch):
    if fault:
        F.set_fault(fault, value)
    F.rebind()
    report = dict(line.split("=", 1) for line in torch.ops.kvswap._engine_report(torch.device("cuda:0")))
    assert set(report) == {"batch_api", "batch_cap", "capture_query", "pin_in_place", "kernel_params"}
    assert report["batch_cap"] == "8192 descriptors per cudaMemcpyBatchAsync call"
    assert report["batch_api"].startswith("cudaMemcpyBatchAsync in use" if batch else "not in use")
    assert report["capture_query"].startswith("cudaStreamIsCapturing ")  # what the table binds
    assert report["kernel_params"] == f"{F.kernel_param_bytes(0)} bytes per launch"


# --- kernel parameters: 32,764 bytes where runtime, driver and device allow it ---------------

LARGE, SMALL = 32752, 4016  # sizeof the two parameter blocks (copy_kernel.h)


@pytest.mark.parametrize(
    "fault,value,param_bytes,launches",
    [
        (None, 0, LARGE, 2),  # 4,081 host ids per launch
        ("runtime_version", 12000, SMALL, 9),  # 489 per launch
        ("driver_version", 12000, SMALL, 9),
        ("compute_major", 6, SMALL, 9),
        ("large_params_absent", 1, SMALL, 9),
        ("fail:cudaDeviceGetAttribute", 101, SMALL, 9),
    ],
)
def test_launches_per_4096_host_ids_with_each_parameter_limit(fake, fault, value, param_bytes, launches):
    if fault:
        F.set_fault(fault, value)
    F.rebind()
    stream = side_stream()
    src = caches(16, 4096, "device", pairs=1, seed=37)
    dst = caches(16, 4096, "pinned", pairs=1, seed=38)
    g = torch.Generator().manual_seed(39)
    sid, did = torch.randperm(4096, generator=g), torch.randperm(4096, generator=g)
    want = expected(src, dst, sid, did)
    torch_kvswap.set_copy_method("kernel")
    torch_kvswap.swap_blocks(src, dst, sid, did)
    assert F.kernel_param_bytes(0) == (32764 if param_bytes == LARGE else 4096)
    assert F.launch_param_bytes() == [param_bytes] * launches
    assert F.synchronize(stream) == "cudaSuccess"
    assert torch.equal(dst[0], want[0])
    assert F.last_error(True) == "cudaSuccess"


@pytest.mark.parametrize(
    "pairs,inline,large,launches",
    [
        (16, "both", True, 2),  # 3,976 ids per launch, all 16 pairs in each
        (16, "both", False, 11),  # 384 ids per launch
        (1, "dst", True, 1),  # device src ids, host dst ids: 8,162 per launch
        (1, "dst", False, 5),  # 978 per launch
        (1, "none", False, 1),  # device ids: one launch whatever the count
    ],
)
def test_launch_counts_for_pairs_and_id_placement(fake, pairs, inline, large, launches):
    if not large:
        F.set_fault("large_params_absent", 1)
    F.rebind()
    stream = side_stream()
    src = caches(16, 4096, "device", pairs=pairs, seed=40)
    dst = caches(16, 4096, "pinned", pairs=pairs, seed=41)
    g = torch.Generator().manual_seed(42)
    sid, did = torch.randperm(4096, generator=g), torch.randperm(4096, generator=g)
    want = expected(src, dst, sid, did)
    sid_t = sid if inline == "both" else F.device_copy(sid)
    did_t = did if inline != "none" else F.device_copy(did)
    torch_kvswap.set_copy_method("kernel")
    torch_kvswap.swap_blocks(src, dst, sid_t, did_t)
    assert len(F.launch_param_bytes()) == launches
    assert F.synchronize(stream) == "cudaSuccess"
    assert all(torch.equal(d, w) for d, w in zip(dst, want))


@pytest.mark.parametrize(
    "fault,value,answer",
    [
        (None, 0, "cudaSuccess"),
        ("driver_version", 12000, "cudaErrorNotSupported"),
        ("runtime_version", 12000, "cudaErrorNotSupported"),
        ("compute_major", 6, "cudaErrorNotSupported"),
    ],
)
def test_the_fake_enforces_the_parameter_limit(fake, fault, value, answer):
    """More than 4 KiB of parameters needs a 12.1+ driver and runtime and sm_70+."""
    if fault:
        F.set_fault(fault, value)
    assert F.launch_large_empty(side_stream()) == answer


# --- sticky errors and invalidated captures ----------------------------------------------------


def test_after_a_sticky_error_every_call_answers_it(fake):
    """driver_types.h:771-772: after cudaErrorIllegalAddress "any further CUDA work will
    return the same error"; cudaGetLastError does not clear it."""
    stream = side_stream()
    (dev,) = caches(2048, 4, "device", pairs=1, seed=43)
    pageable = torch.zeros(4, 2048, dtype=torch.uint8)
    # The kernel on pageable memory (the core would refuse it): an illegal address when it runs.
    torch.ops.kvswap_test.copy_blocks("cuda", [dev], [pageable], torch.tensor([0]), torch.tensor([1]))
    assert F.synchronize(stream) == "cudaErrorIllegalAddress"
    assert F.violations() == ["kernel: touched memory the device cannot address"]
    assert F.last_error(False) == "cudaErrorIllegalAddress"
    assert F.last_error(False) == "cudaErrorIllegalAddress"  # read, and still there
    (pinned,) = caches(2048, 4, "pinned", pairs=1, seed=44)
    for method in ("auto", "dma", "kernel"):
        torch_kvswap.set_copy_method(method)
        with pytest.raises(
            RuntimeError,
            match=r"kvswap CUDA engine: .*stream_is_capturing.* failed: "
            r"cudaErrorIllegalAddress",
        ):
            torch_kvswap.swap_blocks([dev], [pinned], torch.tensor([0]), torch.tensor([1]))
    kernel = torch.ops.kvswap_test.copy_blocks
    with pytest.raises(RuntimeError, match=r"cudaErrorIllegalAddress.*\. launching the block copy kernel"):
        kernel("cuda", [dev], [pinned], torch.tensor([0]), torch.tensor([1]))
    F.set_stream(0, 0)  # the legacy stream: per descriptor
    with pytest.raises(RuntimeError, match=r"cudaErrorIllegalAddress.*\. descriptor 0: "):
        torch.ops.kvswap_test.submit(
            "cuda",
            torch.tensor([dev.data_ptr()]),
            torch.tensor([pinned.data_ptr()]),
            torch.tensor([2048]),
            1,
            2048,
            torch.device("cuda", 0),
        )
    with pytest.raises(
        RuntimeError, match=r"cudaPointerGetAttributes failed: cudaErrorIllegalAddress.* is mapped for cuda:0"
    ):
        torch.ops.kvswap_test.host_mapped("cuda", [pinned], torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"cudaErrorIllegalAddress.*\. pinning 4096 host bytes"):
        torch.ops.kvswap._host_register(torch.zeros(4096, dtype=torch.uint8), torch.device("cuda", 0), True)
    assert F.synchronize(stream) == "cudaErrorIllegalAddress"
    assert F.last_error(True) == "cudaErrorIllegalAddress"


def test_an_invalidated_capture_answers_901_to_further_work(fake):
    """driver_types.h:1019-1022: the capture "has been invalidated due to a previous error"."""
    stream = side_stream()
    src = caches(2048, 4, "pinned", pairs=1, seed=45)
    dst = caches(2048, 4, "device", pairs=1, seed=46)
    with captured(stream) as cap:
        assert F.synchronize(stream) == "cudaErrorStreamCaptureUnsupported"  # sync: illegal, invalidates
        assert torch.ops.kvswap_test.stream_capturing(
            "cuda", torch.device("cuda", 0)
        )  # still inside the capture
        with pytest.raises(
            RuntimeError,
            match=r"cudaErrorStreamCaptureInvalidated.*\. "
            r"launching the block copy kernel",
        ):
            torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
        with pytest.raises(RuntimeError, match=r"cudaErrorStreamCaptureInvalidated.*\. descriptor 0: "):
            torch.ops.kvswap_test.submit(
                "cuda",
                torch.tensor([src[0].data_ptr()]),
                torch.tensor([dst[0].data_ptr()]),
                torch.tensor([2048]),
                0,
                2048,
                torch.device("cuda", 0),
            )
        assert F.last_error(True) == "cudaSuccess"
    assert cap.error == "cudaErrorStreamCaptureInvalidated"
    assert F.launches() == []  # nothing was recorded after the invalidation


# --- device-resident ids: duplicates and overlap are the caller's duty ------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("overlap", [False, True])
def test_unchecked_device_ids_never_write_outside_the_named_blocks(fake, seed, overlap):
    """docs/cuda.md: device ids on the kernel path are not read back, so duplicates,
    source/destination overlap and ids out of range are not refused (the checked mode
    refuses them). What holds on any input: ids out of range are skipped, nothing outside
    the in-range destination blocks is written, and every byte written comes from a block
    that some in-range pair names as its source (under overlap: from the same offset of a
    block of the cache)."""
    stream = side_stream()
    g = torch.Generator().manual_seed(100 + seed)
    blocks, bb = 8, 2048
    whole = F.device_copy(torch.randint(0, 255, (blocks + 2, bb), generator=g, dtype=torch.uint8))
    cache = whole[1 : blocks + 1]  # rows 0 and blocks + 1 guard the cache's ends
    if overlap:
        src, dst = cache, cache
    else:
        host = F.pinned_copy(torch.randint(0, 255, (blocks + 2, bb), generator=g, dtype=torch.uint8))
        src, dst = host[1 : blocks + 1], cache
    n = 12
    sid = torch.randint(-2, blocks + 2, (n,), generator=g)
    did = torch.randint(-2, blocks + 2, (n,), generator=g)
    did[1] = did[0] = 3  # a duplicate destination in every case
    sid[1] = 5
    before_src, before_whole = host_bytes(src), host_bytes(whole)
    sid_t, did_t = F.device_copy(sid), F.device_copy(did)  # alive until the kernel has run
    torch_kvswap.swap_blocks([src], [dst], sid_t, did_t)
    assert F.synchronize(stream) == "cudaSuccess"
    assert F.violations() == []
    after = host_bytes(whole)
    assert torch.equal(after[0], before_whole[0]) and torch.equal(after[-1], before_whole[-1])
    ok = [(s, d) for s, d in zip(sid.tolist(), did.tolist()) if 0 <= s < blocks and 0 <= d < blocks]
    for d in range(blocks):
        sources = [s for s, dd in ok if dd == d]
        row = after[1 + d]
        if not sources:
            assert torch.equal(row, before_whole[1 + d]), d
            continue
        # Under overlap a source may be read before or after it is written: its bytes then
        # come, at the same offset, from some block's bytes before the call.
        states = [before_src[s] for s in (range(blocks) if overlap else sources)]
        words = row.view(-1, 16)
        allowed = torch.stack([state.view(-1, 16) for state in states])
        assert bool((words.unsqueeze(0) == allowed).all(-1).any(0).all()), d


def test_device_ids_read_back_for_the_dma_path_are_checked(fake):
    """Outside capture the descriptor path reads device ids back and checks them as host ids."""
    side_stream()
    src = caches(65536, 4, "device", pairs=1)
    dst = caches(65536, 4, "pinned", pairs=1)
    torch_kvswap.set_copy_method("dma")
    with pytest.raises(ValueError, match="are both 2"):
        torch_kvswap.swap_blocks(src, dst, placed_ids([0, 1], "device"), placed_ids([2, 2], "device"))


# --- the fake's own rules, each triggered directly -----------------------------------------


def _sync_call(kind, buffer, device_buffer):
    """A "potentially unsafe" call of each kind, on memory of the test's."""
    if kind == "cudaMemcpy":
        return F.memcpy_sync(device_buffer.data_ptr(), buffer.data_ptr(), 64, 1)
    if kind == "cudaStreamSynchronize":
        return F.synchronize(F.create_stream(0, False))
    if kind == "cudaHostRegister":
        try:
            torch.ops.kvswap._host_register(buffer, torch.device("cuda", 0), True)
            return "cudaSuccess"
        except RuntimeError as exc:
            return "cudaErrorStreamCaptureUnsupported" if "StreamCaptureUnsupported" in str(exc) else str(exc)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["cudaMemcpy", "cudaStreamSynchronize", "cudaHostRegister"])
@pytest.mark.parametrize(
    "capture_mode,my_mode,own,legal",
    [
        (GLOBAL, GLOBAL, True, False),  # this thread captures: unsafe calls prohibited
        (THREAD_LOCAL, GLOBAL, True, False),
        (RELAXED, GLOBAL, True, True),  # a relaxed capture prohibits nothing
        (GLOBAL, GLOBAL, False, False),  # another thread's global capture, this thread global
        (GLOBAL, THREAD_LOCAL, False, True),  # ... this thread thread-local
        (GLOBAL, RELAXED, False, True),  # ... this thread relaxed
        (THREAD_LOCAL, GLOBAL, False, True),  # another thread's thread-local capture
    ],
)
def test_fake_rule_potentially_unsafe_calls_by_capture_mode(fake, kind, capture_mode, my_mode, own, legal):
    """cuda_runtime_api.h:2536-2548 (cudaThreadExchangeStreamCaptureMode)."""
    buffer = torch.zeros(4096, dtype=torch.uint8)
    device_buffer = F.device_copy(torch.zeros(4096, dtype=torch.uint8))
    stream = F.create_stream(0, False)
    result = {}
    if own:
        with captured(stream, capture_mode) as cap:
            old = F.exchange_capture_mode(my_mode)
            result["call"] = _sync_call(kind, buffer, device_buffer)
            F.exchange_capture_mode(old)
        end = cap.error
    else:
        started, done = threading.Event(), threading.Event()

        def capture_elsewhere():
            result["begin"] = F.begin_capture(stream, capture_mode)
            started.set()
            done.wait(30)
            result["end"] = F.end_capture(stream)[0]

        thread = threading.Thread(target=capture_elsewhere)
        thread.start()
        started.wait(30)
        old = F.exchange_capture_mode(my_mode)
        try:
            result["call"] = _sync_call(kind, buffer, device_buffer)
        finally:
            F.exchange_capture_mode(old)
            done.set()
            thread.join()
        end = result["end"]
    assert result["call"] == ("cudaSuccess" if legal else "cudaErrorStreamCaptureUnsupported")
    assert end == ("cudaSuccess" if legal else "cudaErrorStreamCaptureInvalidated")
    if kind == "cudaHostRegister" and legal:
        torch.ops.kvswap._host_register(buffer, torch.device("cuda", 0), False)


def test_fake_rule_synchronous_memcpy_lands_before_it_returns(fake):
    data = torch.arange(64, dtype=torch.uint8)
    dev = F.device_copy(torch.zeros(64, dtype=torch.uint8))
    assert F.memcpy_sync(dev.data_ptr(), data.data_ptr(), 64, 1) == "cudaSuccess"
    assert torch.equal(F.host_view(dev), data)
    assert F.memcpy_sync(dev.data_ptr(), data.data_ptr(), 64, 2) == "cudaErrorInvalidValue"  # wrong kind
    assert F.last_error(False) == "cudaErrorInvalidValue"


def test_fake_rule_the_legacy_stream_while_a_blocking_stream_captures(fake):
    """cuda_runtime_api.h:2603-2610: the legacy stream would join the capture implicitly."""
    blocking = F.create_stream(0, True)
    dev = F.device_copy(torch.zeros(64, dtype=torch.uint8))
    pinned = F.pinned_copy(torch.zeros(64, dtype=torch.uint8))
    with captured(blocking) as cap:
        with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureImplicit"):
            torch.ops.kvswap_test.stream_capturing("cuda", torch.device("cuda", 0))  # torch's stream: legacy
    assert cap.error == "cudaSuccess"  # asking does not invalidate
    with captured(blocking) as cap:
        assert F.memcpy_on(dev.data_ptr(), pinned.data_ptr(), 64, 1, 0) == "cudaErrorStreamCaptureImplicit"
    assert cap.error == "cudaErrorStreamCaptureInvalidated"  # using it does
    with captured(blocking) as cap:
        old = F.exchange_capture_mode(RELAXED)  # so that the sync itself is legal
        assert F.synchronize(0) == "cudaErrorStreamCaptureImplicit"
        F.exchange_capture_mode(old)
    assert cap.error == "cudaErrorStreamCaptureInvalidated"
    with captured(F.create_stream(0, False)) as cap:  # a non-blocking stream's capture: no rule
        assert F.memcpy_on(dev.data_ptr(), pinned.data_ptr(), 64, 1, 0) == "cudaSuccess"
    assert cap.error == "cudaSuccess"


def test_fake_rule_batch_arrays_must_not_change_before_the_copies_run(fake):
    stream = F.create_stream(0, False)
    src = F.device_copy(torch.arange(128, dtype=torch.uint8))
    dst = F.pinned_copy(torch.zeros(128, dtype=torch.uint8))
    table = torch.tensor(
        [[dst.data_ptr(), dst.data_ptr() + 64], [src.data_ptr(), src.data_ptr() + 64], [64, 64]]
    )
    assert F.batch_copy(table, stream) == "cudaSuccess"
    assert F.synchronize(stream) == "cudaSuccess"
    assert F.violations() == [] and torch.equal(dst, torch.arange(128, dtype=torch.uint8))
    assert F.batch_copy(table, stream) == "cudaSuccess"
    table[2] = 32  # the caller reuses its arrays while the copies are queued
    assert F.synchronize(stream) == "cudaSuccess"
    assert F.violations() == ["cudaMemcpyBatchAsync: descriptor arrays changed before the copies ran"]


@pytest.mark.parametrize(
    "case,answer",
    [
        ("legacy", "cudaErrorInvalidValue"),  # "Must not be legacy NULL stream"
        ("order", "cudaErrorInvalidValue"),  # srcAccessOrder out of range
        ("first_index", "cudaErrorInvalidValue"),  # attrsIdxs[0] must be 0
        ("num_attrs", "cudaErrorInvalidValue"),  # numAttrs <= count
        ("no_attrs", "cudaErrorInvalidValue"),
        ("zero_size", "cudaErrorInvalidValue"),
        ("outside", "cudaErrorInvalidValue"),  # a range leaving its allocation
        ("capturing", "cudaErrorStreamCaptureUnsupported"),
        ("invalidated", "cudaErrorStreamCaptureInvalidated"),
    ],
)
def test_fake_rule_batch_call_arguments(fake, case, answer):
    """cuda_runtime_api.h:6387-6388, 6401-6403, 6426; capture: rmm#2518, cuopt#1753."""
    stream = F.create_stream(0, False)
    src = F.device_copy(torch.arange(128, dtype=torch.uint8))
    dst = F.pinned_copy(torch.zeros(128, dtype=torch.uint8))
    size = 0 if case == "zero_size" else (4096 if case == "outside" else 64)
    table = torch.tensor(
        [[dst.data_ptr(), dst.data_ptr() + 64], [src.data_ptr(), src.data_ptr() + 64], [size, 64]]
    )
    kwargs = (
        {"order": 7}
        if case == "order"
        else {"first_index": 1}
        if case == "first_index"
        else {"num_attrs": 3}
        if case == "num_attrs"
        else {"num_attrs": 0}
        if case == "no_attrs"
        else {}
    )
    if case in ("capturing", "invalidated"):
        with captured(stream) as cap:
            if case == "invalidated":
                F.synchronize(stream)
            assert F.batch_copy(table, stream, **kwargs) == answer
        assert cap.error == ("cudaSuccess" if case == "capturing" else "cudaErrorStreamCaptureInvalidated")
        return
    assert F.batch_copy(table, 0 if case == "legacy" else stream, **kwargs) == answer


BOGUS = 0x12345  # a stream handle the runtime never gave out


def test_fake_rule_unknown_handles_are_invalid(fake):
    table = torch.tensor([[0], [0], [64]])
    assert F.synchronize(BOGUS) == "cudaErrorInvalidResourceHandle"
    assert F.begin_capture(BOGUS, GLOBAL) == "cudaErrorInvalidResourceHandle"
    assert F.end_capture(BOGUS)[0] == "cudaErrorInvalidResourceHandle"
    assert F.launch_graph(0, BOGUS) == "cudaErrorInvalidResourceHandle"
    assert F.memcpy_on(0, 0, 64, 1, BOGUS) == "cudaErrorInvalidResourceHandle"
    assert F.batch_copy(table, BOGUS) == "cudaErrorInvalidResourceHandle"
    assert F.stream_capture_status(BOGUS)[0] == "cudaErrorInvalidResourceHandle"
    assert F.launch_empty(BOGUS, 1, 1, 1) == "cudaErrorInvalidResourceHandle"
    assert F.event_record(0, F.create_stream(0, False)) == "cudaErrorInvalidResourceHandle"
    assert F.event_query(0) == "cudaErrorInvalidResourceHandle"
    F.set_stream(0, BOGUS)  # torch's current stream, as the engine sees it
    with pytest.raises(RuntimeError, match="cudaErrorInvalidResourceHandle"):
        torch.ops.kvswap_test.stream_capturing("cuda", torch.device("cuda", 0))
    assert F.last_error(False) == "cudaSuccess"  # the engine cleared it


def test_fake_rule_capture_begin_and_end(fake):
    """cuda_runtime_api.h:2439-2440 (the legacy stream cannot capture), one capture per
    stream, and cudaStreamEndCapture: not capturing, or another thread in a strict mode
    (driver_types.h:1062-1065)."""
    assert F.begin_capture(0, GLOBAL) == "cudaErrorStreamCaptureUnsupported"
    stream = F.create_stream(0, False)
    assert F.end_capture(stream)[0] == "cudaErrorIllegalState"
    assert F.begin_capture(stream, GLOBAL) == "cudaSuccess"
    assert F.begin_capture(stream, GLOBAL) == "cudaErrorIllegalState"
    assert F.stream_capture_status(stream) == ("cudaSuccess", 1)  # active
    result = {}
    thread = threading.Thread(target=lambda: result.update(end=F.end_capture(stream)[0]))
    thread.start()
    thread.join()
    assert result["end"] == "cudaErrorStreamCaptureWrongThread"
    err, graph = F.end_capture(stream)
    assert err == "cudaSuccess" and graph != 0
    relaxed = F.create_stream(0, False)  # relaxed mode: any thread may end it
    assert F.begin_capture(relaxed, RELAXED) == "cudaSuccess"
    thread = threading.Thread(target=lambda: result.update(end=F.end_capture(relaxed)[0]))
    thread.start()
    thread.join()
    assert result["end"] == "cudaSuccess"


def test_fake_rule_events(fake):
    """cudaEventQuery: not ready until the stream ran past the record (stalled), an event
    recorded in a capture is cudaErrorCapturedEvent in every mode (cuda_runtime_api.h:
    2546-2548), an event never recorded has completed."""
    stream = F.create_stream(0, False)
    err, event = F.event_create()
    assert err == "cudaSuccess"
    assert F.event_query(event) == "cudaSuccess"  # never recorded
    F.set_fault("stalled", 1)
    assert F.event_record(event, stream) == "cudaSuccess"
    assert F.event_query(event) == "cudaErrorNotReady"
    F.set_fault("stalled", 0)
    assert F.event_query(event) == "cudaSuccess"
    with captured(stream) as cap:
        assert F.event_record(event, stream) == "cudaSuccess"
    assert cap.error == "cudaSuccess"
    old = F.exchange_capture_mode(RELAXED)
    assert F.event_query(event) == "cudaErrorCapturedEvent"
    F.exchange_capture_mode(old)
    with captured(stream) as cap:
        assert F.event_query(F.event_create()[1]) == "cudaErrorStreamCaptureUnsupported"  # unsafe, global
    assert cap.error == "cudaErrorStreamCaptureInvalidated"


def test_fake_rule_device_attributes(fake):
    assert F.device_attribute(75, 0) == ("cudaSuccess", 9)  # cudaDevAttrComputeCapabilityMajor
    assert F.device_attribute(76, 1) == ("cudaSuccess", 0)  # ... minor
    assert F.device_attribute(75, 2)[0] == "cudaErrorInvalidDevice"  # two devices
    assert F.device_attribute(1, 0)[0] == "cudaErrorInvalidValue"  # not modelled: refused
    assert F.last_error(False) == "cudaErrorInvalidValue"


def test_fake_rule_launch_configuration(fake):
    """A launch needs a grid of at least one block in x and y, y within 65,535, one y per pair."""
    stream = F.create_stream(0, False)
    assert F.launch_empty(stream, 1, 1, 1) == "cudaSuccess"
    assert F.launch_empty(stream, 0, 1, 1) == "cudaErrorInvalidConfiguration"
    assert F.launch_empty(stream, 1, 0, 0) == "cudaErrorInvalidConfiguration"
    assert F.launch_empty(stream, 1, 65536, 65536) == "cudaErrorInvalidConfiguration"
    assert F.launch_empty(stream, 1, 2, 1) == "cudaErrorInvalidConfiguration"
    assert F.synchronize(stream) == "cudaSuccess"


def test_fake_rule_copies_by_kind_and_memory(fake):
    """cudaMemcpyAsync: the kind must match the sides; a range leaving its allocation, or a
    host range running into one, is invalid; default kind takes any valid memory; a copy
    to pageable memory returns once it has landed."""
    stream = F.create_stream(0, False)
    dev = F.device_copy(torch.arange(256, dtype=torch.uint8))
    other = F.device_copy(torch.zeros(256, dtype=torch.uint8))
    pageable = torch.zeros(256, dtype=torch.uint8)
    assert F.memcpy_on(other.data_ptr(), dev.data_ptr(), 256, 2, stream) == "cudaErrorInvalidValue"  # D2H
    assert (
        F.memcpy_on(other.data_ptr(), pageable.data_ptr(), 256, 3, stream) == "cudaErrorInvalidValue"
    )  # D2D
    assert (
        F.memcpy_on(other.data_ptr(), dev.data_ptr(), 512, 3, stream) == "cudaErrorInvalidValue"
    )  # leaves it
    assert F.memcpy_on(pageable.data_ptr(), dev.data_ptr() - 16, 64, 4, stream) == "cudaErrorInvalidValue"
    assert F.memcpy_on(other.data_ptr(), dev.data_ptr(), 256, 4, stream) == "cudaSuccess"  # default kind
    assert F.memcpy_on(pageable.data_ptr(), other.data_ptr(), 256, 2, stream) == "cudaSuccess"
    assert torch.equal(pageable, torch.arange(256, dtype=torch.uint8))  # landed before it returned
    with captured(stream) as cap:
        assert (
            F.memcpy_on(other.data_ptr(), pageable.data_ptr(), 256, 1, stream)
            == "cudaErrorStreamCaptureUnsupported"
        )  # pageable memory under capture
    assert cap.error == "cudaErrorStreamCaptureInvalidated"


def test_fake_rule_host_registration(fake):
    """cudaHostRegister: a null or empty range is invalid, memory already pinned is
    cudaErrorHostMemoryAlreadyRegistered; both are potentially unsafe under capture."""
    buffer = torch.zeros(4096, dtype=torch.uint8)
    assert F.host_register_raw(0, 4096, True) == "cudaErrorInvalidValue"
    assert F.host_register_raw(buffer.data_ptr(), 0, True) == "cudaErrorInvalidValue"
    assert F.host_register_raw(buffer.data_ptr(), 4096, True) == "cudaSuccess"
    assert F.host_register_raw(buffer.data_ptr(), 4096, True) == "cudaErrorHostMemoryAlreadyRegistered"
    with captured(F.create_stream(0, False)) as cap:
        assert F.host_register_raw(buffer.data_ptr(), 4096, False) == "cudaErrorStreamCaptureUnsupported"
    assert cap.error == "cudaErrorStreamCaptureInvalidated"
    assert F.host_register_raw(buffer.data_ptr(), 4096, False) == "cudaSuccess"
    dev = F.device_copy(torch.zeros(4))
    assert F.pointer_query(dev.data_ptr()) == "cudaSuccess"  # device memory


def test_fake_rule_per_thread_stream_takes_the_batch_path(fake):
    """cudaStreamPerThread is not the legacy stream: the batch API takes it."""
    F.set_stream(0, 2)  # cudaStreamPerThread
    src = caches(4096, 4, "pinned", pairs=1, seed=47)
    dst = caches(4096, 4, "device", pairs=1, seed=48)
    want = expected(src, dst, [1], [2])
    torch_kvswap.set_copy_method("dma")
    torch_kvswap.swap_blocks(src, dst, torch.tensor([1]), torch.tensor([2]))
    assert F.count_calls("cudaMemcpyBatchAsync") == 1
    assert F.synchronize(2) == "cudaSuccess"
    assert torch.equal(host_bytes(dst[0]), want[0])


def test_fake_error_names_and_the_no_op_table(fake):
    F.set_fault("batch_error", 999)  # an error the fake does not name
    F.set_stream(0, F.create_stream(0, False))
    src = caches(4096, 4, "pinned", pairs=1)
    dst = caches(4096, 4, "device", pairs=1)
    torch_kvswap.set_copy_method("dma")
    with pytest.raises(RuntimeError, match=r"cudaErrorUnknown\(fake\)"):
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
    assert F.noop_calls() == 0


# --- pinned means every byte: the engine's own registrations decide --------------------------

DEV0 = torch.device("cuda", 0)


def host_mapped(tensors):
    """The engine's host_mapped of CPU tensors, as the core asks it."""
    return torch.ops.kvswap_test.host_mapped("cuda", tensors, DEV0)


def page_aligned(nbytes):
    """A pageable host buffer of `nbytes` starting on a 4 KiB boundary."""
    raw = torch.zeros(nbytes + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    return raw[skip : skip + nbytes]


@contextlib.contextmanager
def registered(*buffers):
    for b in buffers:
        torch.ops.kvswap._host_register(b, DEV0, True)
    try:
        yield
    finally:
        for b in buffers:
            torch.ops.kvswap._host_register(b, DEV0, False)


def test_a_registered_view_at_an_offset_is_mapped_and_the_kernel_copies_into_it(fake):
    stream = side_stream()
    buffer = page_aligned(6 * 4096)
    host = buffer[2 * 4096 :].view(4, 4096)  # its storage begins two pages before it
    src = caches(4096, 4, "device", pairs=1, seed=31)
    want = expected(src, [host], [0, 3], [2, 1])
    with registered(host):
        assert host_mapped([host])
        torch_kvswap.set_copy_method("kernel")
        torch_kvswap.swap_blocks(src, [host], torch.tensor([0, 3]), torch.tensor([2, 1]))
        assert F.synchronize(stream) == "cudaSuccess"
        assert torch.equal(host, want[0])
        # Under capture the copy is not refused as pageable either.
        torch_kvswap.set_copy_method("auto")
        with captured(stream) as cap:
            torch_kvswap.swap_blocks(src, [host], torch.tensor([1]), torch.tensor([0]))
        assert cap.error == "cudaSuccess"
    assert F.violations() == []


def test_a_registered_prefix_does_not_make_the_whole_tensor_mapped(fake):
    side_stream()
    buffer = page_aligned(4 * 4096)
    host = buffer.view(4, 4096)
    src = caches(4096, 4, "device", pairs=1, seed=32)
    with registered(buffer[: 2 * 4096]):
        assert host_mapped([host[:2]])
        assert not host_mapped([host])
        assert not host_mapped([host[1:3]])  # from inside the registration out of it
        torch_kvswap.set_copy_method("kernel")
        with pytest.raises(ValueError, match="kernel"):
            torch_kvswap.swap_blocks(src, [host], torch.tensor([0]), torch.tensor([3]))
    assert F.violations() == []  # the kernel never touched the unregistered pages
    assert F.last_error(True) == "cudaSuccess"


def test_a_gap_between_two_registrations_is_not_mapped_and_adjacent_ones_are(fake):
    stream = side_stream()
    buffer = page_aligned(4 * 4096)
    host = buffer.view(4, 4096)
    with registered(buffer[:4096], buffer[2 * 4096 : 3 * 4096]):
        assert host_mapped([host[0:1]]) and host_mapped([host[2:3]])
        assert not host_mapped([host[0:3]])  # page 1 between them is pageable
    with registered(buffer[:4096], buffer[4096 : 3 * 4096], buffer[3 * 4096 :]):
        assert host_mapped([host])
        src = caches(4096, 4, "device", pairs=1, seed=33)
        want = expected(src, [host], [0, 1, 2, 3], [3, 2, 1, 0])
        torch_kvswap.set_copy_method("kernel")
        torch_kvswap.swap_blocks(src, [host], torch.tensor([0, 1, 2, 3]), torch.tensor([3, 2, 1, 0]))
        assert F.synchronize(stream) == "cudaSuccess"
        assert torch.equal(host, want[0])
    assert not host_mapped([host])  # unregistered again
    assert F.violations() == []


def test_the_runtime_has_a_second_opinion_on_registered_bytes(fake):
    buffer = page_aligned(2 * 4096)
    with registered(buffer):
        assert host_mapped([buffer])
        # The runtime forgets the registration behind the engine's back.
        assert F.host_register_raw(buffer.data_ptr(), 0, False) == "cudaSuccess"
        assert not host_mapped([buffer])
        assert F.host_register_raw(buffer.data_ptr(), buffer.numel(), True) == "cudaSuccess"


def test_a_strided_host_view_is_judged_by_every_byte_it_spans(fake):
    buffer = page_aligned(4 * 4096)
    rows = buffer.view(4, 4096)
    with registered(buffer[: 3 * 4096]):
        assert host_mapped([rows[:3, :8]])
        assert not host_mapped([rows[:, :8]])  # 32 bytes, but its last row is in the fourth page
        assert host_mapped([rows[:, :8].t()[:, :3]])  # transposed: the same bytes of three rows


# --- the device: the engine works with the caches' device current -----------------------------


@pytest.mark.parametrize("method,block_bytes", [("kernel", 4096), ("dma", 65536)])
@pytest.mark.parametrize("legacy", [False, True])
def test_copies_on_a_device_that_is_not_current(fake, method, block_bytes, legacy):
    """Current device 0, caches on device 1: the kernel must launch, and the batch's event be
    created, with device 1 current (fake rules: cuda_runtime_api.h:1625-1628, 2804)."""
    if not legacy:
        side_stream(1)
    assert F.current_device() == 0
    src = caches(block_bytes, 4, "device", pairs=2, seed=35, device=1)
    dst = caches(block_bytes, 4, "pinned", pairs=2, seed=36)
    want = expected(src, dst, [0, 3], [1, 2])
    torch_kvswap.set_copy_method(method)
    torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 3]), torch.tensor([1, 2]))
    assert F.current_device() == 0  # restored
    F.set_device(1)  # the stream handle 0 means the current device's legacy stream
    assert F.synchronize(F.current_stream(1)) == "cudaSuccess", (F.violations(), F.call_log())
    F.set_device(0)
    assert all(torch.equal(d, w) for d, w in zip(dst, want))
    assert F.violations() == []
    assert bool(F.launches()) == (method == "kernel")


def test_an_invalid_device_is_the_runtimes_error(fake):
    """cudaSetDevice answers cudaErrorInvalidDevice for an ordinal that is no device; torch's
    guard raises it."""
    with pytest.raises(RuntimeError, match="cudaErrorInvalidDevice"):
        torch.ops.kvswap_test.stream_capturing("cuda", torch.device("cuda", 2))  # two devices
    with pytest.raises(RuntimeError, match="cudaErrorInvalidDevice"):
        F.set_device(-1)
    assert F.current_device() == 0
    assert F.last_error(True) == "cudaSuccess"


def test_fake_rule_launches_and_event_records_belong_to_the_current_device(fake):
    """Kernels run on the current device; an event belongs to the device current when it was
    created and records only on a stream of that device (cuda_runtime_api.h:1625-1628, 2804).
    A copy on another device's stream succeeds (Programming Guide, Stream and Event Behavior)."""
    other = F.create_stream(1, False)
    mine = F.create_stream(0, False)
    assert F.launch_empty(other, 1, 1, 1) == "cudaErrorInvalidResourceHandle"
    assert F.launch_empty(mine, 1, 1, 1) == "cudaSuccess"
    _, event = F.event_create()
    assert F.event_record(event, other) == "cudaErrorInvalidResourceHandle"
    assert F.event_record(event, mine) == "cudaSuccess"
    F.set_device(1)
    assert F.launch_empty(other, 1, 1, 1) == "cudaSuccess"
    assert F.event_record(event, other) == "cudaErrorInvalidResourceHandle"  # still device 0's
    assert F.event_record(F.event_create()[1], other) == "cudaSuccess"
    F.set_device(0)
    src = F.device_copy(torch.arange(64, dtype=torch.uint8), 1)
    dst = F.pinned_copy(torch.zeros(64, dtype=torch.uint8))
    assert F.memcpy_on(dst.data_ptr(), src.data_ptr(), 64, 2, other) == "cudaSuccess"
    assert F.synchronize(other) == "cudaSuccess" and F.synchronize(mine) == "cudaSuccess"
    assert torch.equal(dst, torch.arange(64, dtype=torch.uint8))


def _restore_refused_case():
    """Runs in a child: the engine's scope cannot make cuda:1 current again."""
    import os
    import tempfile
    import warnings

    F.install()
    F.reset(2)
    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                side_stream(0)
                src = caches(4096, 4, "device", pairs=1, seed=37)
                dst = caches(4096, 4, "pinned", pairs=1, seed=38)
                want = expected(src, dst, [0, 1], [2, 3])
                torch_kvswap.set_copy_method("kernel")
                F.set_device(1)
                F.set_fault("refuse_device", 1)
                torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 1]), torch.tensor([2, 3]))
                assert F.current_device() == 0  # stays: the restore was refused
                assert F.synchronize(F.current_stream(0)) == "cudaSuccess"
                assert torch.equal(dst[0], want[0])
                assert F.last_error(True) == "cudaSuccess"
                # Refused again while the launch's own error unwinds: that error arrives.
                F.set_fault("refuse_device", -1)
                F.set_device(1)
                F.set_fault("refuse_device", 1)
                F.set_fault("launch_fail_at", 1)
                try:
                    torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
                    raise AssertionError("the failed launch was not reported")
                except RuntimeError as e:
                    assert "launching the block copy kernel" in str(e) and "nothing was copied" in str(e), e
            os.dup2(saved, 2)
            err.seek(0)
            text = err.read().decode() + "".join(f"{w.message}\n" for w in caught)
            assert text.count("could not make cuda:1 current again") == 1, text  # once per process
            assert "cudaErrorDevicesUnavailable" in text, text
        finally:
            os.dup2(saved, 2)
            F.uninstall()


def test_a_refused_device_restore_warns_once_and_never_throws():
    """A throwing destructor ends the process: the case runs in a child process of its own,
    which exits normally (so an instrumented build's coverage counts it)."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_cuda_fake as t; t._restore_refused_case()"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, (child.returncode, child.stderr[-4000:])


# --- batches: copies land in no order -----------------------------------------------------------


def test_fake_rule_a_batchs_copies_land_in_no_set_order(fake):
    """cuda_runtime_api.h:6371-6378. Eight copies into one byte: the byte keeps whichever ran
    last, which is not always the last submitted."""
    stream = F.create_stream(0, False)
    src = F.device_copy(torch.arange(8, dtype=torch.uint8))
    dst = F.pinned_copy(torch.full((1,), 255, dtype=torch.uint8))
    table = torch.tensor([[dst.data_ptr()] * 8, [src.data_ptr() + i for i in range(8)], [1] * 8])
    landed = set()
    for _ in range(6):
        assert F.batch_copy(table, stream) == "cudaSuccess"
        assert F.synchronize(stream) == "cudaSuccess"
        landed.add(int(dst[0]))
    assert len(landed) > 1 and landed <= set(range(8)), landed


def test_a_batch_failure_names_the_descriptor_the_runtime_reports(fake):
    """CUDA 12.8/12.9 report the failing copy through failIdx; CUDA 13 has no such output."""
    side_stream()
    src = caches(4096, 8, "device", pairs=1)
    dst = caches(4096, 8, "pinned", pairs=1)
    F.set_fault("batch_fail_at", 2)
    torch_kvswap.set_copy_method("dma")
    with pytest.raises(RuntimeError) as info:
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5]))
    assert "the runtime names" not in str(info.value)
    F.set_fault("reports_fail_index", 1)
    with pytest.raises(RuntimeError, match=r"the runtime names descriptor 2: "):
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5]))


@pytest.mark.parametrize("method,fault", [("dma", "memcpy_fail_at"), ("kernel", "launch_fail_at")])
def test_fake_rule_a_failed_copy_or_launch_invalidates_the_capture(fake, method, fault):
    """No source says what a failed call does to a capture: the fake invalidates it (the
    unkind answer), so the partial graph is never instantiated."""
    stream = side_stream()
    src = caches(4096, 4, "device", pairs=1)
    dst = caches(4096, 4, "pinned", pairs=1)
    torch_kvswap.set_copy_method(method)
    F.set_fault(fault, 1)  # the second copy or launch
    with captured(stream) as cap:
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
        with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
            torch_kvswap.swap_blocks(src, dst, torch.tensor([2]), torch.tensor([3]))
    assert cap.error == "cudaErrorStreamCaptureInvalidated"
    assert cap.graph is None


@pytest.mark.parametrize("method", ["dma", "kernel"])
def test_the_engine_works_with_every_optional_entry_absent(fake, method):
    """No batch API and no large-parameter launcher in the table: per-descriptor copies, 4 KiB
    kernel parameters, on a device that is not current, into a host view pinned in place."""
    F.set_fault("batch_absent", 1)
    F.set_fault("large_params_absent", 1)
    F.rebind()
    stream = side_stream(1)
    buffer = page_aligned(5 * 4096)
    host = buffer[4096:].view(4, 4096)
    src = caches(4096, 4, "device", pairs=1, seed=39, device=1)
    want = expected(src, [host], [0, 2], [3, 1])
    with registered(host):
        torch_kvswap.set_copy_method(method)
        torch_kvswap.swap_blocks(src, [host], torch.tensor([0, 2]), torch.tensor([3, 1]))
        assert F.synchronize(stream) == "cudaSuccess"
        assert torch.equal(host, want[0])
    assert F.batches() == [] and not F.batch_enabled(1)
    assert F.kernel_param_bytes(1) == 4096
    assert F.violations() == []


@pytest.mark.parametrize("method,nodes", [("auto", 1), ("dma", 8 * 24)])
def test_a_capture_of_many_large_blocks_stays_a_few_graph_nodes(fake, method, nodes):
    """Issue 25: under capture, per-descriptor DMA records one memcpy node per
    descriptor (8 layers x 24 scattered 64 KiB blocks: 192 nodes); "auto"
    takes the kernel path over the mapped host caches, one node per launch."""
    stream = side_stream()
    src = caches(65536, 64, "device", pairs=8, seed=41)
    dst = caches(65536, 64, "pinned", pairs=8, seed=42)
    sid, did = torch.arange(0, 48, 2), torch.arange(1, 49, 2)  # no two adjacent: no merging
    want = expected(src, dst, sid, did)
    torch_kvswap.set_copy_method(method)
    with captured(stream) as cap:
        torch_kvswap.swap_blocks(src, dst, sid, did)
    assert cap.error == "cudaSuccess"
    assert F.graph_nodes(cap.graph) == nodes
    assert F.launch_graph(cap.graph, stream) == "cudaSuccess"
    assert F.synchronize(stream) == "cudaSuccess"
    assert all(torch.equal(host_bytes(d), w) for d, w in zip(dst, want))


def test_the_current_stream_is_per_thread(fake):
    """torch keeps the current stream per thread (c10/cuda/CUDAStream.cpp): a
    copy made on one thread goes to that thread's stream, and a stream another
    thread made current is not this one's."""
    src, dst = caches(2048, 4, "pinned", seed=43), caches(2048, 4, "device", seed=44)
    before = [host_bytes(d) for d in dst]
    want = expected(src, dst, [0, 1], [2, 3])
    mine = side_stream()
    seen = {}

    def other_thread():
        seen["start"] = F.current_stream(0)  # this thread set none: the default stream
        theirs = F.create_stream(0, False)
        F.set_stream(0, theirs)
        seen["theirs"] = theirs
        torch_kvswap.swap_blocks(src, dst, torch.tensor([0, 1]), torch.tensor([2, 3]))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen["start"] == 0 and F.current_stream(0) == mine != seen["theirs"]
    assert F.synchronize(mine) == "cudaSuccess"  # not this thread's copy: nothing lands
    assert all(torch.equal(host_bytes(d), b) for d, b in zip(dst, before))
    assert F.synchronize(seen["theirs"]) == "cudaSuccess"
    assert all(torch.equal(host_bytes(d), w) for d, w in zip(dst, want))


# --- batches every driver accepts: at most 8,192 descriptors a call ---------------------------

CAP = 8192  # descriptors per cudaMemcpyBatchAsync call by default (cuda_engine.cpp, max_batch)
CAP_ENV = "KVSWAP_CUDA_MAX_BATCH_DESCRIPTORS"


def scatter(n, block=16, seed=0):
    """n host-to-device descriptors of `block` bytes, descriptor i copying pinned block perm[i]
    to device block i (no two merge); returns the table, the pinned source (to keep while
    the copies are queued), the device tensor and its expected bytes."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 255, (n, block), dtype=torch.uint8, generator=g)
    perm = torch.randperm(n, generator=g)
    pinned, dst = F.pinned_copy(src), F.device_copy(torch.zeros(n, block, dtype=torch.uint8))
    table = (
        pinned.data_ptr() + perm * block,
        dst.data_ptr() + torch.arange(n) * block,
        torch.full((n,), block),
    )
    return table, pinned, dst, src[perm]


def submit(table):
    sp, dp, sizes = table
    torch.ops.kvswap_test.submit("cuda", sp, dp, sizes, 0, int(sizes.sum()), torch.device("cuda", 0))


def batch_sizes():
    return F.batches()[::4]  # each record: count, num_attrs, first index, access order


@pytest.mark.parametrize("n,calls", [(CAP - 1, [CAP - 1]), (CAP, [CAP]), (CAP + 1, [CAP, 1])])
def test_a_call_is_split_into_batches_of_at_most_the_cap(fake, n, calls):
    stream = side_stream()
    table, _src, dst, want = scatter(n)
    submit(table)
    assert batch_sizes() == calls
    assert F.synchronize(stream) == "cudaSuccess"
    assert torch.equal(F.host_view(dst), want)
    assert F.violations() == []


def test_a_call_of_100000_descriptors_lands_byte_exact(fake):
    stream = side_stream()
    table, _src, dst, want = scatter(100_000)
    submit(table)
    assert batch_sizes() == [CAP] * 12 + [100_000 - 12 * CAP]
    assert F.synchronize(stream) == "cudaSuccess"
    assert torch.equal(F.host_view(dst), want)
    assert F.violations() == []


@pytest.mark.parametrize(
    "n,answer",
    [(51_827, "cudaSuccess"), (51_828, "cudaErrorInvalidValue"), (51_829, "cudaErrorInvalidValue")],
)
def test_fake_rule_a_batch_of_51828_descriptors_is_refused(fake, n, answer):
    """vLLM #49276: one call of 51,828 descriptors crashed the process; the fake refuses it."""
    stream = F.create_stream(0, False)
    (sp, dp, sizes), _src, dst, want = scatter(n, block=1)
    table = torch.stack([dp, sp, sizes])  # read when the copies run: kept until the sync
    assert F.batch_copy(table, stream) == answer
    assert F.synchronize(stream) == "cudaSuccess"
    refused = answer != "cudaSuccess"
    assert F.violations() == (
        [f"cudaMemcpyBatchAsync: {n} descriptors in one call (51,828 crashed the process: vLLM #49276)"]
        if refused
        else []
    )
    assert torch.equal(F.host_view(dst), torch.zeros_like(want) if refused else want)


def test_the_environment_sets_the_cap_when_the_engine_is_bound(fake, monkeypatch):
    monkeypatch.setenv(CAP_ENV, "3")
    F.rebind()
    assert F.max_batch() == 3
    report = dict(line.split("=", 1) for line in torch.ops.kvswap._engine_report(torch.device("cuda:0")))
    assert report["batch_cap"] == "3 descriptors per cudaMemcpyBatchAsync call"
    stream = side_stream()
    table, _src, dst, want = scatter(7)
    submit(table)
    assert batch_sizes() == [3, 3, 1]
    assert F.synchronize(stream) == "cudaSuccess"
    assert torch.equal(F.host_view(dst), want)
    monkeypatch.delenv(CAP_ENV)
    F.rebind()
    assert F.max_batch() == CAP


@pytest.mark.parametrize("text", ["0", "-5", "many", "12x", "", "99999999999999999999"])
def test_a_cap_that_is_not_a_count_is_refused_before_any_copy(fake, monkeypatch, text):
    monkeypatch.setenv(CAP_ENV, text)
    F.rebind()
    side_stream()
    table, _src, _, _ = scatter(2)
    with pytest.raises(
        ValueError,
        match=rf"{CAP_ENV}='{text}' is not a descriptor count: expected a whole "
        rf"number of at least 1 \(the default is 8192\); set one, or unset "
        rf"the variable.*\(nothing was copied\)$",
    ):
        submit(table)
    assert F.count_calls("cudaMemcpyBatchAsync") == 0


def test_the_setter_overrides_the_cap_until_the_engine_is_bound_again(fake):
    F.set_max_batch(2)
    stream = side_stream()
    table, _src, dst, want = scatter(5)
    submit(table)
    assert batch_sizes() == [2, 2, 1]
    assert F.synchronize(stream) == "cudaSuccess"
    assert torch.equal(F.host_view(dst), want)
    with pytest.raises(ValueError, match="must be at least 1, got 0"):
        F.set_max_batch(0)
    F.rebind()
    assert F.max_batch() == CAP


LATER_BATCH_FAILED = (
    r"cudaMemcpyBatchAsync failed: cudaErrorInvalidValue \(.*\)\. 4 descriptors "
    r"\(host_to_device\), batch 2 of 3 of this call's 10 descriptors \(descriptors 4\.\.7, "
    r"at most 4 a batch\); descriptors 0\.\.3 were queued by the earlier batches and will "
    r"still run; any of them may have been queued, wholly or in part \(the runtime does not "
    r"say how far it got\), and what was will still run; descriptors 8\.\.9 were not queued"
)


def second_of_three_batches_fails():
    """10 descriptors in batches of 4, the second batch failing, on a stalled side stream."""
    stream = side_stream()
    F.set_max_batch(4)
    table, src, dst, want = scatter(10)
    F.set_fault("stalled", 1)
    F.set_fault("batch_fail_call", 1)
    return stream, (table, src), dst, want


def test_a_failure_in_a_later_batch_names_what_was_queued_and_the_earlier_batches_land(fake):
    stream, (table, _src), dst, want = second_of_three_batches_fails()
    before = F.host_view(dst).clone()
    with pytest.raises(RuntimeError, match=LATER_BATCH_FAILED) as info:
        submit(table)
    assert "nothing was copied" not in str(info.value)
    assert F.last_error(True) == "cudaSuccess"
    assert F.in_flight(0) == 1  # the queued batches still read the table
    F.set_fault("stalled", 0)
    assert F.synchronize(stream) == "cudaSuccess"
    assert F.in_flight(0) == 0
    got = F.host_view(dst)
    assert torch.equal(got[:4], want[:4]) and torch.equal(got[4:], before[4:])


def test_a_later_batch_failure_is_reported_even_when_its_event_fails(fake):
    _, (table, _src), _, _ = second_of_three_batches_fails()
    F.set_fault("fail:cudaEventRecord", 1)
    with pytest.raises(RuntimeError, match=LATER_BATCH_FAILED):
        submit(table)
    F.set_fault("fail:cudaEventRecord", 0)
    assert F.in_flight(0) == 1  # held without an event: released after a later one of its stream
