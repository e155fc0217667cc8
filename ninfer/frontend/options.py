"""Request options -> what the engine runs and how the answer is shaped.

Every field of vLLM's chat and completions request schema is either honoured here (turned into
engine arguments, template options or an ``Shaping`` of the answer) or refused with a 400 naming
it — never accepted and silently ignored. ``tests/frontend/vllm_fields.py`` lists vLLM's fields
(with the source they were read from) and ``tests/frontend/test_http_options.py`` sends each.

    typed request (schema.py) --refuse()--> 400 naming the first unsupported field
                              --sampling()--> Engine.chat / generate keyword arguments
                              --template()--> TemplateOptions (add_generation_prompt, continue_final_message,
                                              chat_template_kwargs, documents, reasoning_effort)
                              --shaping()--> what the server does with the tokens (stop strings kept,
                                              special tokens, token ids, echo, usage per chunk)
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ninfer import protocol as P
from ninfer.errors import ConfigError, RequestError
from ninfer.frontend import schema as S
from ninfer.frontend.openai_api import bad
from ninfer.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams

MAX_N = 16


@dataclass(frozen=True)
class ModelFacts:
    """What option parsing needs to know of the served model."""

    vocab_size: int
    template: str = ""                 # the chat template's source ("" without one)
    adds_special_tokens: bool = False  # does encoding with add_special_tokens add any token?


# Fields NInfer does not implement: (is the value neutral?, why it is refused). A neutral value
# (the field's default) is accepted, anything else is a 400 naming the field.
def _none(v) -> bool:
    return v is None


def _falsy(v) -> bool:
    return not v


def _one(v) -> bool:
    return v is None or v == 1.0


def _true(v) -> bool:
    return v is None or v is True


REFUSED_ALWAYS: dict[str, tuple[Any, str]] = {
    "use_beam_search": (_falsy, "beam search is not supported"),
    "length_penalty": (_one, "length_penalty applies to beam search, which is not supported"),
    "spaces_between_special_tokens": (_true, "only the tokenizer's own spacing is supported (true)"),
    "priority": (_falsy, "this server does not use priority scheduling (priority must be 0)"),
    "logits_processors": (_falsy, "custom logits processors are not supported"),
    "cache_salt": (_none, "cache salting is not supported: NInfer's context cache is shared by every "
                          "request of this server"),
    "kv_transfer_params": (_none, "disaggregated KV transfer is not supported"),
    "vllm_xargs": (_falsy, "no extension reads vllm_xargs here"),
    "max_repetition_pattern_size": (_falsy, "stopping on repetitive patterns is not supported"),
    "min_repetition_pattern_size": (_falsy, "stopping on repetitive patterns is not supported"),
    "repetition_min_count": (_falsy, "stopping on repetitive patterns is not supported"),
}
REFUSED_CHAT: dict[str, tuple[Any, str]] = {
    "truncate_prompt_tokens": (_none, "truncating a rendered chat would cut its template structure; "
                                      "truncate the messages instead"),
    "chat_template": (_none, "a per-request chat template is not accepted (the model's own template renders "
                             "every chat, as vLLM without --trust-request-chat-template)"),
    "mm_processor_kwargs": (_falsy, "processor options are not supported"),
}
REFUSED_COMPLETIONS: dict[str, tuple[Any, str]] = {
    "suffix": (_falsy, "suffix (fill in the middle) is not supported"),
    "prompt_embeds": (_none, "prompt embeddings are not accepted"),
}


REFUSED_RESPONSES: dict[str, tuple[Any, str]] = {
    "include": (_falsy, "no extra output (include) is available"),
    "max_tool_calls": (_none, "limiting tool calls is not supported"),
    "truncation": (lambda v: v in (None, "disabled"), "only truncation 'disabled' is supported"),
    "top_logprobs": (_falsy, "Responses logprobs are not supported (use chat completions)"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only the default service tier exists"),
    "prompt": (_none, "stored prompt templates are not supported"),
    "parallel_tool_calls": (_true, "only parallel tool calls (true) are supported here"),
    "truncate_prompt_tokens": (_none, "truncating a rendered conversation would cut its template structure"),
    "response_format": (_none, "Responses take the output format as text.format"),
    "bad_words": (_falsy, "bad_words belongs to chat completions"),
    "prompt_logprobs": (_none, "prompt_logprobs belongs to chat completions and completions"),
}


def refuse(req: S.Sampling, table: dict[str, tuple[Any, str]]) -> None:
    """A 400 naming the first field set to a value NInfer does not implement."""
    for name, (neutral, why) in table.items():
        value = getattr(req, name, None)
        if not neutral(value):
            raise bad(f"{name} is not supported: {why}", name)


def refuse_unsupported(req: S.Sampling, chat: bool, facts: ModelFacts) -> None:
    """Chat completions (``chat``), legacy completions or (a ResponsesRequest) Responses."""
    refuse(req, REFUSED_ALWAYS)
    if isinstance(req, S.ResponsesRequest):
        refuse(req, REFUSED_RESPONSES)
    else:
        refuse(req, REFUSED_CHAT if chat else REFUSED_COMPLETIONS)
    if chat and req.add_special_tokens and facts.adds_special_tokens:
        raise bad("add_special_tokens is not supported for chat: the chat template places every special token",
                  "add_special_tokens")
    if req.guided_decoding_backend not in BACKENDS:
        raise bad(f"guided_decoding_backend {req.guided_decoding_backend!r} is not available: this server constrains "
                  "with llguidance ('guidance' or 'auto')", "guided_decoding_backend")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options can only be given with stream=true", "stream_options")


# ---- defaults: the model's generation_config.json ----------------------------------------------

# the sampling values vLLM takes from generation_config.json (``get_diff_sampling_param``), and
# the defaults it falls back to without them (its requests' _DEFAULT_SAMPLING_PARAMS)
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
VLLM_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_defaults(model_dir: str | Path | None, mode: str = "auto") -> dict:
    """vLLM's ``--generation-config``: ``"auto"`` — the sampling defaults of the model's own
    generation_config.json (``max_new_tokens`` as ``max_tokens``); ``"vllm"`` — none (vLLM's own
    defaults); a directory — the generation_config.json there. A missing file gives none; a value
    of the wrong type or out of range is a ConfigError naming it."""
    if mode == "vllm" or model_dir is None:
        return {}
    path = Path(model_dir if mode == "auto" else mode) / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise ConfigError(f"--generation-config {mode}: no generation_config.json there")
        return {}
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    out = {}
    for key in GENERATION_KEYS:
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{path}: {key} must be a number (got {v!r})")
        out["max_tokens" if key == "max_new_tokens" else key] = v
    try:
        SamplingParams(**{k: v for k, v in out.items() if k != "max_tokens"},
                       **({"max_tokens": int(out["max_tokens"])} if "max_tokens" in out else {})).validate()
    except RequestError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if "top_k" in out:
        out["top_k"] = max(0, int(out["top_k"]))      # -1 (off, vLLM's spelling) is our 0
    return out


# ---- sampling ----------------------------------------------------------------------------------

def _token_ids(name: str, ids, vocab: int) -> None:
    bad_id = next((t for t in ids if not 0 <= t < vocab), None)
    if bad_id is not None:
        raise bad(f"{name}: token id {bad_id} is out of range: allowed 0..{vocab - 1}", name)


def logit_bias(raw: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    """OpenAI's ``{"token id": bias}`` (bias in [-100, 100]) as ``{id: bias}``."""
    if not raw:
        return None
    out = {}
    for key, value in raw.items():
        try:
            tid = int(key)
        except ValueError:
            raise bad(f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= tid < vocab:
            raise bad(f"logit_bias: token id {tid} is out of range: allowed 0..{vocab - 1}", "logit_bias")
        if not -100 <= value <= 100:
            raise bad(f"logit_bias: the bias of token {tid} is {value}: allowed -100..100", "logit_bias")
        out[tid] = float(value)
    return out


def bad_word_ids(words: list[str] | None, tok) -> list[list[int]] | None:
    """vLLM's tokenization of ``bad_words``: each word as written (leading spaces stripped) and
    with one leading space, the second only where it gives a different first token and the same
    length (so both spellings a model can produce are barred)."""
    if not words:
        return None
    if tok is None:
        raise bad("bad_words needs the model's tokenizer", "bad_words")
    out: list[list[int]] = []
    for i, word in enumerate(words):
        if not word.strip():
            raise bad(f"bad_words[{i}] is empty", f"bad_words[{i}]")
        plain = tok.tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
        out.append(plain)
        spaced = tok.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def sampling(req: S.Sampling, facts: ModelFacts, max_tokens: int | None, default_max: int, n: int | None,
             tok=None, defaults: dict | None = None) -> dict:
    """The Engine.chat / generate keyword arguments of a request's sampling fields. What the
    request leaves unset comes from ``defaults`` (``generation_defaults``), else vLLM's defaults;
    without max_tokens the answer may use ``defaults["max_tokens"]`` or ``default_max``, capped by
    the rest of the context (``fill_max_tokens``)."""
    if n is not None and not 1 <= n <= MAX_N:
        raise bad(f"n must be between 1 and {MAX_N} (got {n})", "n")
    vocab = facts.vocab_size
    d = {**VLLM_DEFAULTS, **(defaults or {})}

    def pick(name: str):
        v = getattr(req, name)
        return d[name] if v is None else v
    top_k = pick("top_k")
    out = dict(max_tokens=max_tokens or int(d.get("max_tokens", default_max)), fill_max_tokens=max_tokens is None,
               temperature=pick("temperature"), top_p=pick("top_p"), top_k=top_k if top_k > 0 else 0,
               seed=secrets.randbelow(MAX_SEED) if req.seed is None else req.seed,
               presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
               repetition_penalty=pick("repetition_penalty"), ignore_eos=bool(req.ignore_eos))
    if pick("min_p"):
        out["min_p"] = pick("min_p")
    if req.min_tokens:
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise bad(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
        out["min_tokens"] = req.min_tokens
    if req.stop_token_ids:
        _token_ids("stop_token_ids", req.stop_token_ids, vocab)
        out["stop_token_ids"] = list(req.stop_token_ids)
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise bad("allowed_token_ids must not be empty", "allowed_token_ids")
        _token_ids("allowed_token_ids", req.allowed_token_ids, vocab)
        out["allowed_token_ids"] = sorted(set(req.allowed_token_ids))
    bias = logit_bias(req.logit_bias, vocab)
    if bias:
        out["logit_bias"] = bias
    words = bad_word_ids(getattr(req, "bad_words", None), tok)
    if words:
        out["bad_words"] = words
    return out


def prompt_logprobs(req: S.Sampling, implied: int | None = None) -> int | None:
    """vLLM's ``prompt_logprobs`` (chat completions and completions): None, or 0..20 top tokens
    per prompt position (vLLM's default ``max_logprobs``; its -1, the whole vocabulary, exceeds
    that and is refused as vLLM refuses it then). ``implied``: what the request asks without
    the field (completions' ``echo`` with ``logprobs``: the echoed prompt's logprobs, as vLLM
    computes them). As in vLLM, an explicit value cannot be streamed."""
    k = req.prompt_logprobs
    if k is None:
        return implied
    if k == -1:
        raise bad(f"prompt_logprobs=-1 (the whole vocabulary) is not offered: at most {MAX_LOGPROBS} tokens per "
                  f"prompt position (vLLM's default max_logprobs refuses it too)", "prompt_logprobs")
    if not 0 <= k <= MAX_LOGPROBS:
        raise bad(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS} (got {k})", "prompt_logprobs")
    if req.stream:
        raise bad("prompt_logprobs are not available when stream=true (as in vLLM)", "prompt_logprobs")
    return k


# ---- structured outputs ------------------------------------------------------------------------

BACKENDS = (None, "auto", "guidance", "llguidance")      # what constrains here: llguidance
SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def constraint(req: S.Sampling, book, think: tuple[int, int] | None = None) -> P.Constraint | None:
    """The request's grammar, from whichever of OpenAI's ``response_format`` (Responses:
    ``text.format``), vLLM's ``structured_outputs`` or its older ``guided_*`` names it uses (two
    of them: a 400); checked against the model's tokenizer (``book``). ``think``: the reasoning
    tags, when a reasoning parser is on (the grammar then starts after the thinking)."""
    found: list[tuple[str, P.Constraint]] = []
    fmt = getattr(req, "text", None)
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _from_format(rf.type, (rf.json_schema or {}).get("schema"), "response_format")))
    if isinstance(req, S.ResponsesRequest) and fmt is not None and fmt.format is not None and fmt.format.type != "text":
        found.append(("text.format", _from_format(fmt.format.type, fmt.format.schema, "text.format")))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured(req.structured_outputs)))
    guided = [k for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if getattr(req, k) is not None]
    if len(guided) > 1:
        raise bad(f"only one guided constraint at a time (got {', '.join(guided)})", guided[1])
    if guided:
        k = guided[0]
        spec = {k[len("guided_"):]: getattr(req, k)}
        if req.guided_whitespace_pattern is not None:
            spec["whitespace_pattern"] = req.guided_whitespace_pattern
        found.append((k, _from_structured(spec, k)))
    elif req.guided_whitespace_pattern is not None:
        raise bad("guided_whitespace_pattern needs guided_json", "guided_whitespace_pattern")
    if len(found) > 1:
        raise bad(f"give one output constraint, not {found[0][0]} and {found[1][0]}", found[1][0])
    if not found:
        return None
    where, c = found[0]
    return checked(c, book, where, think)


