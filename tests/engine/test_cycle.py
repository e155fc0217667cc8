"""The engine cycle, rule by rule (issue: engine cycle rebuilt). Each test drives the real
EngineCore and worker over the in-process transport, checks the oracle's tokens and ends with
a leak check. The first group reproduces the first wave's findings (each failed on that core:
docs/testing.md records how); the second pins one scheduling rule each."""

from __future__ import annotations


from ninfer import protocol as P
from ninfer.engine.request import Phase
from tests.engine.harness import Harness, force_pause, oracle
from tests.factories import random_prompt


def _req(h: Harness, rid: str):
    return h.req(rid)


def _running(h: Harness, rid: str) -> bool:
    r = _req(h, rid)
    return r is not None and r.phase is Phase.RUNNING and bool(r.outputs)


def _skipped_decode_cycles(h: Harness, *rids: str) -> dict[str, int]:
    """Cycles in which a decoding resident committed no token (it was held up)."""
    skipped = dict.fromkeys(rids, 0)
    while not h.done(*rids):
        before = {r: len(h.streams.get(r, [])) for r in rids}
        running = {r: _running(h, r) for r in rids}
        h.cycle()
        for r in rids:
            if running[r] and r in h.core.requests and len(h.streams.get(r, [])) == before[r]:
                skipped[r] += 1
    return skipped


def _finished_at(h: Harness, rid: str) -> float:
    t = h.finals[rid].timings
    return t.arrival + t.e2e_s


def _check(h: Harness, model: str, rid: str, prompt: list[int], **params) -> None:
    f = h.finals[rid]
    assert f.finish_reason == "length", f.error
    assert f.token_ids == oracle(model, prompt, **params)


def _demote_everything(h: Harness) -> None:
    """Move every cache checkpoint's Device content to the Host (through the commit seam)."""
    [out] = h.core.call_commands([P.Quote()])
    acts = []
    for c in out.facts.checkpoints.values():
        if c.image_device:
            acts.append(P.DemoteState(c.cid, c.generation, c.version))
        bids = tuple(b for b in c.blocks if out.facts.blocks[b].device and not out.facts.blocks[b].pinned)
        if bids:
            acts.append(P.DemoteBlocks(c.cid, c.generation, bids, tuple(out.facts.blocks[b].version for b in bids)))
    [res] = h.core.call_commands([P.Commit(acts)])
    assert res.result.ok, res.result.reason
    h.core.outcomes.committed(acts, res.result)
    h.run(until=lambda: not h.core.tx_busy, max_cycles=200)


# ==== findings ==============================================================================

def test_no_stall_behind_an_older_paused_request(make, tiny_model):
    """Finding 1: an older request paused by Snapshot and a younger resident that decodes
    until Main KV is exhausted — both finish (the young row gives way, the older one resumes),
    no cycle returns 'nothing to do' forever."""
    h = make(max_concurrency=2, kv_capacity=4 * 64, prefill_chunk_tokens=64,
             context_cache={"host_capacity_bytes": 4 << 20})
    pb, pa = random_prompt(70, seed=2), random_prompt(30, seed=3)
    b = h.submit(pb, max_tokens=100, rid="B")
    a = h.submit(pa, max_tokens=200, rid="A")
    h.run(until=lambda: len(h.streams.get(a, [])) >= 3)
    force_pause(h, b)
    assert _req(h, b).snapshot is not None
    h.run(until=lambda: h.done(a, b), max_cycles=3000)
    _check(h, tiny_model, b, pb, max_tokens=100)
    _check(h, tiny_model, a, pa, max_tokens=200)
    assert h.core.stats.stalls == 0 and h.core.stats.capacity_errors == 0
    h.check_clean()


