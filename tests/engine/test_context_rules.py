"""Context-cache rules, one named test each (issue: context cache rules real and pinned). Each
drives the real EngineCore and worker, checks the oracle's tokens where outputs are involved
and ends with a leak check."""

from __future__ import annotations

import pytest

from ninfer import protocol as P
from tests.engine.harness import Harness, oracle, run
from tests.factories import random_prompt


@pytest.fixture
def roomy(make_harness):
    def build(**cfg) -> Harness:
        base = dict(max_concurrency=2, max_context=512, kv_capacity=16 * 64, prefill_chunk_tokens=64,
                    context_cache={"device_state_slots": 4, "host_capacity_bytes": 16 << 20})
        return make_harness(**{**base, **cfg})
    return build


def cache_points(h: Harness) -> list[int]:
    [out] = h.core.call_commands([P.Quote()])
    return sorted(c.frontier for c in out.facts.checkpoints.values() if c.kind is P.CkptKind.CACHE)


def test_a_raw_prompt_retry_hits_its_input_point(roomy, tiny_model):
    """Finding 1: with no typed rewrite the input point is P, the raw input end — the same
    token prompt sent again (a retry, here with another sample) reuses all of it."""
    h = roomy()
    p = random_prompt(90, seed=1)
    run(h, p, max_tokens=4)
    f2 = run(h, p, max_tokens=4, temperature=1.0, seed=7)
    assert f2.usage.cached_tokens == 90 and f2.usage.prefill_tokens == 0
    assert f2.token_ids == oracle(tiny_model, p, max_tokens=4, temperature=1.0, seed=7)
    h.check_clean()


def test_takeover_respects_publication_order(make_harness, tiny_model):
    """Finding 4: an older request admitted after a newer one published a record does not take
    that record over (seed: 重新查询也不能接管 publication order 晚于本请求的记录); it branches,
    and the newer conversation keeps its generation end."""
    # no divergence positions: the scenario needs the older request's first unit to need 3 pages
    # (a save offered where the two prompts part, at 60, would cut it to one page)
    h = make_harness(max_concurrency=3, max_context=512, kv_capacity=8 * 64, prefill_chunk_tokens=256,
                     context_cache={"device_state_slots": 4, "host_capacity_bytes": 0, "divergence_min_tokens": None})
    base = random_prompt(60, seed=2)
    blocker_p = random_prompt(20, seed=3)
    blocker = h.submit(blocker_p, max_tokens=150)              # a resident: at most 3 pages
    h.run(until=lambda: len(h.streams.get(blocker, [])) >= 1)
    h.core.call_commands([P.HoldPages(5)])                     # 2 pages left
    older_p = base + random_prompt(100, seed=4)                # its first unit needs 3: it waits
    older = h.submit(older_p, max_tokens=2, session_id="s")
    newer_p = base + random_prompt(10, seed=5)                 # 2 pages: it overtakes
    newer = h.submit(newer_p, max_tokens=4, recovery_frontier=60, session_id="s")
    h.run(until=lambda: h.done(newer))
    assert older not in h.finals
    h.core.call_commands([P.HoldPages(0)])
    h.core.sched.event()
    h.run(until=lambda: h.done(older))
    assert h.finals[older].usage.cached_tokens == 60        # it did reuse the newer's point
    cont = newer_p + h.finals[newer].token_ids + random_prompt(5, seed=6)
    f = run(h, cont, max_tokens=3, session_id="s")
    assert f.usage.cached_tokens == len(newer_p) + 4 - 1, "the newer publication's E was taken over"
    assert f.token_ids == oracle(tiny_model, cont, max_tokens=3)
    assert h.finals[older].token_ids == oracle(tiny_model, older_p, max_tokens=2)
    h.run(until=lambda: h.done(blocker))
    h.check_clean()


