"""The Python client surface as a user drives it: Engine.start(transport="inproc"), generate,
chat, streaming handles, cancel, async twins, stats, leak checks, bad input, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

import ninfer
from ninfer.errors import RequestError
from tests.factories import random_prompt

CFG = {"max_concurrency": 4, "max_context": 512, "kv_capacity": 8 * 64, "prefill_chunk_tokens": 64,
       "context_cache": {"host_capacity_bytes": 16 << 20}}


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = ninfer.Engine.start(tiny_model, config=CFG, dtype="float64", transport="inproc")
    yield eng
    eng.shutdown()


def ref(model, prompt, **kw):
    return ninfer.reference_generate(model, prompt, dtype="float64", **kw)


def test_generate_matches_the_oracle(engine, tiny_model):
    p = random_prompt(90, seed=1)
    out = engine.generate(p, max_tokens=12, temperature=0.7, seed=3, ignore_eos=True).result(60)
    assert out.finish_reason == "length" and out.error is None
    assert out.token_ids == ref(tiny_model, p, max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)
    assert out.usage.prompt_tokens == 90 and out.usage.completion_tokens == 12
    assert out.timings.ttft_s is not None and out.timings.e2e_s >= out.timings.ttft_s
    assert isinstance(out.text, str)


def test_streaming_events_are_never_repeated(engine):
    h = engine.generate(random_prompt(30, seed=2), max_tokens=10, ignore_eos=True)
    seen = []
    for ev in h:
        assert ev.index == len(seen)
        seen.extend(ev.token_ids)
    assert seen == h.result().token_ids


def test_many_clients_at_once(engine, tiny_model):
    prompts = [random_prompt(20 + 7 * i, seed=10 + i) for i in range(8)]
    results = [None] * 8

    def client(i):
        results[i] = engine.generate(prompts[i], max_tokens=6, ignore_eos=True, seed=i, temperature=1.0).result(120)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, out in enumerate(results):
        assert out.token_ids == ref(tiny_model, prompts[i], max_tokens=6, ignore_eos=True, seed=i, temperature=1.0)


def test_multi_turn_reuses_the_generation_end(engine, tiny_model):
    p1 = random_prompt(80, seed=20)
    o1 = engine.generate(p1, max_tokens=8, ignore_eos=True, session_id="chat-1").result(60)
    p2 = p1 + o1.token_ids + random_prompt(12, seed=21)
    o2 = engine.generate(p2, max_tokens=8, ignore_eos=True, session_id="chat-1").result(60)
    assert o2.usage.cached_tokens == 80 + 8 - 1            # E: everything but the last output
    assert o2.usage.prefill_tokens == len(p2) - o2.usage.cached_tokens
    assert o2.token_ids == ref(tiny_model, p2, max_tokens=8, ignore_eos=True)


def test_chat_renders_with_the_model_template(engine, tiny_model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    out = engine.chat(msgs, max_tokens=5, ignore_eos=True).result(60)
    assert out.token_ids == ref(tiny_model, ninfer.render_chat(tiny_model, msgs), max_tokens=5, ignore_eos=True)


def test_cancel_through_the_handle(engine):
    h = engine.generate(random_prompt(40, seed=30), max_tokens=200, ignore_eos=True)
    for ev in h:
        h.cancel()
        break
    out = h.result(60)
    assert out.finish_reason == "cancelled" and len(out.token_ids) < 200


def test_async_twins(engine, tiny_model):
    p = random_prompt(25, seed=40)

    async def main():
        h = engine.generate(p, max_tokens=6, ignore_eos=True)
        toks = []
        async for ev in h.aiter():
            toks.extend(ev.token_ids)
        out = await h.result_async()
        return toks, out
    toks, out = asyncio.run(main())
    assert toks == out.token_ids == ref(tiny_model, p, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("kwargs,needle", [
    ({"prompt_token_ids": []}, "must be a non-empty list"),
    ({"prompt_token_ids": [1, 99999]}, "prompt token id 99999 is out of range"),
    ({"prompt_token_ids": [1, 2], "max_tokens": 0}, "max_tokens=0"),
    ({"prompt_token_ids": [1, 2], "temperature": -1.0}, "temperature=-1.0"),
    ({"prompt_token_ids": [1] * 500, "max_tokens": 20}, "max_context is 512 tokens"),
    ({"prompt_token_ids": [1, 2, 3], "cache_markers": [1, 2, 3, 3, 1]}, "at most 4 positions"),
    ({"prompt_token_ids": [1, 2, 3], "anchors": [7]}, "position 7 is outside the prompt"),
], ids=["empty", "vocab", "max_tokens", "temperature", "too-long", "markers", "anchor"])
def test_bad_input_fails_that_request_alone(engine, tiny_model, kwargs, needle):
    with pytest.raises(RequestError, match=needle):
        engine.generate(**kwargs)
    p = random_prompt(10, seed=50)
    assert engine.generate(p, max_tokens=3, ignore_eos=True).result(60).token_ids == ref(
        tiny_model, p, max_tokens=3, ignore_eos=True)


def test_stats_and_leak_check(engine):
    # a repeat of its own on an empty cache (under xdist the module's other tests may run in the
    # other worker, or fill the cache so that the first run's save is not admitted)
    engine.drop_caches()
    p = random_prompt(100, seed=51)
    engine.generate(p, max_tokens=2, ignore_eos=True).result(60)
    was = engine.stats()["cache"]
    engine.generate(p, max_tokens=2, ignore_eos=True).result(60)
    s = engine.stats()
    for key in ("cache", "prefill_tokens", "replay_tokens", "bytes_h2d", "bytes_d2h", "pauses",
                "capacity_errors", "occupancy"):
        assert key in s
    assert s["cache"]["hits"] >= was["hits"] + 1 and s["cache"]["reused_tokens"] >= was["reused_tokens"] + 87
    engine.drop_caches()
    engine.check_integrity()
    s = engine.stats()
    assert s["cache"]["checkpoints"] == 0
    assert all(v["available"] == v["total"] for v in s["occupancy"].values())


def test_config_from_toml_and_shutdown(tiny_model, tmp_path):
    f = tmp_path / "engine.toml"
    f.write_text('max_concurrency = 2\nmax_context = 256\nkv_capacity = 256\n\n[context_cache]\nhost_capacity_bytes = 0\n')
    with ninfer.Engine.start(tiny_model, config=str(f), dtype="float32") as eng:
        assert eng.info.max_concurrency == 2 and eng.info.kv_pages == 4
        out = eng.generate(random_prompt(10, seed=60), max_tokens=3).result(60)
        assert len(out.token_ids) >= 1
    with pytest.raises(RequestError, match="shut down"):
        eng.generate([1, 2, 3])


def test_cpu_threads_sets_the_forwards_torch_threads(tiny_model, monkeypatch):
    """``cpu_threads``: the forward of an in-process worker runs on that many torch threads (1 by
    default, DESIGN §8) — read inside the forward itself, so the copy thread's own count of 1
    (set after the control thread's, ATen adopting it at a thread's first parallel op) cannot
    take it back; the outputs are the oracle's."""
    import torch

    from ninfer.native.program import Program
    from tests.engine.harness import oracle
    seen, real = [], Program.execute
    monkeypatch.setattr(Program, "execute", lambda self, rows: (
        seen.append((threading.current_thread().name, torch.get_num_threads())), real(self, rows))[1])
    prompt = random_prompt(40, seed=3)
    eng = ninfer.Engine.start(tiny_model, config={**CFG, "cpu_threads": 2}, dtype="float64", transport="inproc")
    try:
        assert eng.generate(prompt, max_tokens=4, ignore_eos=True).result(60).token_ids == \
            oracle(tiny_model, prompt, max_tokens=4)
    finally:
        eng.shutdown()
    forward = [n for name, n in seen if name == "ninfer-control"]        # the oracle runs on this thread
    assert forward and set(forward) == {2}, seen


