"""Divergence positions (issue 30): where prompts share a prefix and then part, a restore point
is offered exactly there, so raw inputs without markers reuse what they share — a later request
sharing [0, X) hits it, requests that arrive together compute the shared part once — and the
capture earns reuse eligibility by real repeat computation (seed: 两个不同请求的真实计算也能证明
重复需求 … 后续捕获仍能取得该位置的复用资格)."""

from __future__ import annotations

from ninfer import protocol as P
from tests.engine.harness import oracle
from tests.factories import random_prompt

SHARED = 160


def _harness(make_harness, **cc):
    """Divergence positions alone unless ``anticipate`` is asked (the anticipated ones would
    place points below the divergences these tests look at)."""
    cc = {"anticipate": False, **cc}
    return make_harness(max_concurrency=4, max_context=512, kv_capacity=4 * 8 * 64, prefill_chunk_tokens=64,
                        context_cache={"device_state_slots": 8, "host_capacity_bytes": 16 << 20, **cc})


def _branches(n: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A shared prefix and ``n`` prompts that part right after it (distinct next tokens)."""
    shared = random_prompt(SHARED, seed=seed)
    out = []
    for i in range(n):
        tail = random_prompt(40 + 3 * i, seed=seed + 100 + i)
        tail[0] = 10 + i                       # they part exactly at SHARED
        out.append(shared + tail)
    return shared, out


def test_a_later_request_hits_the_point_where_earlier_prompts_parted(make_harness, tiny_model):
    """A, then B (parting from A at 160: B offers a save there), then C: C restores the point
    at 160 — before, only prompt ends were restore points and C computed everything."""
    h = _harness(make_harness)
    _, (a, b, c) = _branches(3)
    usage = {}
    for name, p in (("a", a), ("b", b), ("c", c)):
        rid = h.submit(p, max_tokens=3)
        h.run(until=lambda: h.done(rid))
        assert h.finals[rid].token_ids == oracle(tiny_model, p, max_tokens=3)
        usage[name] = h.finals[rid].usage
    assert usage["b"].cached_tokens == 0 and usage["b"].prefill_tokens == len(b)
    assert usage["c"].cached_tokens == SHARED, usage
    assert usage["c"].prefill_tokens == len(c) - SHARED
    h.check_clean()


def test_requests_arriving_together_compute_their_shared_prefix_once(make_harness, tiny_model):
    """Four prompts parting after a shared 160 tokens arrive together, no markers: the first
    saves at 160 (offered because the others share it), the rest wait for that point."""
    h = _harness(make_harness)
    _, prompts = _branches(4, seed=3)
    rids = [h.submit(p, max_tokens=3) for p in prompts]
    h.run(until=lambda: h.done(*rids))
    computed = sum(h.finals[r].usage.prefill_tokens for r in rids)
    assert computed == SHARED + sum(len(p) - SHARED for p in prompts), computed
    assert [h.finals[r].usage.cached_tokens for r in rids] == [0, SHARED, SHARED, SHARED]
    for r, p in zip(rids, prompts):
        assert h.finals[r].token_ids == oracle(tiny_model, p, max_tokens=3)
    h.check_clean()


def test_without_divergence_positions_only_prompt_ends_are_reused(make_harness):
    """The switch (``divergence_min_tokens = None``) gives back the old behaviour: C computes
    all of its prompt."""
    h = _harness(make_harness, divergence_min_tokens=None)
    _, (a, b, c) = _branches(3)
    for p in (a, b):
        rid = h.submit(p, max_tokens=2)
        h.run(until=lambda: h.done(rid))
    rid = h.submit(c, max_tokens=2)
    h.run(until=lambda: h.done(rid))
    assert h.finals[rid].usage.cached_tokens == 0
    h.check_clean()


def test_a_divergence_computed_by_two_requests_is_repeat_demand(make_harness):
    """B computes across the position A computed across: the capture at 160 is repeat demand —
    its public entry is promoted to the reuse level without any adoption, and the demand
    summary holds two observers there (the history's and B's)."""
    h = _harness(make_harness)
    _, (a, b) = _branches(2, seed=5)
    for p in (a, b):
        rid = h.submit(p, max_tokens=2)
        h.run(until=lambda: h.done(rid))
    rm = h.core.rm
    entries = [e for e in rm.table.entries.values() if e.frontier == SHARED]
    assert len(entries) == 1 and entries[0].level == "reuse", [(e.frontier, e.level) for e in entries]
    assert rm.stats.hits == 0                  # evidence, not a hit
    h.check_clean()


def test_a_close_divergence_is_not_offered(make_harness):
    """A position fewer than ``divergence_min_tokens`` beyond the restore point below it is not
    offered: A keeps a public point at 100 (a marker), A2 and B part 10 tokens later, so no save
    is cut at 110 and B restores the point at 100."""
    h = _harness(make_harness)
    a = random_prompt(100, seed=7)
    b = a + random_prompt(10, seed=8) + [5] + random_prompt(30, seed=9)
    a2 = a + random_prompt(10, seed=8) + [6] + random_prompt(30, seed=10)
    for p, kw in ((a + random_prompt(20, seed=11), {"markers": [100]}), (a2, {}), (b, {})):
        rid = h.submit(p, max_tokens=2, **kw)
        h.run(until=lambda: h.done(rid))
    assert h.finals[rid].usage.cached_tokens == 100
    assert not [e for e in h.core.rm.table.entries.values() if e.frontier == 110]
    h.check_clean()


def _asked(doc: list[int], n: int, q_seed: int) -> list[int]:
    q = random_prompt(n, seed=q_seed)
    q[0] = 5 + q_seed % 50                       # every question starts differently
    return doc + q


def _first_two(h, tiny_model, doc: list[int], n: int) -> P.Usage:
    """A document's first two requests, each with its own ``n``-token question: the second's usage."""
    for p in (_asked(doc, n, 4), _asked(doc, n, 5)):
        rid = h.submit(p, max_tokens=2)
        h.run(until=lambda: h.done(rid))
        assert h.finals[rid].token_ids == oracle(tiny_model, p, max_tokens=2)
    return h.finals[rid].usage


def test_the_first_request_to_share_a_document_restores_it_where_prompts_tend_to_part(make_harness, tiny_model):
    """Prompts that share a document and differ in a 32-token question: the document's first
    request saves 32 tokens before its end (a rung of the anticipated ladder), and the first
    request to share the document restores it there — no second computation of it. With
    anticipated positions off (or divergence positions off) it computes the document again."""
    for cc, want in (({}, SHARED), ({"anticipate": False}, 0), ({"divergence_min_tokens": None}, 0)):
        h = _harness(make_harness, **{"anticipate": True, **cc})
        usage = _first_two(h, tiny_model, random_prompt(SHARED, seed=22), 32)
        assert usage.cached_tokens == want, (cc, usage)
        h.check_clean()


def test_a_tail_longer_than_the_ladder_is_anticipated_once_real_divergences_showed_it(make_harness, tiny_model):
    """A 300-token question after a 160-token document parts beyond the ladder's longest rung
    (256): a new document's second request restores nothing — until three requests sharing
    another document have shown that tail twice or more; then the first request of a new
    document saves at its end less 300 and the second restores the document."""
    for learn, want in ((False, 0), (True, SHARED)):
        h = _harness(make_harness, anticipate=True)
        if learn:
            d1 = random_prompt(SHARED, seed=21)
            for i in (1, 2, 3):
                rid = h.submit(_asked(d1, 300, i), max_tokens=1)
                h.run(until=lambda: h.done(rid))
            assert h.core.rm.tails.get(300, 0) >= 2, h.core.rm.tails
        usage = _first_two(h, tiny_model, random_prompt(SHARED, seed=22), 300)
        assert usage.cached_tokens == want, (learn, usage)
        h.check_clean()
