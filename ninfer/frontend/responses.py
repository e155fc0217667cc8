"""The Responses API: stored responses expand to history, and the current input is normalised
to chat messages before the marker policy applies. The stored raw input never carries the
automatic markers added for one request. The store has its own byte budget and evicts the
least recently used responses."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from ninfer.frontend.openai_api import ApiError, bad, sampling_from, split_tool_calls


@dataclass
class Stored:
    messages: list[dict]          # normalised history including this response's output
    size: int


class ResponseStore:
    def __init__(self, budget_bytes: int = 64 << 20):
        self.budget = budget_bytes
        self.used = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, messages: list[dict]) -> None:
        size = len(json.dumps(messages))
        self._items[rid] = Stored(messages, size)
        self.used += size
        while self.used > self.budget and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self.used -= old.size

    def get(self, rid: str) -> list[dict]:
        item = self._items.get(rid)
        if item is None:
            raise ApiError(404, f"previous response {rid!r} not found", param="previous_response_id",
                           code="previous_response_not_found")
        self._items.move_to_end(rid)
        return [dict(m) for m in item.messages]


def _text_of(content) -> str | list:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise bad("only text content parts are supported", "input")
            parts.append({"type": "text", "text": p.get("text", "")})
        return parts
    raise bad("content must be a string or a list of parts", "input")


def normalise_input(raw) -> list[dict]:
    """Responses input (a string or a list of items) -> chat messages."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for item in raw:
        if not isinstance(item, dict):
            raise bad("every input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"input item role {role!r} is not supported", "input")
            out.append({"role": role, "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))})
        else:
            raise bad(f"input item type {kind!r} is not supported", "input")
    return out


def tools_from(raw) -> list[dict] | None:
    if not raw:
        return None
    out = []
    for t in raw:
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad("only function tools are supported", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


@dataclass
class ResponsesCall:
    history: list[dict]          # expanded stored history + normalised input (what is stored)
    messages: list[dict]         # what is rendered: instructions first
    tools: list[dict] | None
    sampling: dict
    session_id: str | None
    store: bool
    previous: str | None


def parse_responses(body: dict, store: ResponseStore, default_max: int) -> ResponsesCall:
    if body.get("stream"):
        raise bad("stream is not supported on /v1/responses yet; use /v1/chat/completions", "stream")
    prev = body.get("previous_response_id")
    history = store.get(prev) if prev else []
    history += normalise_input(body.get("input"))
    messages = list(history)
    instructions = body.get("instructions")
    if instructions:
        messages = [{"role": "system", "content": str(instructions)}] + messages
    return ResponsesCall(history=history, messages=messages, tools=tools_from(body.get("tools")),
                         sampling=sampling_from(body, ("max_output_tokens",), default_max),
                         session_id=body.get("prompt_cache_key") or body.get("user"),
                         store=body.get("store", True) is not False, previous=prev)


def response_object(rid: str, model: str, call: ResponsesCall, text: str, out) -> dict:
    content, calls = split_tool_calls(text)
    output = []
    if content or not calls:
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": content or "", "annotations": []}]})
    for c in calls:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": c["id"],
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"})
    u = out.usage
    return {"id": rid, "object": "response", "created_at": time.time(), "model": model,
            "status": "completed" if out.finish_reason != "length" else "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"} if out.finish_reason == "length" else None,
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [{"type": "function", **t["function"]} for t in (call.tools or [])],
            "previous_response_id": call.previous, "store": call.store, "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                      "output_tokens": len(out.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": u.prompt_tokens + len(out.token_ids)}}


def stored_messages(call: ResponsesCall, text: str) -> list[dict]:
    """History to store: the raw normalised input (no markers added for this request) plus the
    assistant output."""
    content, calls = split_tool_calls(text)
    msg: dict = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        msg["tool_calls"] = calls
    return [dict(m) for m in call.history] + [msg]
