"""End to end with the official `openai` client against `ninfer serve`, started by the test on a
free loopback port: multi-turn reuse, an agent loop with a tool round trip, streaming,
Responses with previous_response_id, and every bad input with its status code followed by a
successful request."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.frontend.conftest import KEY, metric, reset_cache, scrape
from tests.serving import free_port as _free_port
from tests.serving import wait_up as _wait_up

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)


def test_four_turn_chat_reuses_each_previous_turn(server, client):
    reset_cache(server)
    msgs = [{"role": "system", "content": "Be brief."}]
    prev = None
    for turn in range(4):
        msgs.append({"role": "user", "content": f"Question {turn}: tell me something."})
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
        if prev is not None:   # turn n+1 reuses turn n's prompt and output (all but its last token)
            assert r.usage.prompt_tokens_details.cached_tokens >= prev.prompt_tokens + prev.completion_tokens - 1
        prev = r.usage
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})


def test_agent_loop_with_a_tool_call_and_result(server, client):
    reset_cache(server)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r1 = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    assert r1.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # the agent normalises the call, runs the tool and sends the result back
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 14, "sky": "rain"}'}]
    r2 = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    # the rewritten history still reuses turn 1's restore point: C, the end of the user content
    # (only "<|im_end|>\n<|im_start|>assistant\n" — 5 template tokens — are recomputed)
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens - 5
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens


def test_streaming(server, client):
    reset_cache(server)        # the shared server's cache may be full of larger cold points
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Stream please"}],
                                            max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, usage, reasons = "", None, []
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            reasons.append(ch.choices[0].finish_reason)
        if ch.usage:
            usage = ch.usage
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Stream please"}],
                                           max_tokens=9, temperature=0)
    assert text == again.choices[0].message.content
    assert usage.completion_tokens == 9 and reasons[-1] == "length"
    assert again.usage.prompt_tokens_details.cached_tokens > 0          # same prompt: exact reuse


_metric = metric


def test_reset_prefix_cache_empties_the_cache_only_while_nothing_is_open(server, client):
    """vLLM's POST /reset_prefix_cache: after it nothing is reused; while a request is open it is
    a 409 and nothing is released; it needs the API key."""
    msgs = [{"role": "user", "content": "Reset me, then reuse me."}]
    reset_cache(server)
    a = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    b = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert b.usage.prompt_tokens_details.cached_tokens > 0
    reset_cache(server)
    c = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert c.usage.prompt_tokens_details.cached_tokens == 0
    assert a.choices[0].message.content == b.choices[0].message.content == c.choices[0].message.content
    assert httpx.post(f"{server}/reset_prefix_cache", timeout=30).status_code == 401
    bad = httpx.post(f"{server}/reset_prefix_cache?tier=host", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tier"
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A long one."}],
                                            max_tokens=400, temperature=0, stream=True)
    next(iter(stream))                                   # open: its first chunk came
    r = httpx.post(f"{server}/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 409 and "open" in r.json()["error"]["message"]
    for _ in stream:
        pass
    d = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert d.usage.prompt_tokens_details.cached_tokens > 0        # c's point survived the refused reset


def test_n_choices_share_one_computation_of_the_prompt(server, client):
    """n > 1: one request per choice, submitted together — the prompt is computed once and the
    other choices wait for its point (issue: shared prefixes computed once); greedy choices are
    identical; streamed chunks carry each choice's index."""
    msgs = [{"role": "user", "content": "count the pebbles on the long quiet beach " * 6}]
    waits, saved = _metric(server, "ninfer_cache_pending_waits_total"), _metric(server, "ninfer_cache_pending_saved_tokens_total")
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert 2 <= r.usage.completion_tokens <= 8              # both choices counted
    assert _metric(server, "ninfer_cache_pending_waits_total") >= waits + 1
    assert _metric(server, "ninfer_cache_pending_saved_tokens_total") > saved
    text = {0: "", 1: ""}
    finished = set()
    for ev in client.chat.completions.create(model="tiny", messages=msgs + [{"role": "user", "content": "again"}],
                                             max_tokens=4, n=2, temperature=0, stream=True):
        for c in ev.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and text[0] == text[1]


def test_responses_with_previous_response_id(server, client):
    reset_cache(server)
    r1 = client.responses.create(model="tiny", input="Hello there", max_output_tokens=8, temperature=0)
    assert r1.id.startswith("resp_") and r1.usage.output_tokens == 8
    r2 = client.responses.create(model="tiny", input="And then?", previous_response_id=r1.id,
                                 max_output_tokens=8, temperature=0)
    assert r2.usage.input_tokens > r1.usage.input_tokens + 8
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + 8 - 1
    assert isinstance(r2.output_text, str)


