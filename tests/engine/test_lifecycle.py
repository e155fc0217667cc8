"""Lifecycle events (API.md: ``h.events()``): each moment published once, in order, across
pauses and both resume routes; timings derived from them equal ``Output.timings``; a cancel
counts only the work that really ran (seed: 初次 prefill 与 Replay 分开计数；取消只计已经执行的工作。
GenerationStart 和首次 admitted/first-token 只发布一次)."""

from __future__ import annotations

import pytest

import ninfer
from ninfer import protocol as P
from ninfer.engine.request import Phase
from tests.engine.harness import (
    REASONS,
    Harness,
    assert_timings_derived,
    check_lifecycle,
    oracle,
)
from tests.factories import random_prompt


def _settle(h: Harness) -> None:
    for _ in range(200):
        if not h.core.tx_busy:
            return
        h.worker.wait(0.5)
        h.core.call_commands([])
    raise AssertionError("the transaction never settled")


def _pause(h: Harness, rid: str, revoke: bool) -> None:
    """Pause a resident (as the chain would); ``revoke``: delete its snapshot, so it resumes by
    Replay although the pause kept State/KV."""
    req = h.req(rid)
    h.core.preempt(rid)
    _settle(h)
    if revoke and req.snapshot is not None:
        [out] = h.core.call_commands([P.Quote()])
        snap = out.facts.checkpoints[req.snapshot.cid]
        actions = [P.Delete(snap.cid, snap.generation, snap.version)]
        [res] = h.core.call_commands([P.Commit(actions)])
        assert res.result.ok
        h.core.outcomes.committed(actions, res.result)
    h.core.sched.event()


def test_plain_request_publishes_each_moment_once(make, tiny_model):
    h = make(max_concurrency=2, kv_capacity=6 * 64, prefill_chunk_tokens=32)
    p = random_prompt(70, seed=1)
    rid = h.submit(p, max_tokens=8)
    h.run(until=lambda: h.done(rid))
    ev, f = h.events[rid], h.finals[rid]
    assert [e["event"] for e in ev] == ["queued", "generation_start", "admitted", "first_token", "finished"]
    check_lifecycle(ev, f.pauses, "length")
    assert isinstance(ev[1]["ticket"], int)
    assert_timings_derived(ev, f.timings)
    assert f.timings.paused_s == 0.0 and f.timings.source_wait_s == 0.0
    assert f.token_ids == oracle(tiny_model, p, max_tokens=8)
    h.check_clean()


def test_two_pauses_with_both_resume_routes(make, tiny_model):
    """Paused twice: the first resumes from its Snapshot, the second's snapshot is revoked and it
    resumes by Replay. Two paused and two resumed events, the once-only moments still once;
    paused time is the two windows; tokens equal the oracle's."""
    h = make(max_concurrency=2, kv_capacity=6 * 64, prefill_chunk_tokens=24,
             context_cache={"host_capacity_bytes": 8 << 20})
    p = random_prompt(70, seed=9)
    rid = h.submit(p, max_tokens=16, temperature=0.8, seed=2)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 4)
    _pause(h, rid, revoke=False)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 9)
    _pause(h, rid, revoke=True)
    h.run(until=lambda: h.done(rid))
    ev, f = h.events[rid], h.finals[rid]
    kinds = [e["event"] for e in ev]
    assert kinds == ["queued", "generation_start", "admitted", "first_token",
                     "paused", "resumed", "paused", "resumed", "finished"], kinds
    check_lifecycle(ev, f.pauses, "length")
    assert [e["route"] for e in ev if e["event"] == "resumed"] == ["snapshot", "replay"]
    assert [e["reason"] for e in ev if e["event"] == "paused"] == ["forced", "forced"]
    assert_timings_derived(ev, f.timings)
    windows = sum(q.resumed_at - q.paused_at for q in f.pauses)
    assert f.timings.paused_s == pytest.approx(windows) and f.timings.paused_s > 0
    assert f.timings.max_output_gap_s > 0
    assert f.usage.replay_tokens > 0 and f.usage.prefill_tokens == 70
    assert f.token_ids == oracle(tiny_model, p, max_tokens=16, temperature=0.8, seed=2)
    h.check_clean()


