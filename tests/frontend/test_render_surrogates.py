"""Text the tokenizer cannot take (a lone surrogate, as JSON can carry) is a clear
RequestError naming the field, not a crash inside the tokenizer (issue 13)."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.errors import RequestError
from ninfer.frontend.chat_plan import plan_chat
from ninfer.frontend.render import ChatTokenizer


@pytest.fixture(scope="module")
def tok(tiny_model):
    return ChatTokenizer(tiny_model)


@pytest.mark.parametrize("messages,where", [
    ([{"role": "user", "content": "bad \ud800 half"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": "ok"}, {"role": "assistant", "content": [{"type": "text", "text": "\udfff"}]}],
     r"messages\[1\]\.content"),
    ([{"role": "user", "content": "ok"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"q": "\udc00"}}}]}], r"messages\[1\]\.tool_calls"),
], ids=["string", "part", "tool-call"])
def test_unpaired_surrogate_is_a_request_error(tok, tiny_model, messages, where):
    with pytest.raises(RequestError, match=where + " contains an unpaired surrogate"):
        plan_chat(tok, messages)
    with pytest.raises(RequestError, match="unpaired surrogate"):
        ninfer.render_chat(tiny_model, messages)


def test_surrogate_in_tools_and_paired_astral_text(tok):
    tools = [{"type": "function", "function": {"name": "f\ud83d", "parameters": {}}}]
    with pytest.raises(RequestError, match=r"tools\[0\] contains an unpaired surrogate"):
        plan_chat(tok, [{"role": "user", "content": "hi"}], tools)
    plan = plan_chat(tok, [{"role": "user", "content": "smile \U0001F642"}])   # a real pair is fine
    assert plan.prompt == tok.encode(tok.render([{"role": "user", "content": "smile \U0001F642"}]))
