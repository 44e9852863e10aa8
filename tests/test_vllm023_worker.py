"""vLLM 0.23's own OffloadingWorker drives KVSwapOffloadingHandler on CPU caches.

The handler is built as the reference handler is (block sizes, host block
count, a ``{layer: kv}`` cache dict), registered with vLLM's
``OffloadingWorker`` for (GPU spec -> CPU spec) and (CPU spec -> GPU spec),
and driven with the reference's call pattern: stores, ``get_finished``,
``wait``, loads into zeroed device caches, ``get_finished``. Every loaded byte
is compared with a plain reference copy of the blocks.

Each test runs twice: on the installed vLLM 0.23 (``[vllm]``; skipped when it
is not installed, unless ``KVSWAP_REQUIRE_VLLM=1``, as scripts/test_vllm.sh
sets in its ``.venv-vllm-0.23``), and on a stand-in of vLLM 0.23's worker
interface (``[standin]``, written from vLLM 0.23's source), so the handler's
logic is tested in every environment and by the mutation check.
"""

from __future__ import annotations

import os
import re
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torch_kvswap.offloader import offloader as offloader_module
from torch_kvswap.integrations import vllm as plugin
from torch_kvswap.integrations.vllm import compat
from vllm_helpers import forget_plugin_classes

GPU_BLOCK, CPU_BLOCK, FACTOR = 16, 32, 2
NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 12, 6


# -- the two vLLMs: the installed 0.23 and a stand-in of its interface -------------------


def real_vllm() -> SimpleNamespace:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
        from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
        from vllm.v1.kv_offload.worker.worker import OffloadingWorker, TransferResult
        from torch_kvswap.integrations.vllm import compat

        low, high = compat.HANDLER_RANGE  # the handler's releases: 0.23 and 0.24 run this worker
        if not low <= (compat._major_minor(vllm.__version__) or (0, 0)) <= high:
            raise ImportError(f"vLLM {vllm.__version__} is installed, not one of the handler's releases")
    except Exception as exc:
        if os.environ.get("KVSWAP_REQUIRE_VLLM") == "1":  # scripts/test_vllm.sh: never skip
            raise
        pytest.skip(
            f"vLLM 0.23 is not importable here ({type(exc).__name__}: {exc}); run bash scripts/test_vllm.sh"
        )
    return SimpleNamespace(
        OffloadingWorker=OffloadingWorker,
        TransferResult=TransferResult,
        GPU=GPULoadStoreSpec,
        CPU=CPULoadStoreSpec,
        BlockIDs=BlockIDsLoadStoreSpec,
    )


