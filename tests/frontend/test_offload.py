"""Large inputs are prepared in the helper process (``frontend/offload.py``): the same plan and
tokens as inline, a prompt that cannot fit refused after one count, a lost helper failing only
its request, and the engine's chat path through the helper equal to the inline one."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ninfer.errors import RequestError
from ninfer.frontend import intake as intake_mod
from ninfer.frontend import offload
from ninfer.frontend.chat_plan import OutputMemory, plan_chat
from ninfer.frontend.render import ChatTokenizer

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the weather"},
        {"role": "assistant", "content": "sunny and warm"}, {"role": "user", "content": "and tomorrow"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                           "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def helper():
    pool = offload.Offload()
    yield pool
    pool.shutdown()


def test_the_helpers_plan_equals_the_inline_plan_with_remembered_outputs(tiny_model, helper):
    tok = ChatTokenizer(tiny_model)
    said = tok.encode("sunny and warm")
    own = said[:-1] + [said[-1], said[-1]]            # the model's own tokens differ from a re-tokenisation
    memory = OutputMemory()
    memory.remember("sunny and warm", own)
    inline = plan_chat(tok, CHAT, TOOLS, memory)
    remote = helper.run(offload.plan_chat_job, tiny_model, CHAT, TOOLS, {"sunny and warm": own}, 4096)
    assert remote == inline and own == remote.prompt[remote.prompt.index(own[0]):][:len(own)]


def test_a_prompt_that_cannot_fit_is_refused_after_one_count(tiny_model, helper):
    long = [{"role": "user", "content": "lorem ipsum " * 4000}]
    refusal = helper.run(offload.plan_chat_job, tiny_model, long, None, {}, 1000)
    assert isinstance(refusal, offload.Refusal) and refusal.status == 400
    assert "max_context is 1000 tokens, but the prompt alone has at least" in refusal.message
    bad = helper.run(offload.plan_chat_job, tiny_model, [{"role": "user", "content": "x\ud800"}], None, {}, 1000)
    assert isinstance(bad, offload.Refusal) and "surrogate" in bad.message


def test_the_helpers_tokens_equal_the_tokenizers(tiny_model, helper):
    tok = ChatTokenizer(tiny_model)
    text = "tokenise me, twice over " * 50
    assert helper.run(offload.tokenize_job, tiny_model, text, None, None, True, True, 4096) == \
        tok.tokenizer.encode(text).ids
    assert helper.run(offload.tokenize_job, tiny_model, None, CHAT, TOOLS, True, False, 4096) == \
        tok.encode(tok.render(CHAT, TOOLS, True))
    over = helper.run(offload.tokenize_job, tiny_model, text, None, None, True, True, 10)
    assert isinstance(over, offload.Refusal) and over.param == "prompt" and "but the prompt has" in over.message


def test_the_helper_renders_with_the_requests_template_options(tiny_model, helper):
    """A large chat is planned (and a large /tokenize input rendered) with the same template
    options as inline: chat_template_kwargs, no generation prompt, a continued final message."""
    from ninfer.protocol import TemplateOptions
    tok = ChatTokenizer(tiny_model)
    cont = CHAT + [{"role": "assistant", "content": "It will be"}]
    for messages, opts in [(CHAT, TemplateOptions(kwargs={"enable_thinking": False})),
                           (CHAT, TemplateOptions(add_generation_prompt=False)),
                           (cont, TemplateOptions(add_generation_prompt=False, continue_final_message=True))]:
        inline = plan_chat(tok, messages, TOOLS, OutputMemory(), opts)
        assert helper.run(offload.plan_chat_job, tiny_model, messages, TOOLS, {}, 4096, opts) == inline
        assert inline != plan_chat(tok, messages, TOOLS, OutputMemory())          # the options mattered
    thinking_off = tok.encode(tok.render(CHAT, TOOLS, True, {"enable_thinking": False}))
    assert helper.run(offload.tokenize_job, tiny_model, None, CHAT, TOOLS, True, False, 4096,
                      {"enable_thinking": False}) == thinking_off
    assert helper.run(offload.tokenize_job, tiny_model, None, cont, None, False, False, 4096, None, True) == \
        tok.encode(tok.render(cont, None, False, None, True))


def test_a_lost_helper_fails_only_its_request(tiny_model):
    pool = offload.Offload()
    try:
        pid = pool.run(_pid)
        fut = pool.submit(time.sleep, 30)
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(offload.HelperLost, match="was lost"):
            pool.result(fut)
        assert pool.run(_pid) != pid                   # a fresh helper serves the next
    finally:
        pool.shutdown()


def _pid():
    return True, os.getpid()


def test_the_engines_chat_through_the_helper_equals_inline(tiny_model, monkeypatch):
    """``Engine.chat`` with every input counted large (the helper plans it): the prompt the
    engine computes and the answer are those of the inline path; a follow-up that sends the
    answer back reuses its exact tokens (the remembered output reached the helper)."""
    import ninfer
    engine = ninfer.Engine.start(tiny_model, config={"max_concurrency": 2, "max_context": 1024,
                                                     "context_cache": {"host_capacity_bytes": 1 << 24}})
    try:
        first = engine.chat(CHAT, max_tokens=6).result(timeout=120)
        follow = CHAT + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "thanks"}]
        inline = engine.chat(follow, max_tokens=4).result(timeout=120)
        monkeypatch.setattr(intake_mod, "INLINE_TEXT_CHARS", 0)
        again = engine.chat(CHAT, max_tokens=6).result(timeout=120)
        helped = engine.chat(follow, max_tokens=4).result(timeout=120)
        assert again.prompt_token_ids == first.prompt_token_ids and again.token_ids == first.token_ids
        assert helped.prompt_token_ids == inline.prompt_token_ids and helped.token_ids == inline.token_ids
        with pytest.raises(RequestError, match="max_context is 1024 tokens"):
            engine.chat([{"role": "user", "content": "lorem ipsum " * 2000}], max_tokens=2).result(timeout=120)
    finally:
        engine.shutdown()