def test_one_physical_point_per_shared_prefix(roomy, tiny_model, monkeypatch):
    """Finding 9: concurrent chats with one shared system prompt (a marker) that each compute
    it keep one physical checkpoint at that position with several logical holders, not one per
    request. (Requests that arrive together normally wait for the first one's point instead —
    tests/engine/test_pending.py; here the waiting choice is switched off so that all four
    compute the prefix, as they do when waiting would cost more.)"""
    h = roomy(max_concurrency=4)
    monkeypatch.setattr(h.core.rm, "pending_source", lambda *a, **kw: None)
    shared = random_prompt(70, seed=8)
    prompts = [shared + random_prompt(20, seed=9 + i) for i in range(4)]
    rids = [h.submit(p, max_tokens=3, markers=[70]) for p in prompts]
    h.run(until=lambda: h.done(*rids))
    assert cache_points(h).count(70) == 1
    for r, p in zip(rids, prompts):
        assert h.finals[r].token_ids == oracle(tiny_model, p, max_tokens=3)
    f = run(h, shared + random_prompt(9, seed=20), max_tokens=2)
    assert f.usage.cached_tokens == 70
    h.check_clean()


def test_a_source_that_cannot_be_restored_alone_is_given_up(make_harness, tiny_model):
    """A point whose KV pages wait on the Host can need more Main to restore (its pages, a
    tail copy, the first unit's growth) than computing the prompt from scratch: the request
    reselects without it instead of failing with the capacity contract."""
    h = make_harness(max_concurrency=1, max_context=256, kv_capacity=4 * 64, prefill_chunk_tokens=256,
                     context_cache={"device_state_slots": 2, "host_capacity_bytes": 8 << 20})
    first = random_prompt(138, seed=30)
    f1 = run(h, first, max_tokens=49)
    run(h, random_prompt(200, seed=31), max_tokens=40)         # pushes the first's points to the Host
    cont = first + f1.token_ids[:30] + random_prompt(29, seed=32)   # 197 tokens: 4 pages from scratch
    # its deepest point is the input end P@138: restoring it loads 3 pages, copies the shared
    # tail and grows one — 5 pages of a 4-page Main
    f = run(h, cont, max_tokens=8)
    assert f.token_ids == oracle(tiny_model, cont, max_tokens=8)
    h.check_clean()


def test_sibling_continuations_fork_the_generation_end(roomy, tiny_model):
    """Finding 3: two continuations of one conversation's E planned in the same scan — the
    first must not Move E away from the second (which would recompute it); both reuse it."""
    h = roomy(max_concurrency=2, prefill_chunk_tokens=256)
    p = random_prompt(100, seed=40)
    f1 = run(h, p, max_tokens=30)
    e = len(p) + 30 - 1
    conts = [p + f1.token_ids + random_prompt(6, seed=41 + i) for i in range(2)]
    rids = [h.submit(c, max_tokens=3) for c in conts]
    h.run(until=lambda: h.done(*rids))
    for r, c in zip(rids, conts):
        assert h.finals[r].usage.cached_tokens == e, h.finals[r].usage
        assert h.finals[r].token_ids == oracle(tiny_model, c, max_tokens=3)
    h.check_clean()


def test_evidence_is_real_demand_only(roomy, tiny_model):
    """Finding 8: a save at a position with repeat demand takes the observation's time (a pure
    save is no evidence: 单纯保存不刷新证据), an adoption alone records repeat demand at the
    adopted position, and the summary keys positions by identity tag as well as digest."""
    from ninfer.policy.index import DemandSummary, digest
    h = roomy(max_concurrency=1, kv_capacity=8 * 64)
    rm = h.core.rm
    shared = random_prompt(70, seed=50)
    run(h, shared + random_prompt(5, seed=51), max_tokens=2, markers=[70])
    h.core.drop_caches()                                   # the point is gone, its observation stays
    run(h, shared + random_prompt(5, seed=52), max_tokens=2, markers=[70])
    obs = rm.summary.get(digest(shared), 70)
    assert obs is not None and obs.repeated
    [ent] = [e for e in rm.table.entries.values() if e.cid is not None]
    assert ent.evidence.demand_time == obs.last, "the save refreshed the evidence"
    # an adoption of a generation end (never a candidate position of a prefill) is repeat demand
    p = random_prompt(40, seed=53)
    f = run(h, p, max_tokens=5)
    e = len(p) + 5 - 1
    g = run(h, p + f.token_ids + random_prompt(3, seed=54), max_tokens=2)
    assert g.usage.cached_tokens == e
    adopted = rm.summary.get(digest((p + f.token_ids)[:e]), e)
    assert adopted is not None and adopted.repeated and len(adopted.requests) == 1
    s = DemandSummary(4, b"model-a")
    s.observe(b"d", 5, "r1", 1.0)
    s.observe(b"d", 5, "r2", 2.0, tag=b"model-b")
    assert not s.get(b"d", 5).repeated and s.get(b"d", 5, tag=b"model-b").tag == b"model-b"
    h.check_clean()


