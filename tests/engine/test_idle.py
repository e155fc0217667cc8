"""Idle bookkeeping (``EngineCore.idle``): while the control loop has nothing to do, the Host
order folds the marks of what changed, so the next admission's window reads an order already up
to date. It takes no decision: every window and every output are those of an engine that folds
the marks only when a window is read."""

from __future__ import annotations

import random
import time

import ninfer
from ninfer.engine import core as core_mod
from tests.factories import random_prompt

CFG = dict(max_concurrency=2, max_context=256, kv_capacity=8 * 64, prefill_chunk_tokens=128)


def test_idle_folds_the_marks_and_changes_no_window(make_harness):
    probe = make_harness(max_context=256)
    info = probe.core.info
    cache = {"device_state_slots": 4, "host_capacity_bytes": 6 * info.image_bytes + 10 * info.page_bytes}
    idle, plain = make_harness(**CFG, context_cache=cache), make_harness(**CFG, context_cache=cache)
    rng = random.Random(7)
    done: list[list[int]] = []
    folded = 0
    for i in range(16):
        p = (rng.choice(done) + [i + 1]) if done and rng.random() < 0.4 else random_prompt(rng.randint(20, 90), seed=i)
        p = p[-140:]
        outs = []
        for h in (idle, plain):
            rid = h.submit(p, max_tokens=2)
            h.run(until=lambda rid=rid, h=h: h.done(rid))
            outs.append(h.finals[rid].token_ids)
        assert outs[0] == outs[1]
        folded += len(idle.core.rm.table.dirty)
        idle.core.idle()
        assert not idle.core.rm.table.dirty                       # folded while idle
        assert idle.core.rm.host_window(64) == plain.core.rm.host_window(64)
        done.append(p + outs[0])
    assert folded > 0                                             # there was something to fold
    assert idle.core.stats.cycles == plain.core.stats.cycles
    for h in (idle, plain):
        h.core.check_integrity()
        h.check_clean()


def test_the_control_loop_runs_the_idle_bookkeeping_when_it_has_nothing_to_do(tiny_model, monkeypatch):
    """Through ``Engine.start``: after a request finishes and nothing else is queued, the control
    thread calls ``EngineCore.idle`` before it waits."""
    calls: list[float] = []
    idle = core_mod.EngineCore.idle
    monkeypatch.setattr(core_mod.EngineCore, "idle", lambda self: calls.append(time.monotonic()) or idle(self))
    eng = ninfer.Engine.start(tiny_model, config={"max_concurrency": 2, "max_context": 256}, dtype="float32",
                              transport="inproc")
    try:
        out = eng.generate(random_prompt(40, seed=1), max_tokens=3, ignore_eos=True).result(60)
        finished = time.monotonic()
        assert out.error is None
        deadline = finished + 10
        while not any(t >= finished for t in calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(t >= finished for t in calls), calls
    finally:
        eng.shutdown()
