"""The input side of ``ninfer bench trace``: a trace file -> token prompts with arrival times.

Three formats, one JSON object per line, in arrival order:

    mooncake  {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}
              one id per 512-token block (kvcache-ai/Mooncake FAST25-release/traces)
    bailian   {"chat_id", "parent_chat_id", "timestamp": s, "input_length", "output_length",
               "type", "turn", "hash_ids": [...]}  one id per 16-token block
              (alibaba-edu/qwen-bailian-usagetraces-anon; only timestamp, the lengths and
              hash_ids are read)
    tokens    {"timestamp": ms (optional), "prompt_token_ids": [...], "output_length": m}
              a converted trace with explicit prompts (``--save-tokens`` writes one)

Block -> tokens: every hash id becomes one fixed block of ``block_tokens`` ids, drawn from the
ordinary vocabulary by an RNG seeded with (seed, id), so equal ids give equal blocks and a
prompt is its ids' blocks in order; outputs scale by ``block_tokens / source block`` (at least
1 token). The last id usually covers a partial block (``last_block``)::

    hash_ids  [a,        b,        c  ]      input_length 1,100 (512-token source blocks)
    drop      [A0..A15 | B0..B15]            the 2 whole blocks: 32 tokens (default)
    head      [A0..A15 | B0..B15 | C0..C2]   ceil(1,100 * 16 / 512) = 35 tokens

A partial block's id never recurs in a later request (a later turn holds a whole block there,
whose content and id differ), so under ``head`` no earlier prompt ends inside a later one:
reuse at a prompt end becomes impossible although the real later turn did extend the earlier
prompt. ``drop`` keeps every id-prefix relation a token-prefix relation, at the cost of under
one block per request (a prompt shorter than one block keeps its head). Bailian ids hash each
block's content alone (not the prefix), so equal ids under different prefixes map to equal
blocks under different prefixes: the floors are computed on the tokens, where that is no
shared prefix.

A prompt longer than the context allows keeps its head (prefix sharing is decided there):
``prompt[: max_context - max_tokens]``, ``max_tokens`` first lowered to ``max_context - 1``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from ninfer.errors import NInferError

FORMATS = ("auto", "mooncake", "bailian", "tokens")
LAST_BLOCK = ("drop", "head")
# source block tokens and seconds per timestamp unit of each hash-id format
SOURCE = {"mooncake": (512, 1e-3), "bailian": (16, 1.0)}
TOKEN_TS_UNIT = 1e-3                    # a token trace's timestamps: ms, as Mooncake's


class TraceError(NInferError):
    """A trace file that cannot be read: names the line and the field."""


@dataclass(frozen=True)
class TraceRequest:
    """One replayed request: ``line`` in the file (1-based), arrival in seconds since the first
    replayed request, the prompt and the output length; ``dropped`` prompt tokens were cut to
    fit the context."""
    line: int
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    dropped: int = 0


def detect(row: dict) -> str:
    """The format of one parsed line."""
    if "prompt_token_ids" in row:
        return "tokens"
    if "hash_ids" in row:
        return "bailian" if "chat_id" in row or "parent_chat_id" in row else "mooncake"
    raise TraceError("cannot tell the trace format: a line has neither hash_ids nor prompt_token_ids "
                     "(give --format)")


def read_rows(path: str | Path, offset: int = 0, limit: int | None = None) -> list[tuple[int, dict]]:
    """(line number, parsed object) of the non-blank lines ``offset .. offset + limit``."""
    rows: list[tuple[int, dict]] = []
    seen = 0
    try:
        f = open(path)
    except OSError as exc:
        raise TraceError(f"cannot read the trace {path}: {exc.strerror or exc}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            seen += 1
            if seen <= offset:
                continue
            if limit is not None and len(rows) >= limit:
                break
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise TraceError(f"{path}:{n}: not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            rows.append((n, obj))
    return rows


def model_vocab(model_dir: str | Path) -> int | None:
    """config.json's vocab_size (a vision model's: its text_config's)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def ordinary_vocab(model_dir: str | Path) -> int:
    """Token ids below this are ordinary vocabulary: the first added token of tokenizer.json
    (every special and chat-markup token is an added one), else config.json's vocab_size."""
    vocab = model_vocab(model_dir)
    tok = Path(model_dir) / "tokenizer.json"
    if tok.exists():
        added = [t["id"] for t in json.loads(tok.read_text()).get("added_tokens", [])]
        if added:
            vocab = min(vocab or min(added), min(added))
    if not vocab:
        raise TraceError(f"{model_dir}: no vocab_size in config.json")
    return int(vocab)