def test_lost_hits_are_attributed_to_their_cause(make_harness, tiny_model):
    """Finding 14: a lost hit is a prefix that matched a history whose designed restore point
    is missing, counted by why — a save skipped for want of room counts, an E that a Move
    consumed (the conversation continued from it) does not."""
    h = make_harness(max_concurrency=1, max_context=512, kv_capacity=8 * 64, prefill_chunk_tokens=256,
                     context_cache={"device_state_slots": 0, "host_capacity_bytes": 0})
    p = random_prompt(60, seed=60)
    run(h, p, max_tokens=2)                              # its input point P could not be saved
    run(h, p, max_tokens=2, temperature=1.0, seed=3)     # the retry finds it missing
    s = h.core.stats_dict()["cache"]
    assert s["hit_losses_by_cause"] == {"skipped_no_room": 1} and s["hit_loss_tokens"] == 60
    h2 = make_harness(max_concurrency=1, max_context=512, kv_capacity=8 * 64, prefill_chunk_tokens=256,
                      context_cache={"device_state_slots": 4, "host_capacity_bytes": 0})
    q = random_prompt(50, seed=61)
    f = run(h2, q, max_tokens=4)
    turn2 = run(h2, q + f.token_ids + random_prompt(5, seed=62), max_tokens=2)   # Moves E
    assert turn2.usage.cached_tokens == 53
    run(h2, q + f.token_ids + random_prompt(7, seed=63), max_tokens=2)           # a later sibling
    s2 = h2.core.stats_dict()["cache"]
    assert s2["hit_losses"] == 0, s2["hit_losses_by_cause"]
    h.check_clean()
    h2.check_clean()


def _anchor_points(h: Harness, rid_prompt) -> list[int]:
    rec = h.core.rm.table.records
    out = []
    for r in rec.values():
        out += [h.core.rm.table.ckpts[c].frontier for c in r.anchors if c in h.core.rm.table.ckpts]
    return sorted(out)


def test_anchors_are_keyed_by_position(roomy, tiny_model):
    """Finding 2: a continuation that takes the record over from its input point keeps the
    anchors still on its history; the stale ones (past the rewrite) are replaced first, and
    an anchor at a stale position is updated in place (seed: 锚点同位置更新，超限替换最旧发布点)."""
    h = roomy(max_concurrency=1, kv_capacity=8 * 64)
    x = random_prompt(100, seed=70)
    run(h, x, max_tokens=2, recovery_frontier=50, anchors=[20, 60, 70, 80], session_id="s")
    assert _anchor_points(h, x) == [20, 60, 70, 80]
    y = x[:50] + random_prompt(50, seed=71)                  # rewritten after 50
    f = run(h, y, max_tokens=2, recovery_frontier=50, anchors=[20, 60, 90], session_id="s")
    assert f.usage.cached_tokens == 50
    assert f.token_ids == oracle(tiny_model, y, max_tokens=2)
    got = _anchor_points(h, y)
    assert got == [20, 60, 80, 90], got      # 20 kept, 60 in place, the oldest stale (70) replaced
    ckpts = h.core.rm.table.ckpts
    [a60] = [c for r in h.core.rm.table.records.values() for c in r.anchors if ckpts[c].frontier == 60]
    assert ckpts[a60].tokens == tuple(y[:60])                              # the new history's 60
    h.core.drop_caches()
    # below the limit: the same position is updated in place, not kept twice
    u = random_prompt(90, seed=72)
    run(h, u, max_tokens=2, recovery_frontier=40, anchors=[20, 60], session_id="t")
    v = u[:40] + random_prompt(50, seed=73)
    run(h, v, max_tokens=2, recovery_frontier=40, anchors=[60], session_id="t")
    assert _anchor_points(h, v) == [20, 60]
    h.check_clean()


