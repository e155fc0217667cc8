"""Per-token log-probabilities through the engine (``logprobs=k``): the raw float64
distribution the oracle reports, one entry per output token published exactly once — across
Snapshot and Replay pauses too — and nothing computed or sent when not asked. Prompt
log-probabilities (vLLM's ``prompt_logprobs=k``): one entry per prompt token, equal to an
isolated full computation, because such a request restores no cached prefix."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.errors import RequestError
from ninfer.native import runner
from tests.engine.harness import (
    assert_logprobs_close,
    assert_prompt_logprobs_close,
    force_pause,
    oracle,
    oracle_logprobs,
    oracle_prompt_logprobs,
    run,
)
from tests.factories import random_prompt

SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, presence_penalty=0.4, repetition_penalty=1.2, seed=11)


@pytest.mark.parametrize("kw", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_engine_logprobs_equal_the_oracle(make, tiny_model, kw):
    h = make(max_concurrency=2, prefill_chunk_tokens=64)
    p = random_prompt(90, seed=1)
    f = run(h, p, max_tokens=12, logprobs=5, **kw)
    ids, want = oracle_logprobs(tiny_model, p, 5, max_tokens=12, **kw)
    assert f.token_ids == ids
    assert_logprobs_close(f.logprobs, want)
    assert h.logprobs[f.rid] == f.logprobs            # the stream and the final agree
    h.check_clean()


def test_top_alternatives_are_ordered_and_greedy_picks_the_first(make):
    h = make()
    f = run(h, random_prompt(40, seed=2), max_tokens=8, logprobs=20)
    for e in f.logprobs:
        assert len(e.top) == 20
        keys = [(-lp, t) for t, lp in e.top]
        assert keys == sorted(keys)                    # logprob desc, ties by id asc
        assert e.top[0] == (e.token_id, e.logprob)     # greedy without penalties: the argmax
    f0 = run(h, random_prompt(40, seed=3), max_tokens=4, logprobs=0)
    assert all(e.top == () for e in f0.logprobs) and len(f0.logprobs) == 4


def test_logprobs_none_computes_and_sends_nothing(make, tiny_model, monkeypatch):
    """A request that did not ask never reaches token_logprobs, even batched with one that did."""
    calls = []
    real = runner.token_logprobs
    monkeypatch.setattr(runner, "token_logprobs", lambda *a: calls.append(a) or real(*a))
    h = make(max_concurrency=2)
    pa, pb = random_prompt(30, seed=4), random_prompt(50, seed=5)
    a = h.submit(pa, max_tokens=6, logprobs=2)
    b = h.submit(pb, max_tokens=9)
    h.run(until=lambda: h.done(a, b))
    assert h.finals[b].logprobs is None and b not in h.logprobs
    assert len(calls) == 6 and len(h.finals[a].logprobs) == 6
    assert_logprobs_close(h.finals[a].logprobs, oracle_logprobs(tiny_model, pa, 2, max_tokens=6)[1])


@pytest.mark.parametrize("host,route", [(4 << 20, "snapshot"), (0, "replay")])
def test_paused_and_resumed_requests_report_each_logprob_once(make, tiny_model, host, route):
    """Snapshot keeps the state and reads it back; Replay recomputes the committed tokens
    without sampling them again: either way every token has one entry, equal to the oracle's."""
    h = make(max_concurrency=2, kv_capacity=4 * 64, prefill_chunk_tokens=64,
             context_cache={"host_capacity_bytes": host})
    p = random_prompt(100, seed=2)
    kw = dict(max_tokens=30, logprobs=3, **SAMPLED)
    rid = h.submit(p, rid="B", **kw)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 3)
    force_pause(h, rid)
    h.run(until=lambda: not h.core.tx_busy, max_cycles=50)
    h.core.sched.event()
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert [x.route for x in f.pauses] == [route]
    assert (f.usage.replay_tokens > 0) == (route == "replay")
    ids, want = oracle_logprobs(tiny_model, p, 3, **{k: v for k, v in kw.items() if k != "logprobs"})
    assert f.token_ids == h.streams[rid] == ids
    assert h.logprobs[rid] == f.logprobs and len(f.logprobs) == 30   # the harness checked: once each
    assert_logprobs_close(f.logprobs, want)
    h.check_clean()


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "3"])
def test_bad_logprobs_fail_that_request_alone(make, tiny_model, value):
    h = make()
    with pytest.raises(RequestError, match=r"logprobs=.* out of range: allowed None or 0\.\.20"):
        h.submit([1, 2, 3], logprobs=value)
    p = random_prompt(10, seed=6)
    f = run(h, p, max_tokens=3, logprobs=20)
    assert f.token_ids == oracle_logprobs(tiny_model, p, 20, max_tokens=3)[0]


