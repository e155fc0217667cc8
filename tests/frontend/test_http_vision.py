"""Image parts over HTTP on the tiny vision model: answered (and re-sent: a real cache hit),
through chat completions, Responses and Anthropic's /v1/messages; an image over the media budget
and an audio part are clear 400s. (A text model's image part: test_http_hardening.)"""

from __future__ import annotations

import base64
import json

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


# ---- Anthropic's /v1/messages: an image block takes the chat path ------------------------------------

def anthropic_image(w: int, h: int, seed: int) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(png(w, h, seed)).decode()}}


def messages(base: str, *turns: dict, stream: bool = False) -> dict:
    """A /v1/messages answer: (text, usage) of the message, or of its events when streamed."""
    body = {"model": "x", "max_tokens": 6, "temperature": 0, "messages": list(turns), "stream": stream}
    if not stream:
        r = httpx.post(f"{base}/v1/messages", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return {"text": "".join(b["text"] for b in r.json()["content"] if b["type"] == "text"),
                "usage": r.json()["usage"]}
    text, usage = "", None
    with httpx.stream("POST", f"{base}/v1/messages", json=body, timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] != "error", ev
                if ev["type"] == "content_block_delta":
                    text += ev["delta"]["text"]
                elif ev["type"] == "message_delta":
                    usage = ev["usage"]
    return {"text": text, "usage": usage}


def see(*images: dict) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": "see"}, *images]}


def test_anthropic_image_answers_like_chat_and_its_resend_reuses_past_the_image(vserver):
    """An Anthropic ``image`` block (base64 PNG) is answered as chat completions answers the same
    image and text; re-sent, stream or not, it reuses the cached prefix past the image — more than
    the same text with another image can reuse, which stops before the image — and the next turn
    reuses the whole first prompt, image included (the exact-reuse path of chat)."""
    assert httpx.post(f"{vserver}/reset_prefix_cache", timeout=30).status_code == 200
    first = messages(vserver, see(anthropic_image(64, 96, 1)))
    assert first["usage"]["cache_read_input_tokens"] == 0
    prompt = first["usage"]["input_tokens"]
    other = messages(vserver, see(anthropic_image(64, 96, 3)))       # the same text, another image
    before_image = other["usage"]["cache_read_input_tokens"]
    again = messages(vserver, see(anthropic_image(64, 96, 1)), stream=True)
    assert again["text"] == first["text"]
    assert again["usage"]["cache_read_input_tokens"] > before_image, (again, other)
    assert again["usage"]["cache_read_input_tokens"] + again["usage"]["input_tokens"] == prompt
    turn = messages(vserver, see(anthropic_image(64, 96, 1)), {"role": "assistant", "content": first["text"]},
                    {"role": "user", "content": "and then?"})
    assert turn["usage"]["cache_read_input_tokens"] >= prompt, turn
    assert chat(vserver, image(64, 96, 1)).json()["choices"][0]["message"]["content"] == first["text"]


def _refused(base: str, *turns: dict) -> dict:
    r = httpx.post(f"{base}/v1/messages", timeout=60, json={"model": "x", "max_tokens": 4, "messages": list(turns)})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    return r.json()["error"]


def test_anthropic_images_refused_are_named_as_the_client_sent_them(vserver):
    """A url source is never fetched, a media type that is no image, an image inside a
    tool_result and an image that does not decode: each a 400 in Anthropic's shape naming the
    block of the request — also when a tool_result split the user turn into several chat
    messages (the preparation numbers those)."""
    url = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}}
    assert _refused(vserver, see(url))["message"].startswith(
        "messages[0].content[1].source.url: remote images are not fetched")
    pdf = {"type": "image", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    assert _refused(vserver, see(pdf))["message"].startswith(
        "messages[0].content[1].source.media_type: 'application/pdf' is not an image type")
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]}
    inner = {"type": "tool_result", "tool_use_id": "t1", "content": [anthropic_image(64, 96, 1)]}
    assert _refused(vserver, see(), call, {"role": "user", "content": [inner]})["message"].startswith(
        "messages[2].content[0].content[0]: an image inside a tool_result is not supported")
    broken = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "done"}
    err = _refused(vserver, see(), call, {"role": "user", "content": [result, {"type": "text", "text": "and"}, broken]})
    assert err["message"].startswith("messages[2].content[2].source: not an image that can be decoded"), err
