"""The HTTP layer against a scripted engine, over real HTTP with the official client: what the
tiny random model cannot be made to say — a tool call, a stop string split across tokens —
is scripted here (the last user message is the answer, tokenised with the real tokenizer and
streamed token by token), so streamed tool calls, stop-string hold-back, the tool_choice
grammar handed to the engine, reasoning splits and disconnect cancellation are pinned exactly."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from ninfer.frontend.render import ChatTokenizer
from ninfer.frontend.server import Server
from ninfer.frontend.streaming import ChoiceStream, partial_suffix
from tests.frontend.scripted import OPEN_GATE, ScriptedEngine, running

openai = pytest.importorskip("openai")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def scripted(tiny_model):
    engine = ScriptedEngine(ChatTokenizer(tiny_model))
    with running(Server(engine, "tiny")) as base:
        yield SimpleNamespace(engine=engine, base=base,
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0))


def _say(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _stream(client, **kw) -> tuple[str, list, list]:
    text, calls, reasons = "", [], []
    for ch in client.chat.completions.create(model="tiny", stream=True, **kw):
        for c in ch.choices:
            text += c.delta.content or ""
            calls += c.delta.tool_calls or []
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return text, calls, reasons


def test_a_partial_stop_match_never_leaks_into_the_stream(scripted):
    c = scripted.client
    r = c.chat.completions.create(model="tiny", messages=_say("JSON I[en the rest"), stop="I[en")
    text, _, reasons = _stream(c, messages=_say("JSON I[en the rest"), stop=["I[en"])
    assert r.choices[0].message.content == text == "JSON "
    assert reasons == ["stop"] and r.choices[0].finish_reason == "stop"
    tok = scripted.engine.tokenizer
    full = tok.encode("JSON I[en the rest")
    need = next(k for k in range(1, len(full) + 1) if "I[en" in tok.decode(full[:k]))
    assert r.usage.completion_tokens == need < len(full)
    assert scripted.engine.handles[-1].cancelled                    # the engine stops at the stop string


def test_a_stop_inside_a_many_token_event_counts_only_the_tokens_up_to_it(scripted):
    """Tokens can commit several per event (a prefill's first token with others, speculative
    decoding): the count still ends at the token that completed the stop string."""
    scripted.engine.chunk = 6
    try:
        r = scripted.client.chat.completions.create(model="tiny", messages=_say("JSON I[en the rest of it"),
                                                    stop="I[en")
    finally:
        scripted.engine.chunk = 1
    tok = scripted.engine.tokenizer
    full = tok.encode("JSON I[en the rest of it")
    need = next(k for k in range(1, len(full) + 1) if "I[en" in tok.decode(full[:k]))
    assert r.choices[0].message.content == "JSON " and r.usage.completion_tokens == need


def test_a_stop_prefix_that_never_completes_is_released_at_the_end(scripted):
    text, _, reasons = _stream(scripted.client, messages=_say("JSON I[e and more"), stop=["I[en"])
    assert text == "JSON I[e and more" and reasons == ["stop"]


def test_tool_calls_stream_as_delta_tool_calls(scripted):
    c = scripted.client
    script = "Let me check." + CALL
    text, calls, reasons = _stream(c, messages=_say(script), tools=TOOLS)
    assert text == "Let me check." and "<tool_call>" not in text
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and calls[0].function.arguments == '{"city": "Paris"}'
    assert reasons == ["tool_calls"]
    r = c.chat.completions.create(model="tiny", messages=_say(script), tools=TOOLS)
    msg = r.choices[0].message
    assert msg.content == "Let me check." and msg.tool_calls[0].function.name == "get_weather"
    assert r.choices[0].finish_reason == "tool_calls"


def test_tool_choice_required_and_named_constrain_the_answer(scripted):
    """``required`` and a named function reach the engine as the tool-call grammar (the engine
    draws only calls: tests/engine/test_structured.py, tests/frontend/test_http_structured.py) —
    no verification, no 422; named streams only the call; ``none`` renders no tools."""
    c = scripted.client
    r = c.chat.completions.create(model="tiny", messages=_say(CALL), tools=TOOLS, tool_choice="required")
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    sent = scripted.engine.kwargs[-1]["structured"]
    assert sent.kind == "tool_calls"
    named = {"type": "function", "function": {"name": "get_time"}}
    c.chat.completions.create(model="tiny", messages=_say(CALL), tools=TOOLS, tool_choice=named)
    assert scripted.engine.kwargs[-1]["structured"].kind == "tool_calls"
    assert scripted.engine.kwargs[-1]["structured"] != sent                      # only get_time's calls
    text, calls, _ = _stream(c, messages=_say("words " + CALL), tools=TOOLS,
                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert text == "" and calls[0].function.name == "get_weather"     # named: only the call is streamed
    r = c.chat.completions.create(model="tiny", messages=_say(CALL), tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert "structured" not in scripted.engine.kwargs[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_disconnect_cancels_the_request(scripted, stream):
    scripted.engine.delay = 0.05
    try:
        try:
            with httpx.Client(timeout=0.3) as h:
                with h.stream("POST", f"{scripted.base}/v1/chat/completions",
                              json={"messages": _say("word " * 100), "stream": stream}) as r:
                    for _ in r.iter_bytes():
                        break
        except httpx.TimeoutException:
            pass
        handle = scripted.engine.handles[-1]
        deadline = time.monotonic() + 3
        while not handle.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert handle.cancelled and handle.sent < len(handle.ids)
    finally:
        scripted.engine.delay = 0.002


def test_n_choices_each_end_at_their_stop(scripted):
    r = scripted.client.chat.completions.create(model="tiny", messages=_say("one. two. three."), n=3, stop=". t")
    assert [ch.message.content for ch in r.choices] == ["one", "one", "one"]
    assert r.usage.completion_tokens == 3 * (r.usage.completion_tokens // 3)


# ---- the choice stream on its own ---------------------------------------------------------------------

def test_partial_suffix():
    assert partial_suffix("abc I[", ["I[en"]) == 2
    assert partial_suffix("abc I[en", ["I[en"]) == 0            # a whole match is the scan's, not held
    assert partial_suffix("abc", ["zz", "c"]) == 0
    assert partial_suffix("xx<tool", ["<tool_call>"]) == 5


def test_a_stop_split_across_many_tokens_counts_the_completing_token(tiny_model):
    tok = ChatTokenizer(tiny_model)
    ids = tok.encode("alpha beta gamma delta")
    for stop in ("beta g", "a d", "ta", "gamma delta"):
        s = ChoiceStream(tok.decode, [stop], False)
        out = "".join(s.feed([t]).content for t in ids)
        want = "alpha beta gamma delta"
        assert out == want[:want.find(stop)], stop
        assert "".join(tok.decode(ids[:s.stopped_at])).find(stop) >= 0
        assert stop not in tok.decode(ids[:s.stopped_at - 1])


def test_responses_stream_a_function_call_as_its_own_item(scripted):
    """Responses: a tool call is a function_call output item (streamed with its arguments
    events), the text before it a message item; the non-stream object says the same."""
    c = scripted.client
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    kinds, args, final = [], "", None
    for ev in c.responses.create(model="tiny", input="Let me check." + CALL, tools=tools, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.function_call_arguments.done":
            args = ev.arguments
        if ev.type == "response.completed":
            final = ev.response
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.done")
    assert args == '{"city": "Paris"}' and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["message", "function_call"]
    r = c.responses.create(model="tiny", input="Let me check." + CALL, tools=tools)
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output[1].name == "get_weather" and r.output[0].content[0].text == "Let me check."


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": _say("hello there"), "stream": True, "n": 2}),
    ("/v1/completions", {"prompt": "hello there", "stream": True, "echo": True, "max_tokens": 4}),
], ids=["chat", "completions-echo"])
def test_a_stream_opens_with_its_first_token_not_at_acceptance(scripted, path, body):
    """The role chunk (chat) and the echo (completions) go out with the first token, as vLLM
    sends them: a client timing its first chunk (`vllm bench serve`) then measures the real
    TTFT, not the acceptance. Headers still come at once (the request was accepted)."""
    gate = threading.Event()
    scripted.engine.gate = gate
    lines: list[tuple[float, str]] = []
    try:
        with httpx.Client(timeout=10) as h, h.stream("POST", f"{scripted.base}{path}", json=body) as r:
            assert r.status_code == 200

            def read():
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append((time.monotonic(), line))
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            time.sleep(0.4)
            assert lines == []                                  # nothing before the first token
            opened = time.monotonic()
            gate.set()
            reader.join(timeout=10)
    finally:
        scripted.engine.gate = OPEN_GATE
    chunks = [json.loads(line[5:]) for _, line in lines if line != "data: [DONE]"]
    assert lines[0][0] >= opened and lines[-1][1] == "data: [DONE]"
    if path == "/v1/chat/completions":
        for i in (0, 1):
            mine = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == i]
            assert mine[0] == {"role": "assistant", "content": ""} and "role" not in str(mine[1:])
            assert "".join(d.get("content") or "" for d in mine) == "hello there"
    else:
        assert chunks[0]["choices"][0]["text"] == "hello there"            # the echo, with the first token


@pytest.mark.parametrize("kind", ["worker_lost", "controller_lost", "device_error"])
def test_an_engine_loss_is_a_503_with_its_kind_and_a_retry_hint(scripted, kind):
    """A request a lost worker or controller (or a device error) ended mid-generation: a 503
    carrying the kind, ``code: retryable`` and ``Retry-After`` (non-stream), the same error
    object as the stream's last event; never a 500."""
    from ninfer.errors import LOST_KINDS, RETRY_HINT, ErrorKind, lost_error
    from ninfer.protocol import Failure
    kind = ErrorKind(kind)
    failure = lost_error(kind, "it went") if kind in LOST_KINDS else Failure(kind, "it went" + RETRY_HINT)
    scripted.engine.error = failure.as_dict()             # Output.error: the public dict
    try:
        r = httpx.post(f"{scripted.base}/v1/chat/completions", json={"messages": _say("some words")}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert err["type"] == kind and err["code"] == "retryable" and "retry the request" in err["message"]
        with httpx.stream("POST", f"{scripted.base}/v1/chat/completions", timeout=30,
                          json={"messages": _say("some words"), "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"] == err | {"message": events[-1]["error"]["message"]}
        assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events)
    finally:
        scripted.engine.error = None


# ---- reasoning (the Qwen3 parser: the tiny template knows <think>, so `auto` turns it on) ------------

THOUGHT = "<think>\nThe user says hi. A tool? <tool_call>no</tool_call>\n</think>\n\nHello there!"


def test_reasoning_content_apart_from_the_answer_stream_and_not(scripted):
    c = scripted.client
    r = c.chat.completions.create(model="tiny", messages=_say(THOUGHT))
    msg = r.choices[0].message
    assert msg.content == "Hello there!" and not msg.tool_calls          # no call parsed from thinking
    assert msg.model_extra["reasoning_content"] == "The user says hi. A tool? <tool_call>no</tool_call>"
    assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"]       # vLLM's newer name
    thought, text = "", ""
    for ch in c.chat.completions.create(model="tiny", messages=_say(THOUGHT), stream=True):
        for choice in ch.choices:
            thought += choice.delta.model_extra.get("reasoning_content") or ""
            text += choice.delta.content or ""
    assert (thought, text) == (msg.model_extra["reasoning_content"], "Hello there!")
    plain = c.chat.completions.create(model="tiny", messages=_say("No thinking."))
    assert plain.choices[0].message.content == "No thinking."
    assert plain.choices[0].message.model_extra["reasoning_content"] is None


def test_include_reasoning_false_leaves_the_reasoning_out(scripted):
    r = scripted.client.chat.completions.create(model="tiny", messages=_say(THOUGHT),
                                                extra_body={"include_reasoning": False})
    assert r.choices[0].message.content == "Hello there!"
    assert "reasoning_content" not in r.choices[0].message.model_extra


def test_a_tool_call_after_the_thinking_is_parsed(scripted):
    r = scripted.client.chat.completions.create(model="tiny", messages=_say("<think>call it</think>" + CALL),
                                                tools=TOOLS)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "call it" and m.tool_calls[0].function.name == "get_weather"


def test_responses_carry_a_reasoning_item(scripted):
    c = scripted.client
    r = c.responses.create(model="tiny", input=THOUGHT)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text.startswith("The user says hi.") and r.output_text == "Hello there!"
    tok = scripted.engine.tokenizer
    ids = tok.encode(THOUGHT)
    end = tok.tokenizer.token_to_id("</think>")
    assert r.usage.output_tokens_details.reasoning_tokens == ids.index(end) + 1
    kinds, deltas = [], ""
    for ev in c.responses.create(model="tiny", input=THOUGHT, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.reasoning_text.delta":
            deltas += ev.delta
        if ev.type == "response.completed":
            final = ev.response
    assert deltas == r.output[0].content[0].text
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output[0].id != final.output[1].id
    # the reasoning goes back as an input item (and into the stored history)
    again = c.responses.create(model="tiny", input=[
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "reasoning", "id": r.output[0].id, "summary": [],
         "content": [{"type": "reasoning_text", "text": "The user says hi."}]},
        {"type": "message", "role": "assistant", "content": "Hello there!"},
        {"type": "message", "role": "user", "content": "No thinking now."}])
    assert again.output_text == "No thinking now."