# ---- prompt logprobs (vLLM's prompt_logprobs) ---------------------------------------------------

CACHED = dict(max_concurrency=2, max_context=512, kv_capacity=16 * 64, prefill_chunk_tokens=64,
              context_cache={"device_state_slots": 4, "host_capacity_bytes": 16 << 20})


def test_prompt_logprobs_restore_no_cached_prefix_and_equal_a_full_computation(make, tiny_model):
    """A prompt sharing a cached prefix: a plain request reuses it, one asking prompt_logprobs
    computes its whole prompt (cached_tokens 0, no cache query, as vLLM v1 skips prefix-cache
    reads for it) and its entries equal an isolated full forward; it still saves its own point
    for others."""
    h = make(**CACHED)
    shared = random_prompt(60, seed=21)
    run(h, shared + random_prompt(30, seed=22), max_tokens=4, markers=[60])
    plain = run(h, shared + random_prompt(30, seed=23), max_tokens=4)
    assert plain.usage.cached_tokens == 60                 # the shared prefix is restorable
    queries = h.core.rm.stats.queries
    p = shared + random_prompt(30, seed=24)
    f = run(h, p, max_tokens=5, prompt_logprobs=4)
    assert f.usage.cached_tokens == 0 and f.usage.prefill_tokens == len(p)
    assert h.core.rm.stats.queries == queries                 # it made no cache query
    assert f.token_ids == oracle(tiny_model, p, max_tokens=5)
    assert_prompt_logprobs_close(f.prompt_logprobs, oracle_prompt_logprobs(tiny_model, p, 4))
    assert h.prompt_logprobs[f.rid] == f.prompt_logprobs      # with the first token, the same
    assert f.logprobs is None and all(len(e.top) == 4 for e in f.prompt_logprobs[1:])
    again = run(h, p, max_tokens=4)
    assert again.usage.cached_tokens == len(p)             # it saved its input point for others
    h.check_clean()


@pytest.mark.parametrize("host,route", [(4 << 20, "snapshot"), (0, "replay")])
def test_prompt_logprobs_survive_a_pause_in_the_prompt(make, tiny_model, host, route):
    """Paused in the middle of its prompt: Snapshot continues; Replay restores its own point
    (below what it already computed) and recomputes without reporting a position twice. Every
    prompt position has exactly one entry, equal to the oracle's."""
    h = make(max_concurrency=2, kv_capacity=4 * 64, prefill_chunk_tokens=64,
             context_cache={"host_capacity_bytes": host})
    p = random_prompt(200, seed=25)
    kw = dict(max_tokens=6, prompt_logprobs=2, logprobs=1, **SAMPLED)
    rid = h.submit(p, rid="P", markers=[64], **kw)
    h.run(until=lambda: h.req(rid) is not None and h.req(rid).frontier >= 128)
    assert h.req(rid).frontier < len(p) and len(h.req(rid).prompt_logprobs) == h.req(rid).frontier
    force_pause(h, rid)
    h.run(until=lambda: not h.core.tx_busy, max_cycles=50)
    h.core.sched.event()
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert f.finish_reason in ("length", "stop"), f.error
    assert [x.route for x in f.pauses] == [route]
    assert f.usage.cached_tokens == 0
    assert [x.frontier for x in f.pauses] == [128]
    # Replay restores its own point at the marker (64) and recomputes 64..127 (entries it holds)
    assert f.usage.replay_tokens == (64 if route == "replay" else 0)
    ids, want = oracle_logprobs(tiny_model, p, 1, **{k: v for k, v in kw.items() if k != "logprobs"})
    assert f.token_ids == ids
    assert_logprobs_close(f.logprobs, want)
    assert_prompt_logprobs_close(f.prompt_logprobs, oracle_prompt_logprobs(tiny_model, p, 2))
    assert h.prompt_logprobs[rid] == f.prompt_logprobs
    h.check_clean()


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "3"])
def test_bad_prompt_logprobs_fail_that_request_alone(make, value):
    h = make()
    with pytest.raises(RequestError, match=r"prompt_logprobs=.* out of range: allowed None or 0\.\.20"):
        h.submit([1, 2, 3], prompt_logprobs=value)
    f = run(h, [5], max_tokens=2, prompt_logprobs=0)      # one token: nothing comes before it
    assert f.prompt_logprobs == [None]