def test_a_failed_read_back_fails_only_its_request(make, tiny_model):
    """Finding 2: a copy error inside a transaction aborts it; the request whose read-back it
    was fails with a clear error, every other request finishes, and the next transaction (and
    check_integrity) work."""
    h = make(max_concurrency=2, kv_capacity=8 * 64, max_context=512, prefill_chunk_tokens=256,
             context_cache={"host_capacity_bytes": 8 << 20})
    base = random_prompt(100, seed=4)
    r0 = h.submit(base, max_tokens=4, recovery_frontier=100)
    h.run(until=lambda: h.done(r0))
    _demote_everything(h)
    h.inject({"kind": "copy_error"})
    victim_p, other_p = base + random_prompt(10, seed=5), random_prompt(60, seed=6)
    victim = h.submit(victim_p, max_tokens=4)
    other = h.submit(other_p, max_tokens=6)
    h.run(until=lambda: h.done(victim, other), max_cycles=2000)
    f = h.finals[victim]
    assert f.finish_reason == "error" and f.error.kind == "copy_failed" and "injected copy error" in f.error.message
    _check(h, tiny_model, other, other_p, max_tokens=6)
    again = h.submit(victim_p, max_tokens=4)            # the checkpoint (a Fork source) survived
    h.run(until=lambda: h.done(again), max_cycles=2000)
    _check(h, tiny_model, again, victim_p, max_tokens=4)
    assert h.finals[again].usage.cached_tokens == 100
    assert h.core.stats.copy_failures == 1
    h.check_clean()


def test_a_failed_save_copy_loses_only_the_save(make, tiny_model):
    """Finding 2: a Host save whose copy fails is forgotten; its request is unaffected."""
    h = make(max_concurrency=1, kv_capacity=4 * 64, prefill_chunk_tokens=256,
             context_cache={"device_state_slots": 0, "host_capacity_bytes": 4 << 20},
             faults=[{"kind": "copy_error"}])
    p = random_prompt(80, seed=7)
    rid = h.submit(p, max_tokens=5, recovery_frontier=60)
    # the save's copy settles on its own thread: under CPU load the request may finish first
    h.run(until=lambda: h.done(rid) and not h.core.tx_busy, max_cycles=2000)
    _check(h, tiny_model, rid, p, max_tokens=5)
    assert h.core.stats.copy_failures == 1
    again = h.submit(p, max_tokens=5)                       # the lost save serves nobody ...
    h.run(until=lambda: h.done(again), max_cycles=2000)
    assert h.finals[again].usage.cached_tokens == 0
    cont = p + h.finals[rid].token_ids                      # ... while its E is intact
    turn = h.submit(cont, max_tokens=3)
    h.run(until=lambda: h.done(turn), max_cycles=2000)
    assert h.finals[turn].usage.cached_tokens == 80 + 5 - 1
    _check(h, tiny_model, turn, cont, max_tokens=3)
    h.check_clean()


def test_no_deletion_for_a_bind_that_does_not_happen(make, tiny_model):
    """Finding 3: a capture's admitted replacements are committed only when the capture runs
    (after its unit's permit succeeded). A blocked, then cancelled request deletes nothing: the
    session's E survives and its next turn reuses it."""
    h = make(max_concurrency=1, max_context=384, kv_capacity=6 * 64, prefill_chunk_tokens=256,
             context_cache={"device_state_slots": 1, "host_capacity_bytes": 0})
    t1 = random_prompt(40, seed=1)
    r1 = h.submit(t1, max_tokens=4, session_id="s")
    h.run(until=lambda: h.done(r1))
    h.core.call_commands([P.HoldPages(5)])
    x = h.submit(random_prompt(200, seed=5), max_tokens=2, recovery_frontier=150)
    for _ in range(6):
        h.cycle()
    h.core.cancel(x)
    h.run(until=lambda: h.done(x))
    h.core.call_commands([P.HoldPages(0)])
    t2 = t1 + h.finals[r1].token_ids + random_prompt(10, seed=6)
    r2 = h.submit(t2, max_tokens=4, session_id="s")
    h.run(until=lambda: h.done(r2))
    assert h.finals[r2].usage.cached_tokens == 40 + 4 - 1
    _check(h, tiny_model, r2, t2, max_tokens=4)
    h.check_clean()