def test_the_worker_is_built_on_a_thread_of_its_own(tiny_model, monkeypatch):
    """The model is loaded and calibrated at ``cpu_threads`` on a thread that then exits, and the
    caller's torch thread count is left as it was: an OpenMP team left on the caller's thread
    would put the process over its cores, and libgomp then lets the forward's team sleep between
    ops (a 2-thread forward ran 3x slower; ``native/threads.py``)."""
    import torch

    from ninfer.native.model.model import HybridModel
    from ninfer.native.threads import pin
    seen, load = [], HybridModel.load
    monkeypatch.setattr(HybridModel, "load", staticmethod(lambda *a, **k: (
        seen.append((threading.current_thread().name, torch.get_num_threads())), load(*a, **k))[1]))
    before = pin(1)
    eng = ninfer.Engine.start(tiny_model, config={**CFG, "cpu_threads": 2}, dtype="float32", transport="inproc")
    try:
        assert eng.generate(random_prompt(20, seed=4), max_tokens=2).result(60).token_ids
        assert torch.get_num_threads() == before == 1
        assert seen == [("ninfer-worker-build", 2)], seen
        assert not any(t.name == "ninfer-worker-build" for t in threading.enumerate())
    finally:
        eng.shutdown()


def test_what_startup_built_is_frozen_until_shutdown(tiny_model):
    """``actors/collector.py``: once the engine has started, what it built (the model's modules
    and parameters among them) sits in the collector's permanent generation, so a full collection
    under load does not walk it; shutdown unfreezes it, so a process that starts engine after
    engine can still collect the cycles of the ones it shut down. While it runs the young
    generation is scanned less often (a quote's decoded facts are ~1,000 containers); shutdown
    puts the thresholds back."""
    import gc

    from ninfer.actors.collector import YOUNG
    from ninfer.native.model.model import HybridModel
    before = gc.get_threshold()
    eng = ninfer.Engine.start(tiny_model, config=CFG, transport="inproc")
    try:
        frozen = gc.get_freeze_count()
        models = [o for o in gc.get_objects() if isinstance(o, HybridModel)]
        assert frozen > 10_000 and not models, (frozen, models)      # not in any generation the scans walk
        assert gc.get_threshold() == (max(before[0], YOUNG), *before[1:])
        assert eng.generate(random_prompt(20, seed=5), max_tokens=2).result(60).token_ids
    finally:
        eng.shutdown()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
