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

Cost: a constant number of full renders (the text, the marked text, the probe, the tools
preamble) and of prefix renders (the boundary before the open turn, explicit message markers,
the leading instructions, two bounded searches: provenance.last_boundary), a constant number of
frontier checks, everything else one pass — linear in the conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ninfer.errors import RequestError
from ninfer.frontend.provenance import Rendered, render_with_provenance
from ninfer.frontend.render import ChatTokenizer
from ninfer.protocol import MAX_MARKERS, TemplateOptions

CLOSING_ROLES = ("user", "system", "developer")
# message-level cache_control entries rendered at most (each a prefix render); more is refused
MAX_MESSAGE_MARKS = 4 * MAX_MARKERS


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
        self.tokens = r.tokens
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
                if ids is None:
                    continue
                a, b = r.exact_token(p.start), r.exact_token(p.end)
                if a is None or b is None or list(ids) == r.tokens[a:b]:
                    continue
                edits.append((a, b, list(ids), p.start, p.end))
        if not edits:
            return
        # disjoint parts have disjoint token ranges (offsets never decrease): one ordered pass
        edits = [e for e in sorted(edits) if e[0] <= e[1]]
        edits = [e for k, e in enumerate(edits) if k == 0 or e[0] >= edits[k - 1][1]]
        out, at = [], 0
        for a, b, ids, _, _ in edits:
            out += r.tokens[at:a]
            out += ids
            at = b
        self.tokens = out + r.tokens[at:]
        self.shifts = [(cs, ce, len(ids) - (b - a)) for a, b, ids, cs, ce in reversed(edits)]

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
              memory: OutputMemory | None = None, template: TemplateOptions | None = None) -> ChatPlan:
    """``template``: the generation prompt or a continued final message, and the template's extra
    variables (every rendering below sees the same ones)."""
    t_opts = template or TemplateOptions()
    r = render_with_provenance(tok, messages, tools,
                               add_generation_prompt=t_opts.add_generation_prompt and not t_opts.continue_final_message,
                               template_kwargs=t_opts.kwargs or None, continue_final=t_opts.continue_final_message)
    t = _Tokens(r, messages, memory)
    plan = ChatPlan(prompt=t.tokens)
    rr_char, tc_char, typed_r_char = _typed_r(r, messages)
    plan.response_replay = t.frontier(rr_char)
    plan.turn_closure = t.frontier(tc_char)
    plan.recovery_frontier = _recovery(r, t, messages, typed_r_char)
    plan.split_points = sorted({x for x in (plan.response_replay, plan.turn_closure) if x})
    plan.markers, plan.auto_marker = _markers(r, t, messages)
    return plan


def _typed_r(r: Rendered, messages: list[dict]) -> tuple[int, int, int]:
    """Char positions of ResponseReplay, TurnClosure and the typed R the restore follows."""
    n = len(messages)
    rr_char = r.prompt_end
    tc_char = rr_char
    last_user = next((i for i in range(n - 1, -1, -1) if messages[i].get("role") == "user"), None)
    if last_user is not None:
        after = next((i for i in range(last_user + 1, n) if messages[i].get("role") == "assistant"), None)
        if after is not None and r.message_end(after - 1) is not None:
            tc_char = r.message_end(after - 1)
    kept = r.probe_prefix()                         # probe.startswith(text[:e]) iff e <= kept
    if tc_char > kept:
        # the next user turn would re-render the open turn: the last boundary that survives it
        last = r.last_boundary(kept)
        tc_char = r.message_end(last) if last is not None else 0
    return rr_char, tc_char, rr_char if rr_char <= kept else tc_char


def _recovery(r: Rendered, t: _Tokens, messages: list[dict], typed_r_char: int) -> int | None:
    """C when C->R right after a User/System/Developer message is pure closing structure and C
    is exact; otherwise R (seed: recovery C vs R)."""
    r_tok = t.frontier(typed_r_char)
    last = r.last_boundary(typed_r_char)
    if last is None or messages[last].get("role") not in CLOSING_ROLES or not _content_parts_complete(messages[last]):
        return r_tok
    parts = r.parts_of(last)
    if not parts or r.message_end(last) != typed_r_char:
        return r_tok
    c_char = parts[-1].end
    if any(p.start < typed_r_char and p.end > c_char for p in r.parts):
        return r_tok                                # content between C and R: not closing only
    c_tok = t.frontier(c_char)
    return c_tok if c_tok is not None else r_tok


def _markers(r: Rendered, t: _Tokens, messages: list[dict]) -> tuple[list[int], int | None]:
    """The resolved marker frontiers and the automatic one (None when it yields)."""
    n = len(messages)
    on_messages = sum(1 for m in messages if m.get("cache_control"))
    if on_messages > MAX_MESSAGE_MARKS:
        # each needs a prefix render; far more than the allowed markers is refused unrendered
        raise RequestError(f"cache_control: at most {MAX_MARKERS} cache markers are allowed, got "
                           f"{on_messages} messages with cache_control")
    explicit: list[int] = []
    for i, m in enumerate(messages):
        if m.get("cache_control") and r.message_end(i) is not None:
            explicit.append(r.message_end(i))                 # a message boundary stays one
        content = m.get("content")
        if isinstance(content, list):
            for part in r.parts_of(i):
                src = content[part.part]
                if isinstance(src, dict) and src.get("cache_control"):
                    explicit.append(part.end)
    if len(set(explicit)) > MAX_MARKERS:
        raise RequestError(f"cache_control: at most {MAX_MARKERS} cache markers are allowed, got {len(set(explicit))}")
    resolved = {k for k in (t.frontier(c) for c in explicit) if k}
    auto_marker = None
    auto_tok = t.frontier(_auto_marker(messages, r))
    if auto_tok and (auto_tok in resolved or len(resolved) < MAX_MARKERS):
        resolved.add(auto_tok)
        auto_marker = auto_tok
    for structural in (r.message_end(0) if n and messages[0].get("role") in ("system", "developer") else None,
                       r.tools_end):
        k = t.frontier(structural)
        if k and len(resolved) < MAX_MARKERS:
            resolved.add(k)
    return sorted(resolved), auto_marker


def _auto_marker(messages: list[dict], r: Rendered) -> int | None:
    """OpenAI's default: the end of the last cacheable source part; a structured tool call uses
    its message boundary; with no message content the tools boundary."""
    last_msg = len(messages) - 1
    if last_msg >= 0 and messages[last_msg].get("tool_calls") and not r.parts_of(last_msg):
        return r.message_end(last_msg)
    if r.parts:
        return max(p.end for p in r.parts if p.cacheable)
    return r.tools_end
