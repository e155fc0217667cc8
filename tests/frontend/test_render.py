"""render_chat gives exactly the tokens transformers' apply_chat_template gives."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.errors import RequestError

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a fact",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello there, how are you?"}],
    "system-multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in Français: ça va?"},
    ],
    "tool-round-trip": [
        {"role": "user", "content": "What is the capital of Peru?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"q": "capital of Peru"}}}]},
        {"role": "tool", "content": "Lima"},
    ],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}]}],
}


@pytest.mark.hf
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_tokens_equal_transformers(tiny_model, name):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    messages = CONVERSATIONS[name]
    tools = TOOLS if name == "tool-round-trip" else None
    expected = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    assert ninfer.render_chat(tiny_model, messages, tools=tools) == list(expected)


def test_special_tokens_are_single_ids(tiny_model):
    ids = ninfer.render_chat(tiny_model, CONVERSATIONS["plain"])
    assert ids[0] == 2040                       # <|im_start|>user ...
    assert ids.count(2040) == 2                 # ... and <|im_start|>assistant
    assert ids.count(2041) == 1                 # one <|im_end|>


def test_unknown_role_is_a_request_error(tiny_model):
    with pytest.raises(RequestError, match="Unknown message role: wizard"):
        ninfer.render_chat(tiny_model, [{"role": "wizard", "content": "x"}])
