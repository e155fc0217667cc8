"""Prefix index and demand summary (seed: 前缀索引; 最多 256 项的需求摘要).

Both key a position by the digest of its exact token prefix. Digests only *narrow* candidates:
adoption still compares tokens (and the worker re-verifies tokens, positions, media and
execution identity) — independently computed state is never spliced because digests match.

    digest(tokens[:F]) for every indexed F of a prompt costs one pass over the prompt: the
    running hash is copied at each frontier that some entry uses.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from ninfer.protocol import TOKEN_BYTES, pack_tokens


def prefix_digests(tokens: list[int] | tuple[int, ...], frontiers: list[int]) -> dict[int, bytes]:
    """{F: digest(tokens[:F])} for the given frontiers (<= len(tokens)), in one pass."""
    out: dict[int, bytes] = {}
    h = hashlib.blake2b(digest_size=16)
    fs = sorted(set(frontiers))
    if not fs:
        return out
    # the tokens up to the deepest frontier packed once (fixed-width int32), then hashed piece
    # by piece through views: the same bytes as packing each piece (a lookup over a prompt
    # meets hundreds of indexed frontiers)
    packed = memoryview(pack_tokens(tokens[:min(fs[-1], len(tokens))]))
    pos = 0
    for f in fs:
        if f > len(tokens):
            break
        if f > pos:
            h.update(packed[pos * TOKEN_BYTES:f * TOKEN_BYTES])
            pos = f
        out[f] = h.copy().digest()
    return out


def digest(tokens: list[int] | tuple[int, ...]) -> bytes:
    return prefix_digests(tokens, [len(tokens)])[len(tokens)]


class PrefixIndex:
    """(frontier, digest) -> checkpoint ids, for every live cache checkpoint.

    ``observer`` (optional): called ``observer(True, key, tokens)`` when a key gets its first
    checkpoint and ``observer(False, key)`` when its last one goes — a replica publishes these
    keys as its restore positions (``ninfer/replicas/summary.py``)."""

    def __init__(self):
        self._by_key: dict[tuple[int, bytes], set[int]] = {}
        self._key_of: dict[int, tuple[int, bytes]] = {}
        self._frontiers: dict[int, int] = {}     # frontier -> number of entries using it
        self._sorted = SortedList()              # those frontiers in order (a lookup takes a range)
        self.observer = None

    def __len__(self) -> int:
        return len(self._key_of)

    def add(self, cid: int, tokens: tuple[int, ...]) -> None:
        if cid in self._key_of:
            return
        key = (len(tokens), digest(tokens))
        first = key not in self._by_key
        self._by_key.setdefault(key, set()).add(cid)
        self._key_of[cid] = key
        n = self._frontiers.get(key[0], 0)
        if not n:
            self._sorted.add(key[0])
        self._frontiers[key[0]] = n + 1
        if first and self.observer is not None:
            self.observer(True, key, tokens)

    def remove(self, cid: int) -> None:
        key = self._key_of.pop(cid, None)
        if key is None:
            return
        ids = self._by_key[key]
        ids.discard(cid)
        if not ids:
            del self._by_key[key]            # empty branches are deleted promptly
            if self.observer is not None:
                self.observer(False, key)
        n = self._frontiers[key[0]] - 1
        if n:
            self._frontiers[key[0]] = n
        else:
            del self._frontiers[key[0]]
            self._sorted.remove(key[0])

    def check(self) -> str:
        """Why the index's own structures disagree ("" when they agree): the ordered frontiers
        are exactly those some entry uses, each counted by its entries."""
        used: dict[int, int] = {}
        for f, _ in self._key_of.values():
            used[f] = used.get(f, 0) + 1
        if used != self._frontiers:
            return f"frontier counts {sorted(self._frontiers.items())[:5]}..., the entries give {sorted(used.items())[:5]}..."
        if list(self._sorted) != sorted(used):
            return f"ordered frontiers {list(self._sorted)[:8]}..., in use {sorted(used)[:8]}..."
        return ""

    def same_key(self, cid: int) -> set[int] | None:
        """The checkpoints keyed as ``cid`` is (same frontier and digest; itself included), or
        None when ``cid`` is not indexed. Callers do not mutate it."""
        key = self._key_of.get(cid)
        return None if key is None else self._by_key[key]

    def at(self, tokens: list[int] | tuple[int, ...], frontier: int) -> set[int]:
        """Candidate checkpoint ids at exactly ``frontier`` whose digest matches
        ``tokens[:frontier]`` (one digest, no scan)."""
        if frontier not in self._frontiers or frontier > len(tokens):
            return set()
        return set(self._by_key.get((frontier, digest(tokens[:frontier])), ()))

    def lookup(self, tokens: list[int], limit: int, above: int = -1) -> list[int]:
        """Candidate checkpoint ids whose (frontier, digest) matches a prefix of ``tokens``, at
        frontiers over ``above`` and up to ``limit``."""
        fs = list(self._sorted.irange(above + 1, limit))    # frontiers are whole token counts
        if not fs:
            return []
        out: list[int] = []
        for f, d in prefix_digests(tokens, fs).items():
            out.extend(self._by_key.get((f, d), ()))
        return out


@dataclass
class Observation:
    frontier: int
    tag: bytes = b""                                     # identity tag (execution identity, media)
    requests: list[str] = field(default_factory=list)   # distinct observers (the last few)
    last: float = 0.0                                    # time of the latest real observation
    adopted: bool = False                                # a cross-request adoption happened here

    @property
    def repeated(self) -> bool:
        """Repeat demand: a real cross-request adoption, or two different requests computing it."""
        return self.adopted or len(self.requests) >= 2


class DemandSummary:
    """At most ``capacity`` candidate positions with real request observations, keyed by
    (identity tag, digest, frontier): the same tokens under another execution identity (or
    other media) are another position. Summary hits affect retention and admission only: never
    cache-hit or reused-token statistics, and the summary holds no State/KV."""

    def __init__(self, capacity: int = 256, tag: bytes = b""):
        self.capacity = capacity
        self.tag = tag
        self._entries: OrderedDict[tuple[bytes, bytes, int], Observation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def observe(self, key: bytes, frontier: int, rid: str, now: float, adopted: bool = False,
                tag: bytes | None = None) -> Observation:
        """A real observation (cross-request adoption, or a new prefill commit crossing the
        position) — once per request per position."""
        k = (self.tag if tag is None else tag, key, frontier)
        obs = self._entries.get(k)
        if obs is None:
            obs = self._entries[k] = Observation(frontier, k[0])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)      # the least recently observed goes
        if rid not in obs.requests:
            obs.requests = (obs.requests + [rid])[-8:]
            obs.last = now
        if adopted and not obs.adopted:
            obs.adopted, obs.last = True, now
        self._entries.move_to_end(k)
        return obs

    def get(self, key: bytes, frontier: int, tag: bytes | None = None) -> Observation | None:
        return self._entries.get((self.tag if tag is None else tag, key, frontier))