def checked(c: P.Constraint, book, where: str, think: tuple[int, int] | None) -> P.Constraint:
    from ninfer import structured as st
    try:
        st.check(c, book, where)
    except RequestError as exc:
        raise bad(str(exc), where) from None
    return st.msgspec_replace(c, think=think) if think else c


def _from_format(kind: str, schema, where: str) -> P.Constraint:
    from ninfer import structured as st
    if kind == "json_object":
        return st.json_object()
    if not isinstance(schema, dict):
        raise bad(f"{where}: json_schema needs its schema (an object)", where)
    return _wrap(lambda: st.json_schema(schema), where)


def _from_structured(spec: dict, where: str = "structured_outputs") -> P.Constraint:
    """vLLM's StructuredOutputsParams: one of json / regex / choice / grammar / json_object."""
    from ninfer import structured as st
    known = set(SO_KINDS) | {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                             "structural_tag", "disable_fallback"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise bad(f"{where}.{unknown[0]} is not a structured-output option", where)
    kinds = [k for k in SO_KINDS if spec.get(k) not in (None, False)]
    if spec.get("structural_tag") is not None:
        raise bad(f"{where}.structural_tag is not supported", where)
    if spec.get("disable_additional_properties"):
        raise bad(f"{where}.disable_additional_properties is not supported (set additionalProperties in the "
                  "schema)", where)
    if len(kinds) != 1:
        raise bad(f"{where}: give exactly one of {', '.join(SO_KINDS)} (got {len(kinds)})", where)
    kind, value = kinds[0], spec[kinds[0]]
    # vLLM's default allows any whitespace; NInfer writes compact JSON unless asked explicitly
    flexible = spec.get("disable_any_whitespace") is False
    if kind == "json":
        return _wrap(lambda: st.json_schema(value, flexible, spec.get("whitespace_pattern")), where)
    if kind == "json_object":
        return st.json_object(flexible)
    if kind == "regex" and isinstance(value, str):
        return st.regex(value)
    if kind == "choice" and isinstance(value, list):
        return _wrap(lambda: st.choice(value), where)
    if kind == "grammar" and isinstance(value, str):
        return _wrap(lambda: st.grammar(value), where)
    raise bad(f"{where}.{kind} has the wrong type", where)


def _wrap(build, where: str) -> P.Constraint:
    try:
        return build()
    except RequestError as exc:
        raise bad(f"{where}: {exc}", where) from None


# ---- the chat template -------------------------------------------------------------------------

def template(req: S.ChatRequest, facts: ModelFacts) -> dict:
    """Engine.chat's template keyword arguments: add_generation_prompt, continue_final_message and
    chat_template_kwargs (with ``documents`` and ``reasoning_effort``, which vLLM also hands to
    the template)."""
    add_gen = True if req.add_generation_prompt is None else req.add_generation_prompt
    cont = bool(req.continue_final_message)
    if cont and req.add_generation_prompt:
        raise bad("continue_final_message and add_generation_prompt cannot both be true", "continue_final_message")
    if cont:
        add_gen = False
    kwargs = dict(req.chat_template_kwargs or {})
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.reasoning_effort is not None:
        effort_kwargs(req.reasoning_effort, facts, kwargs, "reasoning_effort")
    out: dict = {}
    if not add_gen:
        out["add_generation_prompt"] = False
    if cont:
        out["continue_final_message"] = True
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


EFFORTS = ("none", "minimal", "low", "medium", "high")


def effort_kwargs(effort: str, facts: ModelFacts, kwargs: dict, param: str) -> None:
    """``reasoning_effort`` (chat) or ``reasoning.effort`` (Responses) as template variables: as
    is where the template reads ``reasoning_effort`` (vLLM passes it so); on a template with
    Qwen3's ``enable_thinking`` switch, "none" / "minimal" turn thinking off and "low" /
    "medium" / "high" on (it has no levels; an explicit chat_template_kwargs.enable_thinking
    wins); else a 400."""
    if effort not in EFFORTS:
        raise bad(f"{param} must be one of {', '.join(EFFORTS)} (got {effort!r})", param)
    if "reasoning_effort" in facts.template:
        kwargs.setdefault("reasoning_effort", effort)
    elif "enable_thinking" in facts.template:
        kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
    else:
        raise bad(f"{param} is not supported by this model's chat template (it reads neither reasoning_effort nor "
                  "enable_thinking)", param)


def responses_template(req: S.ResponsesRequest, facts: ModelFacts) -> dict:
    """Responses' ``reasoning: {"effort", "summary"}`` as template variables (``effort_kwargs``);
    NInfer writes no summaries, so only ``summary`` null or "auto" (whatever the model gives)."""
    r = req.reasoning or {}
    unknown = sorted(set(r) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise bad(f"reasoning.{unknown[0]} is not supported", "reasoning")
    summary = r.get("summary", r.get("generate_summary"))
    if summary not in (None, "auto"):
        raise bad(f"reasoning.summary {summary!r} is not supported: NInfer writes no reasoning summaries "
                  "(the reasoning item carries the model's reasoning text)", "reasoning")
    kwargs: dict = {}
    if r.get("effort") is not None:
        effort_kwargs(r["effort"], facts, kwargs, "reasoning")
    return {"chat_template_kwargs": kwargs} if kwargs else {}


def template_options(kw: dict) -> P.TemplateOptions:
    """The same options as the TemplateOptions the intake renders with."""
    return P.TemplateOptions(add_generation_prompt=kw.get("add_generation_prompt", True),
                             continue_final_message=kw.get("continue_final_message", False),
                             kwargs=dict(kw.get("chat_template_kwargs") or {}))


# ---- how the answer is shaped ------------------------------------------------------------------

@dataclass(frozen=True)
class Shaping:
    """What the server does with a choice's tokens beyond decoding them."""

    include_stop_str: bool = False         # include_stop_str_in_output: keep the matched stop string
    skip_special_tokens: bool = True       # decode without special tokens (vLLM's default)
    return_token_ids: bool = False         # prompt_token_ids + token_ids in the answer
    tokens_as_ids: bool = False            # logprob tokens spelled "token_id:<id>"
    continuous_usage: bool = False         # usage on every streamed chunk
    first_call_only: bool = False          # parallel_tool_calls false: at most one call
    stop_ids: frozenset[int] = frozenset()   # the ids that end the request: their text is not shown
    min_tokens: int = 0                    # (before min_tokens none of them ends it)


def shaping(req: S.Sampling, eos_ids=()) -> Shaping:
    so = req.stream_options
    stops = frozenset(req.stop_token_ids or ()) | (frozenset() if req.ignore_eos else frozenset(eos_ids))
    return Shaping(stop_ids=stops, min_tokens=req.min_tokens or 0,
                   include_stop_str=bool(req.include_stop_str_in_output),
                   skip_special_tokens=req.skip_special_tokens is not False,
                   return_token_ids=bool(req.return_token_ids),
                   tokens_as_ids=bool(req.return_tokens_as_token_ids),
                   continuous_usage=bool(so is not None and so.continuous_usage_stats and req.stream),
                   first_call_only=getattr(req, "parallel_tool_calls", None) is False)
