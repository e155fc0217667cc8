"""The worker executes the plan it is given (finding 9): it applies no lane count, overtaking
budget, order or chunk choice of its own — only the plan's guards, in the plan's order — and
answers with typed outcomes keyed by intent id."""

from __future__ import annotations

import pytest

from ninfer import protocol as P
from ninfer.actors.worker import Worker
from ninfer.config import EngineConfig
from ninfer.sampling_params import SamplingParams
from tests.factories import random_prompt


@pytest.fixture
def worker(tiny_model):
    w = Worker(tiny_model, EngineConfig(dtype="float64", max_concurrency=2, max_context=256, kv_capacity=512,
                                        context_cache={"device_state_slots": 4, "host_capacity_bytes": 0}))
    yield w
    w.shutdown()


def _bind(iid: int, rid: str, n: int, guards=()) -> P.BindIntent:
    prompt = random_prompt(n, seed=iid)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    return P.BindIntent(iid, new=P.NewSeq(rid, P.pack_tokens(prompt), n, params), first_tokens=n,
                        unit=P.UnitSpec(n, P.UnitKind.PREFILL), guards=list(guards))


def _step(worker: Worker, intents) -> P.StepReply:
    return P.decode_reply(worker.handle(P.encode(P.StepPlan(1, intents=intents))))


def test_worker_executes_the_plan_as_given(worker):
    """Three fresh binds on a C = 2 engine, no guards: all three are bound — lanes are the
    Scheduler's bound, not the worker's. Replies are keyed by intent id, in plan order."""
    reply = _step(worker, [_bind(7, "a", 10), _bind(3, "b", 10), _bind(5, "c", 10)])
    assert [o.iid for o in reply.intents] == [7, 3, 5]
    assert all(o.outcome is P.Outcome.OK for o in reply.intents)


def test_worker_applies_the_guards_it_is_sent(worker):
    """The lane bound as a guard (at most 1 success among the earlier binds) and the one-chunk
    guard on a unit: evaluated exactly as stated."""
    lanes = P.Guard((), (1,), 1)
    reply = _step(worker, [_bind(1, "a", 10), _bind(2, "b", 10, [lanes])])
    assert [o.outcome for o in reply.intents] == [P.Outcome.OK, P.Outcome.SKIPPED]
    overtake = P.Guard((11,), (12,), 1)          # 11 failed and one younger success already
    big = _bind(11, "big", 10)
    big.first_tokens = 10_000                    # cannot fit: SHORT
    reply = _step(worker, [big, _bind(12, "x", 10), _bind(13, "y", 10, [overtake])])
    assert [o.outcome for o in reply.intents] == [P.Outcome.SHORT, P.Outcome.OK, P.Outcome.SKIPPED]
    assert reply.intents[0].shortfall


def test_a_short_intent_commits_no_remedy_that_does_not_cover_it(worker):
    """Remedies are conditional: a prefix is committed only if it covers the gap (now, or once
    its copies publish); otherwise nothing irreversible happens."""
    reply = _step(worker, [_bind(1, "a", 60)])
    sid = reply.intents[0].sid
    big = _bind(2, "big", 10)
    big.first_tokens = 10_000
    big.remedies = [P.TakeBack(sid)]            # pausing "a" would not cover 10 000 tokens
    reply = _step(worker, [big])
    assert reply.intents[0].outcome is P.Outcome.SHORT and not reply.intents[0].applied
    assert worker.prog.sequences[sid].phase is P.Phase.RUNNING


def _capture_plan(iid: int, rid: str, n: int, owner, room=()) -> P.BindIntent:
    b = _bind(iid, rid, n)
    b.unit = P.UnitSpec(n, P.UnitKind.PREFILL, captures=[P.Capture(owner, room=list(room))])
    return b


