"""Tests for the tiny model's tokenizer and chat template (ninfer.tiny.tokenizer).

The tokenizer is built once per module. The Jinja template is checked against the
plain-Python `render_reference` in an environment configured like the one
transformers compiles chat templates in, and once end to end through
`transformers.AutoTokenizer`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ninfer.tiny.tokenizer import (
    CHAT_TEMPLATE,
    EXTRA_TOKENS,
    SPECIAL_TOKENS,
    build_tokenizer,
    render_reference,
    token_ids,
)

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tok")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


# --------------------------------------------------------------------------- #
# Jinja environment mirroring transformers.utils.chat_template_utils
# --------------------------------------------------------------------------- #


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers replaces Jinja's HTML-escaping, key-sorting tojson with plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str, *, hf_like: bool = True) -> jinja2.Template:
    """Compile like transformers does (sandbox, trim_blocks, lstrip_blocks, loopcontrols).

    With hf_like=False the whitespace options are off, to show the template does not
    depend on them.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=hf_like, lstrip_blocks=hf_like, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _render(messages, tools=None, add_generation_prompt=True, hf_like=True) -> str:
    return _compile(CHAT_TEMPLATE, hf_like=hf_like).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
    )


# --------------------------------------------------------------------------- #
# Conversations
# --------------------------------------------------------------------------- #

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Heure locale à Zürich ⏰", "parameters": {"type": "object"}},
}


def _call(name, arguments, call_id="call_0"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_ROUND_TRIP = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            _call("get_weather", {"city": "Paris"}),
            _call("get_weather", '{"city": "Tokyo", "unit": "c"}', "call_1"),
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 18}'},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 24}'},
    {"role": "assistant", "content": "Paris is 18 °C and Tokyo is 24 °C."},
    {"role": "user", "content": "Thanks!"},
]

CASES = {
    "multi_turn": (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        None,
    ),
    "system_user": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    "developer": (
        [
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": "Bonjour"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "developer", "content": "Now be terse."},
            {"role": "user", "content": "Why?"},
        ],
        None,
    ),
    "content_parts": (
        [
            {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "kind."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe "},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    {"type": "text", "text": "this café ☕"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ],
        None,
    ),
    "tools_no_system": ([{"role": "user", "content": "Weather?"}], [WEATHER_TOOL, TIME_TOOL]),
    "tools_with_system": (
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Time?"}],
        [TIME_TOOL],
    ),
    "tools_with_developer": (
        [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Time?"}],
        [TIME_TOOL],
    ),
    "tool_call_dict_args": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("get_weather", {"city": "Paris"})]},
        ],
        [WEATHER_TOOL],
    ),
    "tool_call_string_args": (
        [
            {"role": "user", "content": "Weather in Tokyo?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", '{"city":"Tokyo"}')]},
        ],
        [WEATHER_TOOL],
    ),
    "tool_round_trip": (TOOL_ROUND_TRIP, [WEATHER_TOOL]),
    "none_content": (
        [
            {"role": "system", "content": None},
            {"role": "user", "content": None},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "ok"},
            {"role": "assistant", "content": None, "tool_calls": [_call("get_time", None)]},
            {"role": "tool", "content": None},
        ],
        None,
    ),
    "empty": ([], None),
    # Qwen3's thinking: reasoning kept only after the last user message
    "thinking_history": (
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"},
        ],
        None,
    ),
    "thinking_before_a_tool_result": (
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "I should call it.",
             "tool_calls": [_call("get_weather", {"city": "Paris"})]},
            {"role": "tool", "content": "rain"},
        ],
        [WEATHER_TOOL],
    ),
}


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


