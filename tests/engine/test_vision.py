"""Images through the engine (tiny qwen3_5_vision, float64): media identity in the token stream
(identity ids at the pads), tower rows and MRoPE in Program.execute, the encoder cache."""

from __future__ import annotations

import io

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
