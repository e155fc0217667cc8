"""ResourceManager: what is kept, where, and for whom (seed: ResourceManager 行).

It owns the private records and public entries, the prefix index, waiting references and the
demand evidence; it finds restore sources for admissions and Replay resumes, plans the save
opportunities of a request, keeps the books when checkpoints are captured, frozen, moved or
deleted, and decides captures' admission. Physical facts come only from the worker
(checkpoint refs, quotes); nothing here touches a tensor.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ninfer import protocol as P
from ninfer.policy.cost import CostModel
from ninfer.policy.index import DemandSummary, digest, prefix_digests
from ninfer.policy.records import MAX_ANCHORS, CkptInfo, Level, PrivateRecord, PublicEntry, RecordTable
from ninfer.policy.view import RequestView as Request
from ninfer.protocol import EntryOwner, Owner, RecordOwner, Role, WaiterOwner


@dataclass
class SavePoint:
    frontier: int
    owners: list[Owner]               # the first captures, the rest are added as owners
    kinds: list[str]                  # "in" | "a" | "m"
    entries: dict[Owner, PublicEntry] = field(default_factory=dict)   # marker owner -> entry


@dataclass
class CacheBook:
    """What the ResourceManager keeps per request (its own table, keyed by request id)."""

    record: PrivateRecord | None = None     # the private record it continues (once bound)
    save_points: list[SavePoint] = field(default_factory=list)   # pending, by frontier
    source_cid: int | None = None           # the source it adopts (protected until bound)
    wait: P.CkptRef | None = None           # waiting reference on a blocked valuable source
    observed: set[int] = field(default_factory=set)   # candidate positions already observed


@dataclass
class Admission:
    """How a request (re)enters execution: its source and what happens to records."""

    source: CkptInfo | None
    mode: P.BindMode = P.BindMode.FORK
    mover: Owner | None = None
    record: PrivateRecord | None = None
    takeover: bool = False
    cached: int = 0                   # real cross-request reuse (tokens)
    retire: list[P.Retire] = field(default_factory=list)

    @property
    def frontier(self) -> int:
        return self.source.frontier if self.source else 0


@dataclass
class CacheStats:
    queries: int = 0
    hits: int = 0
    reused_tokens: int = 0
    queried_tokens: int = 0
    lost_hits: int = 0                # prefix matched deeper, but its checkpoint is missing
    lost_tokens: int = 0
    captures: int = 0
    captures_skipped: int = 0
    summary_hits: int = 0             # repeat-demand evidence used (retention only; never a hit)
    waits: int = 0


class ResourceManager:
    def __init__(self, info: P.WorkerInfo, cost: CostModel | None = None):
        self.info = info
        self.cost = cost or CostModel()
        self.table = RecordTable()
        self.stats = CacheStats()
        self.summary = DemandSummary(256)
        self.remembered: OrderedDict[tuple[int, bytes], None] = OrderedDict()   # deleted points
        self.books: dict[str, CacheBook] = {}

    # ==== the per-request table =========================================================
    def book(self, req: Request) -> CacheBook:
        b = self.books.get(req.rid)
        if b is None:
            b = self.books[req.rid] = CacheBook()
        return b

    def forget(self, req: Request) -> None:
        self.books.pop(req.rid, None)

    def adopting(self) -> set[int]:
        """Sources being adopted right now (requests binding from them): never victims."""
        return {b.source_cid for b in self.books.values() if b.source_cid is not None}

    def e_owner(self, req: Request) -> RecordOwner | None:
        rec = self.book(req).record
        return rec.owner(Role.E) if rec is not None else None

    # ==== sources ======================================================================
    def candidates(self, tokens: list[int], limit: int) -> list[CkptInfo]:
        """Complete cache points on the hit path: the index narrows by digest, then tokens are
        compared exactly."""
        out = []
        for cid in self.table.index.lookup(tokens, limit):
            info = self.table.ckpts.get(cid)
            if info is not None and tuple(tokens[: info.frontier]) == info.tokens:
                out.append(info)
        return out

    def _h2d_bytes(self, info: CkptInfo) -> int:
        return 0 if info.ref.device else self.info.image_bytes

    def _rank_key(self, info: CkptInfo, req: Request, target: int):
        """Cost first; ties by bytes moved, deeper position, legal session hint, private use,
        newer publication order, stable sequence (seed order)."""
        h2d = self._h2d_bytes(info)
        recs = self.table.record_of(info.cid)
        session = any(r.session is not None and r.session == req.spec.session_id for r, _ in recs)
        order = max((r.publication_order for r, _ in recs), default=-1)
        return (self.cost.source_cost(h2d, target - info.frontier), h2d, -info.frontier,
                not session, not recs, -order, info.cid)

    def choose(self, req: Request, target: int, limit: int) -> CkptInfo | None:
        cands = self.candidates(req.ledger, limit)
        if not cands:
            return None
        best = min(cands, key=lambda c: self._rank_key(c, req, target))
        return best if self._rank_key(best, req, target)[0] <= self.cost.source_cost(0, target) else None

    def plan_admission(self, req: Request) -> Admission:
        """Fresh admission: the best source for the prompt, takeover or branch, Move or Fork.
        A request waiting on a source keeps it unless it became invalid or a better one exists."""
        P_len = len(req.prompt)
        src = self.choose(req, P_len, P_len)
        if src is None:
            return Admission(source=None, record=self._branch(req))
        recs = self.table.record_of(src.cid)
        rec, role = next(((r, role) for r, role in recs if self._may_take_over(r, req)), (None, None))
        adm = Admission(source=src, cached=src.frontier)
        own_wait = WaiterOwner(req.rid)
        if rec is not None:
            adm.record, adm.takeover = rec, True
            if role is Role.E and src.owners - {own_wait} == {rec.owner(Role.E)}:
                adm.mode, adm.mover = P.BindMode.MOVE, rec.owner(Role.E)
        else:
            adm.record = self._branch(req)
        return adm

    def _may_take_over(self, rec: PrivateRecord, req: Request) -> bool:
        """A non-active record that may be updated is taken over; an occupied relation or a
        cross-entry case (a different named session) branches instead."""
        if rec.active is not None:
            return False
        return rec.session is None or req.spec.session_id in (None, rec.session)

    def _branch(self, req: Request) -> PrivateRecord:
        """A tentative new record; it enters the table only if the request binds."""
        return self.table.new_record(req.spec.session_id, insert=False)

    def plan_replay(self, req: Request) -> Admission:
        """Replay resume: any complete point on the committed ledger up to the paused frontier
        (own Snapshot is handled before this). Never counted as a cache hit."""
        target = req.replay_target or 0
        src = self.choose(req, target, target)
        return Admission(source=src, record=self.book(req).record)

    # ==== waiting references ===========================================================
    def wait_on(self, req: Request, adm: Admission) -> list[P.Command]:
        """A queued request keeps its valuable source: a waiting reference protects it without
        allocating, without a lane, without heat or hit counts."""
        src, book = adm.source, self.book(req)
        if src is None or (book.wait is not None and book.wait.cid == src.cid):
            return []
        cmds = self.end_wait(req)
        owner = WaiterOwner(req.rid)
        src.owners.add(owner)
        book.wait = src.ref
        self.stats.waits += 1
        return cmds + [P.AddOwner(src.cid, src.ref.generation, owner)]

    def waiting_on(self, req: Request) -> P.CkptRef | None:
        b = self.books.get(req.rid)
        return b.wait if b is not None else None

    def end_wait(self, req: Request) -> list[P.Command]:
        book = self.books.get(req.rid)
        if book is None or book.wait is None:
            return []
        ref, book.wait = book.wait, None
        owner = WaiterOwner(req.rid)
        if ref.cid in self.table.ckpts:
            self._drop_use(ref.cid, owner)     # its last owner gone: the mirror forgets it too
        return [P.ReleaseOwner(ref.cid, ref.generation, owner)]

    # ==== save opportunities ===========================================================
    def candidate_positions(self, req: Request) -> list[int]:
        """Positions where this request offers a save: its input restore point, anchors, markers."""
        pos = set(req.spec.anchors) | set(req.spec.markers)
        if req.spec.recovery_frontier is not None:
            pos.add(req.spec.recovery_frontier)
        return sorted(pos)

    def save_plan(self, req: Request, start: int, rec: PrivateRecord) -> list[SavePoint]:
        """Input restore point, anchors and markers inside (start, P] — never chunk ends.
        Same frontiers merge into one capture with several owners."""
        P_len = len(req.prompt)
        points: dict[int, SavePoint] = {}

        def add(f: int, owner: Owner, kind: str, entry: PublicEntry | None = None) -> None:
            if start < f <= P_len:
                sp = points.setdefault(f, SavePoint(f, [], []))
                sp.owners.append(owner)
                sp.kinds.append(kind)
                if entry is not None:
                    sp.entries[owner] = entry

        r = req.spec.recovery_frontier
        if r is not None and not self._carried(rec.input_point, req.prompt, r):
            add(r, rec.owner(Role.INPUT), "in")
        for a in sorted(set(req.spec.anchors)):
            if not any(self._carried(c, req.prompt, a) for c in rec.anchors):    # updated in place
                add(a, rec.owner(Role.ANCHOR), "a")
        for m in sorted(set(req.spec.markers)):
            if start < m <= P_len and not self._has_entry(req.prompt, m):
                ent = self.table.new_entry(-1, m, insert=False)     # enters the table when captured
                add(m, ent.owner, "m", ent)
        return [points[f] for f in sorted(points)]

    def _carried(self, cid: int | None, prompt: list[int], r: int) -> bool:
        info = self.table.ckpts.get(cid) if cid is not None else None
        return info is not None and info.frontier == r and tuple(prompt[:r]) == info.tokens

    def _has_entry(self, prompt: list[int], f: int) -> bool:
        return any(e.frontier == f and tuple(prompt[:f]) == self.table.ckpts[e.cid].tokens
                   for e in self.table.entries.values() if e.cid in self.table.ckpts)

    def retire_for(self, req: Request, sp: SavePoint, rec: PrivateRecord | None = None) -> list[P.Retire]:
        """A needed later input point retires the record's old one before its destination is
        requested (seed: 旧点可在申请新目的之前退休；新保存失败不恢复旧点)."""
        rec = rec or self.book(req).record
        if "in" not in sp.kinds or rec is None or rec.input_point is None:
            return []
        info = self.table.ckpts.get(rec.input_point)
        if info is None:
            return []
        return [P.Retire(info.cid, info.ref.generation, rec.owner(Role.INPUT))]

    def anchor_overflow(self, req: Request, rec: PrivateRecord | None = None) -> list[P.Retire]:
        """Over four anchors: the oldest published is replaced (applied once the unit ran)."""
        rec = rec or self.book(req).record
        out = []
        for cid in rec.anchors[: max(0, len(rec.anchors) - MAX_ANCHORS + 1)]:
            info = self.table.ckpts.get(cid)
            if info is not None:
                out.append(P.Retire(cid, info.ref.generation, rec.owner(Role.ANCHOR)))
        return out

    def retired(self, req: Request, retire: list[P.Retire]) -> None:
        """The worker released these holds when the unit ran (whether or not its save found
        room): mirror it."""
        rec = self.book(req).record
        for r in retire:
            if rec.input_point == r.cid and r.owner == rec.owner(Role.INPUT):
                rec.input_point = None
            if r.cid in rec.anchors and r.owner == rec.owner(Role.ANCHOR):
                rec.anchors.remove(r.cid)
            self._drop_use(r.cid, r.owner)

    def capture_terms(self, req: Request, sp: SavePoint, rec: PrivateRecord | None = None
                      ) -> tuple[int, float | None, bool]:
        """(fixed new-coverage benefit, own repeat-demand time or None, owner is reuse) for the
        admission of a capture at ``sp``."""
        f = sp.frontier
        deeper = [c.frontier for c in self.candidates(req.prompt, f) if c.frontier < f]
        benefit = f - max(deeper, default=0)
        obs = self.summary.get(digest(req.prompt[:f]))
        own = obs.last if obs is not None and obs.repeated else None
        if own is not None:
            self.stats.summary_hits += 1
        rec = rec or self.book(req).record
        return benefit, own, rec is not None and rec.level == Level.REUSE

    # ==== evidence =====================================================================
    def observe_prefill(self, req: Request, start: int, end: int) -> None:
        """A new prefill commit crossing a candidate position is a real computation demand
        (once per request per position). Two different requests computing the same position
        prove repeat demand even with nothing cached."""
        observed = self.book(req).observed
        crossed = [p for p in self.candidate_positions(req) if start < p <= end and p not in observed]
        if not crossed:
            return
        now = time.monotonic()
        for f, d in prefix_digests(req.prompt, crossed).items():
            observed.add(f)
            obs = self.summary.observe(d, f, req.rid, now)
            if obs.repeated:
                self._promote(req.prompt[:f], f, now)

    def _promote(self, tokens: list[int], f: int, now: float) -> None:
        """Repeat demand lifts the owners of an existing point at that exact position to the
        reuse level; an input point proves its own position."""
        for info in self.candidates(tokens, f):
            if info.frontier != f:
                continue
            for rec, role in self.table.record_of(info.cid):
                rec.level = Level.REUSE
                rec.evidence.demand_time = now
                if role is Role.INPUT:
                    rec.evidence.proven_frontier = f
            for ent in self.table.entries_of(info.cid):
                ent.level = Level.REUSE
                ent.evidence.demand_time = now

    def _note_adoption(self, req: Request, src: CkptInfo, child: PrivateRecord, takeover: bool) -> None:
        """Real cross-request adoption. Consume (takeover) resets the owner's (time, proven
        frontier) from this source; a Fork child gets this adoption's time and position, while
        the parent keeps its own pair unless the source covers its proven position; public use
        updates the public entry. The summary records repeat demand at the adopted position."""
        now = time.monotonic()
        for rec, _ in self.table.record_of(src.cid):
            if rec is child or src.frontier >= rec.evidence.proven_frontier:
                rec.evidence.demand_time = now
                rec.evidence.proven_frontier = src.frontier
                rec.level = Level.REUSE
        if not takeover:
            child.evidence.demand_time = now
            child.evidence.proven_frontier = src.frontier
            child.level = Level.REUSE
        for ent in self.table.entries_of(src.cid):
            ent.evidence.demand_time = now
            ent.level = Level.REUSE
        self.summary.observe(digest(src.tokens), src.frontier, req.rid, now)

    # ==== bookkeeping ==================================================================
    def on_bound(self, req: Request, adm: Admission, save_points: list[SavePoint]) -> None:
        """A fresh admission succeeded: count the query, take over or branch, note demand."""
        self._count_query(req, adm.source)
        rec = adm.record
        self.table.records.setdefault(rec.id, rec)
        rec.active = req.rid
        book = self.book(req)
        book.record, book.save_points = rec, save_points
        if adm.source is not None and adm.cached:
            self._note_adoption(req, adm.source, rec, adm.takeover)
        if adm.mode is P.BindMode.MOVE and adm.source is not None:
            self._forget(adm.source.cid)         # consumed by the Move

    def on_resumed(self, req: Request, adm: Admission | None) -> None:
        """A Replay resume bound from a cache point (never a hit); a Snapshot resume moved its
        own snapshot. Either way nothing is adopted from another request."""
        self.book(req).source_cid = None

    def _count_query(self, req: Request, src: CkptInfo | None) -> None:
        s = self.stats
        s.queries += 1
        s.queried_tokens += len(req.prompt)
        got = src.frontier if src else 0
        if src is not None:
            s.hits += 1
            s.reused_tokens += got
        fs = [f for f, _ in self.remembered if got < f <= len(req.prompt)]
        if fs:
            digs = prefix_digests(req.prompt, fs)
            deeper = max((f for f in fs if (f, digs[f]) in self.remembered), default=0)
            if deeper:
                s.lost_hits += 1
                s.lost_tokens += deeper - got

    def on_captured(self, req: Request, sp: SavePoint, ref: P.CkptRef) -> list[P.Command]:
        """Attach a new checkpoint to its uses; returns AddOwner commands for extra owners."""
        self.stats.captures += 1
        rec = self.book(req).record
        tokens = tuple(req.ledger[: ref.frontier])
        cmds: list[P.Command] = []
        for i, (owner, kind) in enumerate(zip(sp.owners, sp.kinds)):
            self.table.add_ckpt(ref, tokens, owner)
            if i > 0:
                cmds.append(P.AddOwner(ref.cid, ref.generation, owner))
            if kind == "m":
                ent = sp.entries[owner]
                ent.cid = ref.cid
                self.table.entries[ent.id] = ent
            elif kind == "in":
                rec.input_point = ref.cid
            elif kind == "a":
                rec.anchors.append(ref.cid)
        obs = self.summary.get(digest(tokens))
        if obs is not None and obs.repeated:
            self._promote(list(tokens), ref.frontier, time.monotonic())
        return cmds

    def on_skipped(self, sp: SavePoint) -> None:
        """No room for an optional save: nothing is kept (tentative entries never existed)."""
        self.stats.captures_skipped += 1

    def on_finished(self, req: Request, e: P.CkptRef) -> list[P.Command]:
        """Normal finish: the frozen state is the record's new E (the old E, if it survived a
        Fork, is released by this record). Completion does not refresh evidence."""
        rec = self.book(req).record
        cmds: list[P.Command] = []
        if rec.e is not None:
            info = self.table.ckpts.get(rec.e)
            if info is not None:
                cmds.append(P.ReleaseOwner(info.cid, info.ref.generation, rec.owner(Role.E)))
            self._drop_use(rec.e, rec.owner(Role.E))
        self.table.add_ckpt(e, tuple(req.ledger[: e.frontier]), rec.owner(Role.E))
        rec.e = e.cid
        rec.active = None
        self.table.publish_session(rec, req.ticket)
        return cmds

    def on_released(self, req: Request) -> list[P.Command]:
        """Cancel / error: the record this request continued is free again (a Move may have
        consumed its old E: other owners keep theirs); a waiting reference ends."""
        rec = self.book(req).record
        if rec is not None and rec.active == req.rid:
            rec.active = None
            self.table.prune(rec)
        return self.end_wait(req)

    def _drop_use(self, cid: int, owner: Owner) -> None:
        info = self.table.ckpts.get(cid)
        if info is not None and self.table.drop_owner(cid, owner):
            self._remember(info)

    def _forget(self, cid: int) -> None:
        info = self.table.ckpts.get(cid)
        self.table.forget_ckpt(cid)
        if info is not None:
            self._remember(info)

    def _remember(self, info: CkptInfo) -> None:
        """Keep the digest of deleted points (bounded) to count hits lost to a missing
        checkpoint — the metric users of other engines ask for."""
        self.remembered[(info.frontier, digest(info.tokens))] = None
        while len(self.remembered) > 256:
            self.remembered.popitem(last=False)

    def on_deleted(self, cids: list[int]) -> list[str]:
        """Physical deletions: returns the rids whose waiting reference was revoked."""
        revoked = []
        for cid in cids:
            info = self.table.ckpts.get(cid)
            if info is not None:
                revoked += [o.rid for o in info.owners if isinstance(o, WaiterOwner)]
            self._forget(cid)
        for rid in revoked:
            book = self.books.get(rid)
            if book is not None:
                book.wait = None               # revoked: it reselects its source
        return revoked

    # ==== whole-cache operations =======================================================
    def drop_all(self) -> list[P.Command]:
        """Release every optional cache use (for leak checks): records and entries."""
        cmds = []
        for info in list(self.table.ckpts.values()):
            for owner in list(info.owners):
                if isinstance(owner, (RecordOwner, EntryOwner)):
                    cmds.append(P.ReleaseOwner(info.cid, info.ref.generation, owner))
                    self.table.drop_owner(info.cid, owner)
        for rec in list(self.table.records.values()):
            rec.e, rec.input_point, rec.anchors = None, None, []
            self.table.prune(rec)
        self.table.entries.clear()
        return cmds
