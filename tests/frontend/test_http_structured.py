"""Structured outputs through the real server and the official ``openai`` client, on the random
tiny model: a json_schema answer always parses and validates, a required / named tool_choice
always yields a valid call, and vLLM's ``structured_outputs`` (and the older ``guided_*`` names)
constrain chat and legacy completions alike; bad constraints are a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.frontend.conftest import KEY

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
HEADERS = {"authorization": f"Bearer {KEY}"}
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
    "sky": {"enum": ["clear", "cloudy", "rain"]},
    "hourly": {"type": "array", "items": {"type": "number"}, "maxItems": 4}},
    "required": ["city", "temperature_c", "sky"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
             "additionalProperties": False}}}]
USER = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)


def _fmt() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


def test_a_json_schema_answer_always_parses_and_validates(client):
    for seed in range(6):
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, temperature=1.0, seed=seed,
                                           response_format=_fmt())
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
    text = ""
    for ch in client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, temperature=1.0, seed=99,
                                             response_format=_fmt(), stream=True):
        text += "".join(c.delta.content or "" for c in ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # the openai client's own parse helper (pydantic-free: a dict schema) reads it too
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=120, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_required_or_named_tool_choice_always_yields_a_valid_call(client):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=160, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls"
        for call in calls:
            fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named,
                                           max_tokens=160, temperature=1.0, seed=seed, parallel_tool_calls=False)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and r.choices[0].message.content is None
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])
    streamed = []
    for ch in client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named,
                                             max_tokens=160, temperature=0, stream=True):
        for c in ch.choices:
            streamed += c.delta.tool_calls or []
    assert [c.function.name for c in streamed] == ["get_time"]


def test_structured_outputs_and_the_guided_names(server):
    def chat(**kw) -> str:
        r = httpx.post(f"{server}/v1/chat/completions", headers=HEADERS, timeout=120, json={
            "model": "tiny", "messages": USER, "max_tokens": 60, "temperature": 1.0, "seed": 2, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    assert chat(structured_outputs={"choice": ["sunny", "rainy day"]}) in ("sunny", "rainy day")
    assert chat(guided_choice=["sunny", "rainy day"]) in ("sunny", "rainy day")
    out = chat(structured_outputs={"regex": r"[0-9]{2}:[0-9]{2}"})
    assert len(out) == 5 and out[2] == ":"
    assert chat(guided_regex=r"[0-9]{2}:[0-9]{2}")[2] == ":"
    assert chat(structured_outputs={"grammar": 'root ::= "T=" [0-9] [0-9]?'}).startswith("T=")
    assert chat(guided_grammar='start: "T=" /[0-9]{1,2}/').startswith("T=")
    jsonschema.validate(json.loads(chat(guided_json=SCHEMA, max_tokens=200)), SCHEMA)
    jsonschema.validate(json.loads(chat(structured_outputs={"json": SCHEMA}, max_tokens=200)), SCHEMA)
    flexible = chat(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False}, max_tokens=300)
    jsonschema.validate(json.loads(flexible), SCHEMA)


def test_legacy_completions_and_responses_are_constrained_too(server, client):
    r = httpx.post(f"{server}/v1/completions", headers=HEADERS, timeout=120, json={
        "model": "tiny", "prompt": "The weather as JSON:", "max_tokens": 200, "temperature": 1.0, "seed": 4,
        "response_format": _fmt()})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)
    c = httpx.post(f"{server}/v1/completions", headers=HEADERS, timeout=120, json={
        "model": "tiny", "prompt": "Pick:", "max_tokens": 10, "structured_outputs": {"choice": ["x", "y"]}})
    assert c.json()["choices"][0]["text"] in ("x", "y")
    resp = client.responses.create(model="tiny", input="Weather in Paris as JSON", max_output_tokens=200,
                                   temperature=1.0, text={"format": {"type": "json_schema", "name": "weather",
                                                                     "schema": SCHEMA}})
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    assert resp.text.format.type == "json_schema"
    tools = [{"type": "function", "name": "get_time", "parameters": TOOLS[1]["function"]["parameters"]}]
    called = client.responses.create(model="tiny", input="Time?", tools=tools, tool_choice="required",
                                     max_output_tokens=120, temperature=1.0)
    assert [o.type for o in called.output if o.type != "reasoning"][-1] == "function_call"


BAD = [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": True, "disable_additional_properties": True}}, "structured_outputs"),
    ({"structured_outputs": {"wat": 1}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_a_bad_constraint_is_a_400_naming_its_field(server, extra, param):
    r = httpx.post(f"{server}/v1/chat/completions", headers=HEADERS, timeout=60,
                   json={"model": "tiny", "messages": USER, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