def test_reclaim_that_frees_capacity_retries_the_permit_at_once(make, tiny_model):
    """Finding 4: a row one page short, with reclaimable cache on the Device, runs in the same
    step (the reclaim is its remedy) — no decode cycle is lost."""
    h = make(max_concurrency=1, kv_capacity=4 * 64, prefill_chunk_tokens=256,
             context_cache={"device_state_slots": 2, "host_capacity_bytes": 0})
    r0 = h.submit(random_prompt(100, seed=1), max_tokens=8)
    h.run(until=lambda: h.done(r0))
    p = random_prompt(100, seed=2)
    r = h.submit(p, max_tokens=60)
    assert _skipped_decode_cycles(h, r) == {r: 0}
    _check(h, tiny_model, r, p, max_tokens=60)
    h.check_clean()


def test_every_shortfall_of_a_cycle_is_settled(make, tiny_model):
    """Finding 4: two rows short of a page in the same cycle both get their remedy in that
    cycle (not one shortfall per cycle after the round trip)."""
    h = make(max_concurrency=2, max_context=384, kv_capacity=6 * 64, prefill_chunk_tokens=256,
             context_cache={"device_state_slots": 2, "host_capacity_bytes": 0})
    r0 = h.submit(random_prompt(100, seed=1), max_tokens=8)
    h.run(until=lambda: h.done(r0))
    p1, p2 = random_prompt(127, seed=2), random_prompt(128, seed=3)
    r1, r2 = h.submit(p1, max_tokens=20), h.submit(p2, max_tokens=20)
    assert _skipped_decode_cycles(h, r1, r2) == {r1: 0, r2: 0}
    _check(h, tiny_model, r1, p1, max_tokens=20)
    _check(h, tiny_model, r2, p2, max_tokens=20)
    h.check_clean()


def test_a_transfer_in_flight_does_not_stop_the_chain(make, tiny_model):
    """Finding 4: while a Host save's completion is still on its way, a row short of a page is
    covered by deleting optional Device cache in the same step (the Host holds exactly that
    save, so no demotion can be the remedy)."""
    image = make(max_concurrency=1).core.info.image_bytes
    h = make(max_concurrency=1, kv_capacity=4 * 64, prefill_chunk_tokens=256,
             context_cache={"device_state_slots": 2, "host_capacity_bytes": image},
             faults=[{"kind": "completion_delay", "steps": 10000, "count": 0}])
    r0 = h.submit(random_prompt(100, seed=1), max_tokens=8)      # P@100 and E@107: 2 slots, 2 pages
    h.run(until=lambda: h.done(r0))
    p = random_prompt(60, seed=2)
    r = h.submit(p, max_tokens=100, recovery_frontier=60)        # its save at 60 goes to the Host
    h.run(until=lambda: _running(h, r))
    assert h.core.tx_busy
    assert _skipped_decode_cycles(h, r) == {r: 0}                # at 128: r0's points are deleted
    _check(h, tiny_model, r, p, max_tokens=100)
    h.check_clean()


def test_oldest_paused_takes_back_a_lane(make, tiny_model):
    """Finding 5: the oldest paused request, with no older resident and no free lane, takes
    its lane back from the younger resident instead of waiting for it to finish."""
    h = make(max_concurrency=1, kv_capacity=4 * 64, prefill_chunk_tokens=64,
             context_cache={"host_capacity_bytes": 4 << 20, "device_state_slots": 2})
    pb, pa, pz = random_prompt(40, seed=2), random_prompt(30, seed=3), random_prompt(10, seed=4)
    b = h.submit(pb, max_tokens=30, rid="B")
    a = h.submit(pa, max_tokens=150, rid="A")
    h.run(until=lambda: len(h.streams.get(b, [])) >= 3)
    force_pause(h, b)                          # A takes the free lane
    h.run(until=lambda: len(h.streams.get(a, [])) >= 2)
    z = h.submit(pz, max_tokens=2, rid="Z")    # a real event: B may try again
    h.run(until=lambda: h.done(a, b, z), max_cycles=3000)
    assert _finished_at(h, b) < _finished_at(h, a), "B waited for the younger A to finish"
    assert h.finals[a].pauses and h.core.stats.take_backs >= 1
    _check(h, tiny_model, b, pb, max_tokens=30)
    _check(h, tiny_model, a, pa, max_tokens=150)
    _check(h, tiny_model, z, pz, max_tokens=2)
    h.check_clean()


