"""Structured outputs: constraints as grammars, and one request's grammar state.

The library is llguidance (Rust, one abi3 wheel, no dependencies): measured against xgrammar
and outlines-core on the tiny model's tokenizer (docs/api.md, "Structured outputs"): both
llguidance and xgrammar compile a JSON schema in about a millisecond and compute a token mask in
tens of microseconds, but xgrammar's JSON grammar let raw control characters into strings (2 of
20 random-model answers did not parse with ``json.loads``), llguidance's none; outlines-core has
no context-free grammars (vLLM's ``grammar``). llguidance also takes Lark and GBNF, regexes,
choices, and JSON schemas inside Lark (the tool-call format), and needs no torch or transformers.

    request (frontend)  ->  Constraint(grammar, kind, think)   (sampling_params; travels in the spec)
    worker / oracle     ->  GrammarState per sequence: allowed() [V] bool, accept(token), complete

The state is a pure function of the committed output: ``sync`` feeds it whatever output it has
not seen (a Replay after a destructive pause rebuilds it from the ledger without sampling again;
a Snapshot keeps it). It lives on the sequence, never in a checkpoint, so no cached prefix
carries it. A reasoning model (``Constraint.think``) whose prompt leaves the answer inside its
thinking (a template that opens ``<think>``, as Qwen3.5's) thinks first: the grammar starts after
``</think>`` (whitespace right after it is free), and EOS is barred while thinking. Otherwise the
grammar holds from the answer's first token — a hybrid model that would open ``<think>`` itself
answers without thinking under a constraint (vLLM waits for a ``</think>`` that may never come;
here the constrained answer always arrives).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ninfer.errors import RequestError
from ninfer.sampling_params import Constraint

# JSON the way a model writes it compactly (vLLM's disable_any_whitespace); flexible on request
COMPACT = {"whitespace_flexible": False}


def _llg():
    import llguidance
    return llguidance


# ---- building constraints ------------------------------------------------------------------------

def json_schema(schema: dict | str, flexible: bool = False, whitespace_pattern: str | None = None) -> Constraint:
    """Output that is one JSON value valid for ``schema`` (a dict or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise RequestError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise RequestError("a JSON schema must be an object")
    opts = {"whitespace_flexible": flexible}
    if whitespace_pattern is not None:
        opts["whitespace_pattern"] = whitespace_pattern
    try:
        g = _llg().LLMatcher.grammar_from_json_schema(schema, defaults=opts)
    except ValueError as exc:
        raise RequestError(f"the JSON schema is not valid: {exc}") from None
    return Constraint(grammar=g, kind="json")


def json_object(flexible: bool = False) -> Constraint:
    """Any JSON object (OpenAI's ``response_format: json_object``)."""
    return msgspec_replace(json_schema({"type": "object"}, flexible), kind="json_object")


def regex(pattern: str) -> Constraint:
    return Constraint(grammar=_llg().LLMatcher.grammar_from_regex(pattern), kind="regex")


def choice(options: list[str]) -> Constraint:
    """Exactly one of ``options``."""
    if not options or not all(isinstance(o, str) and o for o in options):
        raise RequestError("a choice needs a non-empty list of non-empty strings")
    return Constraint(grammar=_llg().grammar_from("choice", json.dumps(options)), kind="choice")


def grammar(text: str) -> Constraint:
    """A Lark grammar (llguidance's dialect, ``start:`` rule) or a GBNF / EBNF one (``root ::=``)."""
    try:
        g = _llg().grammar_from("grammar", text)
    except ValueError as exc:
        raise RequestError(f"the grammar does not parse: {exc}") from None
    return Constraint(grammar=g, kind="grammar")


def tool_calls(tools: list[dict], name: str | None = None, parallel: bool = True,
               tag_token: bool = True) -> Constraint:
    """Qwen / Hermes tool calls — ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` —
    of ``name`` (a named tool_choice) or of any of ``tools`` (``required``): one, or with
    ``parallel`` one or more (newline-separated, as the chat template renders them). Arguments
    follow each function's ``parameters`` schema. ``tag_token``: the tags are single tokens of the
    tokenizer (written as llguidance's special-token references, which is how it matches them)."""
    def body(fn: dict) -> dict:
        params = fn.get("parameters") or {"type": "object"}
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}
    fns = [t.get("function", t) for t in tools]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
    if not fns:
        raise RequestError("tool_choice names no function among the tools")
    schema = body(fns[0]) if len(fns) == 1 else {"anyOf": [body(f) for f in fns]}
    schema = {"x-guidance": COMPACT, **schema}
    open_, close = ("<tool_call>", "</tool_call>") if tag_token else ('"<tool_call>"', '"</tool_call>"')
    more = ' ("\\n" call)*' if parallel else ""          # Lark's "\n": a newline between calls
    lark = "\n".join([f"start: call{more}",
                      f'call: {open_} "\\n" body "\\n" {close}',
                      f"body: %json {json.dumps(schema)}", ""])
    return Constraint(grammar=_llg().LLMatcher.grammar_from_lark(lark), kind="tool_calls")