# ---- the Python API --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = ninfer.Engine.start(tiny_model, config={"max_concurrency": 2, "max_context": 256, "kv_capacity": 4 * 64},
                              dtype="float64", transport="inproc")
    yield eng
    eng.shutdown()


def test_generate_and_chat_through_the_api(engine, tiny_model):
    p = random_prompt(40, seed=7)
    h = engine.generate(p, max_tokens=7, temperature=0.7, seed=3, ignore_eos=True, logprobs=2)
    streamed = [e for ev in h for e in ev.logprobs]
    out = h.result(60)
    ids, want = oracle_logprobs(tiny_model, p, 2, max_tokens=7, temperature=0.7, seed=3)
    assert out.token_ids == ids and streamed == out.logprobs
    assert isinstance(out.logprobs[0], ninfer.TokenLogprob)
    assert_logprobs_close(out.logprobs, want)
    chat = engine.chat([{"role": "user", "content": "hi"}], max_tokens=5, ignore_eos=True, logprobs=1).result(60)
    assert len(chat.logprobs) == len(chat.token_ids) == 5
    assert_logprobs_close(chat.logprobs, oracle_logprobs(tiny_model, chat.prompt_token_ids, 1, max_tokens=5)[1])
    plain = engine.generate(p, max_tokens=3, ignore_eos=True)
    assert all(ev.logprobs is None for ev in plain) and plain.result(60).logprobs is None
    for bad in (21, "3"):
        with pytest.raises(RequestError, match="logprobs="):
            engine.generate(p, max_tokens=3, logprobs=bad)


def test_prompt_logprobs_through_the_api(engine, tiny_model):
    """``generate`` / ``chat`` take prompt_logprobs=k: the first stream event and the Output carry
    vLLM's RequestOutput.prompt_logprobs ([None, PromptLogprob, ...]); none unless asked."""
    p = random_prompt(50, seed=26)
    h = engine.generate(p, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    events = list(h)
    out = h.result(60)
    assert events[0].prompt_logprobs == out.prompt_logprobs
    assert all(ev.prompt_logprobs is None for ev in events[1:])
    assert isinstance(out.prompt_logprobs[1], ninfer.PromptLogprob) and out.usage.cached_tokens == 0
    assert_prompt_logprobs_close(out.prompt_logprobs, oracle_prompt_logprobs(tiny_model, p, 3))
    chat = engine.chat([{"role": "user", "content": "hi"}], max_tokens=2, prompt_logprobs=0).result(60)
    assert len(chat.prompt_logprobs) == len(chat.prompt_token_ids)
    assert_prompt_logprobs_close(chat.prompt_logprobs, oracle_prompt_logprobs(tiny_model, chat.prompt_token_ids, 0))
    assert engine.generate(p, max_tokens=2).result(60).prompt_logprobs is None
    with pytest.raises(RequestError, match="prompt_logprobs="):
        engine.generate(p, max_tokens=2, prompt_logprobs=-1)