class BlockTokens:
    """hash id -> its fixed block of ``block_tokens`` ordinary token ids (cached)."""

    def __init__(self, block_tokens: int, vocab: int, seed: int = 0):
        self.block_tokens, self.vocab, self.seed = block_tokens, vocab, seed
        self._blocks: dict[int, list[int]] = {}

    def block(self, hid: int) -> list[int]:
        b = self._blocks.get(hid)
        if b is None:
            rng = random.Random(f"ninfer-trace:{self.seed}:{hid}")   # str seeds hash with sha512: stable
            b = self._blocks[hid] = [rng.randrange(self.vocab) for _ in range(self.block_tokens)]
        return b

    def prompt(self, hash_ids: list[int], input_length: int, source_block: int, last_block: str = "drop") -> list[int]:
        n, bt = len(hash_ids), self.block_tokens
        whole = min(n, input_length // source_block)
        if last_block == "drop" and whole:
            hash_ids, length = hash_ids[:whole], whole * bt
        else:                               # the head of the last block: every id gives a token or more
            length = min(n * bt, max((n - 1) * bt + 1, math.ceil(input_length * bt / source_block)))
        out: list[int] = []
        for hid in hash_ids:
            out += self.block(hid)
        return out[:length]


def scaled_output(output_length: int, block_tokens: int, source_block: int) -> int:
    return max(1, math.floor(output_length * block_tokens / source_block + 0.5))


def _field(path, n: int, row: dict, name: str, kind=int):
    v = row.get(name)
    if kind is list:
        ok = isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
    if not ok:
        want = "a non-empty list of integers" if kind is list else "a number >= 0"
        raise TraceError(f"{path}:{n}: field {name!r} must be {want}, got {v!r}")
    return v


def load(path: str | Path, vocab: int, fmt: str = "auto", block_tokens: int = 16, offset: int = 0,
         limit: int | None = None, max_context: int | None = None, seed: int = 0,
         last_block: str = "drop", model_vocab: int | None = None) -> tuple[str, list[TraceRequest]]:
    """The format read and the requests ``offset .. offset + limit`` of ``path`` as token
    prompts (module docstring), arrivals relative to the first of them. Blocks draw from the
    ordinary ``vocab``; a token trace's ids may be any of the model's (``model_vocab``, default
    ``vocab``): a converted chat keeps its template's special tokens."""
    rows = read_rows(path, offset, limit)
    if not rows:
        raise TraceError(f"{path}: no requests at offset {offset}")
    if fmt == "auto":
        fmt = detect(rows[0][1])
    blocks = BlockTokens(block_tokens, vocab, seed)
    out: list[TraceRequest] = []
    t0 = None
    for n, row in rows:
        if fmt == "tokens":
            prompt = list(_field(path, n, row, "prompt_token_ids", list))
            top = model_vocab or vocab
            bad = next((t for t in prompt if not 0 <= t < top), None)
            if bad is not None:
                raise TraceError(f"{path}:{n}: prompt token id {bad} is outside the model's vocabulary 0..{top - 1}")
            max_tokens = max(1, int(_field(path, n, row, "output_length")))
            ts = float(row.get("timestamp", 0) or 0) * TOKEN_TS_UNIT
        else:
            src, unit = SOURCE[fmt]
            hids = _field(path, n, row, "hash_ids", list)
            prompt = blocks.prompt(hids, int(_field(path, n, row, "input_length")), src, last_block)
            max_tokens = scaled_output(int(_field(path, n, row, "output_length")), block_tokens, src)
            ts = float(_field(path, n, row, "timestamp")) * unit
        t0 = ts if t0 is None else t0
        dropped = 0
        if max_context is not None:
            max_tokens = min(max_tokens, max_context - 1)
            dropped = max(0, len(prompt) - (max_context - max_tokens))
            prompt = prompt[: len(prompt) - dropped]
        out.append(TraceRequest(n, max(0.0, ts - t0), prompt, max_tokens, dropped))
    return fmt, out


def windows(reqs: list[TraceRequest], window_s: float) -> list[list[TraceRequest]]:
    """Requests grouped by ``floor(arrival / window_s)``, in order; empty windows skipped."""
    groups: dict[int, list[TraceRequest]] = {}
    for r in reqs:
        groups.setdefault(int(r.arrival_s // window_s), []).append(r)
    return [groups[k] for k in sorted(groups)]


def save_tokens(reqs: list[TraceRequest], path: str | Path) -> None:
    """The requests as a token trace (format ``tokens``): what was replayed, replayable as is."""
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": round(r.arrival_s / TOKEN_TS_UNIT, 3), "prompt_token_ids": r.prompt,
                                "output_length": r.max_tokens}) + "\n")
