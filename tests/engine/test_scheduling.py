"""Named scheduling rules (seed: permits, the engine cycle, fresh admission, preemption, the
paused queue, the full recovery permit, Snapshot/Replay, the capacity contract). Each drives
the real EngineCore + worker over the in-process transport, cycle by cycle."""

from __future__ import annotations

import pytest

from ninfer import protocol as P
from ninfer.engine.request import Phase
from tests.engine.harness import Harness, oracle
from tests.factories import random_prompt


def _req(h: Harness, rid: str):
    return h.req(rid)


def _admitted_at(h: Harness, rid: str) -> float:
    return h.finals[rid].timings.admitted_at


def test_bounded_overtaking(make, tiny_model):
    """A blocked head is overtaken by at most C younger successes; after that nobody younger
    is admitted before it (here: until the older resident leaves and its pages come back)."""
    C = 2
    h = make(max_concurrency=C, kv_capacity=4 * 64, prefill_chunk_tokens=256,
             context_cache={"device_state_slots": 2, "host_capacity_bytes": 0})
    resident = h.submit(random_prompt(120, seed=2), max_tokens=60)   # holds 2-3 of 4 pages
    h.run(until=lambda: len(h.streams.get(resident, [])) >= 1)
    head_prompt = random_prompt(150, seed=1)                          # first unit: 3 pages
    head = h.submit(head_prompt, max_tokens=2)
    smalls = [h.submit(random_prompt(10, seed=10 + i), max_tokens=2) for i in range(5)]
    h.run(until=lambda: h.done(resident, head, *smalls))
    overtakers = [s for s in smalls if _admitted_at(h, s) < _admitted_at(h, head)]
    assert len(overtakers) == C, "the head must be overtaken at most C times (and here exactly C)"
    assert overtakers == smalls[:C]                                   # FIFO among the younger ones
    assert h.finals[head].token_ids == oracle(tiny_model, head_prompt, max_tokens=2)
    h.check_clean()


def test_overtaking_bound_holds_across_scans(make, tiny_model):
    """A later scan with more free lanes than the blocked head's remaining budget admits only
    that many younger requests (C = 3: two overtake in the first scan, one in the next)."""
    C = 3
    h = make(max_concurrency=C, kv_capacity=6 * 64, prefill_chunk_tokens=256,
             context_cache={"device_state_slots": 3, "host_capacity_bytes": 0})
    resident = h.submit(random_prompt(200, seed=2), max_tokens=50)   # 4 of 6 pages
    h.run(until=lambda: len(h.streams.get(resident, [])) >= 1)
    head_prompt = random_prompt(150, seed=1)                          # needs 3: only 2 are free
    head = h.submit(head_prompt, max_tokens=2)
    # one-token prompts run in the decode batch: two of them admitted together finish together,
    # so the next scan has two free lanes for a head with one overtake left
    smalls = [h.submit(random_prompt(1, seed=10 + i), max_tokens=2) for i in range(6)]
    h.run(until=lambda: h.done(resident, head, *smalls))
    overtakers = [s for s in smalls if _admitted_at(h, s) < _admitted_at(h, head)]
    assert overtakers == smalls[:C], overtakers
    assert h.finals[head].token_ids == oracle(tiny_model, head_prompt, max_tokens=2)
    h.check_clean()


def test_failed_checks_do_not_consume_the_quota(make):
    """Younger requests that also fail do not count as overtaking the head."""
    h = make(max_concurrency=2, kv_capacity=4 * 64, prefill_chunk_tokens=256,
             context_cache={"host_capacity_bytes": 0})
    resident = h.submit(random_prompt(120, seed=2), max_tokens=60)
    h.run(until=lambda: len(h.streams.get(resident, [])) >= 1)
    head = h.submit(random_prompt(150, seed=1), max_tokens=2)
    big = [h.submit(random_prompt(140, seed=3 + i), max_tokens=2) for i in range(3)]
    for _ in range(10):
        h.cycle()
    assert h.core.sched.st(_req(h, head)).overtaken == 0 and all(_req(h, b).phase is Phase.QUEUED for b in big)
    h.run(until=lambda: h.done(resident, head, *big))
    assert all(_admitted_at(h, head) < _admitted_at(h, b) for b in big)
    h.check_clean()


