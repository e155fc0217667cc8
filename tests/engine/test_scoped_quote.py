"""Bounded policy cost: pressure plans on a scoped quote — the Device's content in full plus a
window of Host candidates in the records' order — and decides as it would on the whole
directory (issue: bounded policy cost; seed: 回收与准入, Host 放置预检)."""

from __future__ import annotations

import random

import pytest

from ninfer import protocol as P
from ninfer.engine import core as core_mod
from ninfer.native import reclaim as native_reclaim
from ninfer.policy import pressure as pressure_mod
from tests.engine.harness import oracle
from tests.factories import random_prompt


def _workload(h, n: int, seed: int) -> list[tuple[str, list[int]]]:
    """Distinct chats, some continued, some retried: the Device is always full of cache."""
    rng = random.Random(seed)
    done: list[list[int]] = []
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.3 and done:
            p = (rng.choice(done) + random_prompt(5, seed=seed * 1000 + i))[-140:]
        elif r < 0.4 and done:
            p = rng.choice(done)
        else:
            p = random_prompt(rng.randint(20, 90), seed=seed * 1000 + i)
        rid = h.submit(p, max_tokens=2)
        h.run(until=lambda rid=rid: h.done(rid))
        f = h.finals[rid]
        assert f.finish_reason == "length", f.error
        done.append(p + f.token_ids)
        out.append((rid, p))
    return out


def test_device_decisions_on_a_scoped_quote_equal_those_on_the_whole_directory(make_harness, monkeypatch):
    """A settle on scoped facts (Host content beyond the window left out) yields the same
    remedies, pauses and contract verdicts as on a full quote of the same moment whenever the
    Host victims the full plan picks are inside the window — the Device's candidates,
    co-holders and fallbacks are all there (a fallback outside the facts is live when the
    records know it); and the window, in the records' order, holds those victims most of the
    time even when it is far smaller than the Host's content."""
    monkeypatch.setattr(core_mod, "HOST_WINDOW", 2)       # far less than the Host holds
    h = make_harness(max_concurrency=2, max_context=256, kv_capacity=8 * 64, prefill_chunk_tokens=128,
                     context_cache={"device_state_slots": 4, "host_capacity_bytes": 16 << 20})
    pressure = h.core.pressure
    settle = pressure.settle
    compared = {"n": 0, "partial": 0, "outside": 0}
    width = {"k": 0}
    window = h.core._host_window

    def recorded(k):
        width["k"] = k
        return window(k)
    h.core._host_window = recorded          # which window a settle planned on: the first is judged

    def both(needs, facts, demands, tx_busy, keep=frozenset(), short=None):
        mine = pressure_mod._Short()
        got = settle(needs, facts, demands, tx_busy, keep, mine)
        if mine.hit and short is not None:
            short()
        if facts.partial and not mine.hit and width["k"] == core_mod.HOST_WINDOW:
            full = native_reclaim.quote(h.worker.prog)
            want = settle(needs, full, demands, tx_busy, keep)
            named = {a.cid for v in want[0].values() for r in v.remedies
                     for a in getattr(r, "actions", getattr(r, "host_victims", ()))}
            if not named <= set(facts.checkpoints):
                compared["outside"] += 1          # the best Host victim lay beyond the window
                return got
            assert {i: (v.remedies, v.on_short, v.contract, v.covered) for i, v in got[0].items()} == \
                   {i: (v.remedies, v.on_short, v.contract, v.covered) for i, v in want[0].items()}
            compared["partial"] += 1
        compared["n"] += 1
        return got
    pressure.settle = both
    _workload(h, 40, seed=3)
    assert compared["partial"] >= 10, compared       # the Host held more than the Device, often
    assert compared["outside"] <= compared["partial"] // 4, compared
    print(compared, "wide quotes:", h.core.stats.wide_quotes)
    h.check_clean()


def test_a_host_window_that_does_not_suffice_is_quoted_again_whole(make_harness, tiny_model, monkeypatch):
    """A Host placement that finds no admissible victims inside the window asks for the whole
    directory and plans again — never a skipped demotion or a failed request for it; outputs stay
    exact and the books (the Host order included) balance."""
    monkeypatch.setattr(core_mod, "HOST_WINDOW", 0)
    probe = make_harness(max_context=256)
    info = probe.core.info
    host = 5 * info.image_bytes + 8 * info.page_bytes
    h = make_harness(max_concurrency=2, max_context=256, kv_capacity=8 * 64, prefill_chunk_tokens=128,
                     context_cache={"device_state_slots": 4, "host_capacity_bytes": host})
    ran = _workload(h, 24, seed=4)
    assert h.core.stats.wide_quotes > 0
    for rid, p in ran[::4]:
        assert h.finals[rid].token_ids == oracle(tiny_model, p, max_tokens=2)
    assert h.core.stats.stalls == 0
    h.check_clean()


@pytest.mark.parametrize("seed", [5, 6])
def test_the_host_order_follows_every_change(make_harness, seed):
    """The incremental Host order agrees with the worker's placement and the records' classes
    after every request of a workload with demotions, Host victims, reuse and retries."""
    probe = make_harness(max_context=256)
    info = probe.core.info
    h = make_harness(max_concurrency=2, max_context=256, kv_capacity=8 * 64, prefill_chunk_tokens=128,
                     context_cache={"device_state_slots": 4,
                                    "host_capacity_bytes": 6 * info.image_bytes + 10 * info.page_bytes})
    rng = random.Random(seed)
    done: list[list[int]] = []
    for i in range(20):
        p = (rng.choice(done) + [i + 1]) if done and rng.random() < 0.4 else random_prompt(rng.randint(20, 90), seed=i)
        rid = h.submit(p[-140:], max_tokens=2)
        h.run(until=lambda rid=rid: h.done(rid))
        done.append(p[-140:] + h.finals[rid].token_ids)
        h.core.check_integrity()                     # the Host order check is part of it
    assert len(h.core.rm.host_order) > 0
    h.check_clean()



def test_reclaim_is_planned_as_separately_committable_steps(make_harness):
    """Seed: 批量预约失败时仍可依次尝试单个迁移和删除备选 — a need's remedies are one Reclaim per
    planned step (a demotion with its Host victims, or one deletion group), so Native can commit
    the shortest covering prefix and skip a stale step; never one all-or-nothing batch."""
    h = make_harness(max_concurrency=2, max_context=256, kv_capacity=8 * 64, prefill_chunk_tokens=128,
                     context_cache={"device_state_slots": 4, "host_capacity_bytes": 16 << 20})
    settle = h.core.pressure.settle
    seen = []

    def record(*a, **kw):
        got = settle(*a, **kw)
        seen.extend(v.remedies for v in got[0].values())
        return got
    h.core.pressure.settle = record
    _workload(h, 30, seed=3)
    steps = [[r for r in rem if isinstance(r, P.Reclaim)] for rem in seen]
    assert any(len(s) >= 2 for s in steps), steps
    for s in steps:
        for r in s:
            deletes = [a for a in r.actions if isinstance(a, P.Delete)]
            demotes = [a for a in r.actions if not isinstance(a, (P.Delete, P.DropHostCopy))]
            assert len(demotes) <= 1 and (demotes or deletes), r
    h.check_clean()
