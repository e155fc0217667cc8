"""What a lost replica's requests become (``replica-loss``), model-free: the replicated frontend's
``_lost`` on a real Router, with the Ray calls around it stubbed (no Ray, milliseconds)."""

from __future__ import annotations

import asyncio
from collections import Counter

from ninfer.errors import ErrorKind
from ninfer.replicas.frontend import LIVE, LOST, STARTING, Replica, ReplicatedFrontend
from tests.replicas.test_router import _publish, _router, _toks


def _frontend():
    fe = ReplicatedFrontend.__new__(ReplicatedFrontend)
    fe.router = _router()
    fe.counters, fe._sources, fe.unstarted = Counter(), {"1.0": 1}, {}
    fe.moved, fe.failed, fe.replaced = [], [], []

    async def redispatch(rid):
        fe.moved.append(rid)

    async def replace(slot, gen):
        fe.replaced.append((slot, gen))
    fe._redispatch, fe._replace = redispatch, replace
    fe._fail = lambda rid, kind, message="": fe.failed.append((rid, kind))
    fe._push = lambda: None
    return fe


def _lose(fe, rep):
    async def go():
        fe._lost(rep, "a test")
        await asyncio.sleep(0)                     # the tasks it started run
    asyncio.run(go())


def test_a_lost_replicas_queued_requests_move_and_its_generating_ones_fail_retryably():
    """replica-loss: what the lost replica held with no token yet is re-routed; what had
    produced tokens ends with ``replica_lost``; a replacement starts under the next generation —
    only for a replica that was serving (one that failed to start is retried by its starter)."""
    fe = _frontend()
    doc = _toks(3, 300)
    _publish(fe.router, 1, doc, 200)
    fe.router.route("queued", doc[:250])
    fe.router.route("generating", doc[:260])
    assert fe.router.replica_of("queued") == fe.router.replica_of("generating") == 1
    fe.unstarted["queued"] = b"request"
    rep = Replica(1, 0, None, None)
    rep.state = LIVE
    _lose(fe, rep)
    assert rep.state == LOST and fe.moved == ["queued"]
    assert fe.failed == [("generating", ErrorKind.REPLICA_LOST)] and fe.counters["failed_in_flight"] == 1
    assert fe.replaced == [(1, 1)] and fe.counters["replicas_lost"] == 1
    _lose(fe, rep)                                 # lost once only
    assert fe.counters["replicas_lost"] == 1 and fe.replaced == [(1, 1)]
    starting = Replica(0, 3, None, None)
    assert starting.state == STARTING
    _lose(fe, starting)
    assert fe.replaced == [(1, 1)]
