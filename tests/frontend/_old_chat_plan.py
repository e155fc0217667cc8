"""A frozen copy of the chat planning algorithm as it was before issue 13 (quadratic: every
message prefix rendered). Kept only as the reference the randomized equivalence test compares
the current plan_chat against; do not import it from the package."""

from __future__ import annotations

import copy
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field

from ninfer.errors import RequestError
from ninfer.protocol import MAX_MARKERS

BEGIN, END = "\ue000", "\ue001"
TAG0 = 0xE100


@dataclass
class SourcePart:
    message: int          # index into messages
    part: int             # index into the message's content parts (0 for a string)
    start: int            # char range in the clean text
    end: int
    cacheable: bool = True


@dataclass
class Rendered:
    text: str
    tokens: list[int]
    offsets: list[tuple[int, int]]
    parts: list[SourcePart]
    message_end: list[int | None]          # char position after each message (None: no exact boundary)
    tools_end: int | None                  # char position after the tools/system preamble
    prompt_end: int                         # char position before the generation prompt
    tok: ChatTokenizer = field(repr=False, default=None)
    _starts: list[int] = field(default_factory=list, repr=False)

    def frontier(self, char_pos: int) -> int | None:
        """The exact token frontier at ``char_pos``, or None if it is not one."""
        if char_pos == 0:
            return 0
        if char_pos == len(self.text):
            return len(self.tokens)
        if not self._starts:
            self._starts = [s for s, _ in self.offsets]
        k = bisect_left(self._starts, char_pos)
        if k >= len(self._starts) or self._starts[k] != char_pos:
            return None                                          # inside a token
        if self.tok.encode(self.text[:char_pos]) != self.tokens[:k]:
            return None                                          # BPE differs before the append
        return k

    def parts_of(self, message: int) -> list[SourcePart]:
        return [p for p in self.parts if p.message == message]


def _mark(messages: list[dict]) -> tuple[list[dict], list[tuple[int, int]]]:
    """Copy of messages with every content text wrapped in sentinels; the (message, part) of
    each tag."""
    marked = copy.deepcopy(messages)
    tags: list[tuple[int, int]] = []
    for i, m in enumerate(marked):
        content = m.get("content")
        if isinstance(content, str):
            m["content"] = f"{BEGIN}{chr(TAG0 + len(tags))}{content}{END}{chr(TAG0 + len(tags))}"
            tags.append((i, 0))
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    part["text"] = f"{BEGIN}{chr(TAG0 + len(tags))}{part['text']}{END}{chr(TAG0 + len(tags))}"
                    tags.append((i, j))
    return marked, tags


def _strip(marked_text: str, tags: list[tuple[int, int]]) -> tuple[str, list[SourcePart]]:
    out: list[str] = []
    pos = 0
    opened: dict[int, int] = {}
    parts: list[SourcePart] = []
    i = 0
    while i < len(marked_text):
        ch = marked_text[i]
        if ch in (BEGIN, END) and i + 1 < len(marked_text):
            tag = ord(marked_text[i + 1]) - TAG0
            if ch == BEGIN:
                opened[tag] = pos
            elif tag in opened:
                msg, part = tags[tag]
                parts.append(SourcePart(msg, part, opened.pop(tag), pos))
            i += 2
            continue
        out.append(ch)
        pos += 1
        i += 1
    parts.sort(key=lambda p: p.start)
    return "".join(out), parts


def render_with_provenance(tok: ChatTokenizer, messages: list[dict], tools: list[dict] | None,
                           add_generation_prompt: bool = True) -> Rendered:
    text = tok.render(messages, tools, add_generation_prompt)
    marked, tags = _mark(messages)
    clean, parts = _strip(tok.render(marked, tools, add_generation_prompt), tags)
    if clean != text:                  # the template transformed content: no content provenance
        parts = []
    ends: list[int | None] = []
    for k in range(1, len(messages) + 1):
        prefix = tok.render(messages[:k], tools, add_generation_prompt=False)
        ends.append(len(prefix) if text.startswith(prefix) else None)
    preamble = tok.render([], tools, add_generation_prompt=False) if tools else ""
    tools_end = len(preamble) if preamble and text.startswith(preamble) else None
    no_gen = tok.render(messages, tools, add_generation_prompt=False)
    prompt_end = len(no_gen) if text.startswith(no_gen) else len(text)
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    return Rendered(text=text, tokens=list(enc.ids), offsets=list(enc.offsets), parts=parts,
                    message_end=ends, tools_end=tools_end, prompt_end=prompt_end, tok=tok)

PROBE = {"role": "user", "content": "\ue0ffnext-user probe"}
CLOSING_ROLES = ("user", "system", "developer")


class OutputMemory:
    """Token ids of recent outputs by their text, so an assistant message the client sends back
    is computed with exactly the tokens the model produced (and the generation end E matches)."""

    def __init__(self, capacity: int = 2048):
        self.capacity = capacity
        self._by_text: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def remember(self, text: str, ids: list[int]) -> None:
        if not text:
            return
        self._by_text[text] = tuple(ids)
        self._by_text.move_to_end(text)
        while len(self._by_text) > self.capacity:
            self._by_text.popitem(last=False)

    def get(self, text: str) -> tuple[int, ...] | None:
        return self._by_text.get(text)


@dataclass
class ChatPlan:
    prompt: list[int]
    response_replay: int | None = None
    turn_closure: int | None = None
    recovery_frontier: int | None = None
    markers: list[int] = field(default_factory=list)
    auto_marker: int | None = None
    split_points: list[int] = field(default_factory=list)


