"""Every request field of vLLM's chat and completions schema (``tests/frontend/vllm_fields.py``,
read from vLLM's protocol source) is honoured or refused with a 400 naming it — never accepted and
ignored — and each honoured one changes the answer as in vLLM (through the real server, raw HTTP
or the official ``openai`` client, on the random tiny model)."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest

from ninfer.frontend import schema as S
from tests.frontend.conftest import KEY, reset_cache
from tests.frontend.vllm_fields import CHAT_FIELDS, COMPLETION_FIELDS, LEGACY_GUIDED, STREAM_OPTIONS

openai = pytest.importorskip("openai")
HEADERS = {"authorization": f"Bearer {KEY}"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "Tell me about the sea."}]
OK, NO = "honoured", "refused"
END_THINK = "</think>"

# field -> (value, expectation, other fields the value needs)
CHAT_CASES: dict[str, tuple] = {
    "messages": (USER, OK, {}),
    "model": ("tiny", OK, {}),
    "frequency_penalty": (0.5, OK, {}),
    "logit_bias": ({"17": 5.0}, OK, {}),
    "logprobs": (True, OK, {}),
    "top_logprobs": (2, OK, {"logprobs": True}),
    "max_tokens": (2, OK, {}),
    "max_completion_tokens": (2, OK, {}),
    "n": (2, OK, {}),
    "presence_penalty": (0.5, OK, {}),
    "response_format": ({"type": "json_object"}, OK, {}),
    "seed": (7, OK, {}),
    "stop": (["zz"], OK, {}),
    "stream": (True, OK, {}),
    "stream_options": ({"include_usage": True, "continuous_usage_stats": True}, OK, {"stream": True}),
    "temperature": (0.7, OK, {}),
    "top_p": (0.9, OK, {}),
    "tools": (TOOLS, OK, {}),
    "tool_choice": ("auto", OK, {"tools": TOOLS}),
    "reasoning_effort": ("none", OK, {}),
    "include_reasoning": (False, OK, {}),
    "parallel_tool_calls": (False, OK, {"tools": TOOLS}),
    "user": ("someone", OK, {}),
    "use_beam_search": (True, NO, {}),
    "top_k": (5, OK, {}),
    "min_p": (0.1, OK, {}),
    "repetition_penalty": (1.1, OK, {}),
    "length_penalty": (0.5, NO, {}),
    "stop_token_ids": ([17], OK, {}),
    "include_stop_str_in_output": (True, OK, {"stop": ["e"]}),
    "ignore_eos": (True, OK, {}),
    "min_tokens": (1, OK, {}),
    "skip_special_tokens": (False, OK, {}),
    "spaces_between_special_tokens": (False, NO, {}),
    "truncate_prompt_tokens": (5, NO, {}),
    "prompt_logprobs": (1, OK, {}),
    "allowed_token_ids": ([17, 18, 19], OK, {}),
    "bad_words": (["sea"], OK, {}),
    "echo": (True, OK, {}),
    "add_generation_prompt": (False, OK, {}),
    "continue_final_message": (True, OK, {"add_generation_prompt": False,
                                           "messages": USER + [{"role": "assistant", "content": "The sea is"}]}),
    "add_special_tokens": (True, OK, {}),
    "documents": ([{"title": "a", "text": "b"}], OK, {}),
    "chat_template": ("{{ messages }}", NO, {}),
    "chat_template_kwargs": ({"some_flag": True}, OK, {}),
    "mm_processor_kwargs": ({"max_pixels": 10}, NO, {}),
    "structured_outputs": ({"regex": "a+"}, OK, {}),
    "priority": (1, NO, {}),
    "request_id": ("my-request", OK, {}),
    "logits_processors": (["my.Processor"], NO, {}),
    "return_tokens_as_token_ids": (True, OK, {"logprobs": True}),
    "return_token_ids": (True, OK, {}),
    "cache_salt": ("salt", NO, {}),
    "kv_transfer_params": ({"do_remote_prefill": True}, NO, {}),
    "vllm_xargs": ({"x": 1}, NO, {}),
    "max_repetition_pattern_size": (4, NO, {}),
    "min_repetition_pattern_size": (2, NO, {}),
    "repetition_min_count": (3, NO, {}),
}
COMPLETION_CASES: dict[str, tuple] = {
    "model": ("tiny", OK, {}),
    "prompt": ("Once upon a time", OK, {}),
    "echo": (True, OK, {}),
    "frequency_penalty": (0.5, OK, {}),
    "logit_bias": ({"17": 5.0}, OK, {}),
    "logprobs": (2, OK, {}),
    "max_tokens": (2, OK, {}),
    "n": (2, OK, {}),
    "presence_penalty": (0.5, OK, {}),
    "seed": (7, OK, {}),
    "stop": (["zz"], OK, {}),
    "stream": (True, OK, {}),
    "stream_options": ({"include_usage": True, "continuous_usage_stats": True}, OK, {"stream": True}),
    "suffix": ("the end", NO, {}),
    "temperature": (0.7, OK, {}),
    "top_p": (0.9, OK, {}),
    "user": ("someone", OK, {}),
    "use_beam_search": (True, NO, {}),
    "top_k": (5, OK, {}),
    "min_p": (0.1, OK, {}),
    "repetition_penalty": (1.1, OK, {}),
    "length_penalty": (0.5, NO, {}),
    "stop_token_ids": ([17], OK, {}),
    "include_stop_str_in_output": (True, OK, {"stop": ["e"]}),
    "ignore_eos": (True, OK, {}),
    "min_tokens": (1, OK, {}),
    "skip_special_tokens": (False, OK, {}),
    "spaces_between_special_tokens": (False, NO, {}),
    "truncate_prompt_tokens": (2, OK, {}),
    "allowed_token_ids": ([17, 18, 19], OK, {}),
    "prompt_logprobs": (1, OK, {}),
    "prompt_embeds": ("AAAA", NO, {}),
    "add_special_tokens": (False, OK, {}),
    "response_format": ({"type": "json_object"}, OK, {}),
    "structured_outputs": ({"regex": "a+"}, OK, {}),
    "priority": (1, NO, {}),
    "request_id": ("my-request", OK, {}),
    "logits_processors": (["my.Processor"], NO, {}),
    "return_tokens_as_token_ids": (True, OK, {"logprobs": 1}),
    "return_token_ids": (True, OK, {}),
    "cache_salt": ("salt", NO, {}),
    "kv_transfer_params": ({"do_remote_prefill": True}, NO, {}),
    "vllm_xargs": ({"x": 1}, NO, {}),
    "max_repetition_pattern_size": (4, NO, {}),
    "min_repetition_pattern_size": (2, NO, {}),
    "repetition_min_count": (3, NO, {}),
}
GUIDED_CASES = {"guided_json": ({"type": "object"}, OK, {}), "guided_regex": ("a+", OK, {}),
                "guided_choice": (["a", "b"], OK, {}), "guided_grammar": ("root ::= \"a\"", OK, {}),
                "guided_decoding_backend": ("xgrammar", NO, {}),
                "guided_whitespace_pattern": (" ", OK, {"guided_json": {"type": "object"}})}


def test_every_vllm_field_has_a_decision_and_a_typed_place():
    """The cases cover vLLM's whole field list, and each field is typed in NInfer's schema (so a
    value of the wrong type is a 400 naming it too, and nothing is silently dropped)."""
    assert set(CHAT_CASES) == set(CHAT_FIELDS) and set(COMPLETION_CASES) == set(COMPLETION_FIELDS)
    assert set(GUIDED_CASES) == set(LEGACY_GUIDED)
    chat, comp = set(S.ChatRequest.__struct_fields__), set(S.CompletionRequest.__struct_fields__)
    assert not set(CHAT_FIELDS + LEGACY_GUIDED) - chat and not set(COMPLETION_FIELDS + LEGACY_GUIDED) - comp
    assert set(S.StreamOptions.__struct_fields__) == set(STREAM_OPTIONS)


def _post(server: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, headers=HEADERS, timeout=120)


def _check(server: str, path: str, base: dict, field: str, case: tuple) -> None:
    value, want, extra = case
    body = {**base, **extra, field: value}
    r = _post(server, path, body)
    if want == NO:
        assert r.status_code == 400, (field, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], (field, err)
    else:
        assert r.status_code == 200, (field, r.text[:300])
        if body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, (field, r.text[-300:])
        else:
            assert r.json()["choices"], field


@pytest.mark.parametrize("field", sorted(CHAT_CASES) + sorted(GUIDED_CASES))
def test_every_chat_field_is_honoured_or_refused_by_name(server, field):
    base = {"model": "tiny", "messages": USER, "max_tokens": 3, "temperature": 0}
    _check(server, "/v1/chat/completions", base, field, {**CHAT_CASES, **GUIDED_CASES}[field])


@pytest.mark.parametrize("field", sorted(COMPLETION_CASES) + sorted(GUIDED_CASES))
def test_every_completions_field_is_honoured_or_refused_by_name(server, field):
    base = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
    _check(server, "/v1/completions", base, field, {**COMPLETION_CASES, **GUIDED_CASES}[field])


# ---- what each honoured option does --------------------------------------------------------------

def _complete(server: str, **kw) -> dict:
    body = {"model": "tiny", "prompt": "Once upon a time there was", "max_tokens": 6, "temperature": 0,
            "return_token_ids": True, **kw}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(server: str, **kw) -> dict:
    body = {"model": "tiny", "messages": USER, "max_tokens": 6, "temperature": 0, "return_token_ids": True, **kw}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def _vocab(server: str) -> dict:
    r = httpx.post(f"{server}/tokenize", json={"model": "tiny", "prompt": "hello", "return_token_strs": True},
                   headers=HEADERS, timeout=30)
    return r.json()


def test_return_token_ids_gives_the_prompt_and_the_output_tokens(server):
    c = _complete(server)["choices"][0]
    ids = httpx.post(f"{server}/tokenize", json={"prompt": "Once upon a time there was"}, headers=HEADERS).json()
    assert c["prompt_token_ids"] == ids["tokens"] and len(c["token_ids"]) == 6
    r = _chat(server)
    assert len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]
    rendered = httpx.post(f"{server}/tokenize", json={"messages": USER}, headers=HEADERS).json()["tokens"]
    assert r["prompt_token_ids"] == rendered
    detok = httpx.post(f"{server}/detokenize", json={"tokens": r["choices"][0]["token_ids"]}, headers=HEADERS)
    assert detok.json()["prompt"] == r["choices"][0]["message"]["content"]


def test_logit_bias_forces_and_bans_tokens(server):
    free = _complete(server)["choices"][0]["token_ids"]
    forced = _complete(server, logit_bias={"17": 100})["choices"][0]["token_ids"]
    assert forced == [17] * 6
    banned = _complete(server, logit_bias={str(free[0]): -100})["choices"][0]["token_ids"]
    assert banned[0] != free[0]


def test_allowed_token_ids_limit_every_sampled_token(server):
    allowed = [17, 18, 19, 40, 41]
    got = _complete(server, allowed_token_ids=allowed, temperature=1.0, seed=3, max_tokens=12)
    assert set(got["choices"][0]["token_ids"]) <= set(allowed)


def test_stop_token_ids_end_the_answer_and_min_tokens_delays_them(server):
    free = _complete(server, max_tokens=8)["choices"][0]["token_ids"]
    stop = free[2]
    k = free.index(stop)
    c = _complete(server, max_tokens=8, stop_token_ids=[stop])["choices"][0]
    assert c["finish_reason"] == "stop" and c["token_ids"] == free[:k + 1]
    decode = lambda ids: httpx.post(f"{server}/detokenize", json={"tokens": ids}, headers=HEADERS).json()["prompt"]
    assert c["text"] == decode(free[:k])                     # the stop token's text is not shown
    kept = _complete(server, max_tokens=8, stop_token_ids=[stop], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == decode(free[:k + 1])
    late = _complete(server, max_tokens=8, stop_token_ids=[stop], min_tokens=k + 2)["choices"][0]
    assert len(late["token_ids"]) >= k + 2 and stop not in late["token_ids"][:k + 1]


def test_min_p_one_keeps_only_the_most_likely_token(server):
    greedy = _complete(server, max_tokens=8)["choices"][0]["token_ids"]
    sampled = _complete(server, max_tokens=8, temperature=1.5, seed=11, min_p=1.0)["choices"][0]["token_ids"]
    assert sampled == greedy


def test_bad_words_are_never_completed(server):
    from ninfer.frontend.render import ChatTokenizer
    tok = ChatTokenizer(httpx.get(f"{server}/v1/models", headers=HEADERS).json()["data"][0]["root"])
    free = _chat(server, max_tokens=8)["choices"][0]["token_ids"]

    def one_token_word(t: int) -> bool:          # a word whose plain or spaced spelling is just t
        word = tok.decode([t]).strip()
        return bool(word) and [t] in (tok.tokenizer.encode(word).ids, tok.tokenizer.encode(" " + word).ids)
    t0 = next(t for t in free if one_token_word(t))
    banned = _chat(server, max_tokens=8, bad_words=[tok.decode([t0])])     # a chat field in vLLM
    assert t0 not in banned["choices"][0]["token_ids"]


def test_include_stop_str_in_output_keeps_the_stop_string(server):
    text = _complete(server, max_tokens=8)["choices"][0]["text"]
    stop = text[2:4]
    cut = _complete(server, max_tokens=8, stop=[stop])["choices"][0]
    kept = _complete(server, max_tokens=8, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert cut["text"] == text[:text.index(stop)] and kept["text"] == text[:text.index(stop) + len(stop)]


def test_skip_special_tokens_false_shows_special_tokens(server):
    special = httpx.post(f"{server}/tokenize", json={"prompt": "<|im_start|>"}, headers=HEADERS).json()["tokens"]
    assert len(special) == 1
    kw = dict(allowed_token_ids=special, max_tokens=2, ignore_eos=True)
    assert _complete(server, **kw)["choices"][0]["text"] == ""
    assert _complete(server, skip_special_tokens=False, **kw)["choices"][0]["text"] == "<|im_start|>" * 2


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    full = _complete(server)
    cut = _complete(server, truncate_prompt_tokens=3)
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["prompt_token_ids"] == full["choices"][0]["prompt_token_ids"][-3:]


def test_return_tokens_as_token_ids_spells_logprob_tokens_as_ids(server):
    r = _chat(server, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    content = r["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in r["choices"][0]["token_ids"]]
    assert all(a["token"].startswith("token_id:") for e in content for a in e["top_logprobs"])
    c = _complete(server, logprobs=1, return_tokens_as_token_ids=True)["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]


def test_request_id_names_the_response(server):
    assert _chat(server, request_id="abc-1")["id"] == "chatcmpl-abc-1"
    assert _complete(server, request_id="abc-2")["id"] == "cmpl-abc-2"


def test_continue_final_message_continues_the_open_assistant_message_and_echo_returns_it(server):
    partial = [*USER, {"role": "assistant", "content": "The sea is"}]
    r = _chat(server, messages=partial, add_generation_prompt=False, continue_final_message=True, echo=True)
    ids = r["prompt_token_ids"]
    closed = httpx.post(f"{server}/tokenize", json={"messages": partial, "add_generation_prompt": False},
                        headers=HEADERS).json()["tokens"]
    assert closed[:len(ids)] == ids and len(closed) > len(ids)      # the message's end is not rendered
    detok = httpx.post(f"{server}/detokenize", json={"tokens": ids}, headers=HEADERS).json()["prompt"]
    assert detok.endswith("assistant\nThe sea is")
    assert r["choices"][0]["message"]["content"].startswith("The sea is")
    both = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": partial, "continue_final_message": True,
                                                  "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_add_generation_prompt_false_renders_no_assistant_start(server):
    with_prompt = _chat(server)["prompt_token_ids"]
    without = _chat(server, add_generation_prompt=False)["prompt_token_ids"]
    assert with_prompt[:len(without)] == without and len(with_prompt) > len(without)


def test_chat_template_kwargs_may_not_set_what_the_request_sets(server):
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER,
                                               "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and "chat_template_kwargs.messages" in r.json()["error"]["message"]


# ---- reasoning: the template's switch, and reuse across a thinking conversation ------------------

THINK_OFF = "<think>\n\n</think>\n\n"


def test_enable_thinking_reaches_the_template_and_reasoning_effort_maps_to_it(server):
    def prompt(**kw) -> str:
        ids = _chat(server, max_tokens=1, **kw)["prompt_token_ids"]
        return httpx.post(f"{server}/detokenize", json={"tokens": ids}, headers=HEADERS).json()["prompt"]
    on = prompt()
    assert not on.endswith(THINK_OFF)
    assert prompt(chat_template_kwargs={"enable_thinking": False}) == on + THINK_OFF
    assert prompt(reasoning_effort="none") == on + THINK_OFF
    assert prompt(reasoning_effort="high") == on
    assert prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == on   # explicit wins
    off_ids = _chat(server, max_tokens=1, chat_template_kwargs={"enable_thinking": False})["prompt_token_ids"]
    tokenized = httpx.post(f"{server}/tokenize", json={"messages": USER, "chat_template_kwargs":
                                                       {"enable_thinking": False}}, headers=HEADERS).json()
    assert tokenized["tokens"] == off_ids
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    rr = _post(server, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                         "reasoning": {"effort": "none"}})
    assert rr.status_code == 200 and rr.json()["reasoning"]["effort"] == "none"
    assert _post(server, "/v1/responses", {"model": "tiny", "input": "hi", "reasoning":
                                           {"summary": "detailed"}}).status_code == 400


def test_a_thinking_conversation_reuses_its_input_point_on_the_next_turn(server):
    """The template drops an earlier turn's thinking (Qwen3's rule), so the previous answer's
    generation end is no prefix of the next prompt — but the previous input point is: the next
    turn has cached tokens."""
    reset_cache(server)        # the shared server's cache may be full of larger cold points
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    msgs = [{"role": "system", "content": "Think, then answer."},
            {"role": "user", "content": "Why is the sea salty? Think it through step by step."}]
    r1 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content or "It is.",
              "reasoning_content": "Rivers carry minerals; evaporation leaves salt behind."},
             {"role": "user", "content": "And the Dead Sea?"}]
    r2 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 5
    rendered = httpx.post(f"{server}/tokenize", json={"messages": msgs}, headers=HEADERS).json()["tokens"]
    text = httpx.post(f"{server}/detokenize", json={"tokens": rendered}, headers=HEADERS).json()["prompt"]
    assert "evaporation" not in text                           # the earlier thinking is not rendered


def test_the_real_models_thinking_comes_back_as_reasoning_content(server):
    """On the real (random) tiny model: an answer that starts inside its thinking (the assistant
    turn opened with ``<think>``, continued) is reasoning until ``</think>`` — ``reasoning_content``
    in the non-streamed and the streamed answer alike, no content. (The next turn's reuse, with
    the template dropping that thinking: the test above.)"""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    opened = [{"role": "user", "content": "Why is the sky blue? Think first."},
              {"role": "assistant", "content": "<think>\n"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    r1 = client.chat.completions.create(model="tiny", messages=opened, max_tokens=8, temperature=0, extra_body=extra)
    m = r1.choices[0].message
    reasoning = getattr(m, "reasoning_content", None)
    assert reasoning and END_THINK not in reasoning and not m.content, m   # cut off inside its thinking
    streamed = ""
    for ch in client.chat.completions.create(model="tiny", messages=opened, max_tokens=8, temperature=0,
                                             stream=True, extra_body=extra):
        if ch.choices:
            streamed += getattr(ch.choices[0].delta, "reasoning_content", None) or ""
    assert streamed == reasoning


def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    body = {"model": "tiny", "messages": USER, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = [json.loads(line[6:]) for line in _post(server, "/v1/chat/completions", body).text.splitlines()
              if line.startswith("data: {")]
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all("usage" in c for c in with_choices)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5 and with_choices[0]["usage"]["prompt_tokens"] > 0
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and not chunks[-1]["choices"]
    # without it only the final usage chunk carries usage (OpenAI's include_usage)
    body["stream_options"] = {"include_usage": True}
    plain = [json.loads(line[6:]) for line in _post(server, "/v1/chat/completions", body).text.splitlines()
             if line.startswith("data: {")]
    assert [("usage" in c) for c in plain] == [False] * (len(plain) - 1) + [True]


def test_stream_options_without_stream_is_refused(server):
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, "stream_options":
                                               {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_streamed_token_ids_add_up_to_the_answer(server):
    body = {"model": "tiny", "messages": USER, "max_tokens": 5, "temperature": 0, "stream": True,
            "return_token_ids": True}
    chunks = [json.loads(line[6:]) for line in _post(server, "/v1/chat/completions", body).text.splitlines()
              if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert streamed == _chat(server, max_tokens=5)["choices"][0]["token_ids"]


def _prompt_entry_ok(item: dict, token: int, k: int) -> None:
    """vLLM's prompt_logprobs item: the prompt token (its rank in the vocabulary) and the top k
    (ranks 1..k), each {"logprob", "rank", "decoded_token"}."""
    assert str(token) in item and len(item) in (k, k + 1), item
    assert sorted(v["rank"] for v in item.values() if v["rank"] <= k) == list(range(1, k + 1)), item
    for t, v in item.items():
        assert set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0
        assert isinstance(v["decoded_token"], str)
    top = sorted(item.values(), key=lambda v: v["rank"])
    assert all(a["logprob"] >= b["logprob"] for a, b in zip(top, top[1:]))


def test_prompt_logprobs_come_in_vllms_shape_and_equal_a_full_computation(server, served):
    """Completions: each choice's ``prompt_logprobs``; chat: the response's. One item per prompt
    token, the first null; the values are those of an isolated forward over the whole prompt
    (the request restores no cached prefix: cached_tokens 0 even for a prompt seen before)."""
    from ninfer.reference import reference_prompt_logprobs
    body = dict(prompt="Once upon a time there was a sea", max_tokens=2, prompt_logprobs=2)
    _complete(server, prompt=body["prompt"], max_tokens=2)                 # the same prompt, cached
    r = _complete(server, **body)
    c = r["choices"][0]
    ids, plp = c["prompt_token_ids"], c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    want = reference_prompt_logprobs(served.model, ids, 2, dtype="float32")
    for j in range(1, len(ids)):
        _prompt_entry_ok(plp[j], ids[j], 2)
        assert plp[j][str(ids[j])]["rank"] == want[j].rank
        assert abs(plp[j][str(ids[j])]["logprob"] - want[j].logprob) < 1e-3
        assert [int(t) for t, v in sorted(plp[j].items(), key=lambda kv: kv[1]["rank"]) if v["rank"] <= 2] \
            == [t for t, _ in want[j].top]
    assert "prompt_logprobs" not in _complete(server, prompt="Once upon a time", max_tokens=2)["choices"][0]
    chat = _chat(server, max_tokens=2, prompt_logprobs=0)
    ids = chat["prompt_token_ids"]
    assert len(chat["prompt_logprobs"]) == len(ids) and chat["prompt_logprobs"][0] is None
    for j in range(1, len(ids)):
        _prompt_entry_ok(chat["prompt_logprobs"][j], ids[j], 0)
    assert "prompt_logprobs" not in _chat(server, max_tokens=2)


def test_echo_with_logprobs_covers_the_prompt_then_the_answer(server):
    """OpenAI's / vLLM's echo with logprobs: tokens, token_logprobs, top_logprobs and
    text_offset run over the echoed prompt (its first token without a logprob) and then the
    answer; streamed, the echo chunk carries the prompt's part."""
    prompt = "Once upon a time there was"
    r = _complete(server, prompt=prompt, max_tokens=4, echo=True, logprobs=2)
    c = r["choices"][0]
    ids, lp = c["prompt_token_ids"], c["logprobs"]
    n = len(ids) + 4
    assert c["text"].startswith(prompt) and all(len(lp[k]) == n for k in lp)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    for j in range(1, len(ids)):         # the echoed part is the prompt logprobs (implied, as in vLLM)
        assert lp["token_logprobs"][j] == c["prompt_logprobs"][j][str(ids[j])]["logprob"]
    plain = _complete(server, prompt=prompt, max_tokens=4, logprobs=2)["choices"][0]["logprobs"]
    assert lp["tokens"][len(ids):] == plain["tokens"]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2,
            "stream": True}
    chunks = [json.loads(line[6:]) for line in _post(server, "/v1/completions", body).text.splitlines()
              if line.startswith("data: {")]
    streamed = [ch["logprobs"] for k in chunks for ch in k["choices"] if ch.get("logprobs")]
    assert streamed[0]["token_logprobs"][0] is None and len(streamed[0]["tokens"]) == len(ids)
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    got = [x for s in streamed for x in s["token_logprobs"]]
    assert got[0] is None and all(abs(a - b) < 1e-5 for a, b in zip(got[1:], lp["token_logprobs"][1:]))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("value,extra", [(-1, {}), (-2, {}), (21, {}), (1, {"stream": True}), (0, {"stream": True})])
