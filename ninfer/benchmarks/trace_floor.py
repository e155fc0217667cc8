"""The floors of a replay, computed from its prompts alone, in arrival order.

    ideal         every distinct token prefix computed once: the size of the token trie over
                  all prompts. Per request, its tokens beyond the longest common prefix with any
                  earlier prompt (these sum to the trie's size whatever the order).
    prompt ends   reuse only where an earlier prompt ended: per request, its tokens beyond the
                  longest earlier prompt that is a prefix of it (an exact repeat adds 0).

    earlier  A = 1 2 3 4          B = 1 2 3 4 5 6
    new      C = 1 2 3 4 5 7 8    ideal: 7 - lcp(C, B) = 7 - 5 = 2
                                  ends:  7 - |A|       = 7 - 4 = 3   (B is no prefix of C)

Outputs are not part of either: a trace's later prompts carry earlier answers as hashed blocks,
which the replay turns into fixed tokens, never the tokens an engine generated. An engine needs
the logits after the last prompt token, so a request whose whole prompt is an earlier prompt
or a prefix of one (``repeats``) may cost it a token or more where both floors count 0.

Exact and cheap: the longest common prefix with any earlier prompt is one with a neighbour in
lexicographic order (bisect over the sorted earlier prompts); earlier prompt ends are found by
a per-position random linear prefix hash, each candidate confirmed token by token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Floors:
    """Per request (arrival order): new tokens under each floor; ``repeats``: requests whose
    whole prompt an earlier prompt already covers."""
    ideal: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    repeats: int = 0

    @property
    def ideal_total(self) -> int:
        return sum(self.ideal)

    @property
    def ends_total(self) -> int:
        return sum(self.ends)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def floors(prompts: list[list[int]], seed: int = 0) -> Floors:
    out = Floors()
    longest = max((len(p) for p in prompts), default=0)
    weights = np.random.default_rng(seed).integers(0, 2**63, size=longest, dtype=np.uint64) * np.uint64(2) + \
        np.uint64(1)                                              # odd: every token moves the hash
    keys: list[tuple[int, ...]] = []                             # earlier prompts, sorted
    sorted_arrs: list[np.ndarray] = []
    ends: dict[tuple[int, int], list[int]] = {}                  # (length, prefix hash) -> earlier prompts
    arrs: list[np.ndarray] = []
    lengths: list[int] = []                                      # distinct earlier lengths, sorted
    for p in prompts:
        a = np.asarray(p, dtype=np.int64)
        key = tuple(p)
        i = bisect.bisect_left(keys, key)
        shared = max([_lcp(a, sorted_arrs[j]) for j in (i - 1, i) if 0 <= j < len(keys)], default=0)
        out.ideal.append(len(p) - shared)
        out.repeats += shared == len(p)
        keys.insert(i, key)
        sorted_arrs.insert(i, a)

        h = np.cumsum(a.astype(np.uint64) * weights[: len(a)], dtype=np.uint64)
        best = 0
        for L in reversed(lengths[: bisect.bisect_right(lengths, len(p))]):
            if any(np.array_equal(arrs[q], a[:L]) for q in ends.get((L, int(h[L - 1])), ())):
                best = L
                break
        out.ends.append(len(p) - best)
        if len(p):
            ends.setdefault((len(p), int(h[-1])), []).append(len(arrs))
            if (j := bisect.bisect_left(lengths, len(p))) == len(lengths) or lengths[j] != len(p):
                lengths.insert(j, len(p))
        arrs.append(a)
    return out
