"""Render a conversation with provenance: which message / content part / template structure
produced every character, and which token positions are *exact* frontiers.

Source parts are located by rendering once with invisible sentinels around each content text
(code points the template passes through untouched, chosen per request among ones the rendered
text does not contain), then removing them. A message boundary exists only where the rendering
of the message prefix is an exact prefix of the full rendering; a plan needs a bounded set of
them, so they are rendered on demand and remembered (each costs one O(n) render). A character
position becomes a token frontier only when (1) it falls on a token boundary of the full
tokenization and (2) tokenizing the text before it gives exactly the same tokens — appending
text can change the BPE tail token, so a naive character position is not enough. (2) tokenizes
only from the last special token before the position, where the tokenizer restarts anyway
(render.segment_cuts), so a frontier costs at most one message's length.

    text:    <|im_start|>user\\n[ content ]<|im_end|>\\n<|im_start|>assistant\\n
                               a         C            R
    parts:   (message 1, part 0) spans [a, C); C->R is template closing structure
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

from ninfer.errors import RequestError
from ninfer.frontend.render import ChatTokenizer

# Fresh prefix renders one boundary search may spend (each O(n)): the plan stays linear.
SEARCH_RENDERS = 8
PROBE_TEXT = "next-user probe"

# Private-use code points, in the order they are taken; the first ones are what the sentinels
# always were (begin U+E000, end U+E001, probe U+E0FF, tags from U+E100).
_POOL = ((0xE0FF, 0xE100), (0xE000, 0xE002), (0xE100, 0xF900), (0xE002, 0xE0FF),
         (0xF0000, 0xFFFFE), (0x100000, 0x10FFFE))
_DIGITS = 256


@dataclass
class SourcePart:
    message: int          # index into messages
    part: int             # index into the message's content parts (0 for a string)
    start: int            # char range in the clean text
    end: int
    cacheable: bool = True


@dataclass(frozen=True)
class Sentinels:
    """Marks that occur nowhere in this request's rendering: ``begin tag`` / ``end tag`` around
    each content text, the tag a fixed-width number in base len(digits)."""
    begin: str
    end: str
    digits: str
    width: int

    def tag(self, n: int) -> str:
        base, out = len(self.digits), []
        for _ in range(self.width):
            n, d = divmod(n, base)
            out.append(self.digits[d])
        return "".join(reversed(out))


def _free_chars(used: set[str]) -> Iterator[str]:
    for lo, hi in _POOL:
        for cp in range(lo, hi):
            if chr(cp) not in used:
                yield chr(cp)


def choose_marks(text: str, n_tags: int) -> tuple[str | None, Sentinels | None]:
    """The probe's leading character and the content sentinels for a request whose rendering is
    ``text``; None where the text uses up the pool (then no probe / no content provenance:
    fewer points, never a wrong one)."""
    free = _free_chars(set(text))
    probe = next(free, None)
    begin, end = next(free, None), next(free, None)
    digits = "".join(c for _, c in zip(range(_DIGITS), free))
    if end is None or len(digits) < 2:
        return probe, None
    width = 1
    while len(digits) ** width < n_tags:
        width += 1
    return probe, Sentinels(begin, end, digits, width)


def _texts(messages: list[dict]) -> Iterator[tuple[int, int]]:
    """(message, part) of every content text, in order."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            yield i, 0
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    yield i, j


def _mark(messages: list[dict], tags: list[tuple[int, int]], s: Sentinels) -> list[dict]:
    """Copy of messages with every content text wrapped in sentinels (only the containers on
    the way are copied: the sandboxed template cannot mutate what it reads)."""
    marked = [dict(m) for m in messages]
    for n, (i, j) in enumerate(tags):
        m, t = marked[i], s.tag(n)
        if isinstance(m["content"], str):
            m["content"] = f"{s.begin}{t}{m['content']}{s.end}{t}"
        else:
            if m["content"] is messages[i]["content"]:
                m["content"] = list(m["content"])
            part = m["content"][j] = dict(m["content"][j])
            part["text"] = f"{s.begin}{t}{part['text']}{s.end}{t}"
    return marked


