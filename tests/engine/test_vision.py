"""Images through the engine (tiny qwen3_5_vision, float64): media identity in the token stream
(identity ids at the pads), tower rows and MRoPE in Program.execute, the encoder cache."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from ninfer import protocol as P
from ninfer.errors import RequestError
from ninfer.frontend.media import media_config, prepare_image, request_media
from ninfer.frontend.validate import validate_spec
from ninfer.reference import reference_generate_multimodal
from tests.engine.harness import Harness, force_pause


def png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_prompt(model_dir: str, vocab: int, before: list[int], after: list[int], *images: bytes):
    """before <vs> [img 0 pads] <ve> mid <vs> [img 1] <ve> after -> (prompt, media)."""
    params, tok = media_config(model_dir)
    prepared = [prepare_image(d, params) for d in images]
    ids = list(before)
    for k in range(len(prepared)):
        ids += [tok.start, tok.pad, tok.end] + ([7 + k, 8] if k + 1 < len(prepared) else [])
    ids += after
    from ninfer.frontend.media import expand_image_pads
    expanded, spans = expand_image_pads(ids, prepared, tok)
    return request_media(expanded, prepared, spans, vocab)


@pytest.fixture
def vh(tiny_vision):
    made = []

    def build(**cfg) -> Harness:
        cfg.setdefault("max_context", 256)
        h = Harness(tiny_vision, **cfg)
        made.append(h)
        return h
    yield build
    for h in made:
        h.close()


TEXT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
TAIL = [30, 31, 32, 33]


def ref(model_dir, prompt, media, n=12):
    return reference_generate_multimodal(model_dir, prompt, media, max_tokens=n, dtype="float64")


def test_image_prompt_matches_reference(vh, tiny_vision):
    h = vh()
    vocab = h.core.info.vocab_size
    prompt, media = image_prompt(tiny_vision, vocab, TEXT, TAIL, png(64, 96, 1), png(96, 64, 2))
    assert [m.num_tokens for m in media] == [6, 6] and max(prompt) >= vocab
    rid = h.submit(prompt, max_tokens=12, media=media)
    h.run()
    out = h.finals[rid]
    assert out.error is None and out.token_ids == ref(tiny_vision, prompt, media)
    assert h.core.stats_dict()["vision"]["encodes"] == 2
    h.check_clean()


def test_media_identity_decides_cache_hits(vh, tiny_vision):
    """The same text with another image never hits past the shared text and answers otherwise;
    the same image re-sent hits past the image and answers the same."""
    h = vh()
    vocab = h.core.info.vocab_size
    a, media_a = image_prompt(tiny_vision, vocab, TEXT, TAIL, png(64, 96, 1))
    b, media_b = image_prompt(tiny_vision, vocab, TEXT, TAIL, png(64, 96, 3))
    assert len(a) == len(b) and a != b
    r1 = h.submit(a, max_tokens=10, media=media_a)
    h.run()
    r2 = h.submit(b, max_tokens=10, media=media_b)
    h.run()
    r3 = h.submit(a, max_tokens=10, media=media_a)
    h.run()
    f1, f2, f3 = h.finals[r1], h.finals[r2], h.finals[r3]
    span_end = media_a[0].offset + media_a[0].num_tokens
    assert f2.usage.cached_tokens <= media_b[0].offset          # nothing inside or past the image
    assert f2.token_ids == ref(tiny_vision, b, media_b, 10) != f1.token_ids
    assert f3.usage.cached_tokens > span_end                     # the same image: a real hit
    assert f3.token_ids == f1.token_ids == ref(tiny_vision, a, media_a, 10)
    v = h.core.stats_dict()["vision"]
    assert v["encodes"] == 2                                        # a and b; the hit computed no image
    h.check_clean()
    assert h.core.stats_dict()["vision"]["encoder_cache_entries"] == 0


def test_encoder_cache_eviction_reencodes(vh, tiny_vision):
    """Budget 0: nothing is kept, a chunk needing the image re-encodes it — identical output."""
    h = vh(prefill_chunk_tokens=8, context_cache={"encoder_cache_bytes": 0})
    vocab = h.core.info.vocab_size
    p, media = image_prompt(tiny_vision, vocab, TEXT[:5], TAIL, png(96, 128, 4))   # 12 image tokens
    rid = h.submit(p, max_tokens=8, media=media)
    h.run()
    v = h.core.stats_dict()["vision"]
    assert v["encodes"] >= 2 and v["encoder_cache_entries"] == 0 and v["encoder_cache_hits"] == 0
    assert h.finals[rid].token_ids == ref(tiny_vision, p, media, 8)
    h.check_clean()


@pytest.mark.parametrize("chunk", [3, 7, 10])
def test_chunks_cutting_inside_an_image(vh, tiny_vision, chunk):
    h = vh(prefill_chunk_tokens=chunk)
    vocab = h.core.info.vocab_size
    p, media = image_prompt(tiny_vision, vocab, TEXT[:4], TAIL, png(96, 128, 4), png(64, 64, 5))
    rid = h.submit(p, max_tokens=8, media=media)
    h.run()
    assert h.finals[rid].token_ids == ref(tiny_vision, p, media, 8)
    v = h.core.stats_dict()["vision"]
    assert v["encodes"] == 2 and v["encoder_cache_hits"] > 0      # later chunks reuse the rows
    h.check_clean()


@pytest.mark.parametrize("host", [8 << 20, 0])
def test_pause_mid_decode_after_an_image(vh, tiny_vision, host):
    """Snapshot (Host room) and Replay (no Host): the resumed request answers as if never paused;
    Replay recomputes the image span (re-encoding when its rows were dropped)."""
    h = vh(max_concurrency=2, kv_capacity=6 * 64, prefill_chunk_tokens=16,
           context_cache={"host_capacity_bytes": host, "encoder_cache_bytes": 0})
    vocab = h.core.info.vocab_size
    p, media = image_prompt(tiny_vision, vocab, TEXT, TAIL, png(96, 128, 6))
    rid = h.submit(p, max_tokens=12, media=media)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 4)
    force_pause(h, rid)
    h.run(until=lambda: h.done(rid))
    f = h.finals[rid]
    assert [q.route for q in f.pauses] == (["snapshot"] if host else ["replay"])
    if not host:
        assert f.usage.replay_tokens > 0
    assert f.token_ids == ref(tiny_vision, p, media, 12)
    h.check_clean()


def test_validation_of_media(vh, tiny_vision, tiny_model):
    h = vh()
    info = h.core.info
    p, media = image_prompt(tiny_vision, info.vocab_size, TEXT, TAIL, png(64, 96, 1))
    ok = P.RequestSpec(prompt=p, media=media)
    validate_spec(ok, info)
    m = media[0]
    with pytest.raises(RequestError, match="out of range"):
        validate_spec(P.RequestSpec(prompt=p), info)                     # identity ids without media
    wrong = p[:m.offset] + [p[m.offset] + 1] + p[m.offset + 1:]
    with pytest.raises(RequestError, match="identity ids"):
        validate_spec(P.RequestSpec(prompt=wrong, media=media), info)
    import msgspec
    with pytest.raises(RequestError, match="image tokens"):
        validate_spec(P.RequestSpec(prompt=p, media=[msgspec.structs.replace(m, num_tokens=5)]), info)
    with pytest.raises(RequestError, match="inside an image span"):
        validate_spec(P.RequestSpec(prompt=p, media=media, markers=[m.offset + 2]), info)
    with pytest.raises(RequestError, match="outside the prompt"):
        validate_spec(P.RequestSpec(prompt=p, media=[m, m]), info)
    text_info = msgspec.structs.replace(info, vision_merge=0, model_type="qwen3_next")
    with pytest.raises(RequestError, match="no vision tower"):
        validate_spec(P.RequestSpec(prompt=p, media=media), text_info)


def data_url(data: bytes) -> str:
    import base64
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_engine_chat_with_an_image(tiny_vision):
    """engine.chat with an image_url part: rendered, prepared, expanded with identity ids; the
    answer equals the oracle on that prompt; a second image in the same text answers otherwise."""
    import ninfer
    eng = ninfer.Engine.start(tiny_vision, config=ninfer.EngineConfig(max_context=256, cost_calibration=False),
                              dtype="float64", transport="inproc")
    try:
        def msgs(img: bytes):
            return [{"role": "user", "content": [{"type": "text", "text": "look at"},
                                                 {"type": "image_url", "image_url": {"url": data_url(img)}},
                                                 {"type": "text", "text": "and say"}]}]

        def ask(img: bytes):
            return eng.chat(msgs(img), max_tokens=8, ignore_eos=True).result()
        a, b, a2 = ask(png(64, 96, 1)), ask(png(64, 96, 3)), ask(png(64, 96, 1))
        assert a.error is None and b.error is None
        assert a.token_ids != b.token_ids and a2.token_ids == a.token_ids
        assert a2.usage.cached_tokens > 0 and b.usage.cached_tokens < a2.usage.cached_tokens
        spec = eng._rt.intake.chat(P.ChatSpec(messages=msgs(png(64, 96, 1))))    # the prompt the engine ran
        assert sum(t >= eng.info.vocab_size for t in spec.prompt) == 6 and len(spec.media) == 1
        assert a.token_ids == ref(tiny_vision, spec.prompt, spec.media, 8)
        st = eng.stats()
        assert st["vision"]["encodes"] == 2
        eng.drop_caches()
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_engine_chat_image_on_a_text_model(tiny_model):
    import ninfer
    eng = ninfer.Engine.start(tiny_model, config=ninfer.EngineConfig(max_context=256, cost_calibration=False),
                              transport="inproc")
    try:
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(64, 64, 1))}}]}]
        with pytest.raises(RequestError, match="no vision tower"):
            eng.chat(msgs, max_tokens=4).result()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("host", [True, False], ids=["snapshot", "replay"])
def test_image_prompt_with_mtp_equals_the_reference_through_a_pause(vh, tiny_vision, host):
    """Speculative decoding on a prompt with images (the tiny Qwen3.5 ships one MTP layer, as
    the real one does): the verify rows run at the MRoPE positions after the images, the head
    embeds an image's identity ids as a placeholder (drafts only), and a pause of either route
    changes nothing."""
    cfg = {"context_cache": {"host_capacity_bytes": 64 << 20 if host else 0}}
    h = vh(speculative={"method": "mtp", "num_tokens": 3}, **cfg)
    vocab = h.core.info.vocab_size
    prompt, media = image_prompt(tiny_vision, vocab, TEXT, TAIL, png(64, 96, 1), png(96, 64, 2))
    rid = h.submit(prompt, max_tokens=24, media=media)
    h.run(until=lambda: len(h.streams.get(rid, [])) >= 5)
    force_pause(h, rid)
    h.run(until=lambda: h.done(rid))
    out = h.finals[rid]
    assert out.error is None and out.token_ids == ref(tiny_vision, prompt, media, n=24)
    assert [p.route for p in out.pauses] == ["snapshot" if host else "replay"]
    assert h.core.stats_dict()["speculative"]["drafted"] > 0
    h.check_clean()


MIXED: Counter = Counter()


def _mixed_workload(model_dir: str, vocab: int, seed: int):
    """Text-only and image requests over two shared text bases, two images reused across requests
    (hits) and fresh ones (misses), arriving in waves; preemptions at chosen cycles."""
    import random
    rng = random.Random(seed)
    images = [png(64, 96, 100 + seed), png(96, 64, 200 + seed)]
    bases = [[rng.randrange(3, 200) for _ in range(rng.randint(4, 40))] for _ in range(2)]
    reqs = []
    for i in range(rng.randint(4, 7)):
        before = rng.choice(bases) + [rng.randrange(3, 200) for _ in range(rng.randint(0, 6))]
        after = [rng.randrange(3, 200) for _ in range(rng.randint(1, 8))]
        kind = rng.random()
        earlier = [r for r in reqs if r[2]]
        if earlier and kind > 0.7:                  # an earlier image prompt re-sent, later (a hit)
            t, prompt, media, _ = rng.choice(earlier)
            reqs.append((t + rng.randint(15, 40), prompt, media, rng.randint(4, 14)))
            continue
        if kind < 0.3:
            prompt, media = before + after, []
        else:
            imgs = [rng.choice(images) if rng.random() < 0.7 else png(64, 64, 1000 * seed + i)
                    for _ in range(rng.choice([1, 1, 2]))]
            prompt, media = image_prompt(model_dir, vocab, before, after, *imgs)
        reqs.append((rng.randint(0, 12), prompt, media, rng.randint(4, 14)))
    return sorted(reqs, key=lambda r: r[0]), sorted(rng.sample(range(3, 40), 2))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_mixed_text_and_image_workloads_match_the_oracle(vh, tiny_vision, seed):
    """The float64 oracle over mixed workloads: tight Main KV, a Host for a snapshot or none (Replay),
    a small encoder cache, chunks cutting images, preemptions: every request equals its isolated
    run (the multimodal oracle, or reference_generate for text), with real hits and misses; no leak."""
    from ninfer.reference import reference_generate
    host = [0, 8 << 20][seed % 2]
    h = vh(max_concurrency=3, kv_capacity=6 * 64, prefill_chunk_tokens=[5, 16, 64][seed % 3],
           context_cache={"host_capacity_bytes": host, "encoder_cache_bytes": [0, 40_000, 1 << 20][seed % 3]})
    vocab = h.core.info.vocab_size
    reqs, preempts = _mixed_workload(tiny_vision, vocab, seed)
    pending, live, cycle = list(reqs), {}, 0
    while pending or not h.done(*live):
        while pending and pending[0][0] <= cycle:
            _, p, media, n = pending.pop(0)
            live[h.submit(p, max_tokens=n, media=media)] = (p, media, n)
        if cycle in preempts:
            running = [r for r in h.core.sched.resident.values() if r.phase.name == "RUNNING" and r.outputs]
            if running:
                force_pause(h, running[0].rid)
        h.cycle()
        cycle += 1
        assert cycle < 5000, f"seed {seed}: the workload did not finish"
    for rid, (p, media, n) in live.items():
        f = h.finals[rid]
        assert f.finish_reason == "length", f.error
        want = ref(tiny_vision, p, media, n) if media else reference_generate(
            tiny_vision, p, max_tokens=n, dtype="float64", ignore_eos=True)
        assert f.token_ids == list(want), f"seed {seed}: {rid} differs from its isolated run"
        MIXED["image_hits"] += bool(media) and f.usage.cached_tokens > media[0].offset + media[0].num_tokens
        for q in f.pauses:
            MIXED[q.route] += 1
    MIXED["encodes"] += h.core.stats_dict()["vision"]["encodes"]
    h.check_clean()


@pytest.mark.slow
def test_the_mixed_workloads_hit_past_images_and_paused_by_both_routes(vh, tiny_vision):
    """Run after the sweep above: hits past an image, Snapshot and Replay all happened."""
    seed = 6
    while not (MIXED["image_hits"] and MIXED["snapshot"] and MIXED["replay"]):
        assert seed < 30, dict(MIXED)
        test_mixed_text_and_image_workloads_match_the_oracle(vh, tiny_vision, seed)
        seed += 1
    print("\nmixed vision workloads:", dict(MIXED))
