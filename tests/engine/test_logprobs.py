"""Per-token log-probabilities through the engine (``logprobs=k``): the raw float64
distribution the oracle reports, one entry per output token published exactly once — across
Snapshot and Replay pauses too — and nothing computed or sent when not asked."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.errors import RequestError
from ninfer.native import program
from tests.engine.harness import assert_logprobs_close, force_pause, oracle_logprobs, run
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
    real = program.token_logprobs
    monkeypatch.setattr(program, "token_logprobs", lambda *a: calls.append(a) or real(*a))
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
    assert [x["route"] for x in f.pauses] == [route]
    assert (f.usage["replay_tokens"] > 0) == (route == "replay")
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
