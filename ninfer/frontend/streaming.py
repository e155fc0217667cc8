"""One choice's output as the client sees it, the same in streaming and non-streaming mode:
incremental detokenisation, stop strings held back while a partial match is possible, tool
calls parsed out of the text as they complete, and the tokens (and logprobs) counted up to the
stop.

    engine tokens -> TextDecoder (per token, UTF-8 safe) -> StopScan (hold back a partial stop)
                  -> reasoning split (frontend/reasoning.py: <think> ... </think> apart, when on)
                  -> ToolStream (hold back a partial "<tool_call>", parse closed blocks; the
                     answer only, never the reasoning)
                  -> Piece(content, calls, logprobs, reasoning) ... Finish(reason, completion_tokens)

A stop string ends the choice at the token that completed it: that token is the last one
counted, the text ends before the stop string, and the engine request is cancelled.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def partial_suffix(text: str, needles: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``needles``
    (what must be held back because the next characters could complete a match)."""
    best = 0
    for s in needles:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextDecoder:
    """Incremental detokenisation (the prefix/read offsets vLLM uses): each token's new text is
    the decode of a short window minus the decode of its prefix, so the cost per token is
    constant; an incomplete UTF-8 sequence yields nothing until it completes."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        window = self.decode(self.ids[self.prefix:])
        if window.endswith("\ufffd"):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        if len(window) <= len(before):
            return ""                                   # nothing new yet (e.g. a skipped special)
        if window.startswith(before):
            delta = window[len(before):]
        else:                                           # the window re-read its prefix: full decode
            delta = self.decode(self.ids)[len(self.text):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> None:
        """At the end: what an incomplete trailing sequence decodes to (as a full decode shows it)."""
        full = self.decode(self.ids)
        if len(full) > len(self.text) and full.startswith(self.text):
            self.text = full


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str) -> dict | None:
    """A Qwen/Hermes ``{"name": ..., "arguments": ...}`` block -> an OpenAI tool call."""
    try:
        obj = json.loads(body)
        name, args = obj["name"], obj.get("arguments", {})
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


class ToolStream:
    """Splits released text into content and completed tool calls; a block that does not
    parse stays content."""

    def __init__(self):
        self.buf = ""
        self.inside = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        content, calls = [], []
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = partial_suffix(self.buf, [OPEN])
                    content.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(OPEN):], True
            j = self.buf.find(CLOSE)
            if j < 0:
                break
            body, self.buf, self.inside = self.buf[:j], self.buf[j + len(CLOSE):], False
            call = parse_call(body)
            if call is None:
                content.append(OPEN + body + CLOSE)
            else:
                calls.append(call)
        return "".join(content), calls

    def flush(self) -> str:
        rest = (OPEN if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return rest


@dataclass
class Piece:
    content: str = ""
    calls: list[dict] = field(default_factory=list)
    logprobs: list = field(default_factory=list)      # TokenLogprob per counted token
    token_ids: list[int] = field(default_factory=list)  # the counted tokens this piece adds
    reasoning: str = ""                                 # the model's thinking (a reasoning parser)
    prompt_logprobs: list | None = None                 # the first piece: the prompt's, when asked


@dataclass
class Finish:
    reason: str                      # OpenAI finish reason: stop | length | tool_calls | error
    completion_tokens: int
    out: object                      # the engine's Output
    calls: int = 0
    stop: str | None = None          # the stop string that ended it


class ChoiceStream:
    """Feeds a request's events through decoding, stop strings and tool parsing."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], parse_tools: bool,
                 include_stop: bool = False, stop_ids: frozenset[int] = frozenset(), min_tokens: int = 0,
                 reasoning=None):
        self.text = TextDecoder(decode)
        self.reasoning = reasoning            # a reasoning split (reasoning.ThinkSplit) or None
        self.include_stop = include_stop     # include_stop_str_in_output: the text ends after it
        # the token that stops the request (a stop id or EOS, at or past min_tokens) is counted
        # but, as in vLLM, not part of the text unless include_stop_str_in_output
        self.stop_ids = frozenset() if include_stop else stop_ids
        self.min_tokens = min_tokens
        self.stop = [s for s in stop if s]
        self.longest = max((len(s) for s in self.stop), default=0)
        self.tools = ToolStream() if parse_tools else None
        self.lens: list[int] = []            # decoded text length after each token
        self.sent = 0                        # characters released past the stop scan
        self.stopped_at: int | None = None   # tokens counted when a stop string matched
        self.stop_hit: str | None = None     # ... and which one
        self.ncalls = 0

    def _release(self, text: str, logprobs: list, token_ids: list[int], final: bool = False) -> Piece:
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if final:
                more, rest = self.reasoning.flush()
                thought, text = thought + more, text + rest
        if self.tools is None:
            return Piece(text, [], logprobs, token_ids, thought)
        content, calls = self.tools.feed(text)
        self.ncalls += len(calls)
        return Piece(content, calls, logprobs, token_ids, thought)

    def feed(self, token_ids: list[int], logprobs: list | None = None) -> Piece:
        if self.stopped_at is not None:
            return Piece()
        first = len(self.lens)
        for t in token_ids:
            if not (t in self.stop_ids and len(self.lens) + 1 >= self.min_tokens):
                self.text.add(t)
            self.lens.append(len(self.text.text))
        text = self.text.text
        if self.stop:
            start = max(0, self.sent - self.longest + 1)
            hits = [(i, len(s), s) for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                i, n, self.stop_hit = min(hits)
                end = i + n
                k = next(j for j in range(first, len(self.lens)) if self.lens[j] >= end) + 1
                self.stopped_at = k
                cut = end if self.include_stop else i
                piece = self._release(text[self.sent:cut], list(logprobs or [])[:k - first],
                                      list(token_ids[:k - first]))
                self.sent = cut
                return piece
            upto = len(text) - partial_suffix(text, self.stop)
        else:
            upto = len(text)
        piece = self._release(text[self.sent:upto], list(logprobs or []), list(token_ids))
        self.sent = max(self.sent, upto)
        return piece

    def finish(self, out) -> tuple[Piece, Finish]:
        """The held-back tail (no stop can complete now) and the choice's end."""
        if self.stopped_at is None:
            self.text.flush()
            tail = self._release(self.text.text[self.sent:], [], [], final=True)
            self.sent = len(self.text.text)
        else:
            tail = self._release("", [], [], final=True)
        if self.tools is not None:
            tail.content += self.tools.flush()
        if out.finish_reason == "error":
            reason = "error"
        elif self.stopped_at is not None:
            reason = "stop"
        elif self.ncalls:
            reason = "tool_calls"
        else:
            reason = {"stop": "stop", "length": "length", "cancelled": "stop"}.get(out.finish_reason,
                                                                                 out.finish_reason)
        count = self.stopped_at if self.stopped_at is not None else len(out.token_ids)
        return tail, Finish(reason, count, out, self.ncalls, self.stop_hit)


async def run_choice(handle, stream: ChoiceStream) -> AsyncIterator[Piece | Finish]:
    """Pieces as tokens commit, then the Finish; a matched stop string cancels the request.
    The first token event always yields a piece (empty when its text is held back): a stream
    opens the choice (the role chunk, an echo) on it, never before (vLLM's honest TTFT)."""
    first = True
    async for ev in handle.aiter():
        piece = stream.feed(ev.token_ids, getattr(ev, "logprobs", None))
        if first:
            piece.prompt_logprobs = getattr(ev, "prompt_logprobs", None)
        if first or piece.content or piece.calls or piece.logprobs or piece.token_ids or piece.reasoning:
            first = False
            yield piece
        if stream.stopped_at is not None:
            handle.cancel()
            break
    out = await handle.result_async()
    tail, fin = stream.finish(out)
    if tail.content or tail.calls or tail.reasoning:
        yield tail
    yield fin
