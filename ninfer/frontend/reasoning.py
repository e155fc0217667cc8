"""Reasoning parsers: the model's thinking apart from its answer (vLLM's ``--reasoning-parser``).

    text -> ThinkSplit.feed -> (reasoning, content)      reasoning: chat ``reasoning_content`` /
                                                         Responses reasoning items; content: the
                                                         answer (tool calls are parsed from it)

Qwen3's format (``qwen3``): the answer may open with ``<think>`` (Qwen3 hybrid models write it
themselves) or start inside it (templates whose generation prompt ends with ``<think>``, e.g.
Qwen3.5 and the thinking-2507 models); everything up to ``</think>`` is reasoning, the rest is
the answer. The same parser serves streaming and non-streaming answers, so both split alike; an
answer cut off inside its thinking (max_tokens) is all reasoning. The newlines the template puts
around the thinking are not part of either (the template strips them when it renders a reasoning
back: ``reasoning.strip("\\n")``, ``content.lstrip("\\n")``).
"""

from __future__ import annotations

from ninfer.frontend.streaming import partial_suffix

START, END = "<think>", "</think>"
PARSERS = ("qwen3",)


def choose_parser(name: str, template: str) -> str | None:
    """``auto``: ``qwen3`` when the chat template knows Qwen's thinking (``<think>`` or
    ``enable_thinking``), else none; ``none``; or a parser by name."""
    if name == "none":
        return None
    if name == "auto":
        return "qwen3" if ("<think>" in template or "enable_thinking" in template) else None
    if name not in PARSERS:
        from ninfer.errors import ConfigError
        raise ConfigError(f"--reasoning-parser {name!r} is not one of auto, none, {', '.join(PARSERS)}")
    return name


def starts_inside(prompt_text_tail: str) -> bool:
    """Does the prompt leave the model inside its thinking (the generation prompt ends with
    ``<think>``)?"""
    return prompt_text_tail.rstrip().endswith(START)


class ThinkSplit:
    """Incremental ``<think>`` ... ``</think>`` split; ``feed`` returns (reasoning, content) of
    the text that can be released (a partial tag or trailing newlines are held back)."""

    def __init__(self, inside: bool = False):
        self.state = "inside" if inside else "start"      # start -> inside -> after, or start -> after
        self.buf = ""
        self.lead = True                 # strip newlines at the start of the current part
        self.thought = inside            # was there any thinking at all

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.buf = head[len(START):]
                    self.state, self.lead, self.thought = "inside", True, True
                    continue
                if START.startswith(head):              # a partial "<think>" (or only whitespace)
                    break
                self.state, self.lead = "after", False
                continue
            if self.state == "inside":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning.append(self._part(self.buf[:i]).rstrip("\n"))
                    self.buf = self.buf[i + len(END):]
                    self.state, self.lead = "after", True
                    continue
                keep = partial_suffix(self.buf, [END])
                body = self.buf[:len(self.buf) - keep]
                trail = len(body) - len(body.rstrip("\n"))      # held: they may precede </think>
                reasoning.append(self._part(body[:len(body) - trail]))
                self.buf = self.buf[len(body) - trail:]
                break
            content.append(self._part(self.buf))
            self.buf = ""
        return "".join(reasoning), "".join(content)

    def _part(self, text: str) -> str:
        if self.lead:
            stripped = text.lstrip("\n")
            if stripped:
                self.lead = False
            return stripped
        return text

    def flush(self) -> tuple[str, str]:
        """At the end: what was held back (an unfinished thinking stays reasoning)."""
        rest, self.buf = self.buf, ""
        if self.state == "inside":
            return self._part(rest), ""
        if self.state == "start":
            return "", rest
        return "", self._part(rest)
