"""The seed's scenario table and the context-cache rules as named tests, on the real EngineCore
and worker. Every scenario also checks the oracle's tokens and ends with a leak check."""

from __future__ import annotations

import pytest

from ninfer import protocol as P
from tests.engine.harness import Harness, oracle, run
from tests.factories import random_prompt


@pytest.fixture
def make(make_harness):
    def build(**cfg) -> Harness:
        cfg.setdefault("max_context", 512)
        return make_harness(**cfg)
    return build


def facts(h: Harness) -> P.Facts:
    [out] = h.core.call_commands([P.Quote()])
    return out.facts


def points(h: Harness) -> dict[int, tuple[str, ...]]:
    """frontier -> owners of every cache checkpoint (what the cache holds)."""
    return {c.frontier: c.owners for c in facts(h).checkpoints.values() if c.kind is P.CkptKind.CACHE}


ROOMY = dict(max_concurrency=2, kv_capacity=16 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 4, "host_capacity_bytes": 16 << 20})


def test_agent_generation_end_then_tool_call_normalisation(make, tiny_model):
    """Seed scenario: an agent continues from the previous E; when the client then normalises
    the earlier tool call, E no longer matches and the typed-R input point (saved just before
    the assistant response) serves the rewrite, the suffix is recomputed."""
    h = make(**ROOMY)
    a = random_prompt(60, seed=1)
    t1 = run(h, a, max_tokens=8, session_id="agent", recovery_frontier=58)
    b = a + t1.token_ids + random_prompt(12, seed=2)              # tool result appended
    r2 = len(b) - 2                                                # R: before the assistant header
    t2 = run(h, b, max_tokens=8, session_id="agent", recovery_frontier=r2)
    assert t2.usage.cached_tokens == len(a) + 8 - 1             # E of turn 1
    normalised = b[:r2] + random_prompt(8, seed=3) + random_prompt(10, seed=4)
    t3 = run(h, normalised, max_tokens=8, session_id="agent", recovery_frontier=len(normalised) - 2)
    assert t3.usage.cached_tokens == r2                         # the typed-R fallback
    assert t3.usage.prefill_tokens == len(normalised) - r2
    assert t3.token_ids == oracle(tiny_model, normalised, max_tokens=8)
    assert h.core.rm.stats.hits == 2
    h.check_clean()


def test_private_point_equals_public_marker(make, tiny_model):
    """One state serves both uses; the private record moves on, the public entry lives on by
    its own reference."""
    h = make(**ROOMY)
    shared = random_prompt(50, seed=5)
    p1 = shared + random_prompt(10, seed=6)
    run(h, p1, max_tokens=4, session_id="s1", recovery_frontier=50, markers=[50])
    owners = points(h)[50]
    assert (len([o for o in owners if isinstance(o, P.RecordOwner)]) == 1
            and len([o for o in owners if isinstance(o, P.EntryOwner)]) == 1)
    n_ckpts = len(facts(h).checkpoints)
    # the private record takes a later input point: its old one retires, the marker stays
    p2 = p1 + random_prompt(30, seed=7)
    run(h, p2, max_tokens=4, session_id="s1", recovery_frontier=len(p2) - 1)
    assert 50 in points(h) and all(isinstance(o, P.EntryOwner) for o in points(h)[50])
    # another session with a different suffix still gets the shared prefix
    p3 = shared + random_prompt(20, seed=8)
    f3 = run(h, p3, max_tokens=4, session_id="s2")
    assert f3.usage.cached_tokens == 50
    assert f3.token_ids == oracle(tiny_model, p3, max_tokens=4)
    assert n_ckpts >= 2
    h.check_clean()


