"""The router's scoring rule on fabricated summaries and loads (model-free, milliseconds):
deepest exact restore position, net of the queue it would join; in-flight prefixes; sessions as
the tie-break only; the other routing modes; a lost replica."""

from __future__ import annotations

import random

import pytest

from ninfer import protocol as P
from ninfer.errors import ConfigError
from ninfer.policy.index import digest
from ninfer.replicas.router import NoReplica, Reason, Router, RouterConfig
from ninfer.replicas.summary import bucket_digest


def _toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


def _router(n=2, lanes=4, **kw) -> Router:
    r = Router(RouterConfig(block_tokens=16, **kw))
    for i in range(n):
        r.add(i, lanes)
    return r


def _publish(router: Router, replica: int, toks, *depths, seq=None):
    view = router.table.views.get(replica)
    reset = view is None
    ev = P.SummaryEvent("e", 0 if reset else view.seq + 1, reset,
                        [(d, digest(toks[:d]), bucket_digest(toks, d, 16)) for d in depths], [], len(depths))
    assert router.apply(replica, ev)


def test_the_deepest_restore_position_wins():
    r = _router()
    doc = _toks(1, 400)
    _publish(r, 0, doc, 100)
    _publish(r, 1, doc, 300)
    d = r.route("a", doc[:350] + _toks(2, 20))
    assert (d.replica, d.reason, d.depth) == (1, Reason.RESTORE, 300)


def test_a_digest_match_is_checked_at_its_exact_depth():
    """A position whose bucket is on the prompt's path but whose tokens part before it is no
    match (the exact digest decides, not the bucket)."""
    r = _router()
    doc = _toks(3, 100)
    _publish(r, 1, doc, 70)
    prompt = doc[:68] + _toks(4, 30)          # same bucket (64..79), parts at 68
    d = r.route("a", prompt)
    assert d.depth == 0 and d.reason is Reason.LOAD


def test_load_outweighs_a_short_prefix_not_a_long_one():
    r = _router(lanes=2, queue_tokens=100)
    doc = _toks(5, 600)
    _publish(r, 0, doc, 80, 500)
    for i in range(2):                        # replica 0's two lanes are taken
        assert r.route(f"busy{i}", _toks(10 + i, 30)).replica in (0, 1)
    while r.loads[0].outstanding < 2:
        r.route(f"fill{r.decisions}", doc[:500] + [1])
    assert r.loads[0].outstanding >= 2
    short = r.route("short", doc[:90])        # 80 tokens < one place in the queue (100)
    assert short.replica == 1
    long = r.route("long", doc[:550])         # 500 tokens > the wait
    assert long.replica == 0 and long.reason is Reason.RESTORE


def test_requests_arriving_together_with_a_shared_prefix_go_to_one_replica():
    r = _router(lanes=8)
    system = _toks(6, 1500)
    first = r.route("s0", system + _toks(7, 50))
    for i in range(1, 6):
        d = r.route(f"s{i}", system + _toks(7 + i, 50))
        assert d.replica == first.replica and d.reason is Reason.INFLIGHT and d.depth == 1488
    # unrelated requests spread by load
    others = {r.route(f"o{i}", _toks(100 + i, 40)).replica for i in range(2)}
    assert others == {1 - first.replica}


def test_a_hot_prefix_spills_once_its_replica_queues():
    r = _router(lanes=2, queue_tokens=1000)
    system = _toks(8, 600)
    placed = [r.route(f"h{i}", system + _toks(20 + i, 30)).replica for i in range(6)]
    assert placed.count(0) >= 2 and placed.count(1) >= 2      # neither replica takes everything


def test_session_breaks_ties_only():
    r = _router()
    doc = _toks(9, 300)
    _publish(r, 0, doc, 200)
    r.route("t1", _toks(30, 20), session="S")             # goes somewhere; S remembers it
    mine = r.replica_of("t1")
    r.finished("t1")
    tie = r.route("t2", _toks(31, 20), session="S")
    assert tie.replica == mine and tie.reason is Reason.SESSION
    r.finished("t2")
    r.sessions["S"] = 1
    d = r.route("t3", doc[:250], session="S")             # a restore position beats the session
    assert d.replica == 0 and d.reason is Reason.RESTORE


def test_finished_requests_free_their_load_and_in_flight_prefixes():
    r = _router()
    system = _toks(11, 200)
    r.route("a", system)
    r.admitted("a")
    assert r.loads[r.replica_of("a")].running == 1
    rep = r.finished("a")
    assert r.loads[rep].outstanding == 0 and r.loads[rep].running == 0 and len(r.inflight) == 0


def test_session_and_round_robin_modes():
    s = _router(routing="session")
    first = s.route("a", _toks(12, 10), session="X").replica
    assert all(s.route(f"b{i}", _toks(13 + i, 10), session="X").replica == first for i in range(3))
    rr = _router(n=3, routing="round-robin")
    assert [rr.route(f"c{i}", _toks(20 + i, 10)).replica for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert rr.by_reason[Reason.ROUND_ROBIN] == 6


def test_a_lost_replica_steers_nothing_and_returns_its_requests():
    r = _router()
    doc = _toks(14, 300)
    _publish(r, 1, doc, 200)
    r.route("x", doc[:250])
    assert r.replica_of("x") == 1
    assert r.remove(1) == ["x"]
    d = r.route("y", doc[:250], rerouted=True)
    assert d.replica == 0 and d.depth == 0 and r.rerouted == 1
    r.add(1, 4)                                # replaced: joins with an empty summary
    assert r.table.size(1) == 0
    r.remove(0)
    r.remove(1)
    with pytest.raises(NoReplica):
        r.route("z", doc)


def test_config_is_checked():
    with pytest.raises(ConfigError, match="routing"):
        RouterConfig(routing="random")
    with pytest.raises(ConfigError, match="block_tokens"):
        RouterConfig(block_tokens=0)
    assert RouterConfig.coerce("session").routing == "session"
    assert RouterConfig.coerce({"queue_tokens": 5}).queue_tokens == 5


def test_a_draining_replica_takes_nothing_new_and_keeps_its_load():
    r = _router()
    doc = _toks(15, 300)
    _publish(r, 1, doc, 200)
    r.route("held", doc[:250])
    assert r.replica_of("held") == 1
    r.drain(1)
    d = r.route("new", doc[:250])
    assert d.replica == 0 and d.depth == 0            # its positions steer nothing any more
    assert r.loads[1].outstanding == 1 and r.snapshot()["replicas"]["1"]["draining"]
    r.finished("held")
    assert r.loads[1].outstanding == 0
    r.drain(0)
    with pytest.raises(NoReplica):
        r.route("none", doc)
