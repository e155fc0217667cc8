"""The Responses API: stored responses expand to history, and the current input is normalised
to chat messages before the marker policy applies. The stored raw input never carries the
automatic markers added for one request. The store has its own byte budget and evicts the
least recently used responses; a stored response can be retrieved, deleted and its input items
listed. Streaming emits OpenAI's typed events (``response.created`` ... ``response.completed``).
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from ninfer.frontend import schema as S
from ninfer.frontend.openai_api import bad, not_found


@dataclass
class Stored:
    response: dict                # the response object as returned
    history: list[dict]           # normalised history including this response's output
    input_items: list[dict]       # this request's input items, with ids
    size: int


class ResponseStore:
    def __init__(self, budget_bytes: int = 64 << 20):
        self.budget = budget_bytes
        self.used = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, response: dict, history: list[dict], input_items: list[dict]) -> None:
        size = len(json.dumps([response, history, input_items]))
        old = self._items.pop(rid, None)          # a background response replaces its in-progress object
        if old is not None:
            self.used -= old.size
        self._items[rid] = Stored(response, history, input_items, size)
        self.used += size
        while self.used > self.budget and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self.used -= old.size

    def _get(self, rid: str, param: str | None = None) -> Stored:
        item = self._items.get(rid)
        if item is None:
            raise not_found(f"response {rid!r} not found", param=param,
                            code="previous_response_not_found" if param else "response_not_found")
        self._items.move_to_end(rid)
        return item

    def history(self, rid: str) -> list[dict]:
        return [dict(m) for m in self._get(rid, "previous_response_id").history]

    def response(self, rid: str) -> dict:
        return self._get(rid).response

    def input_items(self, rid: str) -> list[dict]:
        return self._get(rid).input_items

    def delete(self, rid: str) -> None:
        item = self._get(rid)
        del self._items[rid]
        self.used -= item.size


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _str(item: dict, key: str, where: str, default=None) -> str:
    v = item.get(key, default)
    if not isinstance(v, str):
        raise bad(f"{where}.{key} must be a string", where)
    return v


def _text_of(content, where: str, role: str = "user") -> str | list:
    """A message's content as chat content: text parts, and (not for the assistant) ``input_image``
    parts as chat ``image_url`` parts — the chat path prepares them (a model without a vision
    tower answers them with a clear 400)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "input_image" and role != "assistant":
                parts.append({"type": "image_url", "image_url": {"url": _str(p, "image_url", at)}})
                continue
            if kind not in ("input_text", "output_text", "text"):
                raise bad(f"{at}: only text and input_image content parts are supported (got {kind!r})", where)
            parts.append({"type": "text", "text": _str(p, "text", at)})
        return parts
    raise bad(f"{where}.content must be a string or a list of parts", where)


def _stored_parts(content: str | list, role: str) -> list[dict]:
    """The message's parts as ``input_items`` lists them (Responses' own part types)."""
    text = "input_text" if role != "assistant" else "output_text"
    if isinstance(content, str):
        return [{"type": text, "text": content}]
    return [{"type": "input_image", "image_url": p["image_url"]["url"]} if p["type"] == "image_url"
            else {"type": text, "text": p["text"]} for p in content]


