"""Sampling: keyed randomness, filters, penalties and stop rules."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.errors import RequestError
from ninfer.native.sampler import Purpose, apply_penalties, keyed_uniform, sample_token, stop_reason, token_logprobs
from ninfer.reference import reference_generate
from ninfer.sampling_params import SamplingParams
from tests.factories import random_prompt


@given(st.integers(0, 2**63 - 1), st.integers(0, 10**6), st.sampled_from(list(Purpose)))
def test_keyed_uniform_is_a_pure_function_in_unit_interval(seed, pos, purpose):
    u = keyed_uniform(seed, pos, purpose)
    assert 0.0 <= u < 1.0
    assert u == keyed_uniform(seed, pos, purpose)


def test_keyed_uniform_streams_differ_by_seed_position_and_purpose():
    base = keyed_uniform(1, 10, Purpose.SAMPLE)
    assert base != keyed_uniform(2, 10, Purpose.SAMPLE)
    assert base != keyed_uniform(1, 11, Purpose.SAMPLE)
    assert base != keyed_uniform(1, 10, Purpose.DRAFT)
    draws = [keyed_uniform(0, p) for p in range(20000)]
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01          # roughly uniform


def test_greedy_ties_choose_lowest_id():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert sample_token(logits, SamplingParams(), 0, [], []) == 1


def test_recomputing_a_position_draws_the_same_token():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=42)
    first = [sample_token(logits, p, pos, [], []) for pos in range(50)]
    again = [sample_token(logits.clone(), p, pos, [], []) for pos in range(50)]
    assert first == again
    assert len(set(first)) > 5   # it is actually random across positions


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0, -2.0])
    k2 = {sample_token(logits, SamplingParams(temperature=5.0, top_k=2, seed=s), 0, [], []) for s in range(300)}
    assert k2 == {0, 1}
    probs = torch.softmax(logits, -1)
    # smallest prefix with mass >= top_p: just above the first two tokens' mass keeps three
    top_p = float(probs[:2].sum()) + 1e-3
    p3 = {sample_token(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=s), 0, [], []) for s in range(400)}
    assert p3 == {0, 1, 2}


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    counts = Counter(sample_token(logits, SamplingParams(temperature=1.0, seed=7), pos, [], [])
                     for pos in range(6000))
    for tok, p in enumerate((0.5, 0.3, 0.2)):
        assert abs(counts[tok] / 6000 - p) < 0.03


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5], dtype=torch.float64)
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    pf = apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [], [2, 2, 3])
    assert pf.tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.25 - 0.5]
    assert apply_penalties(logits, SamplingParams(presence_penalty=1.0), [0], []) is logits


def test_stop_rules():
    p = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert stop_reason(9, 1, p, eos_ids=(5,)) == "stop"
    assert stop_reason(5, 1, p, eos_ids=(5,)) == "stop"
    assert stop_reason(4, 3, p, eos_ids=(5,)) == "length"
    assert stop_reason(4, 2, p, eos_ids=(5,)) is None
    assert stop_reason(5, 1, SamplingParams(max_tokens=3, ignore_eos=True), eos_ids=(5,)) is None


def test_logprobs_are_the_raw_distribution_with_ordered_alternatives():
    """Raw log_softmax in float64 (before penalties and temperature); top: logprob desc, ties
    by id asc; k = 0: the chosen token only."""
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, -1.0, 2.0], dtype=torch.float32)
    raw = torch.log_softmax(logits.to(torch.float64), -1)
    e = token_logprobs(logits, 2, 4)
    assert e.token_id == 2 and e.logprob == float(raw[2])
    assert [t for t, _ in e.top] == [1, 3, 2, 5]
    assert [lp for _, lp in e.top] == [float(raw[i]) for i in (1, 3, 2, 5)]
    assert token_logprobs(logits, 4, 0).top == () and token_logprobs(logits, 4, 0).logprob == float(raw[4])
    assert len(token_logprobs(logits, 0, 50).top) == 6          # k beyond the vocabulary: all of it
    p = SamplingParams(temperature=0.5, repetition_penalty=1.7, seed=3, logprobs=2)
    tok = sample_token(logits, p, 7, [1, 3], [])
    assert token_logprobs(logits, tok, 2).logprob == float(raw[tok])   # not the penalised one


@given(st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_asking_for_logprobs_never_changes_the_draw(seed):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    plain = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5, seed=seed)
    asked = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5, seed=seed, logprobs=5)
    before = logits.clone()
    tok = sample_token(logits, asked, 3, [1], [2, 2])
    token_logprobs(logits, tok, 5)
    assert torch.equal(logits, before) and tok == sample_token(logits, plain, 3, [1], [2, 2])


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
    ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("seed", -1),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 2.0), ("logprobs", True),
])
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(RequestError, match=f"{field}="):
        SamplingParams(**{field: value}).validate()


# ---- the oracle --------------------------------------------------------------------------

def test_same_request_gives_same_tokens_twice(tiny_model):
    prompt = random_prompt(30, seed=3)
    kw = dict(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, dtype="float64", ignore_eos=True)
    a = reference_generate(tiny_model, prompt, **kw)
    b = reference_generate(tiny_model, prompt, **kw)
    assert a == b and len(a) == 24
    c = reference_generate(tiny_model, prompt, **{**kw, "seed": 1235})
    assert c != a


def test_oracle_stops_on_stop_token(tiny_model):
    prompt = random_prompt(12, seed=4)
    free = reference_generate(tiny_model, prompt, max_tokens=10, dtype="float64", ignore_eos=True)
    stop_at = free[3]
    first = free.index(stop_at)
    out = reference_generate(tiny_model, prompt, max_tokens=10, dtype="float64", ignore_eos=True,
                             stop_token_ids=[stop_at])
    assert out == free[: first + 1]


def test_oracle_rejects_bad_prompt(tiny_model):
    with pytest.raises(RequestError, match="must not be empty"):
        reference_generate(tiny_model, [])
    with pytest.raises(RequestError, match="prompt token id 5000 is out of range"):
        reference_generate(tiny_model, [1, 5000])


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 40), st.integers(0, 10_000))
def test_oracle_sampling_is_reproducible_per_position(tiny_model, n, seed):
    """Tokens drawn at a position depend only on (seed, position, history): continuing from a
    prefix of the output with the committed tokens appended to the prompt gives the same tail."""
    prompt = random_prompt(n, seed=seed)
    kw = dict(temperature=1.0, seed=seed, dtype="float64", ignore_eos=True)
    full = reference_generate(tiny_model, prompt, max_tokens=6, **kw)
    tail = reference_generate(tiny_model, prompt + full[:3], max_tokens=3, **kw)
    assert tail == full[3:]