def _strip(marked_text: str, tags: list[tuple[int, int]], s: Sentinels) -> tuple[str, list[SourcePart]] | None:
    """The text without sentinels and the located parts; None if the marks came out malformed
    (the template cut or moved them)."""
    digit = {c: v for v, c in enumerate(s.digits)}
    out: list[str] = []
    opened: dict[int, int] = {}
    parts: list[SourcePart] = []
    pos = last = 0
    for found in re.finditer(f"[{s.begin}{s.end}]", marked_text):
        i = found.start()
        code = marked_text[i + 1:i + 1 + s.width]
        if i < last or len(code) < s.width or any(c not in digit for c in code):
            return None
        tag = 0
        for c in code:
            tag = tag * len(s.digits) + digit[c]
        if tag >= len(tags):
            return None
        out.append(marked_text[last:i])
        pos += i - last
        if found.group() == s.begin:
            opened[tag] = pos
        elif tag in opened:
            parts.append(SourcePart(*tags[tag], opened.pop(tag), pos))
        last = i + 1 + s.width
    out.append(marked_text[last:])
    parts.sort(key=lambda p: p.start)
    return "".join(out), parts


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, comparing blocks in C (no per-character loop)."""
    n, lo, step = min(len(a), len(b)), 0, 1 << 14
    while lo + step <= n and a[lo:lo + step] == b[lo:lo + step]:
        lo += step
    hi = min(lo + step, n)                      # a[:lo] == b[:lo]; the first difference is < hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Rendered:
    """One request's rendering: text, tokens, located content parts and — on demand — message
    boundaries, the next-user probe and exact token frontiers (each computed once)."""

    def __init__(self, tok: ChatTokenizer, messages: list[dict], tools: list[dict] | None,
                 text: str, parts: list[SourcePart], probe_char: str | None, template_kwargs: dict | None = None):
        self.tok, self.messages, self.tools, self.text, self.parts = tok, messages, tools, text, parts
        self.kwargs = template_kwargs          # every rendering of this request sees them
        self._probe_char = probe_char
        enc = tok.tokenizer.encode(text, add_special_tokens=False)
        self.tokens: list[int] = list(enc.ids)
        self.offsets: list[tuple[int, int]] = list(enc.offsets)
        self._starts = [s for s, _ in self.offsets]
        self._first_at: dict[int, int] | None = None
        cuts = tok.segment_cuts
        self._cuts = [k for k, t in enumerate(self.tokens) if t in cuts
                      and text[self.offsets[k][0]:self.offsets[k][1]] == cuts[t]]
        self._ends: dict[int, int | None] = {}
        self._frontiers: dict[int, int | None] = {}
        self._probe_len: int | None = None
        self._by_message: dict[int, list[SourcePart]] | None = None
        preamble = self._render_or_none([], False) if tools else None
        self.tools_end = len(preamble) if preamble and text.startswith(preamble) else None
        end = self.message_end(len(messages) - 1)            # all messages, no generation prompt
        self.prompt_end = end if end is not None else len(text)

    def _render_or_none(self, messages: list[dict], add_generation_prompt: bool) -> str | None:
        # a rendering the template rejects (a prefix without a user turn, say) has no boundary
        try:
            return self.tok.render(messages, self.tools, add_generation_prompt, self.kwargs)
        except RequestError:
            return None

    def message_end(self, i: int) -> int | None:
        """Char position after message i (None: no exact boundary). One prefix render, once."""
        if i not in self._ends:
            prefix = self._render_or_none(self.messages[:i + 1], False)
            self._ends[i] = len(prefix) if prefix is not None and self.text.startswith(prefix) else None
        return self._ends[i]

    def last_boundary(self, limit: int) -> int | None:
        """The last message whose boundary exists and lies at or before ``limit``.

        Candidates start below the first message whose content the full text places past
        ``limit`` (its prefix rendering contains that content, so it cannot end by ``limit``)
        and go down, rendering at most SEARCH_RENDERS new prefixes. A template whose earlier
        rendering depends on later messages can leave a long run of prefixes that are not
        prefixes of the text; then the search takes the end of the run of boundaries that
        starts at the first message (galloping, O(log n) renders). What it returns may be
        shallower than the true last boundary, but it is always an exact one.
        """
        top = min((p.message for p in self.parts if p.end > limit), default=len(self.messages)) - 1
        fresh = 0
        for i in range(top, -1, -1):
            if i not in self._ends:
                if fresh == SEARCH_RENDERS:
                    run = self._first_run_end(limit, top)
                    known = [j for j, e in self._ends.items() if 0 <= j <= top and e is not None and e <= limit]
                    return max(known + ([run] if run is not None else []), default=None)
                fresh += 1
            e = self.message_end(i)
            if e is not None and e <= limit:
                return i
        return None

    def _first_run_end(self, limit: int, top: int) -> int | None:
        def ok(i: int) -> bool:
            e = self.message_end(i)
            return e is not None and e <= limit

        if top < 0 or not ok(0):
            return None
        lo, step = 0, 1                                 # ok(lo); gallop, then bisect
        while lo < top:
            hi = min(lo + step, top)
            if not ok(hi):
                break
            lo, step = hi, step * 2
        else:
            return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    def probe_prefix(self) -> int:
        """How much of the text a next user turn keeps: the common prefix with the rendering of
        one more user message (``probe.startswith(text[:e])`` iff ``e <=`` this). 0 when no
        probe character is free or the template rejects a user message here."""
        if self._probe_len is None:
            probe = None
            if self._probe_char is not None:
                user = {"role": "user", "content": self._probe_char + PROBE_TEXT}
                probe = self._render_or_none(list(self.messages) + [user], True)
            self._probe_len = common_prefix_len(probe, self.text) if probe is not None else 0
        return self._probe_len

    def frontier(self, char_pos: int) -> int | None:
        """The exact token frontier at ``char_pos``, or None if it is not one."""
        if char_pos not in self._frontiers:
            self._frontiers[char_pos] = self._frontier(char_pos)
        return self._frontiers[char_pos]

    def _frontier(self, char_pos: int) -> int | None:
        if char_pos == 0:
            return 0
        if char_pos == len(self.text):
            return len(self.tokens)
        k = bisect_left(self._starts, char_pos)
        if k >= len(self._starts) or self._starts[k] != char_pos:
            return None                                          # inside a token
        c = bisect_left(self._cuts, k)
        if c < len(self._cuts) and self._cuts[c] == k:
            return k                            # the input is cut here anyway (segment_cuts)
        j = self._cuts[c - 1] if c else -1
        w = self.offsets[j][1] if j >= 0 else 0
        if self.tok.encode(self.text[w:char_pos]) != self.tokens[j + 1:k]:
            return None                                          # BPE differs before the append
        return k

    def exact_token(self, char_pos: int) -> int | None:
        """The first token starting at ``char_pos`` (the token count at the text's end)."""
        if char_pos >= len(self.text):
            return len(self.tokens)
        if self._first_at is None:
            self._first_at = {}
            for k in range(len(self._starts) - 1, -1, -1):
                self._first_at[self._starts[k]] = k
        return self._first_at.get(char_pos)

    def parts_of(self, message: int) -> list[SourcePart]:
        if self._by_message is None:
            self._by_message = {}
            for p in self.parts:
                self._by_message.setdefault(p.message, []).append(p)
        return self._by_message.get(message, [])


def render_with_provenance(tok: ChatTokenizer, messages: list[dict], tools: list[dict] | None,
                           add_generation_prompt: bool = True, template_kwargs: dict | None = None,
                           continue_final: bool = False) -> Rendered:
    """``template_kwargs`` reach every rendering (prefixes and the probe too);
    ``continue_final`` leaves the final message open (``render.continue_final_message``)."""
    text = tok.render(messages, tools, add_generation_prompt, template_kwargs, continue_final)
    tags = list(_texts(messages))
    probe_char, marks = choose_marks(text, len(tags))
    parts: list[SourcePart] = []
    if marks is not None:
        try:
            marked = tok.render(_mark(messages, tags, marks), tools, add_generation_prompt, template_kwargs,
                                continue_final)
        except RequestError:
            marked = None                                  # the template rejects marked content
        stripped = _strip(marked, tags, marks) if marked is not None else None
        if stripped is not None and stripped[0] == text:   # else the template transformed content
            parts = stripped[1]
    return Rendered(tok, messages, tools, text, parts, probe_char, template_kwargs)
