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


# ---- vLLM's other sampling options --------------------------------------------------------

def test_allowed_token_ids_limit_the_draw_greedy_and_sampled():
    logits = torch.tensor([5.0, 1.0, 0.5, 0.2, 3.0], dtype=torch.float64)
    p = SamplingParams(allowed_token_ids=(2, 3))
    assert sample_token(logits, p, 0, [], []) == 2
    drawn = {sample_token(logits, SamplingParams(temperature=2.0, allowed_token_ids=(1, 3), seed=s), 0, [], [])
             for s in range(200)}
    assert drawn == {1, 3}


def test_min_tokens_bars_stop_ids_and_eos_until_reached_unless_nothing_else_is_left():
    logits = torch.tensor([0.0, 9.0, 8.0, 1.0], dtype=torch.float64)      # 1: eos, 2: a stop id
    p = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(2,))
    assert sample_token(logits, p, 0, [], [], eos_ids=(1,)) == 3
    assert sample_token(logits, p, 0, [], [7, 7], eos_ids=(1,)) == 1      # reached: eos again
    ign = SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True)
    assert sample_token(logits, ign, 0, [], [], eos_ids=(1,)) == 1        # eos is no stop id here
    only_stops = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(2,), allowed_token_ids=(1, 2))
    assert sample_token(logits, only_stops, 0, [], [], eos_ids=(1,)) == 1  # never nothing to draw
    assert stop_reason(1, 1, p, eos_ids=(1,)) is None                     # no stop before min_tokens
    assert stop_reason(2, 2, p, eos_ids=(1,)) == "stop"


def test_logit_bias_is_added_and_minus_100_bans():
    logits = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64)
    assert sample_token(logits, SamplingParams(logit_bias=((2, 2.5),)), 0, [], []) == 2
    assert sample_token(logits, SamplingParams(logit_bias=((0, -100.0),)), 0, [], []) == 1


def test_bad_words_bar_the_last_token_of_a_sequence_whose_start_was_generated():
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0], dtype=torch.float64)
    p = SamplingParams(bad_words=((2, 1), (3,)))
    assert sample_token(logits, p, 0, [], [0]) == 1           # "2 1" not started: 1 allowed
    assert sample_token(logits, p, 0, [], [0, 2]) == 2        # after 2, 1 is barred (3 always)


def test_min_p_keeps_tokens_within_a_fraction_of_the_most_likely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    drawn = Counter(sample_token(logits, SamplingParams(temperature=1.0, min_p=0.5, seed=s), 0, [], [])
                    for s in range(3000))
    assert set(drawn) == {0, 1}                               # 0.15 < 0.5 x 0.5
    assert abs(drawn[0] / 3000 - 0.5 / 0.8) < 0.03           # renormalised over what is kept
    assert {sample_token(logits, SamplingParams(temperature=1.0, min_p=0.0, seed=s), 0, [], [])
            for s in range(400)} == {0, 1, 2, 3}
    # top_p then sees the renormalised mass: 0.5 / 0.8 = 0.625 >= 0.6 keeps token 0 alone
    assert {sample_token(logits, SamplingParams(temperature=1.0, min_p=0.5, top_p=0.6, seed=s), 0, [], [])
            for s in range(400)} == {0}


def test_logprobs_stay_raw_under_every_option():
    logits = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)
    p = SamplingParams(allowed_token_ids=(0,), logit_bias=((0, 5.0),), logprobs=1)
    tok = sample_token(logits, p, 0, [], [])
    assert tok == 0 and token_logprobs(logits, tok, 1).logprob == float(torch.log_softmax(logits, -1)[0])


@pytest.mark.parametrize("field,value", [
    ("min_p", -0.1), ("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 17),
    ("logit_bias", ((1, 101.0),)), ("bad_words", ((),)),
])
def test_bad_option_values_name_the_field(field, value):
    with pytest.raises(RequestError, match=f"{field}="):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("field,value", [
    ("logit_bias", ((99999, 1.0),)), ("allowed_token_ids", (99999,)), ("bad_words", ((1, 99999),)),
    ("stop_token_ids", (99999,)),
])
def test_option_token_ids_outside_the_vocabulary_name_the_field(field, value):
    with pytest.raises(RequestError, match=f"{field}=99999"):
        SamplingParams(**{field: value}).validate(vocab_size=100)


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