def test_snapshot_pause_frees_device_memory_and_resume_reads_back(make, tiny_model):
    """Finding 6: a Snapshot pause moves the request's unique Device content to the Host in
    the pause's own commit (its pages are free once the copy publishes, no later reclaim
    round), and its resume moves those bytes back H2D."""
    h = make(max_concurrency=2, kv_capacity=4 * 64, prefill_chunk_tokens=64,
             context_cache={"host_capacity_bytes": 4 << 20})
    p = random_prompt(100, seed=2)
    b = h.submit(p, max_tokens=30, rid="B")
    h.run(until=lambda: len(h.streams.get(b, [])) >= 3)
    force_pause(h, b)
    h.run(until=lambda: not h.core.tx_busy, max_cycles=50)
    [out] = h.core.call_commands([P.Quote()])
    assert out.facts.pools[P.MAIN].free == 4 and _req(h, b).phase is Phase.PAUSED
    snap = out.facts.checkpoints[_req(h, b).snapshot.cid]
    assert not snap.image_device and snap.image_host
    h2d = h.core.bytes[0]
    h.core.sched.event()
    h.run(until=lambda: h.done(b))
    info = h.core.info
    assert h.core.bytes[0] - h2d >= info.image_bytes + 2 * info.page_bytes
    assert h.finals[b].pauses[0].route == "snapshot" and h.finals[b].usage.replay_tokens == 0
    _check(h, tiny_model, b, p, max_tokens=30)
    h.check_clean()


def test_pause_without_host_room_is_destructive_and_replays(make, tiny_model):
    """Finding 6: with no Host room the pause is destructive at once (its pages free in the
    same commit) and the request resumes by Replay — no revocation round needed."""
    h = make(max_concurrency=2, kv_capacity=4 * 64, prefill_chunk_tokens=64,
             context_cache={"host_capacity_bytes": 0})
    p = random_prompt(100, seed=2)
    b = h.submit(p, max_tokens=30, rid="B")
    h.run(until=lambda: len(h.streams.get(b, [])) >= 3)
    force_pause(h, b)
    [out] = h.core.call_commands([P.Quote()])
    cached = {bid for c in out.facts.checkpoints.values() for bid in c.blocks if out.facts.blocks[bid].device}
    assert out.facts.pools[P.MAIN].free == 4 - len(cached) and _req(h, b).snapshot is None
    h.core.sched.event()
    h.run(until=lambda: h.done(b))
    f = h.finals[b]
    assert f.pauses[0].route == "replay" and f.usage.replay_tokens > 0
    assert h.core.stats.revocations == 0
    _check(h, tiny_model, b, p, max_tokens=30)
    h.check_clean()


def test_a_bind_completed_in_the_step_runs_its_unit(make, tiny_model):
    """Finding 7: transactions progress inside the step; a bind whose read-back completed by
    the point after admission runs its first unit in the same step (inline copies make the
    completion available at once)."""
    h = make(max_concurrency=1, kv_capacity=4 * 64, prefill_chunk_tokens=256, copy_engine="inline",
             context_cache={"host_capacity_bytes": 4 << 20})
    p0 = random_prompt(60, seed=3)
    r0 = h.submit(p0, max_tokens=5)
    h.run(until=lambda: h.done(r0))
    _demote_everything(h)
    cont = p0 + h.finals[r0].token_ids
    r1 = h.submit(cont, max_tokens=4)
    cycles = 0
    while not h.streams.get(r1):
        h.cycle()
        cycles += 1
    assert cycles == 1, "the first token came a cycle late"
    h.run(until=lambda: h.done(r1))
    assert h.finals[r1].usage.cached_tokens == 60 + 5 - 1
    _check(h, tiny_model, r1, cont, max_tokens=4)
    h.check_clean()