def test_alpha_and_alpha_beta_markers_then_alpha_gamma(make, tiny_model):
    """Both marker positions get a save opportunity; the shallower one still serves a later
    different suffix."""
    h = make(**ROOMY)
    alpha, beta, gamma = random_prompt(40, seed=9), random_prompt(30, seed=10), random_prompt(25, seed=11)
    run(h, alpha + beta + random_prompt(5, seed=12), max_tokens=3, markers=[40, 70])
    assert {40, 70} <= set(points(h))
    f = run(h, alpha + gamma, max_tokens=5)
    assert f.usage.cached_tokens == 40
    assert f.token_ids == oracle(tiny_model, alpha + gamma, max_tokens=5)
    f2 = run(h, alpha + beta + gamma, max_tokens=5)
    assert f2.usage.cached_tokens == 70
    h.check_clean()


def test_hot_predecessor_with_one_off_branches(make, tiny_model):
    """Each branch carries its own adoption time (completion does not heat it); when their
    footprint outgrows the pools, older branches go before newer ones and before the hot
    shared prefix, which keeps serving."""
    h = make(max_concurrency=1, kv_capacity=8 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 3, "host_capacity_bytes": 0})
    hot = random_prompt(64, seed=13)
    branches = [hot + random_prompt(60, seed=100 + i) for i in range(8)]
    outs = [run(h, b, max_tokens=3, markers=[64]) for b in branches]
    assert all(o.usage.cached_tokens == 64 for o in outs[1:]), "the hot prefix was lost"
    assert all(o.token_ids == oracle(tiny_model, b, max_tokens=3) for o, b in zip(outs, branches))
    kept = {c.frontier for c in facts(h).checkpoints.values()}
    assert 64 in kept
    # the newest branch end survives; the oldest were reclaimed first
    ends = sorted(points(h))
    assert ends and max(ends) == 64 + 60 + 3 - 1
    h.check_clean()


def test_long_input_without_save_points(make, tiny_model):
    """Chunk ends are never save opportunities: a long raw prompt leaves exactly its input end P
    (the raw input's restore point) and its generation end — nothing at the 32-token chunk ends."""
    h = make(max_concurrency=1, kv_capacity=8 * 64, prefill_chunk_tokens=32,
             context_cache={"device_state_slots": 4, "host_capacity_bytes": 16 << 20})
    p = random_prompt(300, seed=14)
    f = run(h, p, max_tokens=4)
    assert h.core.rm.stats.captures == 1
    assert sorted(points(h)) == [300, 300 + 4 - 1]
    assert f.usage.prefill_tokens == 300 and f.token_ids == oracle(tiny_model, p, max_tokens=4)
    h.check_clean()


def test_only_a_few_main_pages_short(make, tiny_model):
    """When a request is a couple of pages short, only the needed page groups move to the
    Host — not the whole history, and not its StateImage."""
    h = make(max_concurrency=1, kv_capacity=8 * 64, prefill_chunk_tokens=512,
             context_cache={"device_state_slots": 2, "host_capacity_bytes": 16 << 20})
    long_p = random_prompt(380, seed=15)
    run(h, long_p, max_tokens=2)                       # its E keeps 6 of 8 pages on the Device
    e = next(c for c in facts(h).checkpoints.values())
    assert len(e.blocks) == 6 and e.image_device
    other = random_prompt(150, seed=16)                # needs 3 pages: one short... two more
    f = run(h, other, max_tokens=2)
    assert f.token_ids == oracle(tiny_model, other, max_tokens=2)
    fx = facts(h)
    e_now = fx.checkpoints[e.cid]
    on_host = [b for b in e_now.blocks if not fx.blocks[b].device]
    assert 0 < len(on_host) < len(e_now.blocks), "only the needed page groups should move"
    assert e_now.image_device, "the StateImage does not move with the pages"
    # and the history is still complete: continuing it reads the pages back
    first = h.finals[next(iter(h.finals))]
    cont = long_p + first.token_ids + [5, 6, 7]
    f2 = run(h, cont, max_tokens=3)
    assert f2.usage.cached_tokens == 380 + 2 - 1
    assert f2.token_ids == oracle(tiny_model, cont, max_tokens=3)
    assert h.core.stats_dict()["bytes_h2d"] > 0
    h.check_clean()


