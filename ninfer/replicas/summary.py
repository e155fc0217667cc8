"""Where each replica can restore, as the router sees it (issue 34).

A hybrid prefix is reusable only where a full StateImage and contiguous KV exist for that exact
position (the seed's checkpoint), so a replica publishes exactly those positions: the
``(depth, digest)`` key of every live cache checkpoint of its prefix index (E, input points,
anchors, markers, divergence and anticipated positions) — never "how many tokens match".

    controller (one per replica)                         router (in the frontend)
    PrefixIndex key appears / disappears                 SummaryTable
      -> RestoreSummary.observe  (bounded: the             apply(replica, SummaryEvent)
         oldest entry goes past ``cap``)                   match(PromptHashes) -> {replica: depth}
      -> take(): one SummaryEvent per cycle
         (added / removed since the last one)

Digests are blake2b-128 of the packed token ids (the prefix index's own ``digest``), so the
controller publishes the key it already computed. The router cannot hash a prompt at every
position, so each entry also carries its *bucket*: the digest of its first ``floor(depth / B) * B``
tokens (B = ``block`` tokens). A prompt of L tokens is hashed once, its running hash kept at every
multiple of B (``PromptHashes``): one dictionary lookup per block finds the entries whose bucket
is on the prompt's path, and only those are checked at their exact depth (B tokens hashed on
from the bucket's state). The cost is O(L / B) lookups whatever the number of entries.

A digest match only steers a request: the replica compares tokens itself before it restores
anything, so a collision costs a routing choice, never an output token.

    prompt   |---- B ----|---- B ----|---- B ----|--
    buckets  0           B           2B          3B       one lookup each
    entry                               ^ depth d: bucket 2B, checked at d exactly
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from ninfer import protocol as P
from ninfer.protocol import pack_tokens

BLOCK = 64                # tokens per bucket (the Main KV page)
CAP = 10_000              # entries one replica publishes at most (the oldest goes first)
DIGEST = 16               # bytes of a digest (the prefix index's)

Key = tuple[int, bytes]   # (depth, digest of tokens[:depth])


def bucket_of(depth: int, block: int = BLOCK) -> int:
    return depth // block * block


def _hasher():
    return hashlib.blake2b(digest_size=DIGEST)


def bucket_digest(tokens, depth: int, block: int = BLOCK) -> bytes:
    """The digest of ``tokens[:bucket_of(depth)]``: where the router finds an entry at ``depth``."""
    h = _hasher()
    h.update(pack_tokens(list(tokens[: bucket_of(depth, block)])))
    return h.digest()


class PromptHashes:
    """One prompt hashed once: the digest at every multiple of ``block`` (with the hash state
    there, to finish an exact digest at any depth with at most ``block`` more tokens)."""

    __slots__ = ("data", "length", "block", "states", "digests", "_exact")

    def __init__(self, tokens, block: int = BLOCK):
        self.data = memoryview(pack_tokens(list(tokens)))
        self.length = len(tokens)
        self.block = block
        h = _hasher()
        self.states = [h.copy()]
        self.digests = [h.digest()]
        step = 4 * block
        for end in range(step, 4 * self.length + 1, step):
            h.update(self.data[end - step:end])
            self.states.append(h.copy())
            self.digests.append(h.digest())
        self._exact: dict[int, bytes] = {}

    def buckets(self) -> list[tuple[int, bytes]]:
        """(b, digest of the first b tokens) for b = 0, B, 2B, ... <= length, shallowest first."""
        return [(i * self.block, d) for i, d in enumerate(self.digests)]

    def exacts(self, depths: list[int]) -> dict[int, bytes]:
        """The digests at ``depths`` (ascending, within one bucket): one pass from its state."""
        out: dict[int, bytes] = {}
        if not depths:
            return out
        i = depths[0] // self.block
        h, pos = self.states[i].copy(), i * self.block
        for d in depths:
            if d > pos:
                h.update(self.data[4 * pos:4 * d])
                pos = d
            out[d] = h.digest()
        return out

    def exact(self, depth: int) -> bytes:
        """The digest of the first ``depth`` tokens (depth <= length)."""
        got = self._exact.get(depth)
        if got is None:
            i = depth // self.block
            if i * self.block == depth:
                got = self.digests[i]
            else:
                h = self.states[i].copy()
                h.update(self.data[4 * i * self.block:4 * depth])
                got = h.digest()
            self._exact[depth] = got
        return got


# ---- the controller's side ---------------------------------------------------------------------

class RestoreSummary:
    """What one replica publishes: every exact restore position of its prefix index, at most
    ``cap`` of them (past it the oldest published entry is dropped from the summary — the
    checkpoint itself stays, the router just stops steering to it), as deltas.

    Invariant: the router's copy after applying every ``take()`` in order equals ``entries()``;
    a key is in at most one of ``_added`` / ``_removed``; ``len(entries()) <= cap``.

    ``observe`` runs on the control thread (the prefix index calls it); ``take`` and
    ``snapshot`` may run on another thread (the actor's), hence the lock.
    """

    def __init__(self, cap: int = CAP, block: int = BLOCK):
        if cap < 1 or block < 1:
            raise ValueError("the summary needs cap >= 1 and block >= 1")
        self.cap, self.block = cap, block
        self._lock = threading.Lock()
        self._entries: OrderedDict[Key, bytes] = OrderedDict()     # key -> bucket digest
        self._added: dict[Key, bytes] = {}
        self._removed: set[Key] = set()
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        self._reset = True                       # the first event says: start from empty
        self.dropped = 0                         # entries dropped by the cap

    def __len__(self) -> int:
        return len(self._entries)

    def observe(self, added: bool, key: Key, tokens=None) -> None:
        """The prefix index's hook: ``key`` appeared (``tokens`` its content) or disappeared."""
        with self._lock:
            if added:
                self._add(key, bucket_digest(tokens, key[0], self.block))
            else:
                self._remove(key)

    def _add(self, key: Key, bucket: bytes) -> None:
        if key in self._entries:
            return
        self._entries[key] = bucket
        if key in self._removed:                 # removed and back within one delta: no change
            self._removed.discard(key)
        else:
            self._added[key] = bucket
        while len(self._entries) > self.cap:
            old, _ = self._entries.popitem(last=False)
            self.dropped += 1
            self._retract(old)

    def _remove(self, key: Key) -> None:
        if self._entries.pop(key, None) is not None:
            self._retract(key)

    def _retract(self, key: Key) -> None:
        if self._added.pop(key, None) is None:   # published before: the router must forget it
            self._removed.add(key)

    def reset(self) -> None:
        """The replica's caches are gone (a new worker, a new core): it starts empty again."""
        with self._lock:
            self._entries.clear()
            self._added.clear()
            self._removed.clear()
            self._reset = True

    def take(self) -> P.SummaryEvent | None:
        """The delta since the last ``take`` (None: nothing changed)."""
        with self._lock:
            if not (self._added or self._removed or self._reset):
                return None
            ev = P.SummaryEvent(self.epoch, self.seq, self._reset,
                                [(k[0], k[1], b) for k, b in self._added.items()],
                                [(k[0], k[1]) for k in self._removed], len(self._entries))
            self.seq += 1
            self._added, self._removed, self._reset = {}, set(), False
            return ev

    def snapshot(self) -> P.SummaryEvent:
        """Everything, as a reset event (a router that lost the thread resynchronises)."""
        with self._lock:
            ev = P.SummaryEvent(self.epoch, self.seq, True,
                                [(k[0], k[1], b) for k, b in self._entries.items()], [], len(self._entries))
            self.seq += 1
            self._added, self._removed, self._reset = {}, set(), False
            return ev

    def entries(self) -> dict[Key, bytes]:
        with self._lock:
            return dict(self._entries)


# ---- the router's side -----------------------------------------------------------------------------

@dataclass
class ReplicaView:
    """The router's copy of one replica's summary."""

    entries: dict[Key, tuple[int, bytes]] = field(default_factory=dict)   # key -> its bucket key
    epoch: str | None = None
    seq: int = -1
    updated: float | None = None             # time.monotonic() of the last event applied
    events: int = 0


class _Bucket:
    """The published entries whose first ``b`` tokens are one bucket's.

    Invariant: ``by_key`` holds exactly the (depth, digest) entries some replica publishes here,
    each with exactly those replicas; ``depths`` and ``holders`` count them by depth and by
    replica. Depths lie in [b, b + B), so a prompt is checked at <= B distinct depths here, however
    many entries share the bucket (a hot system prompt followed by thousands of sessions)."""

    __slots__ = ("by_key", "depths", "holders")

    def __init__(self):
        self.by_key: dict[Key, set[int]] = {}
        self.depths: Counter = Counter()
        self.holders: Counter = Counter()

    def add(self, key: Key, replica: int) -> None:
        reps = self.by_key.setdefault(key, set())
        if not reps:
            self.depths[key[0]] += 1
        reps.add(replica)
        self.holders[replica] += 1

    def remove(self, key: Key, replica: int) -> None:
        reps = self.by_key[key]
        reps.discard(replica)
        self.holders[replica] -= 1
        if not self.holders[replica]:
            del self.holders[replica]
        if not reps:
            del self.by_key[key]
            self.depths[key[0]] -= 1
            if not self.depths[key[0]]:
                del self.depths[key[0]]


class SummaryTable:
    """Every replica's published restore positions, indexed by bucket:

        (b, digest of the first b tokens) -> _Bucket {(depth, digest): {replica, ...}}

    Invariant: an entry is in the bucket index exactly when some replica's ``ReplicaView``
    holds it, with exactly those replicas."""

    def __init__(self, block: int = BLOCK):
        self.block = block
        self._buckets: dict[tuple[int, bytes], _Bucket] = {}
        self.views: dict[int, ReplicaView] = {}

    def apply(self, replica: int, ev: P.SummaryEvent, now: float | None = None) -> bool:
        """Apply one delta in order. False: it does not follow the last one (another epoch
        without a reset, or a gap): the caller resynchronises with a snapshot."""
        view = self.views.get(replica)
        if view is not None and ev.epoch == view.epoch and ev.seq <= view.seq:
            return True                          # older than a snapshot already applied
        if ev.reset:
            self.drop(replica)
            view = self.views[replica] = ReplicaView(epoch=ev.epoch)
        elif view is None or ev.epoch != view.epoch or ev.seq != view.seq + 1:
            return False
        for depth, dig in ev.removed:
            self._unindex(replica, view, (depth, bytes(dig)))
        for depth, dig, bucket in ev.added:
            key = (depth, bytes(dig))
            if key in view.entries:
                continue
            bkey = (bucket_of(depth, self.block), bytes(bucket))
            view.entries[key] = bkey
            at = self._buckets.get(bkey)
            if at is None:
                at = self._buckets[bkey] = _Bucket()
            at.add(key, replica)
        view.seq, view.events = ev.seq, view.events + 1
        view.updated = time.monotonic() if now is None else now
        return True

    def _unindex(self, replica: int, view: ReplicaView, key: Key) -> None:
        bkey = view.entries.pop(key, None)
        if bkey is None:
            return
        at = self._buckets[bkey]
        at.remove(key, replica)
        if not at.by_key:
            del self._buckets[bkey]

    def drop(self, replica: int) -> None:
        """Forget a replica (lost, replaced): its positions steer nothing any more."""
        view = self.views.pop(replica, None)
        if view is not None:
            for key in list(view.entries):
                self._unindex(replica, view, key)

    def size(self, replica: int) -> int:
        view = self.views.get(replica)
        return len(view.entries) if view is not None else 0

    def match(self, prompt: PromptHashes, replicas=None) -> dict[int, int]:
        """{replica: the deepest published restore position that is a prefix of the prompt}
        (replicas without one are absent). ``replicas``: only these count. Buckets deepest
        first; a bucket whose replicas all have a deeper match is skipped; inside one, each
        distinct depth is hashed once (from the bucket's state) and looked up."""
        best: dict[int, int] = {}
        want = None if replicas is None else set(replicas)
        for b, dig in reversed(prompt.buckets()):
            at = self._buckets.get((b, dig))
            if at is None:
                continue
            if not any(r not in best and (want is None or r in want) for r in at.holders):
                continue
            depths = sorted(d for d in at.depths if d <= prompt.length)
            digests = prompt.exacts(depths)
            for depth in reversed(depths):
                holders = at.by_key.get((depth, digests[depth]))
                if holders:
                    for r in holders:
                        if r not in best and (want is None or r in want):
                            best[r] = depth
            if want is not None and len(best) >= len(want):
                break                            # every replica has its deepest already
        return best
