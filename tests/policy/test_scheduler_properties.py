"""The Scheduler's rules as properties over random policy states (model-free, hypothesis): a
random sequence of arrivals, admissions, pauses, finishes, events, recovery permits, scans and
pending waits, and after every step each decision the Scheduler makes is checked against the
rule restated independently (issue 36, moves 6–7). Milliseconds per example; no model, no worker."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.engine.monitor import expected_scan
from ninfer.policy.scheduler import Scheduler
from ninfer.protocol import Guard, Phase, SeqFacts
from tests.policy.test_scheduler import R

# arrivals and scans weighted up: a scan with several candidates, some failing before a younger
# success, is what the overtaking rules are about (uniform ops gave ~1 such scan in 400 examples)
OPS = st.lists(st.tuples(st.sampled_from(["arrive"] * 4 + ["scan"] * 3 + [
    "admit", "pause", "finish", "event", "event", "own_event", "recover", "recovered", "wait", "unwait",
    "cancel", "materialize", "await_release", "released"]), st.integers(0, 10 ** 6)), min_size=20, max_size=60)


def _check(s: Scheduler, reqs: list[R], overtaken: dict[str, int]) -> None:
    C = s.C
    # lanes and membership
    assert len(s.resident) <= C
    fresh, paused = {r.rid for r in s.fresh}, {r.rid for r in s.paused}
    assert not (fresh & paused) and not ((fresh | paused) & set(s.resident))
    assert [r.ticket for r in s.fresh] == sorted(r.ticket for r in s.fresh)
    assert [r.ticket for r in s.paused] == sorted(r.ticket for r in s.paused)
    # permit order: the recovery holder first, then ticket; only running, live, decode-ready rows
    rows = s.rows()
    assert [(r is not s.recovery, r.ticket) for r in rows] == sorted((r is not s.recovery, r.ticket) for r in rows)
    assert all(r.phase is Phase.RUNNING and r.live for r in rows)
    # wait-for-release: a unit waiting for its committed reclaim's copies is planned by neither turn,
    # and every other running, live resident is planned by one of them
    order = s.chunk_order()
    assert not any(r.awaiting_release for r in rows + order)
    assert {r.rid for r in rows + order} == {r.rid for r in s.resident.values()
                                             if r.phase is Phase.RUNNING and r.live and not r.awaiting_release}
    # the chunk turn: the recovery holder first
    if s.recovery is not None and s.recovery in order:
        assert order[0] is s.recovery
    # victims: younger, running, live, not the holder; youngest first
    for q in reqs:
        v = s.victims_for(q)
        want = sorted((r for r in s.resident.values() if r.ticket > q.ticket and r.phase is Phase.RUNNING
                       and r is not s.recovery and r.live), key=lambda r: -r.ticket)
        assert v == want
        # take-back only for the oldest paused, only without an older resident
        assert s.may_take_back(q) == (bool(s.paused) and s.paused[0] is q
                                      and not any(r.ticket < q.ticket for r in s.resident.values()))
    # resume: the oldest paused, woken, live, while nobody holds the permit
    cand = s.resume_candidate()
    if cand is not None:
        assert cand is s.paused[0] and s.recovery is None and s.st(cand).wake and cand.live
    elif s.paused and s.recovery is None and s.paused[0].live:
        assert not s.st(s.paused[0]).wake
    # the scan, restated over the queue it saw
    out = [r for r, _ in s.fresh_candidates()]
    seen = [(r, s.st(r).pending, s.st(r).failed_epoch, s.st(r).overtaken) for r in s.fresh]
    assert out == expected_scan(seen, s.epoch, C)
    # overtaking: only younger successes of the same scan count against a failed request
    for r in s.fresh:
        assert s.st(r).overtaken == overtaken.get(r.rid, 0)


def _guards_hold(s: Scheduler, cands: list[R], budgets: list[int], lanes: int, ok: list[bool]) -> list[bool]:
    """Apply ``fresh_guards`` as the worker does to a pattern of would-be successes: the guards
    let through at most ``lanes`` and never overtake a blocked request beyond its budget."""
    iids = list(range(1, len(cands) + 1))
    guards = s.fresh_guards(iids, budgets, lanes)
    got: list[bool] = []
    for k, gs in enumerate(guards):
        passed = all(any(got[iids.index(u) ] for u in g.unless_ok) or
                     sum(got[iids.index(i)] for i in g.ok_among) < g.at_least for g in gs)
        got.append(passed and ok[k])
    return got


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([1, 1, 2, 2, 3, 4, 8]), OPS)
def test_scheduler_decisions_follow_the_rules_in_any_state(C, ops):
    s = Scheduler(C)
    reqs: list[R] = []
    overtaken: dict[str, int] = {}          # the rule's own count: younger successes while blocked
    ticket = 0
    for op, x in ops:
        live_fresh = [r for r in s.fresh if r.live]
        if op == "arrive":
            n = 20 + x % 40                   # some will still have prefill to do when admitted
            r = R(f"r{ticket}", ticket, phase=Phase.QUEUED, facts=SeqFacts(n - 1 - (x % 3) * 8, n, 1, True, 0))
            ticket += 1
            reqs.append(r)
            s.enqueue(r)
        elif op == "admit" and s.lanes_free > 0 and (live_fresh or any(q.live for q in s.paused)):
            pool = live_fresh + [r for r in s.paused if r.live]
            r = pool[x % len(pool)]
            r.phase = Phase.RUNNING
            s.admit(r)
        elif op == "await_release" and s.resident:
            list(s.resident.values())[x % len(s.resident)].awaiting_release.add(x % 3)
        elif op == "released":
            for r in reqs:
                r.awaiting_release.discard(x % 3)
        elif op == "materialize" and s.resident:
            r = list(s.resident.values())[x % len(s.resident)]
            r.phase = Phase.MATERIALIZING if r.phase is Phase.RUNNING else Phase.RUNNING
        elif op == "pause" and s.resident:
            r = list(s.resident.values())[x % len(s.resident)]
            r.phase = Phase.PAUSED
            s.pause(r)
        elif op == "finish" and reqs:
            r = reqs[x % len(reqs)]
            r.finish_reason = "stop"
            s.remove(r)
        elif op == "cancel" and reqs:
            reqs[x % len(reqs)].cancel_requested = True
        elif op == "event":
            s.event()
        elif op == "own_event" and s.paused:
            s.event(causes={s.paused[x % len(s.paused)].rid})
        elif op == "recover" and s.resident and s.recovery is None:
            s.begin_recovery(list(s.resident.values())[x % len(s.resident)])
        elif op == "recovered" and s.recovery is not None:
            s.end_recovery(s.recovery)
        elif op == "scan":
            cands = s.fresh_candidates()
            admitted = {r.rid for i, (r, _) in enumerate(cands) if (x >> i) & 1}
            tried = [r for r, _ in cands]
            for i, r in enumerate(tried):
                if r.rid not in admitted:
                    overtaken[r.rid] = overtaken.get(r.rid, 0) + sum(1 for q in tried[i + 1:] if q.rid in admitted)
            s.after_scan(tried, admitted)
        elif op == "wait" and live_fresh:
            s.wait_pending(live_fresh[x % len(live_fresh)], True)
        elif op == "unwait" and s.waiting:
            s.wait_pending(list(s.waiting.values())[x % len(s.waiting)], False)
        _check(s, reqs, overtaken)
    # the guards the scan sends: at most the free lanes, and the overtaking budgets
    cands = s.fresh_candidates()
    if cands:
        ok = [bool((ticket >> i) & 1) or i % 2 == 0 for i in range(len(cands))]
        got = _guards_hold(s, [r for r, _ in cands], [b for _, b in cands], max(0, s.lanes_free), ok)
        assert sum(got) <= max(0, s.lanes_free)
        for j, (_, budget) in enumerate(cands):
            if not got[j]:
                assert sum(got[j + 1:]) <= budget


def test_the_guards_are_data_the_worker_can_apply():
    assert Scheduler.fresh_guards([1, 2], [3, 3], 1) == [[Guard((), (), 1)], [Guard((), (1,), 1), Guard((1,), (), 3)]]