def test_a_host_save_is_not_lost_to_a_read_back(make, tiny_model):
    """Finding 8: when a bind's read-back starts in the same step, a save that needs the Host
    joins the transaction (or starts the next) instead of being skipped although the Host has
    room."""
    # every completion arrives a few progress points late (the public fault surface), so the
    # read-back is surely still in flight when the fresh request's save needs the Host
    h = make(max_concurrency=2, kv_capacity=6 * 64, max_context=384, prefill_chunk_tokens=256,
             context_cache={"device_state_slots": 0, "host_capacity_bytes": 8 << 20},
             faults=[{"kind": "completion_delay", "steps": 6, "count": 0}])
    p0 = random_prompt(60, seed=3)
    r0 = h.submit(p0, max_tokens=5)
    h.run(until=lambda: h.done(r0))
    _demote_everything(h)
    cont = p0 + h.finals[r0].token_ids                     # binds from the Host (read-back)
    fresh = random_prompt(100, seed=4)
    a = h.submit(cont, max_tokens=4)
    b = h.submit(fresh, max_tokens=4, recovery_frontier=100)   # its first unit ends on its save
    h.run(until=lambda: h.done(a, b))
    s = h.core.stats_dict()["cache"]
    assert s["captures"] >= 1 and s["captures_skipped"] == 0 and s["captures_skipped_with_room"] == 0
    again = h.submit(fresh + [7], max_tokens=3)
    h.run(until=lambda: h.done(again))
    assert h.finals[again].usage.cached_tokens == 100
    _check(h, tiny_model, again, fresh + [7], max_tokens=3)
    h.check_clean()


# ==== rules ===================================================================================

def test_permit_order_the_older_row_gets_the_last_page(make, tiny_model):
    """Two rows need a page in the same cycle and one is free: the older (lower ticket) gets
    it and keeps decoding; the younger, which cannot progress, gives way (pauses itself)."""
    h = make(max_concurrency=2, max_context=320, kv_capacity=5 * 64, prefill_chunk_tokens=256,
             context_cache={"host_capacity_bytes": 0})
    p1, p2 = random_prompt(127, seed=2), random_prompt(128, seed=3)
    r1, r2 = h.submit(p1, max_tokens=20), h.submit(p2, max_tokens=20)
    skipped = _skipped_decode_cycles(h, r1, r2)
    assert skipped[r1] == 0 and not h.finals[r1].pauses
    assert h.finals[r2].pauses, "the younger row should have given way"
    _check(h, tiny_model, r1, p1, max_tokens=20)
    _check(h, tiny_model, r2, p2, max_tokens=20)
    h.check_clean()


def test_a_short_row_does_not_block_other_rows(make, tiny_model):
    """A row that is short (here: held up until an older resident's pages return) does not
    keep the other permitted rows of the cycle from running."""
    h = make(max_concurrency=3, max_context=256, kv_capacity=6 * 64, prefill_chunk_tokens=256,
             context_cache={"host_capacity_bytes": 0})
    big, mid, small = random_prompt(127, seed=5), random_prompt(127, seed=6), random_prompt(20, seed=7)
    rs, rb, rm_ = h.submit(small, max_tokens=40), h.submit(big, max_tokens=40), h.submit(mid, max_tokens=40)
    h.run(until=lambda: all(_running(h, r) for r in (rb, rm_, rs)))
    h.core.call_commands([P.HoldPages(h.core.pools[P.MAIN].available)])
    # the two younger rows both run short of pages; the middle one takes them back from the
    # youngest — the oldest row, which needs none, decodes on in every cycle
    assert _skipped_decode_cycles(h, rs, rb) == {rs: 0, rb: 0}
    assert h.finals[rm_].pauses if rm_ in h.finals else _req(h, rm_).pauses
    h.core.call_commands([P.HoldPages(0)])
    h.run(until=lambda: h.done(rb, rm_, rs))
    for r, p in ((rb, big), (rm_, mid), (rs, small)):
        _check(h, tiny_model, r, p, max_tokens=40)
    h.check_clean()


