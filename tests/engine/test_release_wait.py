"""A unit whose permit waits for its own demotions' copies is not re-planned meanwhile
(rule wait-for-release; seed: 完成后重新查询真实缺口, 未完成的异步事件不自旋等待).

A prompt prefills into a Device full of earlier requests' cache: its second chunk's two pages
come from demoting that cache to the Host, whose copies are held back a few progress points.
Re-planning the waiting chunk every cycle would commit a fresh demotion each time (measured with
the rule removed: three demotions of two pages for a gap of two, four pages then left idle)."""

from __future__ import annotations

import pytest

from ninfer import protocol as P
from tests.engine.harness import oracle
from tests.factories import random_prompt


@pytest.mark.parametrize("fault", ["completion_delay", "completion_drop"])
def test_a_chunk_waiting_for_its_demotions_is_not_replanned_and_demotes_only_what_it_needs(make_harness, fault):
    """The wait ends on a real event: the completion (held back four progress points), or — when
    it is dropped — the controller's settle of the overdue transaction (after 0.2 s)."""
    h = make_harness(max_concurrency=1, max_context=512, kv_capacity=8 * 64, prefill_chunk_tokens=128,
                     context_cache={"device_state_slots": 8, "host_capacity_bytes": 16 << 20},
                     faults=[{"kind": fault, "steps": 4, "count": 0}], completion_timeout_s=0.2)
    for i in range(6):                                   # the Device fills with cache (normal content)
        rid = h.submit(random_prompt(60, seed=10 + i), max_tokens=2)
        h.run(until=lambda rid=rid: h.done(rid))
    settle = h.core.pressure.settle
    demoted: list[int] = []

    def record(*a, **kw):
        got = settle(*a, **kw)
        for v in got[0].values():
            for r in v.remedies:
                if isinstance(r, P.Reclaim):
                    demoted.extend(b for x in r.actions if isinstance(x, P.DemoteBlocks) for b in x.bids)
        return got
    h.core.pressure.settle = record
    prompt = random_prompt(200, seed=3)                  # its first chunk takes the 2 free pages
    rid = h.submit(prompt, max_tokens=4)
    h.run(until=lambda: h.done(rid))
    assert h.finals[rid].token_ids == oracle(h.model_dir, prompt, max_tokens=4)
    stats = h.core.stats_dict()
    assert stats["bytes_d2h"] > 0, "the chunks' pages came from demotions"
    assert stats["faults_fired"].get(fault, 0) >= 1
    # planned once for the gap of two pages, not again while its copies were in flight
    assert len(demoted) == 2, demoted
    h.check_clean()