def install_standin(
    monkeypatch,
    version: str = "0.23.0",
    handler_interface: bool = True,
    transfer_async_params: str = "job_id, spec",
) -> SimpleNamespace:
    """Installs a stand-in vLLM ``version`` with 0.23's kv_offload worker
    interface (without it when ``handler_interface`` is False)."""

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    class LoadStoreSpec:
        pass

    class BlockIDsLoadStoreSpec(LoadStoreSpec):
        def __init__(self, block_ids):
            self.block_ids = np.array(block_ids, dtype=np.int64)

    class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
        def __init__(self, block_ids, group_sizes, block_indices):
            super().__init__(block_ids)
            assert sum(group_sizes) == len(block_ids) and len(block_indices) == len(group_sizes)
            self.group_sizes, self.block_indices = group_sizes, block_indices

        @staticmethod
        def medium():
            return "GPU"

    class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
        @staticmethod
        def medium():
            return "CPU"

    @dataclass
    class TransferResult:
        job_id: int
        success: bool
        transfer_size: int | None = None
        transfer_time: float | None = None
        transfer_type: tuple[str, str] | None = None

    ns: dict = {}
    exec(
        f"class OffloadingHandler:\n"
        f"    def transfer_async(self, {transfer_async_params}): raise NotImplementedError\n"
        "    def get_finished(self): raise NotImplementedError\n"
        "    def wait(self, job_ids): raise NotImplementedError\n"
        "    def shutdown(self): return\n",
        ns,
    )

    class OffloadingWorker:  # vLLM 0.23's router: by (src.medium(), dst.medium())
        def __init__(self):
            self.handlers, self.by_type = set(), {}

        def register_handler(self, src_cls, dst_cls, handler):
            key = (src_cls.medium(), dst_cls.medium())
            assert key not in self.by_type
            self.handlers.add(handler)
            self.by_type[key] = handler

        def transfer_async(self, job_id, spec):
            src, dst = spec
            handler = self.by_type.get((src.medium(), dst.medium()))
            assert handler is not None
            try:
                return handler.transfer_async(job_id, spec)
            except Exception:  # noqa: BLE001 - vLLM logs it and reports "not submitted"
                return False

        def get_finished(self):
            return [r for h in self.handlers for r in h.get_finished()]

        def wait(self, job_ids):
            for h in self.handlers:
                h.wait(job_ids)

        def shutdown(self):
            for h in self.handlers:
                h.shutdown()

    base = module(
        "vllm.v1.kv_offload.base",
        LoadStoreSpec=LoadStoreSpec,
        GPULoadStoreSpec=GPULoadStoreSpec,
        BlockIDsLoadStoreSpec=BlockIDsLoadStoreSpec,
    )
    common = module("vllm.v1.kv_offload.cpu.common", CPULoadStoreSpec=CPULoadStoreSpec)
    module("vllm.v1.kv_offload.cpu", common=common)
    pkg = {"base": base}
    if handler_interface:
        worker = module(
            "vllm.v1.kv_offload.worker.worker",
            OffloadingHandler=ns["OffloadingHandler"],
            OffloadingWorker=OffloadingWorker,
            TransferResult=TransferResult,
        )
        pkg["worker"] = module("vllm.v1.kv_offload.worker", worker=worker)
    else:
        monkeypatch.setitem(sys.modules, "vllm.v1.kv_offload.worker", None)  # import fails
    module("vllm.v1.kv_offload", **pkg)
    module("vllm.v1")
    module("vllm", __version__=version)
    forget_plugin_classes(monkeypatch)
    return SimpleNamespace(
        OffloadingWorker=OffloadingWorker,
        TransferResult=TransferResult,
        GPU=GPULoadStoreSpec,
        CPU=CPULoadStoreSpec,
        BlockIDs=BlockIDsLoadStoreSpec,
    )


@pytest.fixture(params=["vllm", "standin"])
def v(request, monkeypatch) -> SimpleNamespace:
    """vLLM's classes (``OffloadingWorker``, ``TransferResult``, ``GPU`` and
    ``CPU`` specs) plus ``Handler``, the plug-in's handler class built on them."""
    if request.param == "vllm":
        ns = real_vllm()
        forget_plugin_classes(monkeypatch)
    else:
        ns = install_standin(monkeypatch)
    ns.Handler = plugin.KVSwapOffloadingHandler
    return ns


# -- the caches and the plain reference ---------------------------------------------------


def make_caches(seed: int = 0) -> dict[str, object]:
    """Two layers, as the reference handler takes them: one stacked [2, blocks, ...]
    tensor, one (key, value) pair; random bits in every byte (bf16 and fp32)."""
    g = torch.Generator().manual_seed(seed)
    stacked = torch.randint(-(2**15), 2**15, (2, NUM_GPU_BLOCKS, 4, 8), generator=g, dtype=torch.int16).view(
        torch.bfloat16
    )
    pair = tuple(
        torch.randint(-(2**31), 2**31 - 1, (NUM_GPU_BLOCKS, 3, 5), generator=g, dtype=torch.int32).view(
            torch.float32
        )
        for _ in range(2)
    )
    return {"layers.0": stacked, "layers.1": pair}


def tensors(caches: dict[str, object]) -> list[torch.Tensor]:
    """[layer0 K, layer0 V, layer1 K, layer1 V]: the reference handler's order."""
    return [caches["layers.0"][0], caches["layers.0"][1], *caches["layers.1"]]


def block_bytes(caches) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors(caches))


