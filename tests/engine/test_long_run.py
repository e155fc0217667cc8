"""A long-running engine keeps its policy state bounded (issue: bounded policy cost).

600 requests — chats that continue, retries of raw prompts, shared system prompts, fresh
prompts — through one engine with a small Device and Host: the per-request tables are gone
once each request ends, the logical records and checkpoints stay within what the pools can
hold, the demand summary and the deleted-point memory reach their caps (by ~250 requests) and
stay there, and every output still equals the oracle's on a sample. (2,000 requests showed the
same plateau — 13-14 records, 17 checkpoints at most from request 400 on — at twice the time.) The CPU cost per request over the run (first 200 vs
last 200) is a benchmark, not a timed test: ``ninfer bench cache-scale`` reports it.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.harness import oracle
from tests.factories import random_prompt

N = 600


@pytest.mark.slow
def test_six_hundred_requests_keep_policy_state_bounded(make_harness, tiny_model):
    h = make_harness(max_concurrency=4, max_context=256, kv_capacity=8 * 64, prefill_chunk_tokens=128,
                     context_cache={"device_state_slots": 4, "host_capacity_bytes": 6 << 20})
    rm, sched = h.core.rm, h.core.sched
    rng = random.Random(5)
    system = random_prompt(40, seed=1)
    history: list[list[int]] = []
    peak = {"records": 0, "ckpts": 0}
    checked = 0
    i = 0
    while i < N:
        batch = []
        for _ in range(4):
            r = rng.random()
            if r < 0.3 and history:                       # a chat continues
                p = rng.choice(history)
                p = (p + random_prompt(6, seed=i))[-150:]
            elif r < 0.45 and history:                    # a raw retry
                p = rng.choice(history)
            elif r < 0.75:                                # a shared system prompt
                p = system + random_prompt(rng.randint(3, 30), seed=10**5 + i)
            else:
                p = random_prompt(rng.randint(5, 60), seed=2 * 10**5 + i)
            extra = {"markers": [40]} if p[:40] == system and len(p) > 40 else {}
            batch.append((h.submit(p, max_tokens=3, **extra), p))
            i += 1
        h.run(until=lambda: h.done(*[r for r, _ in batch]), max_cycles=500)
        for rid, p in batch:
            f = h.finals[rid]
            assert f.finish_reason == "length", f.error
            if len(history) < 64:
                history.append(p + f.token_ids)
            else:
                history[rng.randrange(64)] = p + f.token_ids
            if i % 97 < 4 and checked < 12:                # an oracle sample along the run
                assert f.token_ids == oracle(tiny_model, p, max_tokens=3)
                checked += 1
        peak["records"] = max(peak["records"], len(rm.table.records))
        peak["ckpts"] = max(peak["ckpts"], len(rm.table.ckpts))
        assert not rm.books and not sched.state and not h.core.requests      # per-request tables end
    s = h.core.stats_dict()
    assert s["finished"] == N and s["cache"]["hits"] > N // 4
    slots = s["occupancy"]["state"]["total"]
    host_images = h.core.info.host_capacity // h.core.info.image_bytes
    # every checkpoint keeps a StateImage on the Device or the Host
    assert peak["ckpts"] <= slots + host_images, peak
    assert peak["records"] <= 2 * (slots + host_images) + 4, peak
    assert len(rm.summary) == 256 and len(rm.remembered) == 256      # reached, and held to the cap
    h.check_clean()
