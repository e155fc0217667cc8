"""The token content of known histories, for divergence positions (issue 30; seed: 前缀索引 —
digests narrow, tokens decide).

A restore point exists only where some request saved one; where two histories share a prefix
and then diverge, the position X where they part is where a later request that shares [0, X)
needs one. ``HistoryTrie`` finds X for a new prompt against every history it holds — the token
content of live cache checkpoints and of live requests' prompts — in O(len / BLOCK + fan-out)
per query, whatever the number of histories (seed: cost that grows with the cache is a bug):

    node(depth d) --block tokens t[dB:(d+1)B]--> node(d+1)       one node per distinct block
                   a history ending inside a block keeps its partial tail at the node above

Nodes are reference counted by the histories through them and deleted with the last one. A node
also keeps the ids of the *live requests* through it (their number is bounded by the queue),
so the owners of a shared prefix still to be computed are found without a scan. Block
identities are chained digests of the whole prefix, so equal blocks under different prefixes are
different nodes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ninfer.protocol import pack_tokens

BLOCK = 16


@dataclass(eq=False)
class _Node:
    block: tuple[int, ...] = ()                              # the tokens of the edge into it
    children: dict[bytes, "_Node"] = field(default_factory=dict)
    tails: dict[Hashable, tuple[int, ...]] = field(default_factory=dict)   # histories ending here or in the next block
    refs: int = 0                                            # histories through this node
    live: set[str] = field(default_factory=set)              # live requests through it


@dataclass(frozen=True)
class Match:
    """The longest common prefix of a query with any history: its length, and the live requests
    whose prompt shares it (their prefix ``[0, length)`` equals the query's)."""

    length: int
    live: frozenset[str]
    cached: bool           # some cache checkpoint's tokens share it
    steps: int = 0         # the query's cost: blocks walked + branches compared where it parts


def _chain(prev: bytes, block: Sequence[int]) -> bytes:
    return hashlib.blake2b(prev + pack_tokens(list(block)), digest_size=16).digest()


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class HistoryTrie:
    """Invariants (``check``): a node's ``refs`` is the number of histories whose tokens pass
    through it (a partial tail counts at its parent node); ``live`` holds exactly the live
    requests among them; a node with no ref is gone; ``len(self)`` is the number of histories."""

    def __init__(self):
        self.root = _Node()
        self._paths: dict[Hashable, tuple[tuple[int, ...], bool]] = {}   # key -> (tokens, live)

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._paths

    def keys(self) -> set[Hashable]:
        return set(self._paths)

    def _walk(self, tokens: Sequence[int]):
        """(node, full blocks) pairs along ``tokens``' full blocks, the root first."""
        node, h = self.root, b""
        yield node, 0
        for d in range(len(tokens) // BLOCK):
            blk = tuple(tokens[d * BLOCK:(d + 1) * BLOCK])
            h = _chain(h, blk)
            node = node.children.get(h)
            if node is None:
                return
            yield node, d + 1

    def insert(self, key: Hashable, tokens: Sequence[int], live: bool = False) -> None:
        """Hold ``tokens`` under ``key`` (a live request's key is its rid). Idempotent."""
        if key in self._paths:
            return
        tokens = tuple(tokens)
        self._paths[key] = (tokens, live)
        node, h = self.root, b""
        self._add(node, key, live)
        for d in range(len(tokens) // BLOCK):
            blk = tokens[d * BLOCK:(d + 1) * BLOCK]
            h = _chain(h, blk)
            child = node.children.get(h)
            if child is None:
                child = node.children[h] = _Node(block=blk)
            node = child
            self._add(node, key, live)
        node.tails[key] = tokens[len(tokens) - len(tokens) % BLOCK:]      # () when it ends right here

    @staticmethod
    def _add(node: _Node, key: Hashable, live: bool) -> None:
        node.refs += 1
        if live:
            node.live.add(key)

    def remove(self, key: Hashable) -> None:
        got = self._paths.pop(key, None)
        if got is None:
            return
        tokens, live = got
        path: list[tuple[_Node, bytes]] = []
        node, h = self.root, b""
        for d in range(len(tokens) // BLOCK):
            h = _chain(h, tokens[d * BLOCK:(d + 1) * BLOCK])
            path.append((node, h))
            node = node.children[h]
        node.tails.pop(key, None)
        for n in [self.root, *(p.children[k] for p, k in path)]:
            n.refs -= 1
            n.live.discard(key)
        for parent, k in reversed(path):         # empty branches are deleted promptly
            if parent.children[k].refs == 0:
                del parent.children[k]

    def match(self, tokens: Sequence[int]) -> Match:
        """The longest prefix of ``tokens`` some held history shares, and who shares it."""
        node, depth = self.root, 0
        for node, depth in self._walk(tokens):
            pass
        base = depth * BLOCK
        nxt = tuple(tokens[base:base + BLOCK])
        below = [(_common(nxt, ch.block), ch.refs, ch.live) for ch in node.children.values()]
        below += [(_common(nxt, t), 1, {k} if self._paths[k][1] else set()) for k, t in node.tails.items()]
        best = max((c for c, _, _ in below), default=0)
        steps = depth + len(below)
        if base + best == 0:
            return Match(0, frozenset(), False, steps)
        if best == 0:
            refs, live = node.refs, set(node.live)
        else:
            refs, live = 0, set()
            for c, r, lv in below:
                if c == best:
                    refs += r
                    live |= lv
        return Match(base + best, frozenset(live), refs > len(live), steps)

    def sample(self, tokens: Sequence[int], length: int, k: int) -> list[Hashable]:
        """Up to ``k`` held histories whose first ``length`` tokens equal ``tokens[:length]`` (any
        ``k`` of them): the walk down to ``length``, then a search below it that stops at ``k``."""
        node, h = self.root, b""
        full = length // BLOCK
        for d in range(full):
            h = _chain(h, tokens[d * BLOCK:(d + 1) * BLOCK])
            node = node.children.get(h)
            if node is None:
                return []
        part = tuple(tokens[full * BLOCK:length])
        out = [key for key, t in node.tails.items() if t[:len(part)] == part and len(t) >= len(part)][:k]
        stack = [ch for ch in node.children.values() if ch.block[:len(part)] == part]
        while stack and len(out) < k:
            n = stack.pop()
            out += list(n.tails)[: k - len(out)]
            stack.extend(n.children.values())
        return out

    def check(self) -> str | None:
        """The invariants above, recomputed from the held histories (tests, integrity)."""
        want = HistoryTrie()
        for key, (tokens, live) in self._paths.items():
            want.insert(key, tokens, live)

        def same(a: _Node, b: _Node) -> bool:
            return (a.refs == b.refs and a.live == b.live and a.tails == b.tails and a.block == b.block
                    and a.children.keys() == b.children.keys()
                    and all(same(a.children[k], b.children[k]) for k in a.children))
        return None if same(self.root, want.root) else "the history trie disagrees with its histories"