def test_bad_prompt_logprobs_are_refused_by_name(server, path, value, extra):
    base = {"messages": USER} if "chat" in path else {"prompt": "Once upon a time"}
    r = _post(server, path, {"model": "tiny", "max_tokens": 2, **base, **extra, "prompt_logprobs": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and "prompt_logprobs" in err["message"], err
    r = _post(server, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_options_through_the_openai_client(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0,
                                       logit_bias={"17": 100},
                                       extra_body={"min_tokens": 2, "stop_token_ids": [17], "return_token_ids": True})
    # 17 is forced, but as a stop id it is barred for the first two tokens; the third stops
    assert r.model_extra["prompt_token_ids"] and r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["token_ids"][2] == 17
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    plp = r.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(r.model_extra["prompt_token_ids"])
    c = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=2, echo=True, logprobs=1)
    assert c.choices[0].logprobs.token_logprobs[0] is None and c.choices[0].text.startswith("Once upon a time")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, extra_body={"prompt_logprobs": 21})
    assert "prompt_logprobs" in str(exc.value)


def test_schema_decodes_the_fields_it_types():
    req = msgspec.convert({"messages": USER, "min_tokens": 2, "bad_words": ["x"], "echo": True}, S.ChatRequest)
    assert req.min_tokens == 2 and req.bad_words == ["x"] and req.echo
