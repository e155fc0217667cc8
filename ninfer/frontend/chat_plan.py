"""From chat messages to the exact prompt and its restore positions (seed: Frontend 行, typed R,
共享 marker).

    typed R    ResponseReplay  just before the current assistant response starts: the upper
                               bound for retries, structured tool calls and normalised history
               TurnClosure     just before the first assistant start after the current real
                               user message: the upper bound for a next user turn that rewrites
                               the open turn (found with a next-user probe rendering)
    recovery   the input position whose State is actually kept: C (the content boundary before
               the closing structure) only when provenance proves C->R, right after a
               User/System/Developer message, is pure template closing structure and C is an
               exact token frontier — then the closing tokens are recomputed after restore;
               otherwise R. It follows the typed R's message structure, never the auto marker.
    markers    explicit (cache_control on a message or content part; <= 4), the automatic one
               (end of the last cacheable source part; a structured tool call uses its message
               boundary; with no content the tools boundary), bounded structural opportunities
               (leading instructions, tools) — all resolved to exact token frontiers, same points
               merged, the automatic one yielding when four explicit positions are taken.
    splits     rewrite execution frontiers (ResponseReplay, TurnClosure): where the math splits;
               they do not move when the restore position moves or a save fails.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ninfer.errors import RequestError
from ninfer.frontend.provenance import Rendered, render_with_provenance
from ninfer.frontend.render import ChatTokenizer
from ninfer.protocol import MAX_MARKERS

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