class ReferenceHost:
    """Host sub-block rows per cache tensor, as plain byte copies (zeros until stored)."""

    def __init__(self, caches):
        self.rows = {
            i: torch.zeros((NUM_CPU_BLOCKS * FACTOR, *t.shape[1:]), dtype=t.dtype)
            for i, t in enumerate(tensors(caches))
        }

    def store(self, caches, device_ids, host_ids, skip, tensor_ids=(0, 1, 2, 3)):
        rows = [h * FACTOR + s for h in host_ids for s in range(FACTOR)][skip : skip + len(device_ids)]
        for i in tensor_ids:
            for d, r in zip(device_ids, rows):
                self.rows[i][r] = tensors(caches)[i][d].clone()

    def load(self, expected, host_ids, device_ids, skip, tensor_ids=(0, 1, 2, 3)):
        rows = [h * FACTOR + s for h in host_ids for s in range(FACTOR)][skip : skip + len(device_ids)]
        for i in tensor_ids:
            for d, r in zip(device_ids, rows):
                expected[i][d] = self.rows[i][r]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def zero(caches) -> None:
    for t in tensors(caches):
        t.zero_()


def finish(worker, job_ids: set[int], seen: list) -> None:
    """The connector's step end: wait for the jobs, then collect what finished."""
    seen += worker.get_finished()
    worker.wait(job_ids)
    seen += worker.get_finished()


def registered(v, handler):
    worker = v.OffloadingWorker()
    worker.register_handler(v.GPU, v.CPU, handler)
    worker.register_handler(v.CPU, v.GPU, handler)
    return worker


# -- the reference handler's call pattern, byte-exact -----------------------------------------


def test_vllms_worker_round_trips_blocks_byte_exact_with_the_reference_call_pattern(v):
    caches = make_caches()
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, caches, attn_backends={})
    worker = registered(v, handler)
    original = [t.clone() for t in tensors(caches)]
    ref = ReferenceHost(caches)
    seen: list = []
    # step 1: two stores (the second ends on a host-block boundary: skips sub-block 0)
    assert worker.transfer_async(1, (v.GPU([3, 7, 1, 10], [4], [0]), v.CPU([0, 4])))
    assert worker.transfer_async(2, (v.GPU([5], [1], [1]), v.CPU([2])))
    ref.store(caches, [3, 7, 1, 10], [0, 4], 0)
    ref.store(caches, [5], [2], 1)
    finish(worker, {1, 2}, seen)
    # step 2: loads of whole host blocks into zeroed device caches
    zero(caches)
    assert worker.transfer_async(3, (v.CPU([4, 0]), v.GPU([0, 1, 2, 3], [4], [0])))
    assert worker.transfer_async(4, (v.CPU([2]), v.GPU([8, 9], [2], [0])))
    finish(worker, {3, 4}, seen)
    expected = [torch.zeros_like(t) for t in original]
    ref.load(expected, [4, 0], [0, 1, 2, 3], 0)
    ref.load(expected, [2], [8, 9], 0)
    for got, want in zip(tensors(caches), expected):
        assert same_bytes(got, want)
    # the reference copy is not trivially matched: block 0 holds device block 1's bytes
    assert same_bytes(tensors(caches)[0][0], original[0][1])
    assert not same_bytes(tensors(caches)[0][0], original[0][0])
    assert same_bytes(tensors(caches)[3][9], original[3][5])
    assert not tensors(caches)[2][8].view(torch.uint8).any()  # host 2's sub-block 0: never stored
    nbytes = block_bytes(caches)
    assert sorted((r.job_id, r.success, r.transfer_size, r.transfer_type) for r in seen) == [
        (1, True, 4 * nbytes, ("GPU", "CPU")),
        (2, True, nbytes, ("GPU", "CPU")),
        (3, True, 4 * nbytes, ("CPU", "GPU")),
        (4, True, 2 * nbytes, ("CPU", "GPU")),
    ]
    assert all(type(r) is v.TransferResult and r.transfer_time >= 0 for r in seen)
    worker.shutdown()


def test_a_wrong_expected_block_and_a_never_stored_host_block_are_caught(v):
    caches = make_caches(1)
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, caches)
    worker = registered(v, handler)
    original = [t.clone() for t in tensors(caches)]
    assert worker.transfer_async(1, (v.GPU([6, 2], [2], [0]), v.CPU([1])))
    finish(worker, {1}, [])
    zero(caches)
    assert worker.transfer_async(2, (v.CPU([1, 3]), v.GPU([0, 1, 4, 5], [4], [0])))
    finish(worker, {2}, [])
    k = tensors(caches)[0]
    assert same_bytes(k[0], original[0][6]) and same_bytes(k[1], original[0][2])
    assert not same_bytes(k[0], original[0][2])  # a deliberately wrong expected block
    assert not same_bytes(k[4], original[0][4])  # host block 3 was never stored: zeros
    assert not k[4:6].view(torch.uint8).any()
    worker.shutdown()