class _Tokens:
    """The rendered tokens with remembered outputs substituted, and char -> token frontiers
    that account for the substitution."""

    def __init__(self, r: Rendered, messages: list[dict], memory: OutputMemory | None):
        self.r = r
        self.tokens = list(r.tokens)
        self.shifts: list[tuple[int, int, int]] = []        # (char start, char end, token delta)
        if memory is not None:
            self._substitute(messages, memory)

    def _substitute(self, messages: list[dict], memory: OutputMemory) -> None:
        r = self.r
        edits = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            for p in r.parts_of(i):
                ids = memory.get(r.text[p.start:p.end])
                a, b = self._exact(p.start), self._exact(p.end)
                if ids is None or a is None or b is None or list(ids) == self.tokens[a:b]:
                    continue
                edits.append((a, b, list(ids), p.start, p.end))
        for a, b, ids, cs, ce in sorted(edits, reverse=True):
            self.tokens[a:b] = ids
            self.shifts.append((cs, ce, len(ids) - (b - a)))

    def _exact(self, char_pos: int) -> int | None:
        starts = [s for s, _ in self.r.offsets] + [len(self.r.text)]
        try:
            return starts.index(char_pos) if char_pos < len(self.r.text) else len(self.r.tokens)
        except ValueError:
            return None

    def frontier(self, char_pos: int | None) -> int | None:
        if char_pos is None:
            return None
        k = self.r.frontier(char_pos)
        if k is None:
            return None
        for cs, ce, delta in self.shifts:
            if cs < char_pos < ce:
                return None                # inside a substituted output: not offered
            if char_pos >= ce:
                k += delta
        return k


def _content_parts_complete(message: dict) -> bool:
    """Every content part is text (no media missing from the provenance)."""
    c = message.get("content")
    if isinstance(c, str):
        return True
    return isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in c)


def plan_chat(tok: ChatTokenizer, messages: list[dict], tools: list[dict] | None = None,
              memory: OutputMemory | None = None) -> ChatPlan:
    r = render_with_provenance(tok, messages, tools, add_generation_prompt=True)
    t = _Tokens(r, messages, memory)
    plan = ChatPlan(prompt=t.tokens)
    n = len(messages)
    # ---- typed R -----------------------------------------------------------------------------
    rr_char = r.prompt_end
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    tc_char = rr_char
    if users:
        after = [i for i in range(users[-1] + 1, n) if messages[i].get("role") == "assistant"]
        if after and r.message_end[after[0] - 1] is not None:
            tc_char = r.message_end[after[0] - 1]
    probe = tok.render(list(messages) + [PROBE], tools, add_generation_prompt=True)
    if not probe.startswith(r.text[:tc_char]):
        # the next user turn would re-render the open turn: the last boundary that survives it
        tc_char = max((e for e in r.message_end if e is not None and probe.startswith(r.text[:e])), default=0)
    plan.response_replay = t.frontier(rr_char)
    plan.turn_closure = t.frontier(tc_char)
    typed_r_char = rr_char if probe.startswith(r.text[:rr_char]) else tc_char
    # ---- the actual restore position: C or R ------------------------------------------------
    r_tok = t.frontier(typed_r_char)
    plan.recovery_frontier = r_tok
    last = next((i for i in range(n - 1, -1, -1) if r.message_end[i] is not None and r.message_end[i] <= typed_r_char),
                None)
    if last is not None and messages[last].get("role") in CLOSING_ROLES and _content_parts_complete(messages[last]):
        parts = r.parts_of(last)
        if parts:
            c_char = parts[-1].end
            closing_only = not any(p.start < typed_r_char and p.end > c_char for p in r.parts)
            c_tok = t.frontier(c_char)
            if closing_only and c_tok is not None and r.message_end[last] == typed_r_char:
                plan.recovery_frontier = c_tok
    plan.split_points = sorted({x for x in (plan.response_replay, plan.turn_closure) if x})
    # ---- markers -------------------------------------------------------------------------
    explicit: list[int] = []
    for i, m in enumerate(messages):
        if m.get("cache_control") and r.message_end[i] is not None:
            explicit.append(r.message_end[i])                 # a message boundary stays one
        content = m.get("content")
        if isinstance(content, list):
            for part in r.parts_of(i):
                src = content[part.part]
                if isinstance(src, dict) and src.get("cache_control"):
                    explicit.append(part.end)
    if len(set(explicit)) > MAX_MARKERS:
        raise RequestError(f"cache_control: at most {MAX_MARKERS} cache markers are allowed, got {len(set(explicit))}")
    resolved = {k for k in (t.frontier(c) for c in explicit) if k}
    auto = _auto_marker(messages, r)
    auto_tok = t.frontier(auto)
    if auto_tok and (auto_tok in resolved or len(resolved) < MAX_MARKERS):
        resolved.add(auto_tok)
        plan.auto_marker = auto_tok
    for structural in (r.message_end[0] if n and messages[0].get("role") in ("system", "developer") else None,
                       r.tools_end):
        k = t.frontier(structural)
        if k and len(resolved) < MAX_MARKERS:
            resolved.add(k)
    plan.markers = sorted(resolved)
    return plan


def _auto_marker(messages: list[dict], r: Rendered) -> int | None:
    """OpenAI's default: the end of the last cacheable source part; a structured tool call uses
    its message boundary; with no message content the tools boundary."""
    last_msg = len(messages) - 1
    if last_msg >= 0 and messages[last_msg].get("tool_calls") and not r.parts_of(last_msg):
        return r.message_end[last_msg]
    if r.parts:
        return max(p.end for p in r.parts if p.cacheable)
    return r.tools_end
