"""Lane take-back end to end (``lane-take-back``, ``take-back-gate``): with no free lane the
oldest paused request takes back the lane of the *youngest* preemptable resident, and only when
no older resident exists (seed: 收回较年轻请求占用的 lane; 存在较老 resident 时只使用空闲与可选
缓存空间). The rule monitor checks both on every cycle; these scenarios make them arise."""

from __future__ import annotations

import pytest

from tests.engine.harness import force_pause, oracle
from tests.factories import random_prompt


def _paused(h, rid) -> bool:
    r = h.req(rid)
    return r is not None and r.phase.name == "PAUSED"


@pytest.mark.parametrize("memory", ["tight", "ample"])
def test_the_oldest_paused_takes_back_the_youngest_lane(make, tiny_model, memory):
    """B (the oldest) pauses; Y takes its lane; a new arrival is a real event: B takes back a
    lane — Y's, the youngest, not X1's or X2's. With ample memory the resume is short of nothing
    but the lane: the take-back is committed all the same (a lane take-back leads the resume's
    remedies, whatever the shortfall; the rule monitor checks residents <= C)."""
    slots = 4 if memory == "tight" else 16          # Device state slots (12 pages: the most C = 3 may have)
    h = make(max_concurrency=3, kv_capacity=12 * 64, prefill_chunk_tokens=64,
             context_cache={"host_capacity_bytes": 8 << 20, "device_state_slots": slots})
    prompts = {n: random_prompt(20, seed=40 + i) for i, n in enumerate(("B", "X1", "X2", "Y", "Z"))}
    b = h.submit(prompts["B"], max_tokens=40, rid="B")
    x1 = h.submit(prompts["X1"], max_tokens=100, rid="X1")
    x2 = h.submit(prompts["X2"], max_tokens=100, rid="X2")
    h.run(until=lambda: len(h.streams.get(b, [])) >= 3)
    y = h.submit(prompts["Y"], max_tokens=100, rid="Y")        # queued: no free lane
    force_pause(h, b)                                          # Y takes B's lane
    h.run(until=lambda: len(h.streams.get(y, [])) >= 2)
    z = h.submit(prompts["Z"], max_tokens=2, rid="Z")          # a real event: B tries again
    h.run(until=lambda: h.done(b, x1, x2, y, z), max_cycles=5000)
    assert h.finals[y].pauses and not h.finals[x1].pauses and not h.finals[x2].pauses
    assert h.core.stats.take_backs >= 1
    for rid, n in ((b, 40), (x1, 100), (x2, 100), (y, 100), (z, 2)):
        assert h.finals[rid].token_ids == oracle(tiny_model, prompts[rid], max_tokens=n)
    h.check_clean()


def test_no_take_back_beside_an_older_resident(make, tiny_model):
    """B pauses while the older O runs; Y takes B's lane. When B may try again (a new arrival)
    no lane is free, and O is older than B: B waits — it takes nothing back — and resumes once a
    lane frees."""
    h = make(max_concurrency=2, kv_capacity=8 * 64, prefill_chunk_tokens=64,
             context_cache={"host_capacity_bytes": 8 << 20, "device_state_slots": 4})
    prompts = {n: random_prompt(20, seed=50 + i) for i, n in enumerate(("O", "B", "Y", "Z"))}
    o = h.submit(prompts["O"], max_tokens=60, rid="O")
    b = h.submit(prompts["B"], max_tokens=40, rid="B")
    h.run(until=lambda: len(h.streams.get(b, [])) >= 3)
    y = h.submit(prompts["Y"], max_tokens=100, rid="Y")        # queued: no free lane
    force_pause(h, b)                                          # Y takes B's lane
    h.run(until=lambda: len(h.streams.get(y, [])) >= 2)
    z = h.submit(prompts["Z"], max_tokens=2, rid="Z")          # a real event: B may try again
    h.run(until=lambda: h.done(o, b, y, z), max_cycles=5000)
    assert not h.finals[y].pauses and h.core.stats.take_backs == 0
    for rid, n in ((o, 60), (b, 40), (y, 100), (z, 2)):
        assert h.finals[rid].token_ids == oracle(tiny_model, prompts[rid], max_tokens=n)
    h.check_clean()