def test_a_load_may_start_mid_host_block_from_block_indices(v):
    caches = make_caches(2)
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, caches)
    worker = registered(v, handler)
    original = [t.clone() for t in tensors(caches)]
    # a request's blocks 1..3 (index 1 is sub-block 1 of its first host block)
    assert worker.transfer_async(1, (v.GPU([4, 8, 9], [3], [1]), v.CPU([0, 5])))
    finish(worker, {1}, [])
    zero(caches)
    # its blocks 1..2 again: host 0 sub-block 1, then host 5 sub-block 0
    assert worker.transfer_async(2, (v.CPU([0, 5]), v.GPU([10, 11], [2], [1])))
    finish(worker, {2}, [])
    for got, want in zip(tensors(caches), original):
        assert same_bytes(got[10], want[4]) and same_bytes(got[11], want[8])
        assert not got[:10].view(torch.uint8).any()
    worker.shutdown()


def test_each_kv_cache_group_moves_its_own_tensors(v):
    caches = make_caches(3)
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, caches, groups=[[0, 1], [2, 3]])
    worker = registered(v, handler)
    original = [t.clone() for t in tensors(caches)]
    ref = ReferenceHost(caches)
    assert worker.transfer_async(1, (v.GPU([2, 4, 6], [2, 1], [0, 1]), v.CPU([1, 3])))
    ref.store(caches, [2, 4], [1], 0, tensor_ids=(0, 1))
    ref.store(caches, [6], [3], 1, tensor_ids=(2, 3))
    finish(worker, {1}, [])
    zero(caches)
    assert worker.transfer_async(2, (v.CPU([1, 3]), v.GPU([0, 1, 7, 8], [2, 2], [0, 0])))
    finish(worker, {2}, [])
    expected = [torch.zeros_like(t) for t in original]
    ref.load(expected, [1], [0, 1], 0, tensor_ids=(0, 1))
    ref.load(expected, [3], [7, 8], 0, tensor_ids=(2, 3))
    for got, want in zip(tensors(caches), expected):
        assert same_bytes(got, want)
    assert same_bytes(tensors(caches)[2][8], original[2][6])
    worker.shutdown()


# -- error paths ---------------------------------------------------------------------------


def test_a_pair_of_media_the_handler_does_not_serve_is_refused(v):
    caches = make_caches()
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, caches)

    class DiskSpec(v.BlockIDs):
        @staticmethod
        def medium():
            return "DISK"

    worker = registered(v, handler)
    worker.register_handler(v.GPU, DiskSpec, handler)
    assert worker.transfer_async(1, (v.GPU([0, 1], [2], [0]), DiskSpec([0]))) is False
    with pytest.raises(
        ValueError,
        match=r"spec media must be \('GPU', 'CPU'\) \(a store\) or "
        r"\('CPU', 'GPU'\) \(a load\), got \('GPU', 'DISK'\)",
    ):
        handler.transfer_async(1, (v.GPU([0, 1], [2], [0]), DiskSpec([0])))
    with pytest.raises(ValueError, match=r"got \('CPU', 'CPU'\)"):
        handler.transfer_async(1, (v.CPU([0]), v.CPU([1])))
    assert handler.offloader.pending() == []
    assert worker.get_finished() == []
    worker.shutdown()


def test_specs_that_are_not_vllms_are_refused_naming_what_came(v):
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, make_caches())

    class OtherGPU:
        block_ids = np.array([0, 1])

        @staticmethod
        def medium():
            return "GPU"

    with pytest.raises(
        TypeError,
        match=r"spec must pair vLLM's GPULoadStoreSpec with its "
        r"CPULoadStoreSpec, got OtherGPU -> CPULoadStoreSpec",
    ):
        handler.transfer_async(1, (OtherGPU(), v.CPU([0])))
    with pytest.raises(
        TypeError,
        match=r"spec's dst must be a vLLM LoadStoreSpec \(with medium\(\)\), "
        r"got list",
    ):
        handler.transfer_async(1, (v.GPU([0], [1], [1]), [0]))
    with pytest.raises(TypeError, match=r"spec must be a \(src, dst\) tuple"):
        handler.transfer_async(1, [v.GPU([0], [1], [1]), v.CPU([0])])
    handler.shutdown()


