"""Requests that arrive together share one computation of their common prefix (issue: shared
prefixes computed once). A fresh request waits for a restore point another bound request will
publish — never using it before it is complete — holding nothing, blocking nobody, and choosing
again when the point will not come (seed: 等待引用; 未完成副本不能成为查询来源)."""

from __future__ import annotations

from tests.engine.harness import oracle
from tests.factories import random_prompt


def _harness(make_harness, **cc):
    return make_harness(max_concurrency=4, max_context=512, kv_capacity=4 * 8 * 64, prefill_chunk_tokens=64,
                        context_cache={"device_state_slots": 8, "host_capacity_bytes": 16 << 20, **cc})


def _producer_and_waiters(make_harness, n: int, max_tokens: int, seed: int):
    """A producer of an ``n``-token prompt and two identical requests waiting for its point."""
    h = _harness(make_harness)
    p = random_prompt(n, seed=seed)
    producer = h.submit(p, max_tokens=max_tokens)
    waiters = [h.submit(p, max_tokens=max_tokens) for _ in range(2)]
    for _ in range(3):
        h.cycle()
    return h, p, producer, waiters


def test_identical_prompts_arriving_together_compute_once(make_harness, tiny_model):
    h = _harness(make_harness)
    p = random_prompt(300, seed=1)
    rids = [h.submit(p, max_tokens=4) for _ in range(4)]
    h.run(until=lambda: h.done(*rids))
    usage = [h.finals[r].usage for r in rids]
    assert [u.prefill_tokens for u in usage] == [300, 0, 0, 0], usage
    assert all(h.finals[r].token_ids == oracle(tiny_model, p, max_tokens=4) for r in rids)
    c = h.core.stats_dict()["cache"]
    assert c["pending_waits"] == 3 and c["pending_saved_tokens"] == 900 and c["pending_abandoned"] == 0
    assert c["pending_wait_s"] > 0
    h.check_clean()


def test_a_shared_system_prompt_is_computed_once_for_concurrent_sessions(make_harness, tiny_model):
    """Four sessions with one 200-token system prompt (a marker at its end) arrive together:
    the prefix is computed once, each session computes only its own turn."""
    h = _harness(make_harness)
    system = random_prompt(200, seed=2)
    prompts = [system + random_prompt(30 + 7 * i, seed=10 + i) for i in range(4)]
    rids = [h.submit(p, max_tokens=3, markers=[200]) for p in prompts]
    h.run(until=lambda: h.done(*rids))
    computed = sum(h.finals[r].usage.prefill_tokens for r in rids)
    assert computed == 200 + sum(len(p) - 200 for p in prompts), computed
    for r, p in zip(rids, prompts):
        assert h.finals[r].token_ids == oracle(tiny_model, p, max_tokens=3)
    h.check_clean()


def test_waiters_choose_again_when_the_producer_is_cancelled(make_harness, tiny_model):
    h, p, producer, waiters = _producer_and_waiters(make_harness, 400, 4, seed=3)
    assert h.core.stats_dict()["cache"]["pending_waits"] == 2
    h.core.cancel(producer)
    h.run(until=lambda: h.done(producer, *waiters))
    assert h.finals[producer].finish_reason == "cancelled"
    assert h.core.stats_dict()["cache"]["pending_abandoned"] >= 1
    for r in waiters:
        assert h.finals[r].finish_reason == "length"
        assert h.finals[r].token_ids == oracle(tiny_model, p, max_tokens=4)
    assert h.core.stats.stalls == 0
    h.check_clean()


def test_waiters_choose_again_when_the_producers_save_is_skipped(make_harness, tiny_model):
    """The Device's spare slots hold two long cached points and there is no Host tier: the
    producer's save at its input end may not replace them (they cover more than it would) and is
    skipped; the waiters do not wait for nothing (nor twice for it) and compute it themselves."""
    h = make_harness(max_concurrency=3, max_context=512, kv_capacity=24 * 64, prefill_chunk_tokens=64,
                     context_cache={"device_state_slots": 0, "host_capacity_bytes": 0})
    for seed in (7, 8):                                       # two 450-token points fill the spare slots
        rid = h.submit(random_prompt(450, seed=seed), max_tokens=1)
        h.run(until=lambda rid=rid: h.done(rid))
    p = random_prompt(300, seed=4)
    rids = [h.submit(p, max_tokens=3) for _ in range(2)]
    h.run(until=lambda: h.done(*rids))
    c = h.core.stats_dict()["cache"]
    assert c["pending_waits"] == 1 and c["pending_abandoned"] == 1 and c["pending_saved_tokens"] == 0, c
    assert [h.finals[r].usage.prefill_tokens for r in rids] == [300, 300]
    for r in rids:
        assert h.finals[r].token_ids == oracle(tiny_model, p, max_tokens=3)
    assert h.core.stats.stalls == 0
    h.check_clean()


def test_a_request_that_cannot_use_the_prefix_is_not_delayed(make_harness, tiny_model):
    """Waiters hold no lane and do not stop the scan: an unrelated request submitted after them
    is admitted while they still wait."""
    h, p, producer, waiters = _producer_and_waiters(make_harness, 500, 2, seed=5)
    other = h.submit(random_prompt(20, seed=6), max_tokens=2)
    h.run(until=lambda: h.done(other))
    assert not h.done(producer)                               # the producer is still prefilling
    assert all(h.core.sched.st(h.req(r)).pending for r in waiters)
    assert h.finals[other].token_ids == oracle(tiny_model, random_prompt(20, seed=6), max_tokens=2)
    h.run(until=lambda: h.done(producer, *waiters))
    for r in waiters:
        assert h.finals[r].usage.prefill_tokens == 0
    h.check_clean()
