"""MTP speculative decoding (issue 16): it never changes an output token, under caching and both
pause routes, and the head's coverage travels with checkpoints (restored, or restarted at the
bridge when a checkpoint has none).

The tiny model's MTP head is fitted to the target (``make_tiny_model`` does it), so drafts are
really accepted and really rejected in these workloads."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from ninfer.errors import ConfigError
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from tests.engine.harness import oracle, pause_while_drafting, run
from tests.engine.test_invariance import count_speculation, run_workloads, seeds
from tests.factories import random_prompt

SPEC_TOTALS: Counter = Counter()


def _mtp(seed: int) -> dict:
    return {"speculative": {"method": "mtp", "num_tokens": random.Random(seed).randint(1, 4)}}


@pytest.mark.slow
def test_random_workloads_with_mtp_match_the_oracle(tiny_model):
    """The oracle sweep's workloads (pressure, pauses of both routes, cache hits, faults,
    greedy and seeded sampling, logprobs) with k = 1..4 drafts per step (4 workloads, 12 with
    NINFER_SWEEP=full, on every core): every completed request equals the isolated run without
    speculation; nothing leaks."""
    count_speculation(SPEC_TOTALS, run_workloads(tiny_model, seeds(5000, 4, 12), _mtp))


@pytest.mark.slow
def test_sampling_options_with_mtp_match_the_oracle(tiny_model):
    """The sampling-options sweep (allowed ids, stop ids with min_tokens, logit bias, bad words,
    min_p) with MTP drafts: a draft is kept only where the constrained, seeded sampler draws it,
    so every completed request still equals the oracle without speculation."""
    totals: Counter = Counter()
    count_speculation(totals, run_workloads(tiny_model, seeds(8100, 4, 12),
                                            lambda seed: {**_mtp(seed), "options": True}))
    assert totals["accepted"] and totals["rejected"] and totals["pauses"], dict(totals)


@pytest.mark.slow
def test_the_mtp_workloads_really_speculated(tiny_model):
    """Run after the sweep above: drafts were both accepted and rejected, with pauses and hits."""
    seed = 5100
    while not all(SPEC_TOTALS[k] for k in ("accepted", "rejected", "pauses", "hits")):
        assert seed < 5140, dict(SPEC_TOTALS)
        count_speculation(SPEC_TOTALS, run_workloads(tiny_model, [seed, seed + 1], _mtp))
        seed += 2
    print("\nmtp workloads:", dict(SPEC_TOTALS))


def _spec(h) -> dict:
    return h.core.stats_dict()["speculative"]


def test_greedy_decode_with_mtp_accepts_drafts_and_equals_the_oracle(make):
    h = make(speculative={"method": "mtp", "num_tokens": 3})
    prompt = random_prompt(40, 1)
    f = run(h, prompt, max_tokens=48)
    assert f.token_ids == oracle(h.model_dir, prompt, max_tokens=48)
    s = _spec(h)
    assert s["accepted"] > 0 and s["tokens_per_step"] > 1.0, s
    assert len(s["acceptance_by_position"]) == 3
    h.check_clean()


def test_sampled_outputs_with_mtp_are_the_seeded_samples_and_follow_the_target(make, tiny_model):
    """Seeded sampling: with MTP every output equals the run without it (the per-position seeded
    sampler decides every token; a draft is kept only where it equals it). And the tokens follow
    the target's distribution: E[p(t_i)] over the runs equals the mean of sum_t p(t)^2 (what a
    sample from p gives), within 4 standard errors."""
    h = make(speculative={"method": "mtp", "num_tokens": 3}, max_concurrency=4)
    prompt = random_prompt(12, 7)
    rids = [h.submit(prompt, max_tokens=4, temperature=1.0, seed=s) for s in range(120)]
    h.run(until=lambda: h.done(*rids))
    m = HybridModel.load(tiny_model, "float64")
    diffs = []
    for s, rid in enumerate(rids):
        got = h.finals[rid].token_ids
        assert got == oracle(h.model_dir, prompt, max_tokens=4, temperature=1.0, seed=s)
        cache = m.new_cache(2, 2)
        out = m.forward(ForwardBatch.build([SeqInput(prompt + got[:-1], 0, [0, 1], state_slot=1, logits="all")]),
                        cache)
        p = torch.softmax(out.logits[len(prompt):], dim=-1)         # positions of tokens 2..4
        for i, tok in enumerate(got[1:]):
            diffs.append(float(p[i, tok] - (p[i] ** 2).sum()))
    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    assert abs(mean) < 4 * sd / math.sqrt(len(diffs)), (mean, sd)
    assert _spec(h)["accepted"] > 0
    h.check_clean()


def test_a_checkpoint_with_mtp_coverage_resumes_without_recomputing_the_head(make):
    """A hit on a kept point restores the head's KV with it: the hit computes exactly F - 1 head
    entries fewer than the same request without the cache, and no context restarts."""
    base = random_prompt(130, 3)
    second = base + random_prompt(9, 4)
    cold = make(speculative={"method": "mtp", "num_tokens": 2})
    run(cold, second, max_tokens=12)
    entries_cold = _spec(cold)["draft_entries"]

    h = make(speculative={"method": "mtp", "num_tokens": 2})
    run(h, base, max_tokens=12)
    before = _spec(h)
    f = run(h, second, max_tokens=12)
    after = _spec(h)
    assert f.token_ids == oracle(h.model_dir, second, max_tokens=12)
    hit = f.usage.cached_tokens
    assert hit > 64, f.usage
    assert after["context_restarts"] == before["context_restarts"]
    assert after["draft_entries"] - before["draft_entries"] == entries_cold - (hit - 1)
    h.check_clean()


def test_a_checkpoint_without_mtp_coverage_restarts_the_head_at_the_bridge(make):
    """The head's coverage is optional cache: a point whose coverage was dropped (the MTP pool's
    own pressure rule) still restores exactly; the head restarts at the bridge (entry F-1 from
    the StateImage's continuation hidden) and outputs are unchanged."""
    base = random_prompt(130, 5)
    second = base + random_prompt(9, 6)
    h = make(speculative={"method": "mtp", "num_tokens": 2})
    run(h, base, max_tokens=12)
    prog = h.worker.prog
    for ck in list(prog.checkpoints.values()):      # the pressure rule's own step, applied to all
        prog.spec.drop_coverage(ck)
    before = _spec(h)
    f = run(h, second, max_tokens=12)
    after = _spec(h)
    assert f.usage.cached_tokens > 64
    assert f.token_ids == oracle(h.model_dir, second, max_tokens=12)
    assert after["context_restarts"] == before["context_restarts"] + 1
    assert after["accepted"] >= before["accepted"]
    h.check_clean()


def test_mtp_config_errors_are_specific(make_harness, tiny_qwen3):
    from tests.engine.harness import Harness
    with pytest.raises(ConfigError, match="MTP weights"):
        Harness(tiny_qwen3, max_context=256, speculative={"method": "mtp", "num_tokens": 2})
    with pytest.raises(ConfigError, match="speculative.method"):
        make_harness(max_context=256, speculative={"method": "eagle"})
    with pytest.raises(ConfigError, match="num_tokens"):
        make_harness(max_context=256, speculative={"method": "mtp", "num_tokens": 0})
    with pytest.raises(ConfigError, match="draft"):
        make_harness(max_context=256, speculative={"method": "mtp", "draft": "/x"})


@pytest.mark.parametrize("host", [True, False], ids=["snapshot", "replay"])
def test_a_pause_drops_the_drafts_and_the_resumed_request_rebuilds_them(make, host):
    """Seed: MTP 丢弃未使用 drafts，并在恢复后的合法单元中重建 — the paused sequence keeps no
    draft (its first unit after the resume is a plain decode row that drafts again), by both
    routes; outputs equal the oracle."""
    cfg = {"context_cache": {"host_capacity_bytes": 64 << 20 if host else 0}}
    h = make(speculative={"method": "mtp", "num_tokens": 3}, **cfg)
    prompt = random_prompt(30, 11)
    rid, _ = pause_while_drafting(h, prompt, max_tokens=40)
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert [p.route for p in f.pauses] == ["snapshot" if host else "replay"]
    assert f.token_ids == oracle(h.model_dir, prompt, max_tokens=40)
    h.check_clean()


def test_a_verify_unit_reserves_its_speculative_peak(make):
    """Seed: typed KV demand 包含 speculative 峰值 — a decode row whose drafts cross a page
    boundary needs the next page, in the worker's demand and in the controller's."""
    h = make(speculative={"method": "mtp", "num_tokens": 3})
    rid = h.submit(random_prompt(60, 12), max_tokens=40)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 2)       # frontier 61, drafts to 64
    req = h.req(rid)
    seq = h.worker.prog.sequences[req.sid]
    assert seq.frontier == 61 and len(seq.drafts) == 3 and len(seq.blocks["main"]) == 1
    assert h.worker.prog.seq_demand(seq, 1) == {"main": 1}      # positions 61..64: a second page
    assert req.facts.spec == 3
    plan = h.core.planner.build(h.core.host_kv_pages)
    [item] = [i for i in plan.items if i.req is req]
    assert item.unit.kind.name == "VERIFY" and item.need.demand == {"main": 1}