def test_scan_is_not_reopened_by_ordinary_decode(make):
    """A request that failed under the current event is not re-quoted until a real event."""
    h = make(max_concurrency=2, kv_capacity=4 * 64, prefill_chunk_tokens=256,
             context_cache={"host_capacity_bytes": 0})
    runner = h.submit(random_prompt(20, seed=3), max_tokens=60)
    h.cycle()
    h.core.call_commands([P.HoldPages(3)])
    blocked = h.submit(random_prompt(150, seed=4), max_tokens=2)
    quotes = []
    orig = h.core.rm.plan_admission
    h.core.rm.plan_admission = lambda req, *a: quotes.append(req.rid) or orig(req, *a)
    for _ in range(15):                                # the runner only decodes meanwhile
        h.cycle()
    assert quotes.count(blocked) == 1
    h.core.call_commands([P.HoldPages(0)])
    h.core.sched.event()
    h.run(until=lambda: h.done(runner, blocked))
    h.check_clean()


def test_long_request_paused_behind_an_older_resident(make, tiny_model):
    """Seed scenario: the long young request pauses; short requests that fit keep entering
    while it waits; with the older resident present it only uses free and optional-cache space
    (it never pauses anyone to probe); it finishes with the oracle's tokens."""
    h = make(max_concurrency=3, kv_capacity=6 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 1, "host_capacity_bytes": 0})
    old_p, long_p = random_prompt(100, seed=5), random_prompt(120, seed=6)
    old = h.submit(old_p, max_tokens=150)
    long = h.submit(long_p, max_tokens=120)
    h.run(until=lambda: (r := _req(h, long)) is not None and r.phase is Phase.PAUSED)
    short_ps = [random_prompt(8, seed=20 + i) for i in range(3)]
    shorts = [h.submit(p, max_tokens=2) for p in short_ps]
    h.run(until=lambda: h.done(old, long, *shorts))
    f = h.finals[long]
    assert f.pauses, "the long request never paused"
    first = f.pauses[0]
    waited = [s for s in shorts if first.paused_at < h.finals[s].timings.admitted_at < first.resumed_at]
    assert waited, "short requests that fit should enter while the long one is paused"
    assert not h.finals[old].pauses, "the older resident is never a victim of the younger"
    assert all(not h.finals[s].pauses for s in shorts), "a paused request must not pause others to probe"
    assert f.token_ids == oracle(tiny_model, long_p, max_tokens=120)
    assert h.finals[old].token_ids == oracle(tiny_model, old_p, max_tokens=150)
    for s, p in zip(shorts, short_ps):
        assert h.finals[s].token_ids == oracle(tiny_model, p, max_tokens=2)
    h.check_clean()


def _settle_transactions(h: Harness) -> None:
    """Progress the context transaction without running a cycle (nothing resumes meanwhile)."""
    for _ in range(200):
        if not h.core.tx_busy:
            return
        h.worker.wait(0.5)
        h.core.call_commands([])
    raise AssertionError("the transaction never settled")


def _pause(h: Harness, rid: str, revoke: bool) -> None:
    """Pause a resident (the chain's decision) and optionally revoke its snapshot."""
    req = _req(h, rid)
    h.core.preempt(rid)
    _settle_transactions(h)
    if revoke and req.snapshot is not None:
        [out] = h.core.call_commands([P.Quote()])
        snap = out.facts.checkpoints[req.snapshot.cid]
        actions = [P.Delete(snap.cid, snap.generation, snap.version)]
        [res] = h.core.call_commands([P.Commit(actions)])
        assert res.result.ok
        h.core.outcomes.committed(actions, res.result)
    h.core.sched.event()


def test_snapshot_revocation_turns_into_replay(make, tiny_model):
    """A pause snapshot (on the Host) revoked by reclaim: the request resumes by Replay."""
    h = make(max_concurrency=2, kv_capacity=6 * 64, prefill_chunk_tokens=32,
             context_cache={"host_capacity_bytes": 8 << 20})
    p = random_prompt(90, seed=7)
    rid = h.submit(p, max_tokens=20, temperature=1.0, seed=4, presence_penalty=0.5, frequency_penalty=0.3)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 6)
    _pause(h, rid, revoke=True)
    assert _req(h, rid).snapshot is None
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert f.pauses[0].route == "replay" and f.usage.replay_tokens > 0
    assert f.usage.prefill_tokens == 90                  # initial prefill counted once
    assert f.token_ids == oracle(tiny_model, p, max_tokens=20, temperature=1.0, seed=4,
                                 presence_penalty=0.5, frequency_penalty=0.3)
    assert h.core.stats.revocations == 1
    h.check_clean()