def test_fresh_binds_only_from_slack_after_resident_permits(make, tiny_model):
    """A resident row needs the last free page while a fresh request could take it: the row
    gets it; the fresh request waits (fresh admission uses slack, never an existing permit)."""
    h = make(max_concurrency=2, kv_capacity=4 * 64, prefill_chunk_tokens=256,
             context_cache={"host_capacity_bytes": 0})
    p = random_prompt(127, seed=8)
    r = h.submit(p, max_tokens=20)
    h.run(until=lambda: _running(h, r) and _req(h, r).frontier == 128)
    h.core.call_commands([P.HoldPages(1)])         # 4 pages: 2 for r, 1 held, 1 free
    assert h.core.pools[P.MAIN].available == 1
    q = random_prompt(30, seed=9)
    f = h.submit(q, max_tokens=2)                  # needs that free page too
    before = len(h.streams[r])
    h.cycle()                                      # r crosses into its third page now
    assert len(h.streams[r]) == before + 1 and _req(h, f).phase is Phase.QUEUED
    h.core.call_commands([P.HoldPages(0)])
    h.run(until=lambda: h.done(r, f))
    _check(h, tiny_model, r, p, max_tokens=20)
    _check(h, tiny_model, f, q, max_tokens=2)
    h.check_clean()


def test_an_ordinary_unit_settles_its_unused_reservation(make, tiny_model):
    """After every ordinary unit nothing stays reserved (growth is reserved per unit)."""
    h = make(max_concurrency=2, kv_capacity=4 * 64, prefill_chunk_tokens=40,
             context_cache={"host_capacity_bytes": 0})
    p = random_prompt(100, seed=10)
    r = h.submit(p, max_tokens=40)
    while not h.done(r):
        h.cycle()
        req = _req(h, r)
        if req is not None and req.facts is not None and not req.recovery_pending:
            assert req.facts.reserved == 0
    _check(h, tiny_model, r, p, max_tokens=40)
    h.check_clean()


def test_optional_captures_are_skipped_while_a_recovery_permit_is_active(make, tiny_model):
    """While one request holds the full recovery permit, every optional save is skipped (the
    request's unit still runs); once it made new progress, saves happen again."""
    h = make(max_concurrency=2, kv_capacity=6 * 64, max_context=384, prefill_chunk_tokens=256,
             context_cache={"host_capacity_bytes": 8 << 20})
    pr = random_prompt(60, seed=11)
    r = h.submit(pr, max_tokens=30, rid="R")
    h.run(until=lambda: len(h.streams.get(r, [])) >= 3)
    force_pause(h, r)
    h.run(until=lambda: not h.core.tx_busy, max_cycles=50)
    px = random_prompt(100, seed=12)
    x = h.submit(px, max_tokens=3, recovery_frontier=100)     # admitted with R's resume
    h.run(until=lambda: (q := _req(h, r)) is not None and q.phase is Phase.RUNNING)
    assert _req(h, r).recovery_pending or h.core.rm.stats.captures_skipped == 1
    h.run(until=lambda: h.done(r, x))
    assert h.core.rm.stats.captures_skipped == 1               # x's save, during R's recovery
    saved = h.core.rm.stats.captures
    y = h.submit(random_prompt(90, seed=13), max_tokens=3, recovery_frontier=90)
    h.run(until=lambda: h.done(y))
    assert h.core.rm.stats.captures == saved + 1               # no recovery permit: saved
    _check(h, tiny_model, r, pr, max_tokens=30)
    _check(h, tiny_model, x, px, max_tokens=3)
    h.check_clean()


def test_chunk_rotation_among_residents(make, tiny_model):
    """One prefill chunk per cycle, rotating among the residents that still prefill."""
    h = make(max_concurrency=2, kv_capacity=8 * 64, max_context=512, prefill_chunk_tokens=32,
             context_cache={"host_capacity_bytes": 0})
    pa, pb = random_prompt(200, seed=14), random_prompt(200, seed=15)
    a, b = h.submit(pa, max_tokens=2), h.submit(pb, max_tokens=2)
    order = []
    while not (h.done(a, b)):
        before = {r: (_req(h, r).frontier if _req(h, r) is not None else None) for r in (a, b)}
        h.cycle()
        grew = [r for r in (a, b) if _req(h, r) is not None and before[r] is not None
                and _req(h, r).frontier - before[r] > 1]
        assert len(grew) <= 1, "two chunks ran in one cycle"
        order += grew
    assert order[:6] in ([a, b] * 3, [b, a] * 3), order
    _check(h, tiny_model, a, pa, max_tokens=2)
    _check(h, tiny_model, b, pb, max_tokens=2)
    h.check_clean()