def test_models_health_metrics(server, client, tiny_model):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_metrics_parse_into_typed_families_after_real_traffic(server, client):
    """/metrics through prometheus_client's parser: typed families, vLLM's names, the
    model_name label on every sample, histograms with buckets that count the traffic."""
    before = metric(server, "vllm:time_to_first_token_seconds_count", model_name="tiny")
    gen = metric(server, "vllm:generation_tokens_total")
    for i in range(3):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"metrics {i}"}],
                                       max_tokens=4, temperature=0)
    fams = scrape(server)
    kinds = {name: f.type for name, f in fams.items()}
    for name, kind in [("vllm:prefix_cache_queries", "counter"), ("vllm:prefix_cache_hits", "counter"),
                       ("vllm:num_preemptions", "counter"), ("vllm:prompt_tokens", "counter"),
                       ("vllm:generation_tokens", "counter"), ("vllm:num_requests_running", "gauge"),
                       ("vllm:num_requests_waiting", "gauge"), ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:time_to_first_token_seconds", "histogram"), ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"), ("vllm:request_queue_time_seconds", "histogram"),
                       ("ninfer_replay_tokens", "counter"), ("ninfer_cache_hit_losses_by_cause", "counter"),
                       ("ninfer_pauses", "counter"), ("ninfer_bytes_h2d", "counter"), ("ninfer_pool_total", "gauge"),
                       ("ninfer_host_largest_free_bytes", "gauge"), ("ninfer_controller_cpu_seconds", "counter")]:
        assert kinds.get(name) == kind, (name, kinds.get(name))
    assert all(s.labels.get("model_name") == "tiny" for f in fams.values() for s in f.samples)
    ttft = fams["vllm:time_to_first_token_seconds"]
    buckets = [s for s in ttft.samples if s.name.endswith("_bucket")]
    assert len(buckets) > 10 and buckets[-1].labels["le"] == "+Inf"
    assert [b.value for b in buckets] == sorted(b.value for b in buckets)          # cumulative
    assert metric(server, "vllm:time_to_first_token_seconds_count", model_name="tiny") == before + 3
    assert metric(server, "vllm:generation_tokens_total") == gen + 12
    assert {s.labels["route"] for s in fams["ninfer_pauses"].samples} == {"snapshot", "replay"}


BAD = [
    ("malformed-json", "/v1/chat/completions", b"{not json", 400, "malformed JSON"),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("too-long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]}, 400,
     "max_context"),
    ("five-markers", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": f"part {i}.\n", "cache_control": {"type": "ephemeral"}} for i in range(5)]}]},
     400, "at most 4"),
    ("bad-temperature", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "temperature": -1}, 400, "temperature"),
    ("bad-top-p", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 7}, 400, "top_p"),
    ("bad-n", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n must be"),
    ("unknown-previous", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}, 404, "not found"),
    ("body-too-large", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2100000}]}, 413,
     "exceeds"),
]


@pytest.mark.parametrize("name,path,body,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status_and_the_engine_keeps_serving(server, client, name, path, body, status, needle):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}{path}", content=data, timeout=60,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still there?"}],
                                        max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_api_key_is_required(server):
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_engine_down_is_503(tiny_model):
    """In-process server whose engine has shut down answers 503 (and /health says so)."""
    from starlette.testclient import TestClient

    import ninfer
    from ninfer.frontend.server import Server
    eng = ninfer.Engine.start(tiny_model, config={"max_concurrency": 1, "max_context": 256}, transport="inproc")
    app = Server(eng, "tiny").app
    eng.shutdown()
    with TestClient(app) as tc:
        r = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and "shut down" in r.json()["error"]["message"]
        assert tc.get("/health").status_code == 503


@pytest.mark.ray
@pytest.mark.slow
def test_serve_through_the_ray_actors(tiny_model):
    """`ninfer serve` with the default Ray transport (a private local deployment)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "--model", tiny_model, "--port", str(port),
                             "--deployment", "http-ray", "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_up(proc, base)
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        msgs = [{"role": "user", "content": "hello over ray"}]
        r1 = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "again"}]
        r2 = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens + 6 - 1
        # a grammar, template options and the prompt's ids cross the actors too
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["n"], "additionalProperties": False}
        r3 = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=1.0, seed=1,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "n", "schema": schema}},
                                       extra_body={"return_token_ids": True,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
        assert 0 <= json.loads(r3.choices[0].message.content)["n"] <= 99
        tail = httpx.post(f"{base}/detokenize", json={"tokens": r3.model_extra["prompt_token_ids"][-6:]}).json()
        assert tail["prompt"].endswith("<think>\n\n</think>\n\n")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