def test_recovery_permit_is_kept_past_the_old_frontier(make, tiny_model):
    """Reaching the old frontier is not new progress: the full recovery permit stays until the
    first new token commits."""
    h = make(max_concurrency=2, kv_capacity=6 * 64, prefill_chunk_tokens=24,
             context_cache={"host_capacity_bytes": 0})
    p = random_prompt(124, seed=8)        # paused at frontier 128: the next unit needs a new page
    rid = h.submit(p, max_tokens=12)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 5)
    old_frontier = _req(h, rid).frontier
    assert old_frontier == 128
    _pause(h, rid, revoke=True)
    seen_at_old_frontier = False
    while not h.done(rid):
        h.cycle()
        req = _req(h, rid)
        if req is None or req.facts is None or req.phase is not Phase.RUNNING:
            continue
        if req.frontier == old_frontier and len(h.streams[rid]) == 5:
            seen_at_old_frontier = True
            assert req.recovery_pending and h.core.sched.recovery is req
            assert req.facts.reserved == 1, "the permit's first new unit was returned at the old frontier"
        if len(h.streams[rid]) > 5:
            assert not req.recovery_pending
    assert seen_at_old_frontier
    assert h.finals[rid].token_ids == oracle(tiny_model, p, max_tokens=12)
    h.check_clean()


def test_snapshot_resume_reads_back_and_continues(make, tiny_model):
    h = make(max_concurrency=2, kv_capacity=6 * 64, prefill_chunk_tokens=24,
             context_cache={"host_capacity_bytes": 8 << 20})
    p = random_prompt(70, seed=9)
    rid = h.submit(p, max_tokens=12, temperature=0.8, seed=2)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 4)
    _pause(h, rid, revoke=False)
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert f.pauses[0].route == "snapshot" and f.usage.replay_tokens == 0
    assert f.token_ids == oracle(tiny_model, p, max_tokens=12, temperature=0.8, seed=2)
    h.check_clean()


def test_capacity_contract_error_for_a_lone_request(make, tiny_model):
    """When the sole request cannot get a legal unit after all legal reclaim, it fails with
    CapacityContractError naming the numbers — no hang — and the engine keeps serving."""
    h = make(max_concurrency=1, kv_capacity=4 * 64, prefill_chunk_tokens=256,
             context_cache={"host_capacity_bytes": 0})
    h.core.call_commands([P.HoldPages(3)])
    rid = h.submit(random_prompt(100, seed=10), max_tokens=4)
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert f.finish_reason == "error" and f.error.kind == "capacity_contract"
    assert "main: 1 more needed (1 available of 4)" in f.error.message
    h.core.call_commands([P.HoldPages(0)])
    p = random_prompt(100, seed=11)
    ok = h.submit(p, max_tokens=4)
    h.run(until=lambda: h.done(ok))
    assert h.finals[ok].token_ids == oracle(tiny_model, p, max_tokens=4)
    h.check_clean()


def test_ingress_timeout_is_not_restarted_by_a_pause(make):
    """The ingress timeout runs from the original arrival to the first admission: a request
    admitted in time and paused later is not timed out; one never admitted in time is."""
    import time
    h = make(max_concurrency=1, kv_capacity=4 * 64, request_timeout_s=0.3,
             context_cache={"host_capacity_bytes": 0})
    first = h.submit(random_prompt(30, seed=12), max_tokens=100)
    h.run(until=lambda: len(h.streams.get(first, [])) >= 2)
    second = h.submit(random_prompt(30, seed=13), max_tokens=2)      # C = 1: no lane for it
    time.sleep(0.4)
    _pause(h, first, revoke=True)                                    # the lane frees up only now
    h.run(until=lambda: h.done(first, second))
    assert h.finals[first].finish_reason == "length" and h.finals[first].pauses
    assert h.finals[second].finish_reason == "error"
    assert h.finals[second].error.kind == "timeout"
    h.check_clean()