@pytest.mark.parametrize("slot_free", [True, False])
def test_a_saves_admitted_room_is_committed_only_when_it_needs_it(tiny_model, slot_free):
    """The capture admission's replacements ride with the save: with a Device slot free at
    capture time nothing is deleted; without one, the room is committed and the save made."""
    extra = 1 if slot_free else 0
    w = Worker(tiny_model, EngineConfig(dtype="float64", max_concurrency=2, max_context=256, kv_capacity=512,
                                        context_cache={"device_state_slots": extra, "host_capacity_bytes": 0}))
    try:
        first = _step(w, [_capture_plan(1, "a", 20, P.EntryOwner(1))])
        [unit] = first.units
        old = unit.captures[0].captured
        assert old is not None and old.device
        w.handle(P.encode(P.StepPlan(2, commands=[P.Release(first.intents[0].sid)])))
        [fx] = P.decode_reply(w.handle(P.encode(P.StepPlan(3, commands=[P.Quote()])))).commands
        version = fx.facts.checkpoints[old.cid].version
        room = [P.Delete(old.cid, old.generation, version)]
        reply = _step(w, [_capture_plan(4, "b", 30, P.EntryOwner(2), room)])
        [u] = reply.units
        [c] = u.captures
        assert c.result is P.CaptureResult.SAVED and c.captured is not None
        if slot_free:
            assert c.room_applied is None and old.cid in w.prog.checkpoints
        else:
            assert c.room_applied is not None and c.room_applied.ok and old.cid not in w.prog.checkpoints
    finally:
        w.shutdown()


def test_reclaim_steps_are_trimmed_to_the_shortfall_and_a_stale_one_is_skipped(tiny_model):
    """Finding 10: a plan's reclaim comes as separately committable steps; Native commits the
    shortest prefix that covers the real shortfall, and a step that no longer commits (stale
    since its quote) is skipped while the later ones are still tried one by one."""
    w = Worker(tiny_model, EngineConfig(dtype="float64", max_concurrency=1, max_context=256, kv_capacity=256,
                                        context_cache={"device_state_slots": 3, "host_capacity_bytes": 0}))
    try:
        points = []
        for i in range(3):                              # three cached points fill the extra slots
            r = _step(w, [_capture_plan(10 + i, f"p{i}", 20, P.EntryOwner(i + 1))])
            points.append(r.units[0].captures[0].captured)
            w.handle(P.encode(P.StepPlan(20 + i, commands=[P.Release(r.intents[0].sid)])))
        [fx] = P.decode_reply(w.handle(P.encode(P.StepPlan(30, commands=[P.Quote()])))).commands
        dels = [P.Delete(c.cid, c.generation, fx.facts.checkpoints[c.cid].version) for c in points]
        slots = w.prog.pools["state"]
        held = slots.available
        slots.reserve(held)                             # no free slot: the bind needs one reclaimed
        stale = P.Delete(dels[0].cid, dels[0].generation, dels[0].version + 999)
        b = _bind(41, "b", 10)
        b.remedies = [P.Reclaim([stale]), P.Reclaim([dels[1]]), P.Reclaim([dels[2]])]
        out = _step(w, [b]).intents[0]
        slots.unreserve(held)
        assert out.outcome is P.Outcome.OK, out
        assert [a.index for a in out.applied] == [1]     # the stale step skipped, the third not needed
        assert points[0].cid in w.prog.checkpoints and points[1].cid not in w.prog.checkpoints
        assert points[2].cid in w.prog.checkpoints
    finally:
        w.shutdown()


@pytest.mark.parametrize("copies", ["inline", "thread_late"])
def test_a_reclaim_whose_copies_landed_is_retried_on_the_spot(tiny_model, copies):
    """Seed: 同步回收已经改变容量时，当场重试当前许可；需要等待传输完成时才交回调度周期. A
    fresh bind on a full State pool whose remedy demotes a cached image to the Host: when the
    copy has landed by the progress point taken right after the commit (``inline``) the
    transaction settles there (reported at point 2) and the bind is permitted in the same step,
    its unit run; when it has not (a copy thread whose completion comes late) the bind is WAIT
    and nothing of it runs."""
    from ninfer.faults import Fault
    faults = [Fault(kind="completion_delay", count=0, steps=3)] if copies == "thread_late" else []
    w = Worker(tiny_model, EngineConfig(dtype="float64", max_concurrency=1, max_context=256, kv_capacity=256,
                                        copy_engine="inline" if copies == "inline" else "thread", faults=faults,
                                        context_cache={"device_state_slots": 1, "host_capacity_bytes": 16 << 20}))
    try:
        first = _step(w, [_capture_plan(1, "a", 20, P.EntryOwner(1))])
        point = first.units[0].captures[0].captured
        w.handle(P.encode(P.StepPlan(2, commands=[P.Release(first.intents[0].sid)])))
        [fx] = P.decode_reply(w.handle(P.encode(P.StepPlan(3, commands=[P.Quote()])))).commands
        ck = fx.facts.checkpoints[point.cid]
        assert ck.image_device and fx.facts.pools["state"].available == 1
        slots = w.prog.pools["state"]
        slots.reserve(1)                                 # the basic slot taken: the bind needs the image's
        b = _bind(4, "b", 10)
        b.remedies = [P.Reclaim([P.DemoteState(point.cid, ck.generation, ck.version)])]
        reply = _step(w, [b])
        slots.unreserve(1)
        out = reply.intents[0]
        [applied] = out.applied
        assert applied.commit.ok
        if copies == "inline":
            assert out.outcome is P.Outcome.OK, out
            assert [(s.tid, s.point, s.ok) for s in reply.settled] == [(applied.commit.tid, 2, True)]
            assert [u.sid for u in reply.units] == [out.sid]
            [fx] = P.decode_reply(w.handle(P.encode(P.StepPlan(5, commands=[P.Quote()])))).commands
            assert not fx.facts.checkpoints[point.cid].image_device       # on the Host only now
        else:
            assert out.outcome is P.Outcome.WAIT, out
            assert not reply.settled and not reply.units
    finally:
        w.shutdown()


