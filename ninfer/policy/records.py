"""Logical cache records (seed: 续接记录与公共共享条目) and the checkpoints they name.

    PrivateRecord   one history: its generation end E, one input-side restore point, up to
                    four explicit anchors; a session name is a lookup hint and named entry
    PublicEntry     a shared marker position others may fork from

Several logical uses may name one physical checkpoint (a private input point and a public
marker at the same frontier share one StateImage). On the worker every use is an *owner* of
that checkpoint (a tagged union, ``protocol.Owner``); the checkpoint lives while any owner holds
it.

    RecordOwner(record, E | INPUT | ANCHOR)   EntryOwner(entry)   WaiterOwner(rid)
    SnapshotOwner(sid)  (a pause snapshot; never in these tables)
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from ninfer.policy.history import HistoryTrie
from ninfer.policy.index import PrefixIndex
from ninfer.protocol import MAX_ANCHORS, MAX_MARKERS, CkptKind, CkptRef, EntryOwner, Owner, RecordOwner, Role  # noqa: F401

RECENT_ADDS = 64      # new cache points a cached prefix list is brought up to date over (RecordTable.prefixes_of)


class Level(StrEnum):
    NORMAL = "normal"
    REUSE = "reuse"


@dataclass(eq=False)
class CkptInfo:
    """Controller-side mirror of one Native checkpoint."""

    ref: CkptRef
    tokens: tuple[int, ...]
    owners: set[Owner] = field(default_factory=set)
    host_pages: int = 0             # Main KV pages only on the Host (a restore reads them back)

    @property
    def cid(self) -> int:
        return self.ref.cid

    @property
    def frontier(self) -> int:
        return self.ref.frontier


@dataclass(eq=False)
class Evidence:
    """Real demand: (time of the latest real adoption or repeat demand, proven frontier)."""

    demand_time: float | None = None
    proven_frontier: int = 0


@dataclass(eq=False)
class PrivateRecord:
    id: int
    session: str | None
    publication_order: int = -1
    e: int | None = None                    # cid of the generation end
    input_point: int | None = None          # cid of the input-side restore point
    anchors: list[int] = field(default_factory=list)   # cids, oldest published first
    active: str | None = None               # rid of the request continuing it now
    level: Level = Level.NORMAL
    evidence: Evidence = field(default_factory=Evidence)

    def owner(self, role: Role) -> RecordOwner:
        return RecordOwner(self.id, role)

    def points(self) -> list[tuple[Role, int]]:
        """(role, cid) of every restore point this record holds."""
        out = [(Role.E, self.e), (Role.INPUT, self.input_point)] + [(Role.ANCHOR, c) for c in self.anchors]
        return [(r, c) for r, c in out if c is not None]

    @property
    def empty(self) -> bool:
        return self.e is None and self.input_point is None and not self.anchors


@dataclass(eq=False)
class PublicEntry:
    id: int
    cid: int
    frontier: int
    level: Level = Level.NORMAL
    evidence: Evidence = field(default_factory=Evidence)

    @property
    def owner(self) -> EntryOwner:
        return EntryOwner(self.id)


class _Noting(dict):
    """A dict that notes every key it inserts or deletes in ``touched``."""

    def __init__(self, touched: set[int]):
        super().__init__()
        self.touched = touched

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.touched.add(key)

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self.touched.add(key)

    def setdefault(self, key, default=None):
        self.touched.add(key)
        return super().setdefault(key, default)

    def pop(self, key, *default):
        self.touched.add(key)
        return super().pop(key, *default)

    def popitem(self):
        key, value = super().popitem()
        self.touched.add(key)
        return key, value

    def update(self, *args, **kwargs) -> None:
        new = dict(*args, **kwargs)
        super().update(new)
        self.touched.update(new)

    def clear(self) -> None:
        self.touched.update(self)
        super().clear()


class RecordTable:
    """Records, entries, the session index and the checkpoint mirror, kept consistent."""

    def __init__(self):
        self._ids = itertools.count(1)
        self.ckpts: dict[int, CkptInfo] = {}
        # ids of the records and entries inserted, deleted or touched since the pressure planner
        # last read them (its kept survey of the owners' classes and demand times)
        self.touched_records: set[int] = set()
        self.records: dict[int, PrivateRecord] = _Noting(self.touched_records)
        self.entries: dict[int, PublicEntry] = _Noting(self.touched_records)
        self.sessions: dict[str, int] = {}          # session -> record id (newest publication)
        self.index = PrefixIndex()                  # live cache points by exact prefix digest
        self.histories = HistoryTrie()              # their token content (and live prompts): divergence positions
        self._adds = 0                              # cache points indexed so far (an epoch)
        self._recent: deque[int] = deque(maxlen=RECENT_ADDS)   # the cids of the last adds, oldest first
        self._prefixes: dict[int, tuple[int, list[tuple[int, int]]]] = {}   # cid -> (epoch, list)
        self.dirty: set[int] = set()                # cids whose owners, evidence or placement changed
        # cid -> its token count, for each indexed cache point no other live point has the very
        # tokens of (``may_lose_nothing`` is False for it on the whole table), kept as points come
        # and go: the reclaim planner's loss floors are read off it, no index asked per point
        self.lone: dict[int, int] = {}

    def touch(self, holder: PrivateRecord | PublicEntry) -> None:
        """A record's or entry's level or evidence changed: its points are re-ranked."""
        self.touched_records.add(holder.id)
        if isinstance(holder, PublicEntry):
            self.dirty.add(holder.cid)
        else:
            self.dirty.update(c for _, c in holder.points())

    # -- checkpoints -------------------------------------------------------------------------
    def add_ckpt(self, ref: CkptRef, tokens: tuple[int, ...], owner: Owner) -> CkptInfo:
        info = self.ckpts.get(ref.cid)
        self.dirty.add(ref.cid)
        if info is None:
            info = self.ckpts[ref.cid] = CkptInfo(ref, tokens)
            if ref.kind is CkptKind.CACHE:
                self.index.add(ref.cid, tokens)
                self._settle_lone(self.index.same_key(ref.cid))
                self.histories.insert(("ck", ref.cid), tokens)
                self._adds += 1
                self._recent.append(ref.cid)
        info.owners.add(owner)
        return info

    def drop_owner(self, cid: int, owner: Owner) -> bool:
        """Forget one logical use; True if the checkpoint has no owner left (deleted)."""
        info = self.ckpts.get(cid)
        if info is None:
            return True
        self.dirty.add(cid)
        info.owners.discard(owner)
        if not info.owners:
            del self.ckpts[cid]
            self._unindex(cid)
            self.histories.remove(("ck", cid))
            self._prefixes.pop(cid, None)
            return True
        return False

    def forget_ckpt(self, cid: int) -> list[Owner]:
        """A physical delete: every logical use of the checkpoint disappears with it."""
        uses, ents = self.record_of(cid), self.entries_of(cid)     # O(its owners), not O(table)
        self.dirty.add(cid)
        info = self.ckpts.pop(cid, None)
        self._unindex(cid)
        self.histories.remove(("ck", cid))
        self._prefixes.pop(cid, None)
        owners = list(info.owners) if info else []
        for rec, _ in uses:
            if rec.e == cid:
                rec.e = None
            if rec.input_point == cid:
                rec.input_point = None
            if cid in rec.anchors:
                rec.anchors.remove(cid)
            self.prune(rec)
        for ent in ents:
            del self.entries[ent.id]
        return owners

    def _unindex(self, cid: int) -> None:
        """``cid`` leaves the index (and ``lone``); the points left under its key are judged again."""
        same = self.index.same_key(cid)
        rest = [o for o in same if o != cid] if same is not None else []
        self.index.remove(cid)
        self.lone.pop(cid, None)
        self._settle_lone(rest)

    def _settle_lone(self, members) -> None:
        """``lone`` for the points of one index key (all of them), after a point joined or left it."""
        ckpts = self.ckpts
        for m in members:
            info = ckpts.get(m)
            toks = info.tokens if info is not None else ()
            if toks and not any(o != m and (oi := ckpts.get(o)) is not None and oi.tokens == toks for o in members):
                self.lone[m] = len(toks)
            else:
                self.lone.pop(m, None)

    def prefixes_of(self, cid: int) -> list[tuple[int, int]]:
        """(frontier, cid) of the live cache points that are exact prefixes of ``cid`` (itself
        excluded; identical aliases included), deepest first — through the prefix index, never
        a directory scan. Kept across new points: a list taken at most ``RECENT_ADDS`` adds ago is
        brought up to date by checking only the points added since (the pressure planner asks this
        for every candidate every cycle, and a busy cache indexes new points every cycle: a
        lookup hashes the whole token list); deleted ones are filtered out."""
        return [(f, o) for f, o in self._prefix_list(cid) if o in self.ckpts]

    def is_prefix(self, other: int, cid: int) -> bool:
        """Whether ``other`` is one of ``prefixes_of(cid)``, from the two points' tokens alone: a
        question about one point (a record's own few) brings no prefix list up to date."""
        info, o = self.ckpts.get(cid), self.ckpts.get(other)
        if info is None or o is None or other == cid or o.ref.kind is not CkptKind.CACHE:
            return False
        f = o.frontier
        return f <= len(info.tokens) and o.tokens == info.tokens[:f]

    def _prefix_list(self, cid: int) -> list[tuple[int, int]]:
        """The kept list behind ``prefixes_of`` (deleted points not yet filtered out), brought up
        to date: only the points added since it was taken are checked, and when none of them is
        a prefix the list is kept as it is (most cycles index points of other histories).
        Callers do not mutate it."""
        got = self._prefixes.get(cid)
        if got is not None and got[0] == self._adds:
            return got[1]
        info = self.ckpts.get(cid)
        out: list[tuple[int, int]] = []
        if info is not None:
            toks = info.tokens
            since = self._adds - got[0] if got is not None else None
            if since is not None and since <= len(self._recent):    # ids are never reused (one id space)
                new = self._prefixes_among(cid, toks, itertools.islice(self._recent, len(self._recent) - since, None))
                out = sorted(got[1] + new, reverse=True) if new else got[1]
            else:
                out = self._derived_list(cid, toks)
                if out is None:
                    out = self._prefixes_among(cid, toks, self.index.lookup(list(toks), len(toks)))
                    out.sort(reverse=True)
        self._prefixes[cid] = (self._adds, out)
        return out

    def _derived_list(self, cid: int, toks: tuple[int, ...]) -> list[tuple[int, int]] | None:
        """The prefix list of a point that has none kept, from the deepest recent point below it
        whose list is kept (None: no such point): that point, its own list, and the points
        between the two that the index keys — a lookup over the frontiers above it only (a new
        chunk's point sits on a request's earlier one; a lookup over the whole prompt copies the
        running hash at every indexed frontier below it, hundreds on a long prompt)."""
        ckpts, horizon, best = self.ckpts, self._adds - len(self._recent), None
        for o in self._recent:
            oi = ckpts.get(o)
            if o == cid or oi is None or (best is not None and oi.frontier <= best[0]):
                continue
            f = oi.frontier
            if f <= len(toks) and (f == 0 or (oi.tokens and oi.tokens[-1] == toks[f - 1])) and oi.tokens == toks[:f]:
                kept = self._prefixes.get(o)
                if kept is not None and kept[0] >= horizon:         # brought up to date over the recent adds
                    best = (f, o)
        if best is None:
            return None
        f, below = best
        out = [(pf, o) for pf, o in self._prefix_list(below) if o != cid]
        out.append(best)
        out += self._prefixes_among(cid, toks, self.index.lookup(list(toks), len(toks), above=f))
        out.sort(reverse=True)
        return out

    def _prefixes_among(self, cid: int, toks: tuple[int, ...], found) -> list[tuple[int, int]]:
        """(frontier, id) of the points in ``found`` whose tokens are a prefix of ``toks`` (``cid``
        itself excluded); the last token is compared first, the whole prefix only when it matches."""
        out = []
        for other in found:
            o = self.ckpts.get(other)
            if other != cid and o is not None:
                f = o.frontier
                if f <= len(toks) and (f == 0 or (o.tokens and o.tokens[-1] == toks[f - 1])) and o.tokens == toks[:f]:
                    out.append((f, other))
        return out

    def deepest_prefix(self, cid: int, live) -> int:
        """The frontier of the deepest point of ``prefixes_of(cid)`` that ``live`` holds (0: none),
        without listing the others (a point on a long history has hundreds of prefix points)."""
        return next((f for f, o in self._prefix_list(cid) if o in self.ckpts and o in live), 0)

    def may_lose_nothing(self, cid: int, frontier: int, live) -> bool:
        """Whether ``deepest_prefix(cid, live)`` may be ``frontier`` itself: the root, a point
        the index does not key, or a live indexed point with its very tokens (an identical
        alias). False: every exact prefix point is shallower (its least loss is at least one
        token) — read off the index's key of the point, no prefix list brought up to date."""
        if live is self.ckpts:
            return self.lone.get(cid) != frontier          # kept as points come and go (``lone``)
        info = self.ckpts.get(cid)
        if info is None or frontier == 0 or len(info.tokens) != frontier:
            return True
        same = self.index.same_key(cid)
        if same is None:
            return True
        if len(same) < 2:
            return False                          # the key is its own alone
        ckpts, toks = self.ckpts, info.tokens
        return any(o != cid and o in ckpts and o in live and ckpts[o].tokens == toks for o in same)

    # -- records ---------------------------------------------------------------------------
    def new_record(self, session: str | None, insert: bool = True) -> PrivateRecord:
        """A record; ``insert=False`` makes a tentative one (inserted when the request binds)."""
        rec = PrivateRecord(id=next(self._ids), session=session)
        if insert:
            self.records[rec.id] = rec
        return rec

    def new_entry(self, cid: int, frontier: int, insert: bool = True) -> PublicEntry:
        ent = PublicEntry(id=next(self._ids), cid=cid, frontier=frontier)
        if insert:
            self.entries[ent.id] = ent
        return ent

    def prune(self, rec: PrivateRecord) -> None:
        """Empty logical records are deleted promptly (metadata stays bounded)."""
        if rec.empty and rec.active is None and rec.id in self.records:
            del self.records[rec.id]
            if rec.session is not None and self.sessions.get(rec.session) == rec.id:
                del self.sessions[rec.session]

    def publish_session(self, rec: PrivateRecord, order: int) -> None:
        """A session name points at the newest publication; an older request finishing late
        never overwrites a newer one."""
        rec.publication_order = max(rec.publication_order, order)
        if rec.session is None:
            return
        cur = self.records.get(self.sessions.get(rec.session, -1))
        if cur is None or cur is rec or cur.publication_order <= order:
            self.sessions[rec.session] = rec.id

    def record_of(self, cid: int) -> list[tuple[PrivateRecord, Role]]:
        """The records using ``cid`` and in which role, found through the checkpoint's owners
        (every use is also an owner), in record order."""
        info = self.ckpts.get(cid)
        if info is None:
            return []
        out = []
        for o in info.owners:
            if isinstance(o, RecordOwner) and (r := self.records.get(o.record)) is not None \
                    and (o.role, cid) in r.points():
                out.append((r, o.role))
        out.sort(key=lambda x: (x[0].id, x[1]))
        return out

    def entries_of(self, cid: int) -> list[PublicEntry]:
        info = self.ckpts.get(cid)
        if info is None:
            return []
        return sorted((e for o in info.owners if isinstance(o, EntryOwner)
                       and (e := self.entries.get(o.entry)) is not None and e.cid == cid), key=lambda e: e.id)
