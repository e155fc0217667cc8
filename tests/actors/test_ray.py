"""The three Ray actors as a user runs them: Engine.start(transport="ray"), ninfer.connect,
streaming, cancel, async twins, many clients — and output invariance over the actor boundary."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

import ninfer
from ninfer.errors import RequestError
from tests.engine.harness import assert_logprobs_close, oracle, oracle_logprobs
from tests.factories import random_prompt

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TIGHT = {"max_concurrency": 3, "max_context": 256, "kv_capacity": 4 * 64, "prefill_chunk_tokens": 48,
         "context_cache": {"device_state_slots": 1, "host_capacity_bytes": 1 << 20}}


@pytest.fixture
def ray_engine(tiny_model, deployment):
    eng = ninfer.Engine.start(tiny_model, config=TIGHT, dtype="float64", transport="ray", deployment=deployment)
    yield eng
    eng.shutdown()


def test_float64_invariance_over_ray(ray_engine, tiny_model):
    """Random concurrent requests under tight capacity, through the real actors, equal the
    oracle; pauses happen; nothing leaks."""
    rng = random.Random(7)
    reqs = []
    for i in range(8):
        p = random_prompt(rng.randint(20, 140), seed=300 + i)
        kw = dict(max_tokens=rng.randint(5, 40), temperature=rng.choice([0.0, 1.0]), seed=i, ignore_eos=True)
        reqs.append((p, kw, ray_engine.generate(p, **kw)))
    for p, kw, h in reqs:
        out = h.result(300)
        assert out.finish_reason == "length", out.error
        assert out.token_ids == oracle(tiny_model, p, **kw)
    s = ray_engine.stats()
    assert s["preemptions"] > 0
    # the steady cycle and the events took the direct local channels, not per-cycle actor calls
    assert s["step_channel"] == "socket" and ray_engine._rt.streaming
    ray_engine.drop_caches()
    ray_engine.check_integrity()


def test_plain_actor_calls_remain_a_working_fallback(tiny_model, deployment, monkeypatch):
    """NINFER_RAY_STEP_CHANNEL=call: the same workload over plain step calls equals the oracle."""
    monkeypatch.setenv("NINFER_RAY_STEP_CHANNEL", "call")
    eng = ninfer.Engine.start(tiny_model, config=TIGHT, dtype="float64", transport="ray", deployment=deployment)
    try:
        p = random_prompt(60, seed=901)
        out = eng.generate(p, max_tokens=12, ignore_eos=True).result(300)
        assert out.token_ids == oracle(tiny_model, p, max_tokens=12, ignore_eos=True)
        assert eng.stats()["step_channel"] == "call"
    finally:
        eng.shutdown()


def test_streaming_cancel_and_async_over_ray(ray_engine, tiny_model):
    p = random_prompt(30, seed=1)
    h = ray_engine.generate(p, max_tokens=12, ignore_eos=True)
    seen = []
    for ev in h:
        assert ev.index == len(seen)
        seen.extend(ev.token_ids)
    assert seen == h.result().token_ids == oracle(tiny_model, p, max_tokens=12)

    long = ray_engine.generate(random_prompt(20, seed=2), max_tokens=200, ignore_eos=True)
    for _ in long:
        long.cancel()
        break
    assert long.result(60).finish_reason == "cancelled"

    async def main():
        h2 = ray_engine.generate(p, max_tokens=5, ignore_eos=True)
        toks = [t async for ev in h2.aiter() for t in ev.token_ids]
        return toks, await h2.result_async()
    toks, out = asyncio.run(main())
    assert toks == out.token_ids == oracle(tiny_model, p, max_tokens=5)
    with pytest.raises(RequestError, match="out of range"):
        ray_engine.generate([1, 10**6])
    ray_engine.check_integrity()


def test_logprobs_over_ray(ray_engine, tiny_model):
    """Logprob entries cross both actor boundaries (worker -> controller -> frontend -> client)
    once per token, equal to the oracle's; a bad value fails that request alone."""
    p = random_prompt(40, seed=11)
    kw = dict(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    h = ray_engine.generate(p, logprobs=3, **kw)
    streamed = [e for ev in h for e in ev.logprobs]
    out = h.result(120)
    ids, want = oracle_logprobs(tiny_model, p, 3, **kw)
    assert out.token_ids == ids and streamed == out.logprobs
    assert_logprobs_close(out.logprobs, want)
    with pytest.raises(RequestError, match="logprobs=21"):
        ray_engine.generate(p, logprobs=21)
    assert ray_engine.generate(p, max_tokens=2, ignore_eos=True).result(60).logprobs is None


def test_many_clients_and_connect(ray_engine, tiny_model, deployment):
    """Several independent client handles (ninfer.connect) on one deployment at once."""
    clients = [ninfer.connect(address="auto", deployment=deployment) for _ in range(3)]
    outs = {}

    def work(i, eng):
        p = random_prompt(25 + i, seed=50 + i)
        outs[i] = (p, eng.generate(p, max_tokens=6, ignore_eos=True).result(120))
    threads = [threading.Thread(target=work, args=(i, clients[i % 3])) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, out in outs.values():
        assert out.token_ids == oracle(tiny_model, p, max_tokens=6)
    chat = clients[0].chat([{"role": "user", "content": "hi there"}], max_tokens=3)
    assert chat.result(60).finish_reason in ("length", "stop")
    for c in clients:
        c.shutdown()                      # a connected client never tears the deployment down
    assert ray_engine.generate([1, 2, 3], max_tokens=2).result(60).finish_reason in ("length", "stop")


def test_connect_to_a_missing_deployment(ray_session):
    with pytest.raises(RequestError, match="no NInfer deployment named 'nope'"):
        ninfer.connect(address="auto", deployment="nope")


def test_engine_chat_with_an_image_over_ray(tiny_vision, deployment):
    """The deployed shape with images: the frontend actor prepares them within its configured
    media budget (an image over it is that request's clear error), the worker actor encodes;
    the answer equals the in-process one and a re-send hits the cache past the image."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    def chat(w: int, h: int) -> list[dict]:
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(w).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        return [{"role": "user", "content": [{"type": "text", "text": "look at"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]

    cfg = {"max_context": 256, "cost_calibration": False}
    inproc = ninfer.Engine.start(tiny_vision, config=cfg, dtype="float64", transport="inproc")
    try:
        want = inproc.chat(chat(64, 96), max_tokens=8, ignore_eos=True).result().token_ids
    finally:
        inproc.shutdown()
    # 64x96: 24 patches of 1536 float32 = 147 KiB prepared; 128x128: 64 patches = 384 KiB
    eng = ninfer.Engine.start(tiny_vision, config={**cfg, "media_budget_bytes": 200_000}, dtype="float64",
                              transport="ray", deployment=deployment)
    try:
        a = eng.chat(chat(64, 96), max_tokens=8, ignore_eos=True).result()
        b = eng.chat(chat(64, 96), max_tokens=8, ignore_eos=True).result()
        assert a.error is None and a.token_ids == want and b.token_ids == want
        assert b.usage.cached_tokens > a.usage.cached_tokens
        with pytest.raises(RequestError, match="budget"):
            eng.chat(chat(128, 128), max_tokens=4).result()
        assert eng.chat(chat(64, 96), max_tokens=8, ignore_eos=True).result().token_ids == want
    finally:
        eng.shutdown()