def test_destructive_pause_resumes_by_replay(make, tiny_model):
    """No Host: the pause itself is destructive (route replay at the pause and the resume)."""
    h = make(max_concurrency=2, kv_capacity=6 * 64, prefill_chunk_tokens=24,
             context_cache={"host_capacity_bytes": 0})
    p = random_prompt(60, seed=3)
    rid = h.submit(p, max_tokens=10)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 3)
    _pause(h, rid, revoke=False)
    h.run(until=lambda: h.done(rid))
    ev, f = h.events[rid], h.finals[rid]
    check_lifecycle(ev, f.pauses, "length")
    assert [(e["event"], e["route"]) for e in ev if "route" in e] == [("paused", "replay"), ("resumed", "replay")]
    assert_timings_derived(ev, f.timings)
    assert f.token_ids == oracle(tiny_model, p, max_tokens=10)
    h.check_clean()


def test_pressure_pauses_name_their_reason(make, tiny_model):
    """Pauses the preemption chain decides (no test seam): every request's lifecycle is well
    formed and its timings are the derived ones; the pauses say why they happened."""
    h = make(max_concurrency=3, kv_capacity=6 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 1, "host_capacity_bytes": 0})
    prompts = [random_prompt(100, seed=5), random_prompt(120, seed=6)] + [random_prompt(8, seed=20 + i) for i in range(3)]
    rids = [h.submit(prompts[0], max_tokens=150), h.submit(prompts[1], max_tokens=120)]
    h.run(until=lambda: (r := h.req(rids[1])) is not None and r.phase is Phase.PAUSED)
    rids += [h.submit(q, max_tokens=2) for q in prompts[2:]]
    h.run(until=lambda: h.done(*rids))
    reasons = set()
    for rid in rids:
        ev, f = h.events[rid], h.finals[rid]
        check_lifecycle(ev, f.pauses, "length")
        assert_timings_derived(ev, f.timings)
        reasons |= {e["reason"] for e in ev if e["event"] == "paused"}
    assert reasons and reasons <= REASONS - {"forced"}
    h.check_clean()


def test_cancel_while_queued_is_queued_then_finished(make):
    h = make(max_concurrency=1, kv_capacity=4 * 64, prefill_chunk_tokens=16)
    other = h.submit(random_prompt(40, seed=14), max_tokens=20)
    rid = h.submit(random_prompt(30, seed=15), max_tokens=5)
    h.cycle()
    h.core.cancel(rid)
    h.run(until=lambda: h.done(rid, other))
    ev, f = h.events[rid], h.finals[rid]
    assert [e["event"] for e in ev] == ["queued", "generation_start", "finished"]
    assert ev[-1]["finish_reason"] == "cancelled"
    assert f.usage.prefill_tokens == f.usage.replay_tokens == f.usage.cached_tokens == 0
    assert_timings_derived(ev, f.timings)
    assert f.timings.ttft_s is None and f.timings.queue_s is None
    h.check_clean()


def test_cancel_counts_only_executed_work(make):
    """Cancelled mid-prefill: the prefill tokens are the frontier it reached. Cancelled in the
    middle of a Replay: the replay tokens are what it recomputed since the resume, not the
    frontier it was rebuilding to; the initial prefill stays counted once. The engine's
    totals agree."""
    h = make(max_concurrency=1, kv_capacity=4 * 64, prefill_chunk_tokens=16,
             context_cache={"host_capacity_bytes": 0})
    a = h.submit(random_prompt(100, seed=21), max_tokens=30)
    h.run(until=lambda: (r := h.req(a)).facts is not None and 16 < r.frontier < 100)
    reached = h.req(a).frontier
    h.core.cancel(a)
    h.run(until=lambda: h.done(a))
    fa = h.finals[a]
    assert fa.finish_reason == "cancelled" and fa.usage.prefill_tokens == reached < 100
    assert "first_token" not in [e["event"] for e in h.events[a]]

    b = h.submit(random_prompt(100, seed=22), max_tokens=60)
    h.run(until=lambda: len(h.streams.get(b, [])) >= 50)
    target = h.req(b).frontier                        # 100 prompt tokens + 49 outputs computed
    _pause(h, b, revoke=False)                        # no Host: destructive, resumes by Replay
    # (from its input point at 100: 49 tokens to recompute, 16 per chunk)
    req = h.req(b)
    h.run(until=lambda: req.phase is Phase.RUNNING and req.usage.replay_tokens > 0)
    assert req.replay_target is not None and req.frontier < target, "the replay finished already"
    reached = req.frontier
    h.core.cancel(b)
    h.run(until=lambda: h.done(b))
    fb = h.finals[b]
    [resumed] = [e for e in h.events[b] if e["event"] == "resumed"]
    assert fb.finish_reason == "cancelled" and resumed["route"] == "replay"
    assert fb.usage.replay_tokens == reached - resumed["frontier"] < target - resumed["frontier"]
    assert fb.usage.prefill_tokens == 100
    check_lifecycle(h.events[b], fb.pauses, "cancelled")
    assert_timings_derived(h.events[b], fb.timings)
    s = h.core.stats_dict()
    assert s["prefill_tokens"] == fa.usage.prefill_tokens + fb.usage.prefill_tokens
    assert s["replay_tokens"] == fb.usage.replay_tokens == h.core.stats.tokens_replayed
    h.check_clean()