def test_zero_host_and_few_device_slots(make, tiny_model):
    """Optional saves may fail; necessary execution reclaims what it needs; Replay progresses
    under the full recovery permit; every output is exact."""
    h = make(max_concurrency=2, max_context=256, kv_capacity=4 * 64, prefill_chunk_tokens=48,
             context_cache={"device_state_slots": 0, "host_capacity_bytes": 0})
    prompts = [random_prompt(90 + 10 * i, seed=20 + i) for i in range(5)]
    rids = [h.submit(p, max_tokens=30, recovery_frontier=len(p) - 5, markers=[20]) for p in prompts]
    h.run(until=lambda: h.done(*rids))
    for rid, p in zip(rids, prompts):
        assert h.finals[rid].token_ids == oracle(tiny_model, p, max_tokens=30)
    s = h.core.stats_dict()
    assert s["cache"]["captures_skipped"] > 0
    assert s["preemptions"] > 0
    h.check_clean()


def test_repeated_computation_builds_demand_evidence(make, tiny_model):
    """Seed scenario: a position nobody could keep is computed by two different requests; that
    is repeat demand (recorded when their prefill commits cross it), so a save there may
    replace normal content (admission row 2) — while hit statistics count only real reuse. The
    second computation's own save rides on the commit that forms the evidence: it is admitted
    (the save exists only if that commit happens), and the third request reuses it."""
    h = make(max_concurrency=1, kv_capacity=8 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 1, "host_capacity_bytes": 0})
    big = random_prompt(250, seed=30)
    run(h, big, max_tokens=2)                        # its E fills the only spare slot
    x = random_prompt(60, seed=31)
    prompts = [x + random_prompt(40, seed=32 + i) for i in range(3)]
    # the input point is the marker position (one save opportunity per request)
    fa = run(h, prompts[0], max_tokens=2, markers=[60], recovery_frontier=60)
    assert 60 not in points(h)                       # row 1: 60 tokens of coverage < losing an E
    assert h.core.rm.stats.captures_skipped == 1 and h.core.rm.stats.summary_hits == 0
    hits_before = h.core.rm.stats.hits
    fb = run(h, prompts[1], max_tokens=2, markers=[60], recovery_frontier=60)
    assert fb.usage.cached_tokens == 0
    assert 60 in points(h), "the second computation proves repeat demand: its save is admitted (row 2)"
    assert h.core.rm.stats.summary_hits >= 1 and h.core.rm.stats.hits == hits_before
    fc = run(h, prompts[2], max_tokens=2, markers=[60], recovery_frontier=60)
    assert fc.usage.cached_tokens == 60 and h.core.rm.stats.hits == hits_before + 1
    for f, p in zip((fa, fb, fc), prompts):
        assert f.token_ids == oracle(tiny_model, p, max_tokens=2)
    h.check_clean()


def test_capture_admission_row1_budget_allows_a_cheap_replacement(make):
    """Without own repeat demand a save may replace content when its new coverage is larger
    than what the replacement loses."""
    h = make(max_concurrency=1, kv_capacity=8 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 1, "host_capacity_bytes": 0})
    run(h, random_prompt(20, seed=40), max_tokens=2)          # a small E (loss 21)
    p = random_prompt(200, seed=41)
    run(h, p, max_tokens=2, recovery_frontier=180)            # benefit 180 > 21: admitted
    assert 180 in points(h) and 21 not in points(h)
    assert h.core.rm.stats.captures_skipped == 0
    h.check_clean()