def test_an_in_process_hang_only_delays_the_step(tiny_model):
    """In-process there is no other process to time out: a ``worker_hang`` makes its step take
    ``seconds`` longer and the request completes exactly (over Ray ``step_timeout_s`` replaces
    the worker: tests/actors/test_faults.py)."""
    import time

    import ninfer
    from tests.engine.harness import oracle
    eng = ninfer.Engine.start(tiny_model, config={"max_concurrency": 2, "max_context": 256, "step_timeout_s": 0.05,
                                                  "faults": [{"kind": "worker_hang", "point": "after_execute",
                                                              "skip": 2, "seconds": 0.3}]}, dtype="float64")
    try:
        p = random_prompt(30, seed=5)
        t0 = time.perf_counter()
        out = eng.generate(p, max_tokens=6, ignore_eos=True).result(60)
        assert out.token_ids == oracle(tiny_model, p, max_tokens=6)
        assert time.perf_counter() - t0 >= 0.3
        assert eng.stats()["faults_fired"].get("worker_hang") == 1
    finally:
        eng.shutdown()


def test_fault_and_timeout_config_errors_name_the_field():
    from ninfer.errors import ConfigError
    from ninfer.faults import Fault
    with pytest.raises(ConfigError, match="worker_hang needs point="):
        Fault(kind="worker_hang")
    with pytest.raises(ConfigError, match="seconds >= 0"):
        Fault(kind="worker_hang", point="before_execute", seconds=-1)
    with pytest.raises(ConfigError, match="step_timeout_s"):
        EngineConfig(step_timeout_s=0)
    assert EngineConfig(step_timeout_s=None).step_timeout_s is None


def test_a_chain_may_demote_a_block_its_own_take_back_lets_go_of(tiny_model):
    """The take-back's second pass (seed: 暂停较年轻者后其共享的可选缓存即可回收) plans a
    demotion of a page the victim shared with a cached point: the page is pinned while the victim
    runs and its version changes when the victim lets go — both because of the chain's own
    earlier step. The worker's simulation and its commit judge such a step as it will be after
    the steps before it, so the chain commits (once a CPU-loaded run hit this: the worker skipped
    the demotion every cycle and the oldest request failed with the capacity contract)."""
    page = 262144                                        # one float64 KV page of the tiny model
    w = Worker(tiny_model, EngineConfig(dtype="float64", max_concurrency=2, max_context=128, kv_capacity=128,
                                        context_cache={"device_state_slots": 1, "host_capacity_bytes": page}))
    try:
        first = _step(w, [_capture_plan(1, "a", 40, P.EntryOwner(1))])
        sid, point = first.intents[0].sid, first.units[0].captures[0].captured
        [fx] = P.decode_reply(w.handle(P.encode(P.StepPlan(2, commands=[P.Quote()])))).commands
        [shared] = [b for b in fx.facts.blocks.values() if point.cid in b.holders and -sid in b.holders]
        assert shared.pinned and fx.facts.pools["main"].available == 1
        b = _bind(3, "b", 100)                           # two pages: one more than is free
        b.remedies = [P.TakeBack(sid), P.Reclaim([P.DemoteBlocks(point.cid, point.generation, (shared.bid,),
                                                                 (shared.version,))])]
        out = _step(w, [b]).intents[0]
        assert out.outcome in (P.Outcome.OK, P.Outcome.WAIT), out
        assert [a.index for a in out.applied] == [0, 1] and out.applied[1].commit.ok
        assert w.prog.sequences[sid].phase is P.Phase.PAUSED
    finally:
        w.shutdown()
