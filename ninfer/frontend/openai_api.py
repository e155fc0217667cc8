"""OpenAI response shapes built from engine outputs, and the one error type of the HTTP layer.

Every failure the server answers — validation, unknown route or model, wrong method, engine
error, an internal exception — is an ``ApiError`` rendered as OpenAI's error JSON
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from ninfer.errors import LOST_KINDS, ErrorKind, RequestError


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, kind="not_found_error", param=param, code=code)


# An engine that lost a worker, a controller or its connection, or a device or copy that
# failed, serves on: the request that met it is a 503 with its kind, and a retry is served.
RETRYABLE = tuple(k.value for k in (*LOST_KINDS, ErrorKind.DEVICE_ERROR, ErrorKind.COPY_FAILED))
RETRY_AFTER = {"retry-after": "1"}


def request_error(exc: Exception) -> ApiError:
    """An engine-side failure of one request."""
    msg = str(exc)
    if "shut down" in msg:
        return ApiError(503, msg, kind="service_unavailable")
    if "unavailable" in msg or "was lost" in msg:
        return ApiError(503, msg, kind="service_unavailable", code="retryable", headers=RETRY_AFTER)
    if isinstance(exc, RequestError):
        return bad(msg)
    return ApiError(500, msg, kind="internal_error")


def engine_error(out) -> ApiError:
    """The error of a request that ended with finish_reason "error": a 503 with ``Retry-After``
    and ``code: retryable`` for the kinds in RETRYABLE, a 400 for bad input, else a 500."""
    err = out.error or {}
    kind = err.get("type", "error")
    message = err.get("message", "the request failed")
    if kind in RETRYABLE:
        return ApiError(503, message, kind=kind, code="retryable", headers=RETRY_AFTER)
    return ApiError(400 if kind == ErrorKind.REQUEST_ERROR else 500, message, kind=kind)


# ---- usage ----------------------------------------------------------------------------------

def usage_block(usage, completion_tokens: int) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": usage.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def prompt_usage(outs: list) -> SimpleNamespace:
    """Several prompts (legacy completions with a list): prompt and cached tokens summed."""
    return SimpleNamespace(prompt_tokens=sum(o.usage.prompt_tokens for o in outs),
                           cached_tokens=sum(o.usage.cached_tokens for o in outs))


# ---- logprobs -------------------------------------------------------------------------------

def chat_logprobs(entries: list, token_str, top: int) -> dict:
    """Engine ``TokenLogprob`` entries -> chat ``choices[].logprobs`` ({"content": [...]})."""
    def one(tid: int, lp: float) -> dict:
        s = token_str(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top[:top]]}
                        for e in entries]}


def completion_logprobs(entries: list, token_str, offset: int) -> dict:
    """Engine logprob entries -> legacy completions ``choices[].logprobs``."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        s = token_str(e.token_id)
        tokens.append(s)
        lps.append(e.logprob)
        tops.append({token_str(t): lp for t, lp in e.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _finite(lp: float) -> float:
    """-inf as the JSON-safe number vLLM and OpenAI use."""
    return max(lp, -9999.0)


def echo_logprobs(prompt_ids: list[int], entries: list | None, token_str, top: int) -> dict:
    """The echoed prompt's part of completions ``choices[].logprobs`` (echo with logprobs), from
    the engine's prompt logprobs ([None, PromptLogprob, ...]): the first token has none (nothing
    comes before it); text offsets count from the prompt's start."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for tid, e in zip(prompt_ids, entries or [None] * len(prompt_ids)):
        s = token_str(tid)
        tokens.append(s)
        lps.append(None if e is None else _finite(e.logprob))
        tops.append(None if e is None else {token_str(t): _finite(lp) for t, lp in e.top[:top]})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two completions logprobs objects one after the other (the echoed prompt, then the answer)."""
    return {k: first[k] + then[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_logprobs(entries: list | None, decoded) -> list | None:
    """The engine's prompt logprobs as vLLM's ``prompt_logprobs``: one item per prompt token, the
    first null, each other ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` — the prompt
    token itself (its rank in the vocabulary) first, then the top k (ranks 1..k); a prompt token
    among the top k appears once, with its rank there (vLLM builds the dict in that order)."""
    if entries is None:
        return None
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": decoded(e.token_id)}}
        for rank, (t, lp) in enumerate(e.top, 1):
            d[str(t)] = {"logprob": _finite(lp), "rank": rank, "decoded_token": decoded(t)}
        out.append(d)
    return out


# ---- chat completions -----------------------------------------------------------------------

def chat_message(content: str, calls: list[dict]) -> dict:
    text = content.strip() if calls else content
    message = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_completion(rid: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None, index: int = 0,
          logprobs: dict | None = None) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def tool_call_deltas(calls: list[dict], first: int) -> list[dict]:
    """Completed calls as streamed ``delta.tool_calls`` (each whole in one delta)."""
    return [{"index": first + j, **c} for j, c in enumerate(calls)]


# ---- legacy completions ---------------------------------------------------------------------

def completion(rid: str, model: str, created: int, choices: list[dict], usage: dict | None) -> dict:
    out = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def now() -> int:
    return int(time.time())