def _held_by(h: Harness, rid: str) -> list[int]:
    return sorted(c.frontier for c in cache_facts(h) if P.WaiterOwner(rid) in c.owners)


def cache_facts(h: Harness):
    [out] = h.core.call_commands([P.Quote()])
    return list(out.facts.checkpoints.values())


def _waiter_behind_a_runner(make_harness, seed: int):
    """A finished 100-token chat (E at 101, input point P at 100), a runner holding the only
    lane, and the chat's continuation queued behind it, waiting on E."""
    h = make_harness(max_concurrency=1, max_context=512, kv_capacity=8 * 64, prefill_chunk_tokens=256,
                     context_cache={"device_state_slots": 4, "host_capacity_bytes": 0})
    base = random_prompt(100, seed=seed)
    f = run(h, base, max_tokens=2)
    runner = h.submit(random_prompt(30, seed=seed + 1), max_tokens=40)      # holds the only lane
    h.run(until=lambda: len(h.streams.get(runner, [])) >= 1)
    cont = base + f.token_ids + [3, 4]
    waiter = h.submit(cont, max_tokens=2)
    for _ in range(3):
        h.cycle()
    return h, runner, waiter, cont, f


def test_waiting_references_carry_their_points_and_are_no_public_entry(make_harness, tiny_model):
    """Finding 7: a waiter holds its source and the record's compatible input point it will
    carry; points that only waiters keep are not offered to other requests."""
    h, runner, waiter, cont, f = _waiter_behind_a_runner(make_harness, seed=80)
    base = cont[:100]
    assert _held_by(h, waiter) == [100, 101]            # E and the carried input point P
    h.core.drop_caches()                                # the record lets go: only the waiter keeps them
    other = h.submit(base + f.token_ids + [5], max_tokens=2)
    for _ in range(3):
        h.cycle()
    assert _held_by(h, other) == [], "a point only a waiter keeps was offered as a public source"
    h.run(until=lambda: h.done(runner, waiter, other))
    assert h.finals[waiter].usage.cached_tokens == 101              # its own waited source
    assert h.finals[waiter].token_ids == oracle(tiny_model, cont, max_tokens=2)
    h.check_clean()


def test_a_deleted_carried_point_does_not_end_the_wait_on_its_source(make_harness, tiny_model):
    """Finding 7 (found by the long run under load): reclaim deletes a point a waiter only
    carries (its input point P) while its source E survives. The request still waits on E and,
    once a lane frees, takes E over (Move) — its own waiting reference released first; before,
    the deletion dropped the wait from the books while the worker kept the hold, and every Move
    was refused ("still held by" the request's own waiter) until the engine stalled."""
    h, runner, waiter, cont, _ = _waiter_behind_a_runner(make_harness, seed=84)
    assert _held_by(h, waiter) == [100, 101]
    [out] = h.core.call_commands([P.Quote()])
    p = next(c for c in out.facts.checkpoints.values() if c.frontier == 100)
    actions = [P.Delete(p.cid, p.generation, p.version)]
    [res] = h.core.call_commands([P.Commit(actions)])
    assert res.result.ok
    h.core.outcomes.committed(actions, res.result)
    assert _held_by(h, waiter) == [101]
    h.run(until=lambda: h.done(runner, waiter))
    assert h.finals[waiter].finish_reason == "length", h.finals[waiter].error
    assert h.finals[waiter].usage.cached_tokens == 101
    assert h.finals[waiter].token_ids == oracle(tiny_model, cont, max_tokens=2)
    assert h.core.stats.stalls == 0
    h.check_clean()