def test_build_is_deterministic(tok_dir, tmp_path):
    build_tokenizer(tmp_path / "again")
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_build_is_deterministic_across_processes(tok_dir, tmp_path):
    code = (
        "import sys, pathlib; from ninfer.tiny.tokenizer import build_tokenizer; "
        "build_tokenizer(pathlib.Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "proc")], check=True, cwd=REPO_ROOT)
    assert (tmp_path / "proc" / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_vocab_layout(tok, tok_dir):
    assert tok.get_vocab_size(with_added_tokens=True) == 2048
    ids = token_ids(tok_dir)
    expected = {t: 2048 - 9 + i for i, t in enumerate(SPECIAL_TOKENS + EXTRA_TOKENS)}
    assert ids == expected
    added = tok.get_added_tokens_decoder()
    assert sorted(added) == list(range(2039, 2048))
    assert all(added[ids[t]].special for t in SPECIAL_TOKENS)
    assert not any(added[ids[t]].special for t in EXTRA_TOKENS)
    # Each added token is a single id even when glued to text.
    for t in SPECIAL_TOKENS + EXTRA_TOKENS:
        assert tok.encode(f"a{t}b").ids.count(ids[t]) == 1
    # The base vocabulary holds every byte, so nothing is ever unknown.
    assert min(tok.get_vocab(with_added_tokens=False).values()) == 0


def test_other_vocab_size(tmp_path):
    build_tokenizer(tmp_path, vocab_size=1000)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 1000
    assert token_ids(tmp_path)["<|im_end|>"] == 1000 - 9 + 2
    with pytest.raises(ValueError):
        build_tokenizer(tmp_path / "small", vocab_size=200)


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! It's 2024-05-06 and x = 3.14; don't panic.",
        "  leading spaces, tabs\tand\nnew lines\n\n",
        "Café, naïve, crème brûlée, Zürich, smørrebrød, ¿Qué tal?",
        "你好，世界！東京は晴れです。안녕하세요",
        "Emoji 😀🚀👍🏽 ❤️ and ✅",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "<|im_start|>user\n<tool_call>\n{}\n</tool_call><think>hm</think><|im_end|>",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_merges_are_useful(tok):
    # A trained BPE should compress common English well below one token per byte.
    text = "The weather in Paris is partly cloudy today."
    assert len(tok.encode(text).ids) < len(text.encode()) / 2


# --------------------------------------------------------------------------- #
# Chat template
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_template_matches_reference(case, add_generation_prompt):
    messages, tools = CASES[case]
    expected = render_reference(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert _render(messages, tools, add_generation_prompt) == expected
    # Whitespace control is explicit, so the plain Jinja defaults give the same text.
    assert _render(messages, tools, add_generation_prompt, hf_like=False) == expected


def test_thinking_is_dropped_before_the_last_user_message_and_can_be_switched_off():
    messages, _ = CASES["thinking_history"]
    text = _render(messages, add_generation_prompt=False)
    assert "R1" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>" in text
    off = _compile(CHAT_TEMPLATE).render(messages=messages[:3], enable_thinking=False, add_generation_prompt=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off == render_reference(messages[:3], enable_thinking=False)
    assert _render(messages[:3]) == render_reference(messages[:3], enable_thinking=True)


def test_transformers_drops_none_keys_same_output():
    # transformers removes keys whose value is None before rendering.
    messages, tools = CASES["none_content"]
    stripped = [{k: v for k, v in m.items() if v is not None} for m in messages]
    assert _render(stripped, tools) == render_reference(messages, tools)


def test_reference_exact_chatml():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [_call("f", {"a": 1}), _call("g", '{"b":2}')]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": [{"type": "text", "text": "2"}]},
    ]
    assert render_reference(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"b":2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_reference_tools_block():
    text = render_reference([{"role": "user", "content": "x"}], tools=[TIME_TOOL], add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(TIME_TOOL, ensure_ascii=False) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' in text
    assert text.endswith("<|im_start|>user\nx<|im_end|>\n")
    with_system = render_reference([{"role": "system", "content": "S"}], tools=[TIME_TOOL])
    assert with_system.startswith("<|im_start|>system\nS\n\n# Tools\n\n")


def test_developer_renders_as_system():
    dev = [
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "E"},
    ]
    sysm = [{**m, "role": "system"} if m["role"] == "developer" else m for m in dev]
    assert _render(dev) == _render(sysm) == render_reference(sysm)


def test_unknown_role_raises():
    messages = [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "meanwhile"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="narrator"):
        _render(messages)
    with pytest.raises(ValueError, match="narrator"):
        render_reference(messages)


@pytest.mark.hf
def test_transformers_apply_chat_template(tok_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    ids = token_ids(tok_dir)
    assert len(hf) == 2048
    assert hf.eos_token == "<|im_end|>" and hf.eos_token_id == ids["<|im_end|>"]
    assert hf.pad_token_id == ids["<|endoftext|>"] and hf.bos_token is None
    assert hf.model_max_length == 4096
    text = hf.apply_chat_template(TOOL_ROUND_TRIP, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert text == render_reference(TOOL_ROUND_TRIP, tools=[WEATHER_TOOL], add_generation_prompt=True)
    # Tokenized, it matches the raw tokenizers encoding and keeps the control tokens whole.
    hf_ids = hf.apply_chat_template(TOOL_ROUND_TRIP, tools=[WEATHER_TOOL], tokenize=True, add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert list(hf_ids) == tok.encode(text).ids
    assert hf.decode(hf_ids) == text
    for t in SPECIAL_TOKENS[1:] + EXTRA_TOKENS[:4]:
        assert list(hf_ids).count(ids[t]) == text.count(t), t
