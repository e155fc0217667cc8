"""Bounds on one request body, checked right after decoding (``frontend/bounds.py``): names and
ids, every free-text field alone and together against the context, JSON values, media left to
their own limits — and, over HTTP, the 10 MB fields of the issue refused before any rendering."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from ninfer.frontend.bounds import BodyBounds, check_body, decode_checked
from ninfer.frontend.render import ChatTokenizer
from ninfer.frontend.server import Server
from tests.frontend.scripted import ScriptedEngine, running

B = BodyBounds(max_text_chars=1000, max_context=100, max_values=200, max_numbers=500)


def _msgs(*contents) -> list[dict]:
    return [{"role": "user", "content": c} for c in contents]


@pytest.mark.parametrize("body,status,param,needle", [
    ({"tools": [{"type": "function", "function": {"name": "f" * 300}}]}, 400, "tools[0].function.name",
     "300 characters: at most 256"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c" * 257, "function": {"name": "f"}}]}]}, 400,
     "messages[0].tool_calls[0].id", "257 characters"),
    ({"tools": [{"function": {"name": "f", "description": "d" * 1001}}]}, 400, "tools[0].function.description",
     "1001 characters: at least 100 tokens"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "a" * 2000}}]}]},
     400, "messages[0].tool_calls[0].function.arguments", "2000 characters"),
    ({"instructions": "i" * 1500, "input": "x"}, 400, "instructions", "more than this engine's max_context of 100"),
    ({"messages": _msgs("a" * 600, "b" * 600)}, 400, None, "the request's text has 1200 characters"),
    ({"tools": [{"function": {"name": "f", "parameters": {"properties": {"x": {"description": "p" * 1200}}}}}]},
     400, "tools[0].function.parameters.properties.x.description", "1200 characters"),
    ({"messages": _msgs(*["x"] * 150)}, 413, None, "too many JSON values"),
    ({"prompt": list(range(600))}, 413, None, "500 numbers"),
], ids=["function-name", "tool-call-id", "tool-description", "tool-arguments", "instructions", "total-text",
        "tool-parameters", "values", "numbers"])
def test_each_bound_is_named_in_its_refusal(body, status, param, needle):
    r = check_body(body, B)
    assert r is not None and r.status == status and r.param == param and needle in r.message, r


def test_media_payloads_are_not_text_and_bodies_within_bounds_pass():
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                                               "A" * 50_000}},
                                         {"type": "text", "text": "what is it"}]}
    assert check_body({"messages": [image], "prompt": list(range(400))}, B) is None
    anthropic = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "B" * 50_000}}
    assert check_body({"messages": [{"role": "user", "content": [anthropic]}]}, B) is None
    hidden = {"properties": {"data": {"description": {"k%d" % i: "v" for i in range(300)}}}}
    assert check_body({"tools": [{"function": {"name": "f", "parameters": hidden}}]}, B).status == 413


def test_malformed_and_deep_bodies_are_refusals():
    assert decode_checked(b'{"a": ', B, trim=False)[1][1].message.startswith("malformed JSON")
    deep = b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    body, refusal = decode_checked(deep, BodyBounds(max_text_chars=10, max_context=10, max_values=10 ** 6), trim=False)[1]
    assert body is None and "nested too deeply" in refusal.message


@pytest.fixture(scope="module")
def bounded(tiny_model):
    engine = ScriptedEngine(ChatTokenizer(tiny_model))
    with running(Server(engine, "tiny")) as base:
        yield engine, base


@pytest.mark.parametrize("name,path,body,param", [
    ("tool-description", "/v1/chat/completions",
     {"messages": _msgs("hi"), "tools": [{"type": "function", "function": {"name": "f", "description": "lorem " * 1_700_000}}]},
     "tools[0].function.description"),
    ("tool-arguments", "/v1/chat/completions",
     {"messages": [*_msgs("hi"), {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": "a b " * 2_500_000})}}]},
                   {"role": "tool", "tool_call_id": "c", "content": "ok"}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("instructions", "/v1/responses", {"input": "hi", "instructions": "lorem " * 1_700_000}, "instructions"),
    ("tokenize", "/tokenize", {"prompt": "lorem " * 1_700_000}, "prompt"),
], ids=lambda x: x if isinstance(x, str) and not x.startswith("/") else "")
def test_ten_megabyte_fields_are_refused_before_any_rendering(bounded, name, path, body, param):
    """The issue's cases: each 10 MB field is a 400 naming it, decided in the helper process (the
    body is over 1 MiB) before any template or tokenizer runs (the scripted engine sees nothing)."""
    engine, base = bounded
    before = len(engine.handles)
    data = json.dumps(body).encode()
    assert len(data) > 10_000_000
    t0 = time.monotonic()
    r = httpx.post(base + path, content=data, headers={"content-type": "application/json"}, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["code"] == "context_length_exceeded", r.text[:300]
    assert "max_context of 4096" in err["message"] and len(engine.handles) == before
    assert time.monotonic() - t0 < 30


def test_a_large_body_of_many_values_is_a_413(bounded):
    _, base = bounded
    data = json.dumps({"messages": _msgs(*["hi"] * 100_000)}).encode()
    r = httpx.post(base + "/v1/chat/completions", content=data, headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_values"
