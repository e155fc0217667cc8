"""Structured outputs in the engine (ninfer/structured.py): the output follows the grammar and
equals the oracle that applies the same grammar to the request alone — across a Snapshot pause
(the state is kept), a Replay pause (rebuilt from the committed output, nothing sampled again)
and MTP speculation (a draft is kept only where the constrained sampler draws it); the grammar
is never part of a cached prefix."""

from __future__ import annotations

import json

import pytest

from ninfer import structured as st
from ninfer.frontend.render import ChatTokenizer
from tests.engine.harness import force_pause, oracle, run
from tests.factories import random_prompt

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}


def _text(model_dir: str, ids: list[int]) -> str:
    return ChatTokenizer(model_dir).decode(ids)


def _valid(model_dir: str, ids: list[int]) -> dict:
    obj = json.loads(_text(model_dir, ids))
    import jsonschema
    jsonschema.validate(obj, SCHEMA)
    return obj


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_output_validates_and_equals_the_oracle(make, temperature):
    h = make()
    c = st.json_schema(SCHEMA)
    for seed in range(4):
        prompt = random_prompt(30, seed)
        f = run(h, prompt, max_tokens=120, temperature=temperature, seed=seed, structured=c)
        assert f.finish_reason == "stop"                      # the grammar completed
        _valid(h.model_dir, f.token_ids)
        assert f.token_ids == oracle(h.model_dir, prompt, max_tokens=120, temperature=temperature, seed=seed,
                                     structured=c)
    assert h.core.stats_dict()["structured"]["masks"] > 0
    h.check_clean()


@pytest.mark.parametrize("route", ["snapshot", "replay"])
def test_a_pause_keeps_or_rebuilds_the_grammar_state(make, route):
    """Paused mid-answer: a Snapshot resume continues the state, a Replay resume rebuilds it from
    the committed output (``rebuilt`` counts it) — either way the answer equals the oracle."""
    snap = 431104 + 3 * 262144
    h = make(context_cache={"host_capacity_bytes": snap if route == "snapshot" else 0})
    c = st.json_schema(SCHEMA)
    prompt = random_prompt(40, 9)
    rid = h.submit(prompt, max_tokens=120, temperature=1.0, seed=4, structured=c)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 6)
    force_pause(h, rid)
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert [p.route for p in f.pauses] == [route], f.pauses
    want = oracle(h.model_dir, prompt, max_tokens=120, temperature=1.0, seed=4, structured=c)
    assert f.token_ids == want and f.finish_reason == "stop"
    _valid(h.model_dir, f.token_ids)
    rebuilt = h.core.stats_dict()["structured"]["rebuilt"]
    assert rebuilt == (1 if route == "replay" else 0)
    h.check_clean()


def test_with_mtp_a_draft_is_kept_only_where_the_constrained_sampler_draws_it(make):
    h = make(speculative={"method": "mtp", "num_tokens": 3})
    c = st.json_schema(SCHEMA)
    for seed in range(3):
        prompt = random_prompt(25, 20 + seed)
        f = run(h, prompt, max_tokens=120, temperature=0.0, seed=seed, structured=c)
        assert f.token_ids == oracle(h.model_dir, prompt, max_tokens=120, seed=seed, structured=c)
        _valid(h.model_dir, f.token_ids)
    spec = h.core.stats_dict()["speculative"]
    assert spec["drafted"] > 0
    h.check_clean()


def test_the_grammar_is_no_part_of_a_cached_prefix(make):
    """A constrained request and an unconstrained one on the same prompt: the second reuses the
    first's point and is not constrained by it (and the reverse)."""
    h = make()
    prompt = random_prompt(70, 3)
    c = st.choice(["yes", "no"])
    first = run(h, prompt, max_tokens=8, structured=c)
    assert _text(h.model_dir, first.token_ids) in ("yes", "no")
    free = run(h, prompt, max_tokens=8)
    assert free.usage.cached_tokens > 0 and free.token_ids == oracle(h.model_dir, prompt, max_tokens=8)
    again = run(h, prompt + free.token_ids + random_prompt(5, 4), max_tokens=8, structured=c)
    assert _text(h.model_dir, again.token_ids) in ("yes", "no") and again.usage.cached_tokens > 0
    h.check_clean()


def test_regex_choice_and_grammar_constraints(make):
    h = make()
    prompt = random_prompt(20, 5)
    for c, check in [(st.regex(r"[0-9]{3}-[a-c]{2}"), lambda s: len(s) == 6 and s[3] == "-"),
                     (st.choice(["red", "green", "blue"]), lambda s: s in ("red", "green", "blue")),
                     (st.grammar('root ::= "x" [0-9] [0-9]'), lambda s: s[0] == "x" and s[1:].isdigit()),
                     (st.grammar('start: "(" NUM ")"\nNUM: /[0-9]{1,3}/'), lambda s: s[0] == "(" and s[-1] == ")")]:
        f = run(h, prompt, max_tokens=20, temperature=1.0, seed=1, structured=c)
        assert check(_text(h.model_dir, f.token_ids)), (c.kind, _text(h.model_dir, f.token_ids))
        assert f.token_ids == oracle(h.model_dir, prompt, max_tokens=20, temperature=1.0, seed=1, structured=c)


def test_a_prompt_that_opens_the_thinking_thinks_first_then_follows_the_grammar(make):
    """A template that leaves the answer inside ``<think>`` (Qwen3.5's): the thinking is free
    (EOS barred), the grammar holds after ``</think>`` and the whitespace right after it; the
    oracle applies the same."""
    import msgspec
    h = make()
    tok = ChatTokenizer(h.model_dir).tokenizer
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    c = msgspec.structs.replace(st.choice(["red", "blue"]), think=(think, end))
    prompt = random_prompt(20, 6) + [think]
    kw = dict(max_tokens=80, temperature=1.0, seed=3, structured=c, logit_bias=((end, 8.0),))
    f = run(h, prompt, **kw)
    assert end in f.token_ids and f.token_ids.index(end) > 0          # it thought, then closed
    answer = _text(h.model_dir, f.token_ids[f.token_ids.index(end) + 1:]).strip()
    assert answer in ("red", "blue") and f.finish_reason == "stop"
    assert f.token_ids == oracle(h.model_dir, prompt, **kw)
    plain = run(h, random_prompt(20, 6), **kw)                       # not opened: no thinking at all
    assert _text(h.model_dir, plain.token_ids) in ("red", "blue")