def msgspec_replace(c: Constraint, **kw) -> Constraint:
    import msgspec
    return msgspec.structs.replace(c, **kw)


# ---- the tokenizer side --------------------------------------------------------------------------

@dataclass
class GrammarStats:
    """Counters of one process's grammar work (the worker reports them)."""

    requests: int = 0
    masks: int = 0
    mask_s: float = 0.0
    rebuilt: int = 0          # states rebuilt from a committed output (after a destructive pause)


@dataclass
class Book:
    """One model's llguidance tokenizer, its whitespace-only tokens and EOS ids."""

    tok: object
    vocab: int
    eos: tuple[int, ...]
    ws: torch.Tensor                       # [V] bool: tokens that decode to whitespace only


@lru_cache(maxsize=4)
def _book(path: str, stamp: int, vocab: int, eos: tuple[int, ...]) -> Book:
    text = Path(path).read_text()
    tok = _llg().LLTokenizer(text, n_vocab=vocab, eos_token=list(eos))
    ws = torch.zeros(vocab, dtype=torch.bool)
    for i in range(vocab):
        if not tok.is_special_token(i):
            b = tok.decode_bytes([i])
            ws[i] = bool(b) and not b.strip()
    return Book(tok, vocab, tuple(eos), ws)


def book_for(model_dir: str | Path, vocab: int, eos: tuple[int, ...]) -> Book:
    """The model's grammar book (loaded once per directory): its tokenizer.json is needed."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise RequestError(f"{model_dir}: structured outputs need the model's tokenizer.json")
    return _book(str(path.resolve()), path.stat().st_mtime_ns, vocab, tuple(eos))


def check(c: Constraint, book: Book, where: str) -> None:
    """A grammar the matcher cannot use is a RequestError naming ``where``."""
    msg = _llg().LLMatcher.validate_grammar(c.grammar, book.tok)
    if msg and not msg.startswith("WARNING"):
        raise RequestError(f"{where}: {msg.splitlines()[0]}")


# ---- one request's state ------------------------------------------------------------------------

THINKING, GRAMMAR = "thinking", "grammar"


class GrammarState:
    """The grammar of one sequence's output. ``allowed()`` is the mask of the next token (cached
    until the next ``accept``), ``accept`` advances by a committed token, ``complete`` says the
    grammar is done (the request stops there)."""

    def __init__(self, c: Constraint, book: Book, prompt: list[int], stats: GrammarStats | None = None):
        self.c, self.book = c, book
        self.stats = stats if stats is not None else GrammarStats()
        self.m = _llg().LLMatcher(book.tok, c.grammar, log_level=0)
        if self.m.is_error():
            raise RequestError(f"structured output: {self.m.get_error().splitlines()[0]}")
        self.fed = 0                    # committed output tokens seen
        self.lead = False               # right after </think>: whitespace is free
        self.phase = GRAMMAR
        if c.think is not None:
            last = next((t for t in reversed(prompt) if not (t < book.vocab and book.ws[t])), None)
            self.phase = THINKING if last == c.think[0] else GRAMMAR
        self._mask: torch.Tensor | None = None
        self.stats.requests += 1

    @classmethod
    def rebuilt(cls, c: Constraint, book: Book, prompt: list[int], outputs: list[int],
                stats: GrammarStats | None = None) -> "GrammarState":
        """The state after ``outputs`` (committed earlier), without sampling them again."""
        g = cls(c, book, prompt, stats)
        if outputs:
            g.stats.rebuilt += 1
        g.sync(outputs)
        return g

    def sync(self, outputs: list[int]) -> None:
        for t in outputs[self.fed:]:
            self.accept(t)

    @property
    def complete(self) -> bool:
        return self.phase == GRAMMAR and self.m.is_stopped()

    def allowed(self) -> torch.Tensor:
        """[V] bool on the CPU: the tokens the grammar lets come next."""
        if self._mask is None:
            t = time.perf_counter()
            self._mask = self._compute()
            self.stats.masks += 1
            self.stats.mask_s += time.perf_counter() - t
        return self._mask

    def _compute(self) -> torch.Tensor:
        V = self.book.vocab
        if self.phase == THINKING:
            mask = torch.ones(V, dtype=torch.bool)
            mask[[e for e in self.book.eos if e < V]] = False
            return mask
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:V]
        mask = torch.from_numpy(bits.astype(bool))
        if self.lead:
            mask |= self.book.ws
        if not bool(mask.any()):              # a dead end: let the answer end instead of drawing nothing
            mask[[e for e in self.book.eos if e < V]] = True
        return mask

    def accept(self, token: int) -> None:
        self.fed += 1
        self._mask = None
        if self.phase == THINKING:
            if token == self.c.think[1]:
                self.phase, self.lead = GRAMMAR, True
            return
        if self.lead and token < self.book.vocab and bool(self.book.ws[token]):
            return                                   # whitespace between the thinking and the answer
        self.lead = False
        if not self.m.consume_token(token) and token not in self.book.eos:
            raise RequestError(f"structured output: token {token} does not satisfy the grammar "
                               f"({self.m.get_error().splitlines()[0]})")
