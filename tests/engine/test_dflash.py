"""DFlash / DFlash2 speculative decoding (issue 17): greedy and seeded outputs equal the run
without it under caching and both pause routes; the draft's context travels with checkpoints (a
hit restores it, a checkpoint without it is no restore point and prefill rebuilds it); DFlash2's
window evicts the context below it.

The tiny drafts are fitted to the tiny target (``make_tiny_dflash``), so blocks are really
accepted and rejected in these workloads."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ninfer.errors import ConfigError
from ninfer.native.objects import pages_for
from tests.engine.harness import force_pause, oracle, pause_while_drafting, run
from tests.engine.test_invariance import count_speculation, run_workloads, seeds
from tests.factories import random_prompt

TOTALS: Counter = Counter()


def _spec(h) -> dict:
    return h.core.stats_dict()["speculative"]


@pytest.fixture
def drafts(tiny_dflash, tiny_dflash2) -> dict[str, str]:
    return {"dflash": tiny_dflash, "dflash2": tiny_dflash2}


def _sweep(tiny_model: str, drafts: dict[str, str], sweep: list[int], totals: Counter = TOTALS,
           options: bool = False) -> None:
    """DFlash (even seeds) and DFlash2 with a 96-position window (odd seeds), 1..7 drafts per
    block, in the oracle sweep's workloads (``options``: the sampling-options sweep's)."""
    def overrides(seed: int) -> dict:
        method = ("dflash", "dflash2")[seed % 2]
        return {"speculative": {"method": method, "draft": drafts[method],
                                "num_tokens": random.Random(seed).randint(1, 7)}, "options": options}
    all_stats = run_workloads(tiny_model, sweep, overrides)
    for seed, stats in zip(sweep, all_stats):
        assert stats["speculative"]["method"] == overrides(seed)["speculative"]["method"]
    count_speculation(totals, all_stats)


@pytest.mark.slow
def test_random_workloads_with_dflash_match_the_oracle(tiny_model, drafts):
    """The oracle sweep's workloads (pressure, both pause routes, hits, faults, sampling,
    logprobs) with DFlash and DFlash2 (3 workloads, 10 with NINFER_SWEEP=full, on every core):
    every completed request equals the isolated run; nothing leaks."""
    _sweep(tiny_model, drafts, seeds(7000, 3, 10))


@pytest.mark.slow
def test_sampling_options_with_dflash_match_the_oracle(tiny_model, drafts):
    """The sampling-options sweep (grammars, allowed ids, stop ids with min_tokens, logit bias,
    bad words, min_p) with DFlash and DFlash2 blocks: a drafted token is kept only where the
    constrained, seeded sampler draws it and a rejected one never advances the grammar, so every
    completed request equals the oracle without speculation."""
    from tests.engine.test_invariance import TOTALS as SWEEP
    totals: Counter = Counter()
    before = Counter(SWEEP)
    _sweep(tiny_model, drafts, seeds(8200, 3, 8), totals, options=True)
    seen = Counter(SWEEP) - before
    assert totals["accepted"] and totals["rejected"] and seen["constrained"], (dict(totals), dict(seen))


@pytest.mark.slow
def test_the_dflash_workloads_really_speculated(tiny_model, drafts):
    """Run after the sweep above: blocks were both accepted and rejected, with pauses and hits."""
    seed = 7100
    while not all(TOTALS[k] for k in ("accepted", "rejected", "pauses", "hits")):
        assert seed < 7140, dict(TOTALS)
        _sweep(tiny_model, drafts, [seed, seed + 1])
        seed += 2
    print("\ndflash workloads:", dict(TOTALS))


@pytest.mark.parametrize("method", ["dflash", "dflash2"])
def test_greedy_decode_with_dflash_accepts_blocks_and_equals_the_oracle(make, drafts, method):
    h = make(speculative={"method": method, "draft": drafts[method]})
    prompt = random_prompt(40, 1)
    f = run(h, prompt, max_tokens=60)
    assert f.token_ids == oracle(h.model_dir, prompt, max_tokens=60)
    s = _spec(h)
    assert s["method"] == method and len(s["acceptance_by_position"]) == 7     # block 8 = 7 drafts
    assert s["accepted"] > 0 and s["tokens_per_step"] > 1.0, s
    h.check_clean()


def test_block_and_num_tokens_spell_the_same_setting(make, tiny_dflash):
    h = make(speculative={"method": "dflash", "draft": tiny_dflash, "block": 4})
    prompt = random_prompt(20, 2)
    f = run(h, prompt, max_tokens=20)
    assert f.token_ids == oracle(h.model_dir, prompt, max_tokens=20)
    assert len(_spec(h)["acceptance_by_position"]) == 3
    h.check_clean()


def test_sampled_outputs_with_dflash_are_the_seeded_samples(make, tiny_dflash):
    h = make(speculative={"method": "dflash", "draft": tiny_dflash}, max_concurrency=4)
    prompt = random_prompt(12, 7)
    rids = [h.submit(prompt, max_tokens=12, temperature=0.7, seed=s) for s in range(16)]
    h.run(until=lambda: h.done(*rids))
    for s, rid in enumerate(rids):
        assert h.finals[rid].token_ids == oracle(h.model_dir, prompt, max_tokens=12, temperature=0.7, seed=s)
    h.check_clean()


def test_a_hit_restores_the_dflash_context_without_recomputing_it(make, tiny_dflash):
    """A hit on a kept point restores the draft's context with it: the warm request appends
    exactly `hit` context positions fewer than the same request on a cold engine, no context
    restarts, same output. Prefill runs in 48-token chunks: every chunk appends its positions."""
    base = random_prompt(130, 3)
    second = base + random_prompt(9, 4)
    cfg = {"speculative": {"method": "dflash", "draft": tiny_dflash}, "prefill_chunk_tokens": 48}
    cold = make(**cfg)
    run(cold, second, max_tokens=12)
    cold_entries = _spec(cold)["draft_entries"]

    h = make(**cfg)
    run(h, base, max_tokens=12)
    before = _spec(h)
    f = run(h, second, max_tokens=12)
    after = _spec(h)
    assert f.token_ids == oracle(h.model_dir, second, max_tokens=12)
    hit = f.usage.cached_tokens
    assert hit > 64, f.usage
    assert after["context_restarts"] == before["context_restarts"] == 0
    assert after["draft_entries"] - before["draft_entries"] == cold_entries - hit
    h.check_clean()


def _uncovered_resend(h, base, second) -> tuple:
    run(h, base, max_tokens=12)
    before = _spec(h)
    f = run(h, second, max_tokens=12)
    return before, _spec(h), f


def test_a_checkpoint_without_dflash_coverage_is_rebuilt_by_prefill(make, tiny_dflash):
    """A point whose draft context was dropped (the pool's own pressure step, applied to every
    checkpoint) is no restore point: the re-send prefills its whole prompt — counted as prefill,
    not as a hit — which rebuilds the context; outputs and drafts are those of a cold engine."""
    base = random_prompt(130, 5)
    second = base + random_prompt(9, 6)
    cold = make(speculative={"method": "dflash", "draft": tiny_dflash})
    fc = run(cold, second, max_tokens=12)

    h = make(speculative={"method": "dflash", "draft": tiny_dflash})
    run(h, base, max_tokens=12)
    prog = h.worker.prog
    cks = list(prog.checkpoints.values())
    assert cks and all(ck.blocks["dflash"] for ck in cks)
    for ck in cks:
        prog.spec.drop_coverage(ck)
    h.core.call_commands([])                         # a round trip: the report reaches the policy
    before = _spec(h)
    f = run(h, second, max_tokens=12)
    after = _spec(h)
    assert f.usage.cached_tokens == 0 and f.usage.prefill_tokens == len(second), f.usage
    assert f.token_ids == fc.token_ids == oracle(h.model_dir, second, max_tokens=12)
    assert after["accepted"] - before["accepted"] == _spec(cold)["accepted"]      # the same drafts
    assert after["context_restarts"] == before["context_restarts"]
    h.check_clean()


def test_a_short_draft_pool_drops_coverage_and_the_point_is_not_a_hit(make, tiny_dflash):
    """`speculative.draft_pages` caps the pool: with room for one sequence's context only, the
    next request's context append drops the first one's checkpoints' coverage (pressure rule);
    re-sending the first prompt then prefills instead of hitting; outputs are unchanged."""
    a, b = random_prompt(150, 8), random_prompt(150, 9)
    h = make(speculative={"method": "dflash", "draft": tiny_dflash, "draft_pages": 4})
    run(h, a, max_tokens=8)
    run(h, b, max_tokens=8)
    assert _spec(h)["coverage_dropped"] > 0
    f = run(h, a, max_tokens=8)
    assert f.usage.cached_tokens < 64 and f.token_ids == oracle(h.model_dir, a, max_tokens=8)
    h.check_clean()


@pytest.mark.parametrize("host", [True, False], ids=["snapshot", "replay"])
def test_a_pause_drops_the_block_and_the_resume_keeps_the_context_rules(make, tiny_dflash, host):
    """Seed: DFlash/DFlash2 保持各自 context 和 local state 规则 — a paused sequence keeps no
    draft; Snapshot resumes with its context (no restart), Replay rebuilds it with Main; outputs
    equal the oracle."""
    cfg = {"context_cache": {"host_capacity_bytes": 64 << 20 if host else 0}}
    h = make(speculative={"method": "dflash", "draft": tiny_dflash}, **cfg)
    prompt = random_prompt(30, 11)
    rid, _ = pause_while_drafting(h, prompt, max_tokens=40)
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert [p.route for p in f.pauses] == ["snapshot" if host else "replay"]
    assert f.token_ids == oracle(h.model_dir, prompt, max_tokens=40)
    assert _spec(h)["context_restarts"] == 0
    h.check_clean()


def test_a_snapshot_without_its_context_resumes_with_a_restarted_context(make, tiny_dflash):
    """A paused request's snapshot whose draft context was dropped (pool pressure) still resumes
    exactly by Snapshot: the context restarts at the resume point (counted), drafts continue from
    what it gathers, outputs equal the oracle."""
    h = make(speculative={"method": "dflash", "draft": tiny_dflash},
             context_cache={"host_capacity_bytes": 64 << 20})
    prompt = random_prompt(30, 16)
    rid = h.submit(prompt, max_tokens=40)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 6)
    seq = h.worker.prog.sequences[h.req(rid).sid]
    force_pause(h, rid)
    h.run(until=lambda: h.req(rid) is not None and h.req(rid).phase.name == "PAUSED")
    assert seq.snapshot is not None and seq.snapshot.blocks["dflash"]
    h.worker.prog.spec.drop_coverage(seq.snapshot)
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert [p.route for p in f.pauses] == ["snapshot"]
    assert f.token_ids == oracle(h.model_dir, prompt, max_tokens=40)
    assert _spec(h)["context_restarts"] == 1
    h.check_clean()


def test_dflash2_keeps_only_its_window_of_context(make, tiny_dflash2):
    """DFlash2 (window 96): between calls a running sequence holds exactly the draft pages from
    the window's first page to its frontier; checkpoints keep what their own window needs, so a
    hit deep in a long prompt restores a complete context; outputs equal the oracle."""
    h = make(speculative={"method": "dflash2", "draft": tiny_dflash2}, max_concurrency=2, max_context=512)
    prompt = random_prompt(200, 13)
    rid = h.submit(prompt, max_tokens=70)
    while not h.done(rid):
        h.cycle()
        h.worker.prog.check_integrity()
        req = h.req(rid)
        seq = h.worker.prog.sequences.get(req.sid) if req is not None and req.sid is not None else None
        if seq is not None and seq.phase.name == "RUNNING" and seq.draft_frontier == seq.frontier:
            first = max(0, seq.frontier - 96 + 1) // 64
            assert seq.draft_base == first * 64
            assert len(seq.blocks["dflash"]) == pages_for(seq.frontier) - first
    assert h.finals[rid].token_ids == oracle(h.model_dir, prompt, max_tokens=70)
    f = run(h, prompt + h.finals[rid].token_ids + random_prompt(5, 14), max_tokens=8)
    assert f.usage.cached_tokens > 128 and _spec(h)["context_restarts"] == 0
    h.check_clean()


@pytest.mark.slow
def test_dflash2_window_of_2048_evicts_the_context_below_it(make_harness, tiny_model, tmp_path):
    """The real drafts' window (2,048): a 2,300-token prompt leaves the pages below
    F − 2047 out of the sequence's directory; output equals the oracle."""
    from ninfer.tiny.dflash import make_tiny_dflash
    draft = make_tiny_dflash(tiny_model, tmp_path / "d2", kind="dflash2", seed=2, fit=False)
    h = make_harness(max_context=2400, speculative={"method": "dflash2", "draft": str(draft), "num_tokens": 3})
    prompt = random_prompt(2300, 15)
    rid = h.submit(prompt, max_tokens=6)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 2)
    seq = h.worker.prog.sequences[h.req(rid).sid]
    first = (seq.frontier - 2048 + 1) // 64
    assert first > 0 and seq.draft_base == first * 64
    assert len(seq.blocks["dflash"]) == pages_for(seq.frontier) - first
    h.run(until=lambda: h.done(rid))
    assert h.finals[rid].token_ids == oracle(h.model_dir, prompt, max_tokens=6)
    h.check_clean()


def test_dflash_config_errors_are_specific(make_harness, tiny_dflash, tmp_path):
    with pytest.raises(ConfigError, match="needs draft="):
        make_harness(max_context=256, speculative={"method": "dflash"})
    with pytest.raises(ConfigError, match="disagree"):
        make_harness(max_context=256, speculative={"method": "dflash", "draft": tiny_dflash, "block": 4,
                                                   "num_tokens": 5})
    with pytest.raises(ConfigError, match="exceeds the draft's block"):
        make_harness(max_context=256, speculative={"method": "dflash", "draft": tiny_dflash, "num_tokens": 9})
    with pytest.raises(ConfigError, match="block"):
        make_harness(max_context=256, speculative={"method": "mtp", "block": 4})
    with pytest.raises(ConfigError, match="no config.json"):
        make_harness(max_context=256, speculative={"method": "dflash", "draft": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="is a dflash draft"):
        make_harness(max_context=256, speculative={"method": "dflash2", "draft": tiny_dflash})
