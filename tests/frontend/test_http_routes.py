"""The routes issue 32 added (item 6): Anthropic's /v1/messages (request and stream shapes, text,
tools, tool results, images, its error shape; through the same exact-reuse path), Responses'
background mode and cancel, /ping, /load, /openapi.json and /docs, and vLLM's metric families."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from ninfer.frontend import anthropic as A
from ninfer.frontend.render import ChatTokenizer
from ninfer.frontend.server import Server
from tests.frontend.conftest import KEY, scrape
from tests.frontend.scripted import OPEN_GATE, ScriptedEngine, running

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"name": "get_weather", "description": "the weather", "input_schema": {"type": "object"}}]
HDR = {"x-api-key": "k", "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def routed(tiny_model):
    engine = ScriptedEngine(ChatTokenizer(tiny_model))
    with running(Server(engine, "tiny", api_key="k")) as base:
        yield engine, base


def _msg(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/messages", json={"model": "tiny", "max_tokens": 64, **body}, headers=HDR, timeout=30)


def _events(base: str, **body) -> list[tuple[str, dict]]:
    out = []
    with httpx.stream("POST", f"{base}/v1/messages", json={"model": "tiny", "max_tokens": 64, "stream": True,
                                                            **body}, headers=HDR, timeout=30) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == kind
                out.append((kind, data))
    return out


# ---- Anthropic messages --------------------------------------------------------------------------

def test_messages_text_and_stream(routed):
    _, base = routed
    r = _msg(base, system="be brief", messages=[{"role": "user", "content": "hello there"}])
    m = r.json()
    assert r.status_code == 200 and m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["content"] == [{"type": "text", "text": "hello there"}] and m["stop_reason"] == "end_turn"
    assert set(m["usage"]) >= {"input_tokens", "output_tokens", "cache_read_input_tokens"}
    ev = _events(base, messages=[{"role": "user", "content": [{"type": "text", "text": "hello there"}]}])
    kinds = [k for k, _ in ev]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-2:] == ["message_delta",
                                                                                         "message_stop"]
    assert "".join(d["delta"]["text"] for k, d in ev if k == "content_block_delta") == "hello there"
    assert ev[-2][1]["delta"]["stop_reason"] == "end_turn" and ev[-2][1]["usage"]["output_tokens"] > 0
    # message_start already says how long the prompt is (as the same request without streaming)
    same = _msg(base, messages=[{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]).json()
    assert ev[0][1]["message"]["usage"]["input_tokens"] == \
        same["usage"]["input_tokens"] + same["usage"]["cache_read_input_tokens"] > 0


def test_messages_tool_use_tool_result_and_stop_sequences(routed):
    _, base = routed
    m = _msg(base, tools=TOOLS, messages=[{"role": "user", "content": "Checking." + CALL}]).json()
    assert m["stop_reason"] == "tool_use" and m["content"][0] == {"type": "text", "text": "Checking."}
    use = m["content"][1]
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and use["input"] == {"city": "Paris"}
    assert use["id"].startswith("toolu_")
    ev = _events(base, tools=TOOLS, messages=[{"role": "user", "content": CALL}])
    starts = [d["content_block"] for k, d in ev if k == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for k, d in ev if k == "content_block_delta"
                      and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"} and ev[-2][1]["delta"]["stop_reason"] == "tool_use"
    follow = [{"role": "user", "content": "weather?"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": use["id"], "name": "get_weather",
                                                 "input": {"city": "Paris"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny. Done"}]}]
    m = _msg(base, tools=TOOLS, messages=follow, stop_sequences=[". D"]).json()
    assert m["content"] == [{"type": "text", "text": "sunny"}]
    assert m["stop_reason"] == "stop_sequence" and m["stop_sequence"] == ". D"


def test_messages_errors_are_in_anthropics_shape(routed):
    _, base = routed
    r = httpx.post(f"{base}/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                   headers=HDR, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
                   timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = _msg(base, messages=[{"role": "user", "content": "x"}], tool_choice={"type": "tool", "name": "nope"},
             tools=TOOLS)
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def test_messages_tool_choice_any_and_tool_reach_the_engine_as_the_tool_call_grammar(routed):
    """Anthropic's ``any`` / ``tool`` are chat's ``required`` / named: the engine gets the
    tool-call grammar (so the call is always made, no verification afterwards);
    ``disable_parallel_tool_use`` allows one call only; ``auto`` constrains nothing."""
    engine, base = routed
    m = _msg(base, tools=TOOLS, tool_choice={"type": "any"}, messages=[{"role": "user", "content": CALL}]).json()
    assert m["stop_reason"] == "tool_use" and m["content"][0]["name"] == "get_weather"
    many = engine.kwargs[-1]["structured"]
    assert many.kind == "tool_calls"
    _msg(base, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
         messages=[{"role": "user", "content": CALL}])
    one = engine.kwargs[-1]["structured"]
    assert one.kind == "tool_calls" and one.grammar != many.grammar
    _msg(base, tools=TOOLS, tool_choice={"type": "auto"}, messages=[{"role": "user", "content": CALL}])
    assert "structured" not in engine.kwargs[-1]


def test_messages_convert_to_the_chat_input():
    req = A.convert({"max_tokens": 5, "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
                     "tools": TOOLS, "tool_choice": {"type": "any"},
                     "messages": [{"role": "user", "content": [
                         {"type": "text", "text": "look"},
                         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "calling"},
                                                           {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                            "input": {"city": "Oslo"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
                                                      {"type": "text", "text": "and now?"}]}]})
    messages, tools, choice = A.chat_input(req)
    assert messages == [
        {"role": "system", "content": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "rain"},
        {"role": "user", "content": "and now?"}]
    assert tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                                        "description": "the weather"}}]
    assert choice == "required"


def test_a_tool_results_breakpoint_and_the_image_paths_carry_over():
    """A tool_result's cache_control (on the block or its last text block) becomes the tool
    message's; each image's chat (message, part) maps back to its block for error messages."""
    png = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}
    eph = {"type": "ephemeral"}
    req = A.convert({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "a", "cache_control": eph},
        {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "b"},
                                                                 {"type": "text", "text": "c", "cache_control": eph}]},
        {"type": "text", "text": "see"}, png]}]})
    images: dict = {}
    messages, _, _ = A.chat_input(req, images)
    assert messages[:2] == [{"role": "tool", "tool_call_id": "t1", "content": "a", "cache_control": eph},
                            {"role": "tool", "tool_call_id": "t2", "content": "bc", "cache_control": eph}]
    assert images == {(2, 1): "messages[0].content[3]"}
    assert A.request_path("messages[2].content[1].image_url: too big", images) == (
        "messages[0].content[3].source: too big", "messages[0].content[3].source")
    assert A.request_path("messages[0].content[0]: other", images) == ("messages[0].content[0]: other", None)


# ---- Responses background and cancel ------------------------------------------------------------------

def test_a_background_response_is_cancelled(routed):
    engine, base = routed
    gate = threading.Event()
    engine.gate = gate                                  # the engine holds it before its first token
    try:
        auth = {"authorization": "Bearer k"}
        r = httpx.post(f"{base}/v1/responses", json={"input": "write a lot", "background": True}, headers=auth,
                       timeout=30).json()
        assert r["status"] == "in_progress" and r["background"] is True
        assert httpx.get(f"{base}/v1/responses/{r['id']}", headers=auth, timeout=30).json()["status"] == "in_progress"
        c = httpx.post(f"{base}/v1/responses/{r['id']}/cancel", headers=auth, timeout=30)
        assert c.status_code == 200 and c.json()["status"] == "cancelled" and engine.handles[-1].cancelled
        assert httpx.get(f"{base}/v1/responses/{r['id']}", headers=auth, timeout=30).json()["status"] == "cancelled"
        again = httpx.post(f"{base}/v1/responses/{r['id']}/cancel", headers=auth, timeout=30)
        assert again.status_code == 400 and "only a background response in progress" in again.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/responses/resp_nope/cancel", headers=auth, timeout=30).status_code == 404
    finally:
        engine.gate = OPEN_GATE
        gate.set()


def test_a_background_response_completes_and_is_stored(routed):
    _, base = routed
    auth = {"authorization": "Bearer k"}
    r = httpx.post(f"{base}/v1/responses", json={"input": "short one", "background": True}, headers=auth,
                   timeout=30).json()
    deadline = time.monotonic() + 20
    while (got := httpx.get(f"{base}/v1/responses/{r['id']}", headers=auth, timeout=30).json())["status"] \
            == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got["status"] == "completed" and got["output"][0]["content"][0]["text"] == "short one"
    bad = httpx.post(f"{base}/v1/responses", json={"input": "x", "background": True, "store": False}, headers=auth,
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "background"


# ---- probes and the API description -------------------------------------------------------------------

def test_ping_load_openapi_and_docs(routed):
    engine, base = routed
    assert httpx.get(f"{base}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{base}/ping", timeout=10).status_code == 200
    assert httpx.get(f"{base}/load", timeout=10).json() == {"server_load": 0}
    gate = threading.Event()
    engine.gate = gate
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", headers={"authorization": "Bearer k"}, timeout=30,
                          json={"messages": [{"role": "user", "content": "wait"}], "stream": True}) as s:
            assert s.status_code == 200
            assert httpx.get(f"{base}/load", timeout=10).json() == {"server_load": 1}
            gate.set()
            s.read()
    finally:
        engine.gate = OPEN_GATE
    assert httpx.get(f"{base}/load", timeout=10).json() == {"server_load": 0}
    spec = httpx.get(f"{base}/openapi.json", timeout=10).json()
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses/{response_id}/cancel", "/tokenize"):
        assert path in spec["paths"], path
    body = spec["paths"]["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/MessagesRequest"}
    assert "max_tokens" in spec["components"]["schemas"]["MessagesRequest"]["required"]
    assert "/openapi.json" in httpx.get(f"{base}/docs", timeout=10).text


# ---- the real engine: exact reuse through /v1/messages, vLLM's metric families ------------------------

def test_messages_reuse_the_previous_turn_exactly(server):
    """Two Anthropic turns over the tiny model: the second reads the first turn (its prompt and
    the model's own answer) from the cache, as /v1/chat/completions does."""
    hdr = {"x-api-key": KEY}
    turn = [{"role": "user", "content": [{"type": "text", "text": "tell me a story about a cat"}]}]
    first = httpx.post(f"{server}/v1/messages", headers=hdr, timeout=120,
                       json={"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": turn}).json()
    turn += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "and then?"}]
    second = httpx.post(f"{server}/v1/messages", headers=hdr, timeout=120,
                        json={"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": turn}).json()
    u1, u2 = first["usage"], second["usage"]
    assert u2["cache_read_input_tokens"] >= u1["input_tokens"] + u1["cache_read_input_tokens"] + u1["output_tokens"] - 1


def test_vllm_metric_families_are_exposed(server):
    httpx.post(f"{server}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=120,
               json={"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 4, "n": 2})
    fams = scrape(server)
    for name in ("vllm:request_time_per_output_token_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
                 "vllm:request_params_n", "vllm:iteration_tokens_total", "vllm:prompt_tokens_cached",
                 "vllm:cache_config_info", "ninfer_actor_restarts", "ninfer_request_failures",
                 "ninfer_requests_resubmitted"):
        assert name in fams, name
    counts = {s.name: s.value for s in fams["vllm:request_generation_tokens"].samples}
    assert counts["vllm:request_generation_tokens_count"] >= 2
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "64" and info["max_num_seqs"] == "2" and info["max_model_len"] == "1024"
    iters = {s.name: s.value for s in fams["vllm:iteration_tokens_total"].samples}
    assert iters["vllm:iteration_tokens_total_count"] > 0 and iters["vllm:iteration_tokens_total_sum"] > 0
