"""The bound KVSwapTieringOffloadingSpec puts on vLLM's p2p tier
(torch_kvswap/integrations/vllm/p2p.py), on a stand-in tier and clock.

The stand-ins have only what the bound reads of vLLM's
``P2PSecondaryTierManager`` (``lookup``, ``_failed_req_ids``, ``_sessions``
and a session's ``_conn.mark_dead``), ``P2PSourceInfo`` and
``LookupResult``; tests/test_vllm_p2p_conformance.py runs the same bound on
each vLLM release's own tier (0.27 to 0.32), and tests/test_vllm_p2p.py
through two engines.
"""

from __future__ import annotations

import dataclasses
import enum
import logging

import pytest

from torch_kvswap.integrations.vllm.p2p import DEFAULT_LOOKUP_TIMEOUT_S, _Bound, lookup_timeout

TIMEOUT = 10.0
PEER = "127.0.0.1:5710"


class Result(enum.Enum):
    MISS = 0
    HIT = 1
    RETRY = 2


@dataclasses.dataclass
class Source:
    kv_request_id: str
    peer_id: str
    do_probe: bool


class Context:
    def __init__(self, source: Source | None):
        self.source = source

    def get_state(self, cls):
        assert cls is Source
        return self.source


class Conn:
    dead = False

    def mark_dead(self):
        self.dead = True


class Session:
    def __init__(self):
        self._conn = Conn()


class Tier:
    """What vLLM's tier answers: `answers` in turn, then RETRY."""

    def __init__(self, *answers: Result):
        self._failed_req_ids: set[str] = set()
        self._sessions = {PEER: Session()}
        self.answers = list(answers)
        self.calls = 0

    def lookup(self, key, ctx):
        self.calls += 1
        return self.answers.pop(0) if self.answers else Result.RETRY


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def bound(tier: Tier, clock: Clock) -> _Bound:
    return _Bound(tier, TIMEOUT, Source, Result, clock)


def ask(b: _Bound, ctx: Context):
    return b.lookup(b.tier.lookup, "key", ctx)


def request(rid: str = "r1", peer: str = PEER, probe: bool = True) -> Context:
    return Context(Source(rid, peer, probe))


def test_a_lookup_retried_for_less_than_the_timeout_is_retried_again():
    tier, clock = Tier(), Clock()
    b = bound(tier, clock)
    assert ask(b, request()) is Result.RETRY
    clock.now += TIMEOUT - 0.001
    assert ask(b, request()) is Result.RETRY
    assert not tier._failed_req_ids and not tier._sessions[PEER]._conn.dead


def test_at_the_timeout_the_request_misses_and_the_peer_is_marked_dead(caplog):
    tier, clock = Tier(), Clock()
    b = bound(tier, clock)
    assert ask(b, request()) is Result.RETRY
    clock.now += TIMEOUT
    with caplog.at_level(logging.WARNING):
        assert ask(b, request()) is Result.MISS
    assert tier._failed_req_ids == {"r1"}  # vLLM's lookup misses every later key of the request
    assert tier._sessions[PEER]._conn.dead  # vLLM's reap fails the session's other lookups
    assert f"p2p peer {PEER} answered no lookup of request r1 in 10.0 s" in caplog.text


def test_the_dead_peer_is_refused_at_once_for_the_timeout_then_asked_again():
    tier, clock = Tier(), Clock()
    b = bound(tier, clock)
    ask(b, request())
    clock.now += TIMEOUT
    assert ask(b, request()) is Result.MISS
    calls = tier.calls
    clock.now += TIMEOUT - 0.001
    assert ask(b, request("r2")) is Result.MISS  # refused without asking vLLM's tier
    assert tier.calls == calls and "r2" in tier._failed_req_ids
    clock.now += 0.001
    assert ask(b, request("r3")) is Result.RETRY  # the window is over: a restarted peer may answer
    assert tier.calls == calls + 1


def test_an_answer_restarts_the_requests_clock():
    tier, clock = Tier(Result.RETRY, Result.HIT), Clock()
    b = bound(tier, clock)
    assert ask(b, request()) is Result.RETRY
    clock.now += TIMEOUT - 1
    assert ask(b, request()) is Result.HIT
    clock.now += TIMEOUT - 1
    assert ask(b, request()) is Result.RETRY  # counted from here, not from the first RETRY
    clock.now += TIMEOUT - 1
    assert ask(b, request()) is Result.RETRY


def test_a_finished_request_forgets_its_clock():
    tier, clock = Tier(), Clock()
    b = bound(tier, clock)
    finished = []
    ask(b, request())
    b.finished(finished.append, request())
    clock.now += TIMEOUT
    assert ask(b, request()) is Result.RETRY  # a new request under the same id starts afresh
    assert len(finished) == 1


@pytest.mark.parametrize("ctx", [request(probe=False), Context(None)], ids=["prefill-decode", "no-peer"])
def test_requests_that_do_not_probe_a_peer_pass_through(ctx):
    tier, clock = Tier(), Clock()
    b = bound(tier, clock)
    ask(b, ctx)
    clock.now += 10 * TIMEOUT
    assert ask(b, ctx) is Result.RETRY and not tier._failed_req_ids


def test_another_peer_is_not_refused_with_the_dead_one():
    tier, clock = Tier(), Clock()
    tier._sessions["10.0.0.2:5711"] = Session()
    b = bound(tier, clock)
    ask(b, request())
    clock.now += TIMEOUT
    assert ask(b, request()) is Result.MISS
    assert ask(b, request("r2", peer="10.0.0.2:5711")) is Result.RETRY


@pytest.mark.parametrize("value", [0, -1, "soon", float("inf"), float("nan"), True, None])
def test_a_lookup_timeout_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(ValueError, match=r"'p2p_lookup_timeout_s' must be a positive number of seconds"):
        lookup_timeout({"p2p_lookup_timeout_s": value})


def test_the_lookup_timeout_defaults_and_takes_numbers():
    assert lookup_timeout({}) == DEFAULT_LOOKUP_TIMEOUT_S == 15.0
    assert lookup_timeout({"p2p_lookup_timeout_s": "2.5"}) == 2.5
    assert lookup_timeout({"p2p_lookup_timeout_s": 1e-3}) == 1e-3