def test_a_rewrite_retires_the_superseded_generation_end_at_admission(roomy, tiny_model):
    """Finding 7: a request that takes its record over from the input point after a rewrite
    retires the record's deeper E (no longer its history) as soon as it is admitted, not when
    it finishes (seed: 接纳后退休获准替代的更深私有点)."""
    h = roomy(max_concurrency=1, kv_capacity=8 * 64)
    x = random_prompt(100, seed=82)
    run(h, x, max_tokens=4, recovery_frontier=50, session_id="s")
    assert 103 in cache_points(h)
    y = x[:50] + random_prompt(50, seed=83)
    rid = h.submit(y, max_tokens=30, recovery_frontier=50, session_id="s")
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 1)
    assert 103 not in cache_points(h) and 50 in cache_points(h)
    h.run(until=lambda: h.done(rid))
    assert h.finals[rid].usage.cached_tokens == 50
    assert h.finals[rid].token_ids == oracle(tiny_model, y, max_tokens=30)
    h.check_clean()


def test_restore_cost_counts_kv_pages_on_the_host(make_harness, tiny_model):
    """Finding 13: a source's restore cost counts the KV pages only the Host holds as well as
    its StateImage — the worker reports placement changes and the controller's mirror agrees
    with the worker's facts after demotions."""
    h = make_harness(max_concurrency=1, max_context=256, kv_capacity=4 * 64, prefill_chunk_tokens=256,
                     context_cache={"device_state_slots": 2, "host_capacity_bytes": 8 << 20})
    first = random_prompt(138, seed=30)
    run(h, first, max_tokens=49)
    run(h, random_prompt(200, seed=31), max_tokens=40)          # pushes the first's pages to the Host
    [out] = h.core.call_commands([P.Quote()])
    facts, rm, info = out.facts, h.core.rm, h.core.info
    moved = 0
    for cid, c in facts.checkpoints.items():
        host_pages = sum(1 for b in c.blocks if not facts.blocks[b].device)
        mirror = rm.table.ckpts[cid]
        assert mirror.host_pages == host_pages and mirror.ref.device == c.image_device, cid
        assert rm._h2d_bytes(mirror) == (0 if c.image_device else info.image_bytes) + host_pages * info.page_bytes
        moved += host_pages
    assert moved >= 3
    h.check_clean()


def test_the_cost_model_is_calibrated_at_startup(tiny_model):
    """Finding 13: the engine measures its Host→Device copy rate and prefill rate when it
    starts and reports the model it ranks sources with in ``stats()``."""
    import ninfer
    from ninfer.policy.cost import CostModel
    eng = ninfer.Engine.start(tiny_model, config={"max_concurrency": 1, "max_context": 256}, dtype="float64",
                              transport="inproc")
    try:
        cm = eng.stats()["cost_model"]
        assert cm["calibrated"] and cm["h2d_bytes_per_s"] > 0 and cm["prefill_s_per_token"] > 0
        assert (cm["h2d_bytes_per_s"], cm["prefill_s_per_token"]) != (CostModel.h2d_bytes_per_s,
                                                                   CostModel.prefill_s_per_token)
        p = random_prompt(30, seed=90)
        assert eng.generate(p, max_tokens=3).result(60).token_ids == oracle(tiny_model, p, max_tokens=3)
        eng.drop_caches()
        eng.check_integrity()
    finally:
        eng.shutdown()
    off = ninfer.Engine.start(tiny_model, config={"max_concurrency": 1, "max_context": 256,
                                                  "cost_calibration": False}, dtype="float64", transport="inproc")
    try:
        assert off.stats()["cost_model"]["calibrated"] is False
    finally:
        off.shutdown()


def test_a_fork_from_a_shallower_point_leaves_the_parents_evidence(roomy, tiny_model):
    """Seed: Fork 从父记录较浅位置启动时，父记录保留原有一对证据；source 已覆盖父记录的证明位置
    时才更新父记录 — the parent's proven position does not regress to the shallower source."""
    h = roomy(max_concurrency=2, kv_capacity=8 * 64)
    rm = h.core.rm
    x = random_prompt(100, seed=95)
    f = run(h, x, max_tokens=2, recovery_frontier=50)
    b = h.submit(x + f.token_ids + random_prompt(4, seed=96), max_tokens=30,
                 recovery_frontier=50)                                 # adopts E@101, carries @50
    h.run(until=lambda: len(h.streams.get(b, [])) >= 1)
    [rec] = [r for r in rm.table.records.values() if r.active == b]
    proven, when = rec.evidence.proven_frontier, rec.evidence.demand_time
    assert proven == 101
    c_prompt = x[:50] + random_prompt(30, seed=97)
    c = h.submit(c_prompt, max_tokens=2, recovery_frontier=50)        # Forks the input point @50
    h.run(until=lambda: len(h.streams.get(c, [])) >= 1)
    assert h.finals.get(c) is None or h.finals[c].usage.cached_tokens == 50
    assert (rec.evidence.proven_frontier, rec.evidence.demand_time) == (proven, when)
    h.run(until=lambda: h.done(b, c))
    assert h.finals[c].usage.cached_tokens == 50
    assert h.finals[c].token_ids == oracle(tiny_model, c_prompt, max_tokens=2)
    h.check_clean()