def test_session_is_a_hint_and_older_finishes_do_not_overwrite(make):
    """An older request finishing late does not overwrite a newer publication of the session;
    unnamed histories are still reusable by exact content."""
    h = make(max_concurrency=2, kv_capacity=16 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 4, "host_capacity_bytes": 16 << 20})
    base = random_prompt(40, seed=50)
    old = h.submit(base + random_prompt(5, seed=51), max_tokens=40, session_id="s")
    new = h.submit(base + random_prompt(5, seed=52), max_tokens=2, session_id="s")
    h.run(until=lambda: h.done(old, new))
    rec = h.core.rm.table.records[h.core.rm.table.sessions["s"]]
    assert rec.publication_order == max(r.publication_order for r in h.core.rm.table.records.values())
    f = run(h, base + random_prompt(5, seed=51) + h.finals[old].token_ids + [9], max_tokens=2)
    assert f.usage.cached_tokens == 45 + 40 - 1            # unnamed: reused by exact content
    h.check_clean()


def test_waiting_reference_protects_a_blocked_source(make):
    """A queued request keeps its valuable source with a waiting reference: optional writes
    cannot delete it, and it is released when the request binds."""
    h = make(max_concurrency=1, kv_capacity=8 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 1, "host_capacity_bytes": 0})
    base = random_prompt(100, seed=60)
    run(h, base, max_tokens=2)
    runner = h.submit(random_prompt(30, seed=61), max_tokens=40)      # holds the only lane
    h.run(until=lambda: len(h.streams.get(runner, [])) >= 1)
    waiter = h.submit(base + h.finals[next(iter(h.finals))].token_ids + [3, 4], max_tokens=2)
    for _ in range(5):
        h.cycle()
    held = [c for c in facts(h).checkpoints.values() if any(isinstance(o, P.WaiterOwner) for o in c.owners)]
    # the base prompt's input end P = 100 survived (dropping its E lost only one token)
    assert held and held[0].frontier == 100
    h.run(until=lambda: h.done(runner, waiter))
    assert h.finals[waiter].usage.cached_tokens == 100
    assert not any(isinstance(o, P.WaiterOwner) for c in facts(h).checkpoints.values() for o in c.owners)
    assert h.core.rm.stats.waits >= 1
    h.check_clean()


def test_metadata_stays_bounded_over_many_distinct_requests(make):
    """Empty records and index branches are deleted promptly: after many distinct requests the
    controller's metadata is bounded by what is physically kept."""
    h = make(max_concurrency=2, kv_capacity=8 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 2, "host_capacity_bytes": 2 << 20})
    for i in range(60):
        run(h, random_prompt(30 + i % 50, seed=1000 + i), max_tokens=2, recovery_frontier=20,
            markers=[10], session_id=f"s{i}")
    rm = h.core.rm
    phys = len(facts(h).checkpoints)
    assert len(rm.table.ckpts) == phys
    assert len(rm.table.records) <= phys and len(rm.table.entries) <= phys
    assert len(rm.table.index) == phys and len(rm.table.sessions) <= phys
    assert len(rm.summary) <= 256 and len(rm.remembered) <= 256
    h.check_clean()
    assert not rm.table.records and not rm.table.entries and len(rm.table.index) == 0


def test_stats_separate_real_hits_from_summary_hits_and_count_lost_hits(make):
    """A deleted deeper point that a later prompt matches counts as a hit lost to a missing
    checkpoint."""
    h = make(max_concurrency=1, kv_capacity=8 * 64, prefill_chunk_tokens=64,
             context_cache={"device_state_slots": 0, "host_capacity_bytes": 0})
    p = random_prompt(100, seed=70)
    f1 = run(h, p, max_tokens=2)
    run(h, random_prompt(300, seed=71), max_tokens=2)          # pushes the first E out
    run(h, p + f1.token_ids + [1, 2], max_tokens=2)
    s = h.core.stats_dict()["cache"]
    assert s["hit_losses"] == 1 and s["hit_loss_tokens"] == 101
    assert s["hit_losses_by_cause"] == {"evicted": 1}
    assert s["hits"] == 0 and s["summary_hits"] == 0
    h.check_clean()
