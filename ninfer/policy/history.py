"""The token content of known histories, for divergence positions (issue 30; seed: 前缀索引 —
digests narrow, tokens decide).

A restore point exists only where some request saved one; where two histories share a prefix
and then diverge, the position X where they part is where a later request that shares [0, X)
needs one. ``HistoryTrie`` finds X for a new prompt against every history it holds — the token
content of live cache checkpoints and of live requests' prompts — in O(len / BLOCK + log fan-out
+ the branches that share the most with it) per query, whatever the number of histories (seed:
cost that grows with the cache is a bug; a node's branches are kept in token order, so the ones
sharing the longest prefix with the query are found by bisection, not by a scan — the root of a
cache of 10k distinct prompts has 10k branches):

    node(depth d) --block tokens t[dB:(d+1)B]--> node(d+1)       one node per distinct block
                   a history ending inside a block keeps its partial tail at the node above

Nodes are reference counted by the histories through them and deleted with the last one. A node
also keeps the ids of the *live requests* through it (their number is bounded by the queue),
so the owners of a shared prefix still to be computed are found without a scan. A node's
children are keyed by their block's tokens themselves (exact, no digest to collide; equal blocks
under different prefixes hang under different parents, so they are different nodes) — a key
costs a tuple hash, where a chained blake2b digest of each block cost ~2 us: ~0.3 ms for each of
a 2,000-token prompt's histories, inserted and removed several times over a prompt's life.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import islice

BLOCK = 16


@dataclass(eq=False)
class _Node:
    block: tuple[int, ...] = ()                              # the tokens of the edge into it
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)   # by the child's block
    tails: dict[Hashable, tuple[int, ...]] = field(default_factory=dict)   # histories ending here or in the next block
    refs: int = 0                                            # histories through this node
    live: set[str] = field(default_factory=set)              # live requests through it
    # the branches below it in token order: (tokens, serial) of every child's block and every
    # tail; ``refs_of`` maps the serial to the child's block or the tail's key
    order: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    refs_of: dict[int, tuple[bool, Hashable]] = field(default_factory=dict)   # serial -> (is child, id)
    serial: int = -1                                         # its own entry in its parent's order
    tail_serial: dict[Hashable, int] = field(default_factory=dict)

    def enter(self, tokens: tuple[int, ...], serial: int, child: bool, ref: Hashable) -> None:
        insort(self.order, (tokens, serial))
        self.refs_of[serial] = (child, ref)

    def leave(self, tokens: tuple[int, ...], serial: int) -> None:
        i = bisect_left(self.order, (tokens, serial))
        del self.order[i]
        del self.refs_of[serial]

    def prefixed(self, prefix: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
        """The branches whose tokens start with ``prefix`` (a contiguous run of ``order``)."""
        lo = bisect_left(self.order, (prefix,))
        if not prefix:
            return self.order[lo:]
        hi = bisect_left(self.order, (prefix[:-1] + (prefix[-1] + 1,),), lo)
        return self.order[lo:hi]


@dataclass(frozen=True)
class Match:
    """The longest common prefix of a query with any history: its length, and the live requests
    whose prompt shares it (their prefix ``[0, length)`` equals the query's)."""

    length: int
    live: frozenset[str]
    cached: bool           # some cache checkpoint's tokens share it
    steps: int = 0         # the query's cost: blocks walked + branches compared where it parts


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
        self._serials = 0

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._paths

    def keys(self) -> set[Hashable]:
        return set(self._paths)

    def _walk(self, tokens: Sequence[int]):
        """(node, full blocks) pairs along ``tokens``' full blocks, the root first."""
        node = self.root
        yield node, 0
        for d in range(len(tokens) // BLOCK):
            node = node.children.get(tuple(tokens[d * BLOCK:(d + 1) * BLOCK]))
            if node is None:
                return
            yield node, d + 1

    def insert(self, key: Hashable, tokens: Sequence[int], live: bool = False) -> None:
        """Hold ``tokens`` under ``key`` (a live request's key is its rid). Idempotent."""
        if key in self._paths:
            return
        tokens = tuple(tokens)
        self._paths[key] = (tokens, live)
        node = self.root
        self._add(node, key, live)
        for d in range(len(tokens) // BLOCK):
            blk = tokens[d * BLOCK:(d + 1) * BLOCK]
            child = node.children.get(blk)
            if child is None:
                child = node.children[blk] = _Node(block=blk, serial=self._next())
                node.enter(blk, child.serial, True, blk)
            node = child
            self._add(node, key, live)
        tail = node.tails[key] = tokens[len(tokens) - len(tokens) % BLOCK:]      # () when it ends right here
        node.tail_serial[key] = self._next()
        node.enter(tail, node.tail_serial[key], False, key)

    def _next(self) -> int:
        self._serials += 1
        return self._serials

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
        path: list[tuple[_Node, tuple[int, ...]]] = []
        node = self.root
        for d in range(len(tokens) // BLOCK):
            blk = tokens[d * BLOCK:(d + 1) * BLOCK]
            path.append((node, blk))
            node = node.children[blk]
        tail = node.tails.pop(key)
        node.leave(tail, node.tail_serial.pop(key))
        for n in [self.root, *(p.children[k] for p, k in path)]:
            n.refs -= 1
            n.live.discard(key)
        for parent, k in reversed(path):         # empty branches are deleted promptly
            child = parent.children[k]
            if child.refs == 0:
                parent.leave(child.block, child.serial)
                del parent.children[k]

    def match(self, tokens: Sequence[int]) -> Match:
        """The longest prefix of ``tokens`` some held history shares, and who shares it."""
        node, depth = self.root, 0
        for node, depth in self._walk(tokens):
            pass
        base = depth * BLOCK
        nxt = tuple(tokens[base:base + BLOCK])
        # the branch sharing the most with nxt is next to where nxt would sort
        i = bisect_left(node.order, (nxt,))
        near = node.order[max(0, i - 1):i + 1]
        best = max((_common(nxt, t) for t, _ in near), default=0)
        steps = depth + len(near)
        if base + best == 0:
            return Match(0, frozenset(), False, steps)
        if best == 0:
            refs, live = node.refs, set(node.live)
        else:
            refs, live = 0, set()
            sharing = node.prefixed(nxt[:best])      # exactly the branches sharing ``best`` tokens
            steps += len(sharing)
            for _, serial in sharing:
                child, ref = node.refs_of[serial]
                if child:
                    ch = node.children[ref]
                    refs += ch.refs
                    live |= ch.live
                else:
                    refs += 1
                    if self._paths[ref][1]:
                        live.add(ref)
        return Match(base + best, frozenset(live), refs > len(live), steps)

    def sample(self, tokens: Sequence[int], length: int, k: int) -> list[Hashable]:
        """Up to ``k`` held histories whose first ``length`` tokens equal ``tokens[:length]`` (any
        ``k`` of them): the walk down to ``length``, then a search below it that stops at ``k``."""
        node = self.root
        full = length // BLOCK
        for d in range(full):
            node = node.children.get(tuple(tokens[d * BLOCK:(d + 1) * BLOCK]))
            if node is None:
                return []
        part = tuple(tokens[full * BLOCK:length])
        # the node's tails first, then depth first below it, the newest branch first — the
        # histories a query samples decide which tails are learned, so the order is kept; the
        # branches sharing ``part`` are found in token order, not by a scan of the node
        if part:
            matching = sorted(serial for _, serial in node.prefixed(part))          # insertion order
            out = [node.refs_of[s][1] for s in matching if not node.refs_of[s][0]][:k]
            stack = [node.children[node.refs_of[s][1]] for s in matching if node.refs_of[s][0]]
        else:
            out = list(islice(node.tails, k))
            stack = list(node.children.values())
        while stack and len(out) < k:
            n = stack.pop()
            out += islice(n.tails, k - len(out))
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
                    and [t for t, _ in a.order] == [t for t, _ in b.order]
                    and sorted(a.refs_of.values(), key=repr) == sorted(b.refs_of.values(), key=repr)
                    and all(same(a.children[k], b.children[k]) for k in a.children))
        return None if same(self.root, want.root) else "the history trie disagrees with its histories"
