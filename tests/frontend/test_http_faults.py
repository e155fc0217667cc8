"""A real forward error over HTTP (issue 32): ``ninfer serve`` started as a user starts it, with
the documented fault injection in its ``--config`` file (``[[faults]] kind = "forward_error"``),
so the engine's own forward call fails — no scripted engine. The request that met it is a 503
with ``Retry-After: 1``, ``error.type == "device_error"`` and ``code: retryable`` (a stream: the
same error object as its last event, after the tokens it had), on the OpenAI and the Anthropic
routes; a request queued beside it gets the oracle's answer; /metrics counts the failures by kind.

The fault's opportunities are forward calls, counted from the server's start: with one lane
every call serves one request, so one test drives the server through its phases in order — the
stream is alone for its first calls (its prefill and a few decode steps); the 6th call fails it,
the 7th an Anthropic request, the 8th one of two requests sent at once.
"""

from __future__ import annotations

import json
import threading

import httpx

import ninfer
from tests.frontend.conftest import metric
from tests.serving import serving

CONFIG = """max_concurrency = 1
max_context = 512
dtype = "float64"

[context_cache]
host_capacity_bytes = 16777216

[[faults]]
kind = "forward_error"
skip = 5
count = 3
"""


def _chat(text: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **extra}


def _retryable(err: dict) -> None:
    assert err["type"] == "device_error" and err["code"] == "retryable", err
    assert "injected forward error" in err["message"], err


def _stream_fails_after_its_tokens(faulty: str) -> None:
    """Calls 1-5 serve the stream (its prefill, then decode steps); the 6th fails: the tokens it
    had arrive, then the error object, then ``[DONE]``."""
    with httpx.stream("POST", f"{faulty}/v1/chat/completions", json=_chat("stream one", stream=True),
                      timeout=120) as s:
        assert s.status_code == 200
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    _retryable(events[-1]["error"])
    assert all("error" not in e for e in events[:-1])
    assert any(e["choices"][0]["delta"].get("content") for e in events[:-1])      # the tokens it had


def _anthropic_is_a_503_in_its_shape(faulty: str) -> None:
    r = httpx.post(f"{faulty}/v1/messages", timeout=120, json={
        "model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
    assert body["error"]["ninfer_type"] == "device_error" and "injected forward error" in body["error"]["message"]


def _the_failed_one_is_a_503_and_the_one_beside_it_is_exact(faulty: str, tiny_model: str) -> None:
    """Two requests at once on one lane: the one whose forward call fails is a 503 with its
    kind and a retry hint; the other gets exactly the oracle's tokens."""
    out: dict = {}

    def send(k: str) -> None:
        out[k] = httpx.post(f"{faulty}/v1/chat/completions", timeout=120,
                            json=_chat(f"request {k}", return_token_ids=True))
    threads = [threading.Thread(target=send, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in out.values() if r.status_code != 200]
    served = [r for r in out.values() if r.status_code == 200]
    assert len(failed) == len(served) == 1, [(r.status_code, r.text) for r in out.values()]
    r = failed[0]
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    _retryable(r.json()["error"])
    body = served[0].json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["token_ids"] == ninfer.reference_generate(
        tiny_model, body["prompt_token_ids"], max_tokens=8, dtype="float64", ignore_eos=True)


def test_forward_errors_over_http(tiny_model, tmp_path):
    with serving(tiny_model, tmp_path, CONFIG, "--served-model-name", "tiny") as (base, _):
        _stream_fails_after_its_tokens(base)
        _anthropic_is_a_503_in_its_shape(base)
        _the_failed_one_is_a_503_and_the_one_beside_it_is_exact(base, tiny_model)
        # the server serves on, and /metrics counts the three by kind
        r = httpx.post(f"{base}/v1/chat/completions", json=_chat("after the faults"), timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        assert metric(base, "ninfer_request_failures_total", kind="device_error") == 3