def test_between_calls_the_directories_cover_exactly_the_frontiers(make):
    """A rejected draft's pages go back at once: after every call each running sequence holds
    exactly the Main pages of its frontier and the MTP pages of its head's frontier (the
    Program's integrity check, run after every cycle of a decode that crosses pages)."""
    h = make(speculative={"method": "mtp", "num_tokens": 4}, max_concurrency=2)
    rids = [h.submit(random_prompt(n, 20 + n), max_tokens=90) for n in (3, 61)]
    while not h.done(*rids):
        h.cycle()
        h.worker.prog.check_integrity()
    assert _spec(h)["drafted"] > _spec(h)["accepted"] > 0
    h.check_clean()


def test_serve_takes_vllms_speculative_config_flag(tiny_model, tmp_path):
    """``ninfer serve --speculative-config JSON`` (vLLM's flag) turns MTP on over the config file:
    the same chat answer as without, /metrics unchanged in shape; a bad value is one line, exit 2."""
    import subprocess
    import sys

    import httpx

    from tests.serving import serving
    bad = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--model", tiny_model, "--transport", "inproc",
                          "--speculative-config", '{"method": "mtp", "num_tokens": 0}'],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "speculative.num_tokens" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    body = {"model": "m", "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": "hi there"}]}
    answers = []
    for extra in ((), ("--speculative-config", '{"method": "mtp", "num_tokens": 2}')):
        with serving(tiny_model, tmp_path, "max_context = 512\n", "--served-model-name", "m", *extra) as (base, _):
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["message"]["content"])
            metrics = httpx.get(f"{base}/metrics", timeout=30).text
            drafted = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_draft_tokens")]
            assert bool(drafted) == bool(extra) and (not drafted or float(drafted[0].split()[-1]) > 0)
    assert answers[0] == answers[1]