def test_a_failed_copy_is_reported_as_success_false_and_the_next_job_still_runs(v, monkeypatch):
    caches = make_caches()
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, caches)
    worker = registered(v, handler)
    real = offloader_module.ops.swap_blocks

    def broken(*args, **kw):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(offloader_module.ops, "swap_blocks", broken)
    assert worker.transfer_async(1, (v.GPU([0, 1], [2], [0]), v.CPU([0])))
    seen: list = []
    finish(worker, {1}, seen)
    assert [(r.job_id, r.success, r.transfer_type) for r in seen] == [(1, False, ("GPU", "CPU"))]
    monkeypatch.setattr(offloader_module.ops, "swap_blocks", real)
    assert worker.transfer_async(2, (v.GPU([0, 1], [2], [0]), v.CPU([0])))
    seen = []
    finish(worker, {2}, seen)
    assert [(r.job_id, r.success) for r in seen] == [(2, True)]
    worker.shutdown()


def test_a_bad_job_is_not_submitted_and_leaves_nothing_pending(v):
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, make_caches(), strict=True)
    worker = registered(v, handler)
    # strict: host block 2 was never stored
    assert worker.transfer_async(1, (v.CPU([2]), v.GPU([0, 1], [2], [0]))) is False
    with pytest.raises(ValueError, match=r"reads host block 2 .*which no store has written"):
        handler.transfer_async(1, (v.CPU([2]), v.GPU([0, 1], [2], [0])))
    # three device blocks from block index 0 need two host blocks
    with pytest.raises(ValueError, match=r"store of 3 device blocks needs 2 host blocks \(factor 2\), got 1"):
        handler.transfer_async(2, (v.GPU([0, 1, 2], [3], [0]), v.CPU([0])))
    with pytest.raises(IndexError, match=r"host_block_ids\[0\] = 6 is out of range: valid ids are 0\.\.5"):
        handler.transfer_async(3, (v.GPU([0, 1], [2], [0]), v.CPU([NUM_CPU_BLOCKS])))
    assert handler.offloader.pending() == [] and worker.get_finished() == []
    worker.shutdown()


def test_a_job_id_refused_once_can_be_submitted_again(v):
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, make_caches())
    with pytest.raises(ValueError, match=r"store of 3 device blocks needs 2 host blocks"):
        handler.transfer_async(1, (v.GPU([0, 1, 2], [3], [0]), v.CPU([0])))
    assert handler.transfer_async(1, (v.GPU([0, 1], [2], [0]), v.CPU([0])))
    handler.wait({1})
    assert [(r.job_id, r.success) for r in handler.get_finished()] == [(1, True)]
    handler.shutdown()


def test_a_job_id_in_flight_or_not_an_int_is_refused(v):
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, make_caches())
    assert handler.transfer_async(1, (v.GPU([0, 1], [2], [0]), v.CPU([0])))
    with pytest.raises(ValueError, match=r"job id 1 is already in flight or not yet reported"):
        handler.transfer_async(1, (v.CPU([0]), v.GPU([2, 3], [2], [0])))
    with pytest.raises(TypeError, match=r"job_id must be an int, got str '2'"):
        handler.transfer_async("2", (v.CPU([0]), v.GPU([2, 3], [2], [0])))
    handler.wait({1})
    assert [(r.job_id, r.transfer_type) for r in handler.get_finished()] == [(1, ("GPU", "CPU"))]
    handler.shutdown()


def test_wait_ignores_the_ids_of_other_handlers_even_when_strict(v):
    # vLLM's worker hands every handler the whole set of ids it waits for
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, make_caches(), strict=True)
    worker = registered(v, handler)
    assert worker.transfer_async(1, (v.GPU([0, 1], [2], [0]), v.CPU([0])))
    worker.wait({1, 99})
    assert [r.job_id for r in worker.get_finished()] == [1]
    worker.shutdown()