def test_source_ties_break_by_session_hint_then_private_use_then_newer_publication(make_harness):
    """Seed: 成本相同时依次考虑搬运字节、更深复用位置、合法 session 提示、私有用途、较新 publication
    order 和稳定序号 — aliases of one position (equal cost) are chosen by these, in this order."""
    from ninfer.engine.request import Request
    from ninfer.protocol import RequestSpec
    from ninfer.sampling_params import SamplingParams
    h = make_harness(max_concurrency=1, max_context=256)
    rm = h.core.rm
    toks = tuple(random_prompt(40, seed=98))

    def alias(cid: int, session=None, order=-1, private=True):
        ref = P.CkptRef(cid, cid, 40, P.CkptKind.CACHE, True, False)
        if private:
            rec = rm.table.new_record(session)
            rec.e, rec.publication_order = cid, order
            rm.table.add_ckpt(ref, toks, rec.owner(P.Role.E))
        else:
            ent = rm.table.new_entry(cid, 40)
            rm.table.add_ckpt(ref, toks, ent.owner)

    def pick(session=None) -> int:
        req = Request(spec=RequestSpec(prompt=list(toks) + [1, 2], params=SamplingParams(max_tokens=1),
                                       session_id=session), rid=f"q{session}", ticket=10**6)
        return rm.choose(req, 42, 42).cid

    alias(901, order=5, private=False)
    alias(902, order=3)
    alias(903, order=7)
    alias(904, session="s", order=1)
    assert pick("s") == 904                 # the legal session hint first
    assert pick() == 903                    # then private use, then the newer publication order
    for cid in (901, 902, 903, 904):
        rm.table.forget_ckpt(cid)
    alias(911, private=False)               # a public entry, and a private point never published:
    alias(912, order=-1)                    # private use decides before the stable sequence
    assert pick() == 912
    for cid in (911, 912):
        rm.table.forget_ckpt(cid)


@pytest.mark.parametrize("inner", [True, False], ids=["inner-saves", "saves-cut"])
def test_rewrite_execution_frontiers_split_the_math_even_without_a_save(roomy, tiny_model, inner):
    """Seed: rewrite_execution_frontiers 另行约束数学执行的切分 … 实际恢复位置前移或可选保存失败都不
    改变这些数学边界 — a split point that is no save point (here the restore position C lies
    before it) still ends a prefill unit there; the chunk would otherwise run through it. With
    inner saves C is saved inside the first unit; without, C ends a unit of its own."""
    h = roomy(max_concurrency=1, kv_capacity=8 * 64, prefill_chunk_tokens=128,
              context_cache={"device_state_slots": 4, "host_capacity_bytes": 16 << 20, "inner_saves": inner})
    units: list[int] = []
    step = h.core.client.step

    def record(plan):
        for it in plan.intents:
            n = it.first_tokens if isinstance(it, P.BindIntent) else it.unit.n_tokens
            units.append(n)
        return step(plan)
    h.core.client.step = record
    prompt = random_prompt(100, seed=86)
    rid = h.submit(prompt, max_tokens=2, recovery_frontier=30, split_points=[37])
    h.run(until=lambda: h.done(rid))
    want = [37, 63] if inner else [30, 7, 63]          # C = 30 is saved; 37 only splits
    assert units[:len(want)] == want, units
    assert 30 in cache_points(h)
    assert h.finals[rid].token_ids == oracle(tiny_model, prompt, max_tokens=2)
    h.check_clean()