def normalise_input(raw: str | list[dict]) -> tuple[list[dict], list[dict]]:
    """Responses input (a string or a list of items) -> chat messages, and the items as stored
    (with ids) for ``input_items``."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not raw:
        raise bad("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    items: list[dict] = []
    thought: list[str] = []          # reasoning items: the next assistant message's reasoning_content
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought.append(_reasoning_text(item, where))
            items.append({"id": item.get("id") or _item_id("rs"), "type": "reasoning", "summary": [],
                          "content": [{"type": "reasoning_text", "text": thought[-1]}]})
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{where}.role {role!r} is not supported", where)
            content = _text_of(item.get("content"), where, role)
            out.append({"role": role, "content": content})
            if role == "assistant" and thought:
                out[-1]["reasoning_content"], thought = "".join(thought), []
            items.append({"id": item.get("id") or _item_id("msg"), "type": "message", "role": role,
                          "content": _stored_parts(content, role), "status": "completed"})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function",
                    "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where, "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if thought:
                out[-1]["reasoning_content"], thought = "".join(thought), []
            items.append({"id": item.get("id") or _item_id("fc"), "type": "function_call", "status": "completed",
                          "call_id": call["id"], "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            if not isinstance(output, str):
                output = json.dumps(output)
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where), "content": output})
            items.append({"id": item.get("id") or _item_id("fco"), "type": "function_call_output",
                          "call_id": item["call_id"], "output": output, "status": "completed"})
        else:
            raise bad(f"{where}.type {kind!r} is not supported", where)
    return out, items


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning input item's text: its ``content`` (reasoning_text parts), else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise bad(f"{where}: a reasoning item's content / summary must be a list of parts with text", where)
    return "".join(p["text"] for p in parts)


def tools_from(raw: list[S.ResponseTool] | None) -> list[dict] | None:
    if not raw:
        return None
    out = []
    for i, t in enumerate(raw):
        if t.type != "function" or not t.name:
            raise bad(f"tools[{i}]: only function tools with a name are supported (got type {t.type!r})",
                      f"tools[{i}]")
        fn = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        if t.parameters is not None:
            fn["parameters"] = t.parameters
        out.append({"type": "function", "function": fn})
    return out


@dataclass
class ResponsesCall:
    history: list[dict]          # expanded stored history + normalised input (what is stored)
    messages: list[dict]         # what is rendered: instructions first
    input_items: list[dict]
    tools: list[dict] | None
    tool_choice: object
    req: S.ResponsesRequest
    store: bool
    previous: str | None
    instructions: str | None = None
    extra: dict = field(default_factory=dict)


def parse_responses(req: S.ResponsesRequest, store: ResponseStore) -> ResponsesCall:
    prev = req.previous_response_id
    history = store.history(prev) if prev else []
    messages, items = normalise_input(req.input)
    history += messages
    rendered = list(history)
    if req.instructions:
        rendered = [{"role": "system", "content": req.instructions}] + rendered
    tools = tools_from(req.tools)
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, dict):
        name = choice.get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    if choice == "none":
        tools = None
    return ResponsesCall(history=history, messages=rendered, input_items=items, tools=tools, tool_choice=choice,
                         req=req, store=req.store is not False, previous=prev, instructions=req.instructions)


def reasoning_item(text: str, rs_id: str, status: str | None = None) -> dict:
    item = {"type": "reasoning", "id": rs_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
    if status is not None:
        item["status"] = status
    return item


def output_items(content: str, calls: list[dict], status: str, msg_id: str | None = None,
                 reasoning: str = "", rs_id: str | None = None) -> list[dict]:
    """The response's output: a reasoning item (when the model thought), the message, the calls."""
    text = content.strip() if calls else content
    output = [reasoning_item(reasoning, rs_id or _item_id("rs"))] if reasoning else []
    if text or not (calls or reasoning):
        output.append({"type": "message", "id": msg_id or _item_id("msg"), "status": status, "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    for c in calls:
        output.append(call_item(c, "completed"))
    return output


def call_item(c: dict, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{c['id'][5:]}", "call_id": c["id"], "name": c["function"]["name"],
            "arguments": c["function"]["arguments"], "status": status}


def response_object(rid: str, model: str, created: int, call: ResponsesCall, output: list[dict],
                    status: str, usage, output_tokens: int, reason: str | None = None,
                    reasoning_tokens: int = 0) -> dict:
    req = call.req
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "error": None,
            "incomplete_details": {"reason": reason} if status == "incomplete" else None,
            "instructions": call.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "output": output, "parallel_tool_calls": True,
            "previous_response_id": call.previous, "store": call.store,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "text": {"format": _format(req)},
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "tool_choice": call.tool_choice if isinstance(call.tool_choice, str) else
            {"type": "function", "name": call.tool_choice["function"]["name"]},
            "tools": [{"type": "function", "strict": None, "parameters": None, "description": None, **t["function"]}
                      for t in (call.tools or [])],
            "truncation": "disabled", "user": req.user,
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": usage.prompt_tokens + output_tokens}}


def _format(req: S.ResponsesRequest) -> dict:
    f = req.text.format if req.text is not None and req.text.format is not None else None
    if f is None or f.type == "text":
        return {"type": "text"}
    out = {"type": f.type}
    if f.type == "json_schema":
        out.update({k: v for k, v in (("name", f.name), ("schema", f.schema), ("strict", f.strict),
                                      ("description", f.description)) if v is not None})
    return out


def stored_history(call: ResponsesCall, content: str, calls: list[dict], reasoning: str = "") -> list[dict]:
    """History to store: the raw normalised input (no markers added for this request) plus the
    assistant output (its reasoning as reasoning_content: the template decides where it shows)."""
    text = content.strip() if calls else content
    msg: dict = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = reasoning
    return [dict(m) for m in call.history] + [msg]


class EventStream:
    """OpenAI's Responses streaming events for one response, numbered in order."""

    def __init__(self):
        self.seq = 0
        self.msg_id = _item_id("msg")
        self.rs_id = _item_id("rs")
        self.text = ""
        self.thought = ""
        self.message_open = False
        self.reasoning_open = False
        self.index = 0                       # output_index of the next item

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def reasoning_delta(self, delta: str) -> list[str]:
        """The thinking streams first, as a reasoning item (``response.reasoning_text.delta``)."""
        if not delta:
            return []
        out = []
        if not self.reasoning_open:
            self.reasoning_open = True
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item={**reasoning_item("", self.rs_id, "in_progress"), "content": []}))
        self.thought += delta
        return out + [self.event("response.reasoning_text.delta", item_id=self.rs_id, output_index=self.index,
                                 content_index=0, delta=delta)]

    def close_reasoning(self) -> list[str]:
        if not self.reasoning_open:
            return []
        self.reasoning_open = False
        out = [self.event("response.reasoning_text.done", item_id=self.rs_id, output_index=self.index,
                          content_index=0, text=self.thought),
               self.event("response.output_item.done", output_index=self.index,
                          item=reasoning_item(self.thought, self.rs_id, "completed"))]
        self.index += 1
        return out

    def open_message(self) -> list[str]:
        if self.message_open:
            return []
        out = self.close_reasoning()
        self.message_open = True
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return out + [self.event("response.output_item.added", output_index=self.index, item=item),
                self.event("response.content_part.added", item_id=self.msg_id, output_index=self.index,
                           content_index=0, part=part)]

    def text_delta(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = self.open_message()
        self.text += delta
        return out + [self.event("response.output_text.delta", item_id=self.msg_id, output_index=self.index,
                                 content_index=0, delta=delta, logprobs=[])]

    def close_message(self, status: str) -> list[str]:
        if not self.message_open:
            return []
        self.message_open = False
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        item = {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": [part]}
        out = [self.event("response.output_text.done", item_id=self.msg_id, output_index=self.index,
                          content_index=0, text=self.text, logprobs=[]),
               self.event("response.content_part.done", item_id=self.msg_id, output_index=self.index,
                          content_index=0, part=part),
               self.event("response.output_item.done", output_index=self.index, item=item)]
        self.index += 1
        return out

    def call(self, c: dict) -> list[str]:
        out = self.close_reasoning() + self.close_message("completed")
        item = call_item(c, "in_progress")
        args = item["arguments"]
        out += [self.event("response.output_item.added", output_index=self.index, item={**item, "arguments": ""}),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=self.index,
                           delta=args),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                           arguments=args),
                self.event("response.output_item.done", output_index=self.index, item={**item, "status": "completed"})]
        self.index += 1
        return out
