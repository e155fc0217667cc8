"""With no free lane the scanned requests keep their valuable sources (``no-lane-keeps-sources``,
seed: 没有空 lane 时仍可保留选中的恢复来源): every one the scan looked at holds a waiting
reference on its source until a lane frees, then restores from it."""

from __future__ import annotations

from tests.engine.harness import oracle, run
from tests.factories import random_prompt


def test_every_scanned_request_keeps_its_source_while_no_lane_is_free(make_harness, tiny_model):
    h = make_harness(max_concurrency=1, max_context=512, kv_capacity=8 * 64, prefill_chunk_tokens=256,
                     context_cache={"device_state_slots": 8, "host_capacity_bytes": 0})
    bases = [random_prompt(100, seed=90 + i) for i in range(2)]
    finals = [run(h, b, max_tokens=2) for b in bases]
    runner = h.submit(random_prompt(30, seed=95), max_tokens=40)          # holds the only lane
    h.run(until=lambda: len(h.streams.get(runner, [])) >= 1)
    conts = [b + f.token_ids + [3, 4] for b, f in zip(bases, finals)]
    waiters = [h.submit(c, max_tokens=2) for c in conts]
    for _ in range(3):
        h.cycle()
    assert all(h.core.rm.waiting_on(h.req(w)) is not None for w in waiters), \
        [h.core.rm.waiting_on(h.req(w)) for w in waiters]
    h.run(until=lambda: h.done(runner, *waiters))
    for w, c in zip(waiters, conts):
        assert h.finals[w].usage.cached_tokens == 101
        assert h.finals[w].token_ids == oracle(tiny_model, c, max_tokens=2)
    h.check_clean()