@pytest.mark.parametrize("phase", ["queued", "prefill", "decode", "paused", "recovering", "materializing"])
def test_cancel_in_every_phase(make, tiny_model, phase):
    """Cancel ends that request alone, counts only work really executed, and frees everything."""
    faults = [{"kind": "completion_delay", "steps": 5, "count": 0}] if phase == "materializing" else []
    h = make(max_concurrency=1, kv_capacity=4 * 64, prefill_chunk_tokens=16,
             context_cache={"host_capacity_bytes": 8 << 20}, faults=faults)
    bystander_p = random_prompt(40, seed=14)
    p = random_prompt(100, seed=15)
    if phase == "queued":
        other = h.submit(bystander_p, max_tokens=30)
        rid = h.submit(p, max_tokens=5)
        h.cycle()
        assert _req(h, rid).phase is Phase.QUEUED
    elif phase == "materializing":
        first = h.submit(p[:64], max_tokens=1, recovery_frontier=64)
        h.run(until=lambda: h.done(first))
        [out] = h.core.call_commands([P.Quote()])
        acts = []
        for c in out.facts.checkpoints.values():
            acts.append(P.DemoteState(c.cid, c.generation, c.version))
            acts.append(P.DemoteBlocks(c.cid, c.generation, c.blocks,
                                       tuple(out.facts.blocks[b].version for b in c.blocks)))
        [res] = h.core.call_commands([P.Commit(acts)])
        h.core.outcomes.committed(acts, res.result)
        h.run(until=lambda: not h.core.tx_busy)
        rid = h.submit(p, max_tokens=5)
        h.run(until=lambda: (r := _req(h, rid)) is not None and r.phase is Phase.MATERIALIZING)
        other = None
    else:
        rid = h.submit(p, max_tokens=30)
        other = None
        if phase == "prefill":
            h.run(until=lambda: 0 < (_req(h, rid).frontier if _req(h, rid).facts else 0) < 100)
        else:
            h.run(until=lambda: len(h.streams.get(rid, [])) >= 3)
        if phase in ("paused", "recovering"):
            _pause(h, rid, revoke=phase == "recovering")
        if phase == "recovering":
            h.run(until=lambda: _req(h, rid).recovery_pending and _req(h, rid).phase is Phase.RUNNING)
    h.core.cancel(rid)
    h.run(until=lambda: h.done(rid) and (other is None or h.done(other)))
    f = h.finals[rid]
    assert f.finish_reason == "cancelled"
    assert f.token_ids == h.streams.get(rid, [])
    if other is not None:
        assert h.finals[other].token_ids == oracle(tiny_model, bystander_p, max_tokens=30)
    if phase == "queued":
        assert f.usage.prefill_tokens == 0
    h.check_clean()
    after = h.submit(bystander_p, max_tokens=3)        # the engine keeps serving
    h.run(until=lambda: h.done(after))
    assert h.finals[after].token_ids == oracle(tiny_model, bystander_p, max_tokens=3)


def test_a_resume_that_cannot_bind_leaves_the_prefill_turn_to_a_resident(make):
    """Seed: Paused 请求的等待只约束它自身 — with an older resident present, the oldest paused
    request's resume only tries free and optional space; its attempt takes the cycle's prefill
    turn only if it binds: the plan also carries a resident's chunk, skipped exactly when the
    resume bound (a resume short cycle after cycle used to starve every resident's prefill until
    the progress guard failed the oldest — seed 328184 under CPU load)."""
    from tests.engine.harness import force_pause
    h = make(max_concurrency=2, prefill_chunk_tokens=16, context_cache={"host_capacity_bytes": 0, "device_state_slots": 0})
    old = h.submit(random_prompt(200, seed=31), max_tokens=4)
    young = h.submit(random_prompt(20, seed=32), max_tokens=30)
    h.run(until=lambda: len(h.streams.get(young, [])) >= 2)
    force_pause(h, young)
    h.run(until=lambda: (r := _req(h, young)) is not None and r.phase is Phase.PAUSED)
    assert h.req(old).frontier < 199, "the older resident is still prefilling"
    h.core.sched.event()                      # a capacity event: the paused request may try
    plan = h.core.planner.build(h.core.host_kv_pages)
    [resume] = [i for i in plan.items if i.kind == "resume"]
    [chunk] = [i for i in plan.items if i.kind == "chunk"]
    assert chunk.req is h.req(old) and resume.spec.n_tokens > 1
    assert chunk.intent.guards == [P.Guard((), (resume.iid,), 1)]
    h.run(until=lambda: h.done(old, young))
    h.check_clean()
