"""OpenAI request and response shapes: chat completions and Responses, parsed into what the
engine takes and built back from its outputs. Bad input raises ApiError with the HTTP status and
the OpenAI error shape; the engine keeps serving."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass

from ninfer.errors import RequestError


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass
class ChatCall:
    messages: list[dict]
    tools: list[dict] | None
    sampling: dict
    session_id: str | None
    stream: bool
    include_usage: bool
    stop: list[str]
    n: int = 1                      # choices: n requests of the one prompt (computed once, then Forked)


def _num(body: dict, name: str, kind, default):
    v = body.get(name, default)
    if v is None:
        return default
    if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
        raise bad(f"{name} must be an integer", name)
    if kind is float and (not isinstance(v, (int, float)) or isinstance(v, bool)):
        raise bad(f"{name} must be a number", name)
    return kind(v)


def sampling_from(body: dict, max_name: tuple[str, ...], default_max: int) -> dict:
    """Engine sampling keywords; without an explicit limit the output may use the rest of the
    context up to ``default_max`` (as other OpenAI-compatible servers do)."""
    max_tokens, fill = default_max, True
    for name in max_name:
        if body.get(name) is not None:
            max_tokens, fill = _num(body, name, int, default_max), False
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad("logprobs are not supported", "logprobs")
    return dict(max_tokens=max_tokens, fill_max_tokens=fill, temperature=_num(body, "temperature", float, 1.0),
                top_p=_num(body, "top_p", float, 1.0), top_k=_num(body, "top_k", int, 0),
                seed=_num(body, "seed", int, 0), presence_penalty=_num(body, "presence_penalty", float, 0.0),
                frequency_penalty=_num(body, "frequency_penalty", float, 0.0),
                repetition_penalty=_num(body, "repetition_penalty", float, 1.0))


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        return stop
    raise bad("stop must be a string or a list of at most 4 strings", "stop")


MAX_N = 16


def parse_chat(body: dict, default_max: int) -> ChatCall:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools must be a list", "tools")
    if body.get("tool_choice") == "none":
        tools = None
    opts = body.get("stream_options") or {}
    n = _num(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"n must be between 1 and {MAX_N} (got {n})", "n")
    return ChatCall(n=n, messages=messages, tools=tools or None,
                    sampling=sampling_from(body, ("max_tokens", "max_completion_tokens"), default_max),
                    session_id=body.get("prompt_cache_key") or body.get("user"),
                    stream=bool(body.get("stream")), include_usage=bool(opts.get("include_usage")),
                    stop=_stop(body))


# ---- outputs --------------------------------------------------------------------------------

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Qwen-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks -> OpenAI
    tool calls; the remaining text is the content."""
    calls = []
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return text, []
    rest = TOOL_CALL.sub("", text).strip()
    return rest or None, calls


def usage_block(usage, completion_tokens: int) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": usage.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def finish(reason: str, calls: list) -> str:
    if calls:
        return "tool_calls"
    return {"stop": "stop", "length": "length", "cancelled": "stop"}.get(reason, reason)


def chat_completion(rid: str, model: str, texts: list[str], outs: list) -> dict:
    """One completion with a choice per output (n > 1: the prompt is counted once in usage, the
    completion tokens of every choice together)."""
    choices = []
    for i, (text, out) in enumerate(zip(texts, outs)):
        content, calls = split_tool_calls(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": i, "message": message, "logprobs": None,
                        "finish_reason": finish(out.finish_reason, calls)})
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_block(outs[0].usage, sum(len(o.token_ids) for o in outs))}


def chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None, index: int = 0) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def check_stop(text: str, stop: list[str]) -> int | None:
    """Index where the first stop string begins, if any."""
    hits = [i for s in stop if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def request_error(exc: Exception) -> ApiError:
    msg = str(exc)
    if "shut down" in msg or "unavailable" in msg or "was lost" in msg:
        return ApiError(503, msg, kind="service_unavailable")
    if isinstance(exc, RequestError):
        return bad(msg)
    return ApiError(500, msg, kind="internal_error")
