"""Template options of a chat (vLLM's ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``): every rendering of the request sees them, the engine runs exactly what
``ninfer.render_chat`` renders with them, and a continued message stays open."""

from __future__ import annotations

import json
import shutil

import pytest

import ninfer
from ninfer.errors import RequestError
from ninfer.frontend.chat_plan import plan_chat
from ninfer.frontend.render import ChatTokenizer, continue_final_message, render_chat
from ninfer.protocol import TemplateOptions

USER = [{"role": "user", "content": "Tell me about the sea."}]
PARTIAL = [*USER, {"role": "assistant", "content": "The sea is"}]


def test_continue_final_message_leaves_the_final_message_open(tiny_model):
    tok = ChatTokenizer(tiny_model)
    closed = tok.render(PARTIAL, add_generation_prompt=False)
    opened = tok.render(PARTIAL, add_generation_prompt=False, continue_final=True)
    assert closed.startswith(opened) and opened.endswith("<|im_start|>assistant\nThe sea is")
    assert render_chat(tiny_model, PARTIAL, continue_final_message=True) == tok.encode(opened)
    # trailing whitespace the template kept stays; a template that strips it is cut at the text
    assert continue_final_message("a: hi there  <end>", [{"content": "hi there  "}]) == "a: hi there  "
    assert continue_final_message("a: hi there<end>", [{"content": "hi there  "}]) == "a: hi there"
    with pytest.raises(RequestError, match="continue_final_message"):
        continue_final_message("a: something else", [{"content": "hi there"}])


def test_template_kwargs_reach_every_rendering(tiny_model, tmp_path):
    """A template that reads a variable: the prompt and the plan's prefix renderings see it (the
    plan's restore positions are those of the text rendered with it)."""
    d = tmp_path / "m"
    shutil.copytree(tiny_model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if greeting %}{{ greeting }}\n{% endif %}" + cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = ChatTokenizer(d)
    plain = plan_chat(tok, USER)
    greeted = plan_chat(tok, USER, template=TemplateOptions(kwargs={"greeting": "Ahoy"}))
    assert tok.decode(greeted.prompt).startswith("Ahoy\n") and not tok.decode(plain.prompt).startswith("Ahoy")
    extra = len(greeted.prompt) - len(plain.prompt)
    assert greeted.recovery_frontier == plain.recovery_frontier + extra
    assert [m + extra for m in plain.markers] == greeted.markers


def test_the_engine_runs_the_continued_prompt_and_refuses_contradictions(tiny_model):
    eng = ninfer.Engine.start(tiny_model, config={"max_concurrency": 1, "max_context": 512}, transport="inproc")
    try:
        h = eng.chat(PARTIAL, max_tokens=3, add_generation_prompt=False, continue_final_message=True)
        assert h.prompt_token_ids == render_chat(tiny_model, PARTIAL, continue_final_message=True)
        assert h.result().prompt_token_ids == h.prompt_token_ids
        with pytest.raises(RequestError, match="cannot both be true"):
            eng.chat(PARTIAL, continue_final_message=True)
        with pytest.raises(RequestError, match="chat_template_kwargs.tools"):
            eng.chat(USER, chat_template_kwargs={"tools": []})
    finally:
        eng.shutdown()
