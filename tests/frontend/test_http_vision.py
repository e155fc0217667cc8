"""Image parts over HTTP on the tiny vision model: answered (and re-sent: a real cache hit),
an image over the media budget and an audio part are clear 400s. (A text model's image part:
test_http_hardening.)"""

from __future__ import annotations

import httpx
import pytest

from tests.engine.test_vision import data_url, png
from tests.serving import serving


@pytest.fixture(scope="module")
def vserver(tiny_vision, tmp_path_factory):
    config = ('max_concurrency = 2\nmax_context = 512\ndtype = "float32"\nmedia_budget_bytes = 200000\n\n'
              '[context_cache]\nhost_capacity_bytes = 16777216\n')
    with serving(tiny_vision, tmp_path_factory.mktemp("serve_vision"), config, "--served-model-name", "x") as (base, _):
        yield base


def chat(base: str, *parts: dict) -> httpx.Response:
    body = {"model": "x", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, *parts]}]}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def image(w: int, h: int, seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(png(w, h, seed))}}


def test_image_chat_and_its_cache_hit(vserver):
    r1 = chat(vserver, image(64, 96, 1))
    assert r1.status_code == 200, r1.text
    r2 = chat(vserver, image(64, 96, 1))
    assert r2.status_code == 200
    assert r2.json()["choices"][0]["message"] == r1.json()["choices"][0]["message"]
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_image_over_the_media_budget_is_a_400(vserver):
    r = chat(vserver, image(128, 128, 2))          # 393216 bytes of pixel_values > 200000
    assert r.status_code == 400, r.text
    assert "media budget" in r.json()["error"]["message"]


def test_audio_part_is_still_a_400(vserver):
    r = chat(vserver, {"type": "input_audio", "input_audio": {}})
    assert r.status_code == 400 and "input_audio" in r.json()["error"]["message"]


def test_responses_input_image_answers_like_chat_and_lists_its_item(vserver):
    """The Responses API's ``input_image`` part takes the chat path's image preparation: the same
    answer as chat completions for the same image and text, and ``input_items`` lists the part."""
    url = data_url(png(64, 96, 1))
    body = {"model": "x", "max_output_tokens": 6, "temperature": 0,
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": url}]}]}
    r = httpx.post(f"{vserver}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["output"][0]["content"][0]["text"]
    assert text == chat(vserver, image(64, 96, 1)).json()["choices"][0]["message"]["content"]
    items = httpx.get(f"{vserver}/v1/responses/{r.json()['id']}/input_items", timeout=30).json()["data"]
    assert items[0]["content"][1] == {"type": "input_image", "image_url": url}
