"""Render a conversation with provenance: which message / content part / template structure
produced every character, and which token positions are *exact* frontiers.

Source parts are located by rendering with invisible sentinels around each content text
(private-use characters the template passes through untouched), then removing them; message
boundaries by rendering message prefixes (a boundary exists only where the prefix rendering is
an exact prefix of the full rendering). A character position becomes a token frontier only when
(1) it falls on a token boundary of the full tokenization and (2) tokenizing the text before it
gives exactly the same tokens — appending text can change the BPE tail token, so a naive
character position is not enough.

    text:    <|im_start|>user\\n[ content ]<|im_end|>\\n<|im_start|>assistant\\n
                               a         C            R
    parts:   (message 1, part 0) spans [a, C); C->R is template closing structure
"""

from __future__ import annotations

import copy
from bisect import bisect_left
from dataclasses import dataclass, field

from ninfer.frontend.render import ChatTokenizer

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
