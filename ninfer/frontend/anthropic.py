"""Anthropic's Messages API (``POST /v1/messages``), which agent tools speak, onto the same chat
path as OpenAI's: a request becomes chat messages (so the template, the exact-reuse plan and the
markers are those of ``/v1/chat/completions``), the output a ``message`` object or its stream.

    request                                  chat input
    system (text or text blocks)             a system message (block cache_control kept)
    user text / image blocks                 text / image_url parts (base64 → data: URL; a url
                                             source is never fetched: http(s) is a 400)
    user tool_result blocks                  tool messages (tool_call_id = tool_use_id, text
                                             and cache_control), in order
    assistant text / tool_use blocks         content / tool_calls (input → JSON arguments)
    tools {name, description, input_schema}  function tools (parameters = input_schema)
    tool_choice auto | any | tool | none     auto | required | named | none
    stop_sequences, max_tokens, temperature, top_p, top_k

    output: content [text, tool_use ...], stop_reason end_turn | max_tokens | stop_sequence |
    tool_use, usage {input_tokens, output_tokens, cache_read_input_tokens (real reuse)}

    stream: message_start, content_block_start / _delta (text_delta, input_json_delta) /
    _stop per block, message_delta {stop_reason, usage}, message_stop (ping after the start)

Errors use Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with the
same statuses as the OpenAI routes.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from ninfer.frontend.openai_api import ApiError, bad

KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class Source(Struct, kw_only=True):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class TextBlock(Struct, tag="text", tag_field="type", kw_only=True):
    text: str
    cache_control: dict[str, Any] | None = None


class ImageBlock(Struct, tag="image", tag_field="type", kw_only=True):
    source: Source
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any] = {}
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock


class Message(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any] = {}
    description: str | None = None
    cache_control: dict[str, Any] | None = None
    type: str | None = None


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(Struct, kw_only=True):
    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None


def convert(body: dict) -> MessagesRequest:
    try:
        return msgspec.convert(body, MessagesRequest)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        param = msg.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in msg else None
        raise bad(msg.replace("`$.", "`"), param) from None


def error_body(exc: ApiError) -> dict:
    """Anthropic's error object; NInfer's own kind (``worker_lost``, ...) rides along."""
    return {"type": "error", "error": {"type": KINDS.get(exc.status, "api_error"), "message": str(exc),
                                       "ninfer_type": exc.kind}}


# ---- request -> chat input ------------------------------------------------------------------------

def _cache(block) -> dict:
    return {"cache_control": block.cache_control} if block.cache_control else {}


IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp")   # what the server decodes


def _image(block: ImageBlock, where: str) -> dict:
    s = block.source
    if s.type == "base64":
        if not s.data or not s.media_type:
            raise bad(f"{where}.source: a base64 image needs media_type and data", f"{where}.source")
        if s.media_type.lower() not in IMAGE_TYPES:
            raise bad(f"{where}.source.media_type: {s.media_type[:60]!r} is not an image type this server decodes "
                      f"({', '.join(IMAGE_TYPES)})", f"{where}.source.media_type")
        url = f"data:{s.media_type};base64,{s.data}"
    else:
        if not s.url:
            raise bad(f"{where}.source: a url image needs url", f"{where}.source")
        if s.url.partition(":")[0].lower() in ("http", "https"):
            raise bad(f"{where}.source.url: remote images are not fetched (the server never reads the network); "
                      'send the image as a base64 source ({"type": "base64", "media_type": "image/png", "data": ...})',
                      f"{where}.source.url")
        url = s.url
    return {"type": "image_url", "image_url": {"url": url}, **_cache(block)}


_CHAT_PART = re.compile(r"messages\[(\d+)\]\.content\[(\d+)\](\.image_url)?")


def request_path(message: str, blocks: dict[tuple[int, int], str]) -> tuple[str, str | None]:
    """An error about the chat input (``messages[i].content[j].image_url: ...``, from the image
    preparation) named by the Anthropic request's own path (``messages[k].content[l].source``) —
    a user turn split by tool_result blocks numbers its chat messages differently; and that
    path (None when the error names no image of the request)."""
    m = _CHAT_PART.search(message)
    block = blocks.get((int(m.group(1)), int(m.group(2)))) if m else None
    if block is None:
        return message, None
    path = block + (".source" if m.group(3) else "")
    return message[:m.start()] + path + message[m.end():], path


def _text_parts(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": b.text, **_cache(b)} if isinstance(b, TextBlock) else _image(b, f"{where}[{j}]")
            for j, b in enumerate(content)]


def _tool_result(b: ToolResultBlock, where: str) -> dict:
    """A tool_result's content and cache_control as a tool message's: text only (a tool
    message holds no image), a breakpoint on its last text block or on the block itself."""
    if isinstance(b.content, str):
        return {"content": b.content, **_cache(b)}
    for k, part in enumerate(b.content):
        if isinstance(part, ImageBlock):
            raise bad(f"{where}.content[{k}]: an image inside a tool_result is not supported (a tool message holds "
                      "text only); send it as an image block of the user turn", f"{where}.content[{k}]")
        if part.cache_control and k != len(b.content) - 1:
            raise bad(f"{where}.content[{k}].cache_control: a breakpoint inside a tool_result goes on its last "
                      "block or on the tool_result block itself", f"{where}.content[{k}].cache_control")
    last = b.content[-1] if b.content else None
    cache = b.cache_control or (last.cache_control if last is not None else None)
    return {"content": "".join(p.text for p in b.content), **({"cache_control": cache} if cache else {})}


def chat_input(req: MessagesRequest, parts_at: dict[tuple[int, int], str] | None = None
               ) -> tuple[list[dict], list[dict] | None, object]:
    """(chat messages, function tools, OpenAI tool_choice) of an Anthropic request;
    ``parts_at`` is filled with each image's chat (message, part) index -> its block's path
    (``request_path``)."""
    if not req.messages:
        raise bad("messages must be a non-empty list", "messages")
    parts_at = {} if parts_at is None else parts_at
    out: list[dict] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text_parts(req.system, "system")
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        blocks = [TextBlock(text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            text = [b for b in blocks if isinstance(b, TextBlock)]
            uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
            if any(isinstance(b, (ImageBlock, ToolResultBlock)) for b in blocks):
                raise bad(f"{where}: an assistant turn holds text and tool_use blocks only", where)
            msg: dict = {"role": "assistant", "content": "".join(b.text for b in text) if text else
                         (None if uses else "")}
            if uses:
                msg["tool_calls"] = [{"id": u.id, "type": "function",
                                      "function": {"name": u.name, "arguments": json.dumps(u.input)}} for u in uses]
            out.append(msg)
            continue
        parts: list[dict] = []
        images: list[tuple[int, str]] = []             # (part index, Anthropic path) of this chat message

        def flush() -> None:
            for k, path in images:
                parts_at[(len(out), k)] = path
            images.clear()
        for j, b in enumerate(blocks):
            if isinstance(b, ToolResultBlock):
                if parts:
                    flush()
                    out.append({"role": "user", "content": parts})
                    parts = []
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, **_tool_result(b, f"{where}[{j}]")})
            elif isinstance(b, ToolUseBlock):
                raise bad(f"{where}[{j}]: tool_use blocks belong to assistant turns", f"{where}[{j}]")
            elif isinstance(b, TextBlock):
                parts.append({"type": "text", "text": b.text, **_cache(b)})
            else:
                images.append((len(parts), f"{where}[{j}]"))
                parts.append(_image(b, f"{where}[{j}]"))
        if parts:
            flush()
            simple = len(parts) == 1 and parts[0]["type"] == "text" and "cache_control" not in parts[0]
            out.append({"role": "user", "content": parts[0]["text"] if simple else parts})
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema or {"type": "object"},
                                               **({"description": t.description} if t.description else {})}}
             for t in req.tools or ()]
    choice: object = "auto"
    if req.tool_choice is not None:
        c = req.tool_choice
        if c.type == "tool":
            if not c.name:
                raise bad("tool_choice: type 'tool' needs name", "tool_choice.name")
            choice = {"type": "function", "function": {"name": c.name}}
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[c.type]
    return out, tools or None, choice


def sampling(req: MessagesRequest) -> dict:
    """Engine sampling values (Anthropic's temperature defaults to 1)."""
    return dict(max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0)


# ---- output -----------------------------------------------------------------------------------------

def new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use(call: dict) -> dict:
    """An OpenAI tool call as a tool_use block (arguments that are not a JSON object: as text)."""
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        args = None
    if not isinstance(args, dict):
        args = {"arguments": call["function"]["arguments"]}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": args}


def usage(u, output_tokens: int) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(reason: str, stop: str | None) -> tuple[str, str | None]:
    if stop is not None:
        return "stop_sequence", stop
    return STOP_REASONS.get(reason, "end_turn"), None


def message(mid: str, model: str, text: str, calls: list[dict], reason: str, stop: str | None, u,
            output_tokens: int) -> dict:
    content = ([{"type": "text", "text": text.strip() if calls else text}] if text.strip() or not calls else [])
    content += [tool_use(c) for c in calls]
    sr, seq = stop_reason(reason, stop)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": sr, "stop_sequence": seq, "usage": usage(u, output_tokens)}


class EventStream:
    """Anthropic's stream events for one message: blocks opened and closed in order."""

    def __init__(self, mid: str, model: str):
        self.mid, self.model = mid, model
        self.index = -1
        self.open: str | None = None            # "text" while a text block is open

    @staticmethod
    def event(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    def start(self, input_tokens: int = 0, cached: int = 0) -> list[str]:
        msg = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": input_tokens, "output_tokens": 0, "cache_read_input_tokens": cached,
                         "cache_creation_input_tokens": 0}}
        return [self.event("message_start", message=msg), self.event("ping")]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.index)]

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = []
        if self.open != "text":
            out += self._close()
            self.index += 1
            self.open = "text"
            out.append(self.event("content_block_start", index=self.index, content_block={"type": "text", "text": ""}))
        return out + [self.event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": delta})]

    def tool(self, call: dict) -> list[str]:
        block = tool_use(call)
        out = self._close()
        self.index += 1
        out.append(self.event("content_block_start", index=self.index,
                              content_block={**block, "input": {}}))
        out.append(self.event("content_block_delta", index=self.index,
                              delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
        out.append(self.event("content_block_stop", index=self.index))
        return out

    def end(self, reason: str, stop: str | None, usage: dict) -> list[str]:
        """``usage``: the whole of it (message_start went out with the first token, before the
        engine had counted the prompt)."""
        sr, seq = stop_reason(reason, stop)
        return self._close() + [self.event("message_delta", delta={"stop_reason": sr, "stop_sequence": seq},
                                           usage=usage),
                                self.event("message_stop")]

    def error(self, exc: ApiError) -> str:
        return self.event("error", error=error_body(exc)["error"])