def test_events_through_the_api(tiny_model):
    """``h.events()`` over the in-process transport: partial while the request runs, the whole
    list once the result is there; ``Output.timings`` are derived from it."""
    cfg = {"max_concurrency": 2, "max_context": 256, "kv_capacity": 6 * 64, "prefill_chunk_tokens": 32}
    eng = ninfer.Engine.start(tiny_model, config=cfg, dtype="float64", transport="inproc")
    try:
        h = eng.generate(random_prompt(50, seed=4), max_tokens=6, ignore_eos=True)
        first = next(iter(h))
        assert first.index == 0
        seen = [e["event"] for e in h.events()]
        assert seen[:4] == ["queued", "generation_start", "admitted", "first_token"] and "finished" not in seen
        out = h.result(60)
        ev = h.events()
        check_lifecycle(ev, out.pauses, "length")
        assert_timings_derived(ev, out.timings)
        assert ev[0]["t"] == out.timings.arrival
    finally:
        eng.shutdown()


@pytest.mark.parametrize("first_len,first_fails", [(40, True), (120, False)], ids=["generating", "mid-prefill"])
def test_a_request_kept_across_a_worker_loss_publishes_nothing_twice(tiny_model, first_len, first_fails):
    """A worker death: the running request fails if it had produced tokens, else it is kept
    (mid-prefill: admitted once, never twice); the queued one is kept by the new core with its
    arrival and published moments (one queued, one generation_start), then runs."""
    cfg = {"max_concurrency": 1, "max_context": 256, "kv_capacity": 4 * 64, "prefill_chunk_tokens": 16,
           "faults": [{"kind": "worker_death", "point": "before_execute", "skip": 4}]}
    eng = ninfer.Engine.start(tiny_model, config=cfg, dtype="float64", transport="inproc")
    try:
        first = eng.generate(random_prompt(first_len, seed=31), max_tokens=4, ignore_eos=True)
        kept = eng.generate(random_prompt(20, seed=32), max_tokens=3, ignore_eos=True)
        f, k = first.result(120), kept.result(120)
        assert eng.stats()["worker_recoveries"] == 1
        if first_fails:
            assert f.finish_reason == "error" and f.error["type"] == "worker_lost" and f.token_ids
        else:
            assert f.finish_reason == "length", f.error
        assert k.finish_reason == "length", k.error
        for h, out in ((first, f), (kept, k)):
            check_lifecycle(h.events(), out.pauses, out.finish_reason)
            assert_timings_derived(h.events(), out.timings)
    finally:
        eng.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_lifecycle_over_ray(tiny_model):
    """The same events cross both actor boundaries (controller -> frontend -> client) in order,
    once each, under pressure that pauses some requests; the timings the client gets are the
    ones derived from them."""
    import random

    pytest.importorskip("ray")
    from ninfer.actors.client import init_ray
    init_ray(None)                      # shared with the actor tests' session when they run too
    cfg = {"max_concurrency": 3, "max_context": 256, "kv_capacity": 4 * 64, "prefill_chunk_tokens": 48,
           "context_cache": {"device_state_slots": 1, "host_capacity_bytes": 1 << 20}}
    eng = ninfer.Engine.start(tiny_model, config=cfg, dtype="float64", transport="ray", deployment="t-lifecycle")
    try:
        rng = random.Random(7)
        hs = []
        for i in range(8):
            p = random_prompt(rng.randint(20, 140), seed=300 + i)
            hs.append(eng.generate(p, max_tokens=rng.randint(5, 40), temperature=rng.choice([0.0, 1.0]), seed=i,
                                   ignore_eos=True))
        paused = 0
        for h in hs:
            out = h.result(300)
            ev = h.events()
            check_lifecycle(ev, out.pauses, "length")
            assert_timings_derived(ev, out.timings)
            paused += sum(e["event"] == "paused" for e in ev)
        assert paused == eng.stats()["preemptions"] > 0
    finally:
        eng.shutdown()