def test_shutdown_is_idempotent_and_refuses_later_jobs(v):
    handler = v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, make_caches())
    worker = registered(v, handler)
    assert worker.transfer_async(1, (v.GPU([0, 1], [2], [0]), v.CPU([0])))
    worker.shutdown()
    handler.shutdown()
    assert [r.job_id for r in worker.get_finished()] == [1]  # results stay available
    assert worker.transfer_async(2, (v.GPU([0, 1], [2], [0]), v.CPU([0]))) is False
    with pytest.raises(RuntimeError, match="shut down"):
        handler.transfer_async(2, (v.GPU([0, 1], [2], [0]), v.CPU([0])))


def test_caches_that_are_not_per_layer_key_value_pairs_are_refused(v):
    with pytest.raises(
        TypeError,
        match=r"gpu_caches must be a mapping of layer name to its "
        r"\(key, value\) caches, got list",
    ):
        v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, [torch.zeros(2, 4, 8)])
    with pytest.raises(
        ValueError,
        match=r"gpu_caches\['l0'\] must be a \(key, value\) pair or a tensor "
        r"whose dim 0 \(of size 2\) picks key and value, got shape \(4, 8\)",
    ):
        v.Handler(GPU_BLOCK, CPU_BLOCK, NUM_CPU_BLOCKS, {"l0": torch.zeros(4, 8)})
    with pytest.raises(ValueError, match=r"host_block_size \(24\) must be a positive multiple"):
        v.Handler(GPU_BLOCK, 24, NUM_CPU_BLOCKS, make_caches())


# -- the version check (stand-in releases only) -------------------------------------------------


@pytest.mark.parametrize(
    "version, interface, differs",
    [
        (
            "0.33.0",
            False,
            r"release 0\.33 is above the handler's range \(from 0\.25 on, use "
            r"KVSwapOffloadingSpec\); vllm\.v1\.kv_offload\.worker\.worker cannot be imported",
        ),
        ("0.22.0", True, r"release 0\.22 is below the handler's range"),
        ("main", True, r"its version 'main' is not a release number"),
    ],
)
def test_a_release_without_the_handler_interface_is_refused_naming_it(
    monkeypatch, version, interface, differs
):
    install_standin(monkeypatch, version, handler_interface=interface)
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=rf"^torch_kvswap's OffloadingHandler does not support vLLM {version}: "
        rf"{differs}.*\. Supported: vLLM 0\.23 to 0\.24 \(tested: 0\.23\.0\)$",
    ):
        plugin.KVSwapOffloadingHandler  # noqa: B018


def test_a_023_whose_transfer_async_differs_is_refused(monkeypatch):
    install_standin(monkeypatch, transfer_async_params="job_id, src_spec, dst_spec")
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=r"does not support vLLM 0\.23\.0: OffloadingHandler\.transfer_async takes "
        r"\['job_id', 'src_spec', 'dst_spec'\], expected \['job_id', 'spec'\]\.",
    ):
        plugin.KVSwapOffloadingHandler  # noqa: B018


def test_the_standin_0_23_is_accepted_and_the_class_is_built_once(monkeypatch):
    install_standin(monkeypatch)
    cls = plugin.KVSwapOffloadingHandler
    assert cls is plugin.KVSwapOffloadingHandler
    assert cls.__mro__[1] is sys.modules["vllm.v1.kv_offload.worker.worker"].OffloadingHandler


def test_on_vllm_0_23_the_connector_spec_is_still_refused_pointing_at_the_handler(monkeypatch):
    real_vllm()  # the installed vLLM 0.23 or 0.24 (skips without it)
    import vllm

    major, minor = compat._major_minor(vllm.__version__)
    forget_plugin_classes(monkeypatch)
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=rf"does not support vLLM {re.escape(vllm.__version__)} \(offloading path\): "
        rf"release {major}\.{minor} is below "
        r"the supported range; .*OffloadingHandler\.transfer_async\(job_id, spec\) "
        r"interface, not OffloadingWorker\.submit_store/submit_load "
        r"\(KVSwapOffloadingHandler serves that interface\)",
    ):
        plugin.KVSwapOffloadingSpec  # noqa: B018
