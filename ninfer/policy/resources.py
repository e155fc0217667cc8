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
from enum import StrEnum

from ninfer import protocol as P
from ninfer.policy.cost import CostModel
from ninfer.policy.host_order import HostOrder
from ninfer.policy.index import DemandSummary, digest, prefix_digests
from ninfer.policy.records import MAX_ANCHORS, CkptInfo, Level, PrivateRecord, PublicEntry, RecordTable
from ninfer.policy.view import RequestView as Request
from ninfer.protocol import EntryOwner, Owner, RecordOwner, Role, WaiterOwner


class SaveKind(StrEnum):
    """Why a request offers a save at a position (several may share one)."""

    INPUT = "in"              # its input restore point (C, R or P): the private record's
    ANCHOR = "a"              # an explicit private anchor
    MARKER = "m"              # a caller's shared marker: a public entry
    DIVERGENCE = "d"          # where it parts from a known history: a public entry
    ANTICIPATED = "t"         # its end less a frequently observed divergence tail: a public entry


@dataclass
class SavePoint:
    frontier: int
    owners: list[Owner]               # the first captures, the rest are added as owners
    kinds: list[SaveKind]
    entries: dict[Owner, PublicEntry] = field(default_factory=dict)   # marker owner -> entry


@dataclass
class CacheBook:
    """What the ResourceManager keeps per request (its own table, keyed by request id)."""

    record: PrivateRecord | None = None     # the private record it continues (once bound)
    save_points: list[SavePoint] = field(default_factory=list)   # pending, by frontier
    source_cid: int | None = None           # the source it adopts (protected until bound)
    wait: P.CkptRef | None = None           # waiting reference on a blocked valuable source
    carried: list[P.CkptRef] = field(default_factory=list)   # the compatible points it carries, held too
    observed: set[int] = field(default_factory=set)   # candidate positions already observed
    unfit: set[int] = field(default_factory=set)      # sources whose restore cannot fit at all
    pending: PendingWait | None = None      # waiting for another request's save still to come
    waited: set[str] = field(default_factory=set)     # producers it waited for in vain (never again)
    pending_base: int | None = None         # a wait ended with the point there: the source it had
    waited_s: float = 0.0                   # time spent in pending waits that ended
    lost: dict | None = None                # its admission missed a restore point: where, why
    divergence: list[int] = field(default_factory=list)   # divergence positions it offers a save at
    diverged_from: set[int] = field(default_factory=set)  # ... those another request computed across


@dataclass
class PendingWait:
    """A fresh request waits for a restore point another request will publish (seed: 等待
    引用; 未完成副本不能成为查询来源 — it is no source until it is complete)."""

    producer: str            # rid of the request whose save it waits for
    frontier: int            # the position of that save
    base: int                # the frontier of the best complete source it had
    since: float


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


LOST_CAUSES = ("evicted", "released", "skipped_no_room", "skipped_no_admission", "skipped_no_turn")
# evicted: reclaim deleted it; released: its last owner let it go (a record's newer E replaced
# it, an anchor retired); skipped_*: the save never happened — no Device slot or Host room, the
# admission table refused the replacement, or no turn (a full recovery permit was active)


@dataclass
class CacheStats:
    queries: int = 0
    hits: int = 0
    reused_tokens: int = 0
    queried_tokens: int = 0
    lost_hits: int = 0                # prefix matched a history whose restore point is missing
    lost_tokens: int = 0
    lost_by_cause: dict = field(default_factory=dict)   # cause -> lost hits (LOST_CAUSES)
    captures: int = 0
    captures_skipped: int = 0
    summary_hits: int = 0             # repeat-demand evidence used (retention only; never a hit)
    waits: int = 0
    pending_waits: int = 0            # fresh requests that waited for another's pending save
    pending_saved_tokens: int = 0     # tokens they did not compute because they waited
    pending_wait_s: float = 0.0       # time they spent waiting
    pending_abandoned: int = 0        # waits whose point never came (producer gone, save skipped)


PUBLIC = (SaveKind.MARKER, SaveKind.DIVERGENCE, SaveKind.ANTICIPATED)    # kinds whose owner is a public entry
OPTIONAL_CUTS = {SaveKind.DIVERGENCE, SaveKind.ANTICIPATED}   # no input boundary of the request itself
LADDER = 5                # anticipated positions at its end less divergence_min x 1, 2, 4, 8, 16 ...
ANTICIPATE = 3            # ... and less up to 3 longer tails seen most often at real divergences
TAIL_KINDS = 64            # distinct tail lengths remembered (the least frequent goes)
TAIL_SAMPLE = 4            # earlier histories whose tail a divergence records
MAX_DIVERGENCE = 4          # divergence positions one request offers at most (as MAX_MARKERS)
HISTORY_OBSERVER = "<history>"   # the earlier request that computed across a divergence position


class ResourceManager:
    def __init__(self, info: P.WorkerInfo, cost: CostModel | None = None, divergence_min: int | None = 16,
                 anticipate: bool = True):
        self.info = info
        self.cost = cost or CostModel()
        self.divergence_min = divergence_min    # None: no divergence positions
        self.anticipate = anticipate            # anticipated positions too (the ladder, frequent long tails)
        self.tails: dict[int, int] = {}         # divergence tail (tokens from a prompt end back to where it parted) -> times seen
        self.table = RecordTable()
        self.stats = CacheStats()
        self.summary = DemandSummary(256, info.exec_identity)
        self.remembered: OrderedDict[tuple[int, bytes], str] = OrderedDict()   # missing points -> cause
        self.books: dict[str, CacheBook] = {}
        self.host_order = HostOrder(self.table)
        self.uncovered: dict[int, int] = {}    # cid -> generation: no restore source (``uncover``)

    def host_window(self, k: int) -> list[int]:
        """The Host candidates a scoped quote carries (see policy/host_order.py)."""
        return self.host_order.window(k)

    def fold_marks(self) -> None:
        """Fold the marks of what changed into the Host order now (``HostOrder.refresh``), so
        the next window reads an order already up to date: what the engine does while idle.
        The same keys as when the window folds them: nothing changes the records in between."""
        self.host_order.refresh()

    # ==== the per-request table =========================================================
    def book(self, req: Request) -> CacheBook:
        b = self.books.get(req.rid)
        if b is None:
            b = self.books[req.rid] = CacheBook()
        return b

    def forget(self, req: Request) -> None:
        self.books.pop(req.rid, None)
        self.table.histories.remove(req.rid)

    def adopting(self) -> set[int]:
        """Sources being adopted right now (requests binding from them): never victims."""
        return {b.source_cid for b in self.books.values() if b.source_cid is not None}

    def e_owner(self, req: Request) -> RecordOwner | None:
        rec = self.book(req).record
        return rec.owner(Role.E) if rec is not None else None

    # ==== sources ======================================================================
    def candidates(self, tokens: list[int], limit: int, rid: str | None = None) -> list[CkptInfo]:
        """Complete cache points on the hit path: the index narrows by digest, then tokens are
        compared exactly. A point only waiters keep is no public candidate except for its own
        waiter ``rid`` (seed: 仅由等待者保留的点不作为新的公共目录入口)."""
        out = []
        for cid in self.table.index.lookup(tokens, limit):
            info = self.table.ckpts.get(cid)
            if info is not None and tuple(tokens[: info.frontier]) == info.tokens and self._public(info, rid) \
                    and self.restorable(info):
                out.append(info)
        return out

    @staticmethod
    # rule: waiter-only-not-public
    def _public(info: CkptInfo, rid: str | None) -> bool:
        """Not a point that only waiters keep — unless ``rid`` is one of them (its own source)."""
        return not info.owners or not all(isinstance(o, WaiterOwner) and o.rid != rid for o in info.owners)

    # rule: restorable
    def restorable(self, info: CkptInfo) -> bool:
        """Not a point the worker reported without the draft coverage its restore needs."""
        return self.uncovered.get(info.cid) != info.ref.generation

    def uncover(self, refs) -> None:
        """The worker's report of checkpoints without their draft coverage (DFlash): each stays
        until released, but no request restores from it or shares it as a save."""
        for cid, generation in refs:
            if cid in self.table.ckpts:
                self.uncovered[cid] = generation

    def _h2d_bytes(self, info: CkptInfo) -> int:
        """What restoring this source reads back: its StateImage unless on the Device, and
        its KV pages that only the Host holds (the worker reports placement changes)."""
        return (0 if info.ref.device else self.info.image_bytes) + info.host_pages * self.info.page_bytes

    def placed(self, changes) -> None:
        """Mirror the worker's placement report (O(what changed))."""
        for cid, generation, on_device, host_pages in changes:
            info = self.table.ckpts.get(cid)
            if info is None or info.ref.generation != generation:
                continue
            r = info.ref
            self.table.dirty.add(cid)
            if r.device != on_device:
                info.ref = P.CkptRef(r.cid, r.generation, r.frontier, r.kind, on_device, r.host or not on_device)
            info.host_pages = host_pages

    # rule: source-ranking
    def _rank_key(self, info: CkptInfo, req: Request, target: int):
        """Cost first; ties by bytes moved, deeper position, legal session hint, private use,
        newer publication order, stable sequence (seed order)."""
        h2d = self._h2d_bytes(info)
        recs = self.table.record_of(info.cid)
        session = any(r.session is not None and r.session == req.spec.session_id for r, _ in recs)
        order = max((r.publication_order for r, _ in recs), default=-1)
        return (self.cost.source_cost(h2d, target - info.frontier), h2d, -info.frontier,
                not session, not recs, -order, info.cid)

    # rule: prompt-logprobs-restore
    def restore_limit(self, req: Request, limit: int) -> int:
        """The deepest restore point ``req`` may use, ``limit`` at most. A request asking for
        prompt logprobs (vLLM's ``prompt_logprobs``) needs the logits of every prompt position,
        and a restored prefix has none: it restores no point past the positions whose entries it
        already holds — a fresh one no point at all (vLLM v1 skips prefix-cache reads for such a
        request the same way: ``get_computed_blocks`` returns nothing), a Replay after a pause
        any point up to its paused frontier (it computed everything below). It still saves
        points for others."""
        if req.spec.params.prompt_logprobs is None:
            return limit
        held = len(req.prompt_logprobs)
        return limit if held >= len(req.prompt) - 1 else min(limit, held)

    def choose(self, req: Request, target: int, limit: int) -> CkptInfo | None:
        limit = self.restore_limit(req, limit)
        if limit <= 0:
            return None
        cands = self.candidates(req.ledger, limit, req.rid)
        book = self.books.get(req.rid)
        if book is not None and book.unfit:
            cands = [c for c in cands if c.cid not in book.unfit]
        if not cands:
            return None
        best = min(cands, key=lambda c: self._rank_key(c, req, target))
        # rule: source-worth
        return best if self._rank_key(best, req, target)[0] <= self.cost.source_cost(0, target) else None

    def plan_admission(self, req: Request, queued: list[Request] = (), released: set[Owner] = frozenset()
                       ) -> Admission:
        """Fresh admission: the best source for the prompt, takeover or branch, Move or Fork.
        A request waiting on a source keeps it unless it became invalid or a better one exists.
        E is Moved only when no other ``queued`` request (the fresh queue, this scan included)
        also extends it — a sibling continuation would otherwise recompute it; those Fork.
        ``released``: waiter owners this scan already decided to let go (read as gone)."""
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
            # rule: move-or-fork
            if role is Role.E and src.owners - {own_wait} - released == {rec.owner(Role.E)} \
                    and not self._extended_by(src, req, queued):
                adm.mode, adm.mover = P.BindMode.MOVE, rec.owner(Role.E)
            adm.retire = self._superseded(rec, src, req)
        else:
            adm.record = self._branch(req)
        return adm

    # rule: supersede-at-admission
    def _superseded(self, rec: PrivateRecord, src: CkptInfo, req: Request) -> list[P.Retire]:
        """Taking a record over from a shallower point (an input point after a rewrite): its
        deeper E that this prompt no longer continues is retired once the bind is admitted
        (seed: 接纳后退休获准替代的更深私有点); a failed bind retires nothing."""
        e = self.table.ckpts.get(rec.e) if rec.e is not None else None
        if e is None or e.cid == src.cid or e.frontier <= src.frontier:
            return []
        if e.frontier <= len(req.prompt) and tuple(req.prompt[: e.frontier]) == e.tokens:
            return []
        return [P.Retire(e.cid, e.ref.generation, rec.owner(Role.E))]

    @staticmethod
    def _extended_by(src: CkptInfo, req: Request, queued) -> bool:
        f = src.frontier
        return any(r is not req and r.live and len(r.prompt) >= f and tuple(r.prompt[:f]) == src.tokens
                   for r in queued)

    # rule: takeover-or-branch
    def _may_take_over(self, rec: PrivateRecord, req: Request) -> bool:
        """A non-active record that may be updated is taken over; an occupied relation or a
        cross-entry case (a different named session) branches instead."""
        if rec.active is not None or rec.publication_order > req.ticket:
            return False          # seed: 重新查询也不能接管 publication order 晚于本请求的记录
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
    # rule: waiter-carries-points
    def wait_on(self, req: Request, adm: Admission) -> list[P.Command]:
        """A queued request keeps its valuable source: a waiting reference protects it without
        allocating, without a lane, without heat or hit counts."""
        src, book = adm.source, self.book(req)
        if src is None or (book.wait is not None and book.wait.cid == src.cid):
            return []
        cmds = self.end_wait(req)
        owner = WaiterOwner(req.rid)
        src.owners.add(owner)
        self.table.dirty.add(src.cid)
        book.wait = src.ref
        self.stats.waits += 1
        cmds.append(P.AddOwner(src.cid, src.ref.generation, owner))
        # it carries the record's still compatible input point and anchors: held with it
        # (seed: 等待请求引用同一个 Native 检查点，并携带本次兼容的输入恢复点与有限锚点)
        rec = adm.record if adm.takeover else None
        for cid in ([rec.input_point, *rec.anchors] if rec is not None else []):
            info = self.table.ckpts.get(cid) if cid is not None else None
            if info is None or info.cid == src.cid or owner in info.owners or info.frontier > len(req.prompt) \
                    or tuple(req.prompt[: info.frontier]) != info.tokens:
                continue
            info.owners.add(owner)
            self.table.dirty.add(info.cid)
            book.carried.append(info.ref)
            cmds.append(P.AddOwner(info.cid, info.ref.generation, owner))
        return cmds

    def unfit_source(self, req: Request, cid: int) -> list[P.Command]:
        """Restoring this source cannot fit even alone (its KV pages on the Host plus the
        first unit exceed Main): the request reselects without it rather than failing."""
        self.book(req).unfit.add(cid)
        return self.end_wait(req)

    # ==== waiting for a pending point =================================================
    # rule: pending-source
    def pending_source(self, req: Request, base: int, producers) -> tuple[str, int] | None:
        """A deeper restore point another request will publish for this prompt's exact prefix:
        (producer rid, frontier), or None. ``producers``: (request, its frontier now, its pending
        save points) — residents and the binds planned earlier in this scan. Source cost: wait
        while the producer's remaining prefill to the point is no more than computing the prefix
        from the best complete source (``base``) oneself; the deepest such point wins. A
        producer it already waited for in vain is never waited for again."""
        book = self.book(req)
        prompt = req.prompt
        best: tuple[str, int] | None = None
        usable = self.restore_limit(req, len(prompt))      # a point it may not restore is no reason to wait
        for producer, now, points in producers:
            if producer is req or producer.rid in book.waited or not producer.live:
                continue
            for sp in points:
                f = sp.frontier
                if f <= max(base, now) or f > usable or (best is not None and f <= best[1]):
                    continue
                if f - now > f - base:
                    continue                  # computing it oneself costs less than the wait
                if producer.prompt[:f] == prompt[:f]:
                    best = (producer.rid, f)
        return best

    def wait_pending(self, req: Request, producer: str, frontier: int, base: int) -> None:
        self.book(req).pending = PendingWait(producer, frontier, base, time.monotonic())
        self.stats.pending_waits += 1

    # rule: pending-holds
    def pending_holds(self, req: Request, producer: Request | None, resident: bool) -> bool:
        """Whether the wait still holds: the producer is bound, live, before the point and still
        plans to save it. When it ends with the point published the request adopts it through
        the ordinary source choice; when the point never came (producer gone, save skipped or
        refused) that producer is not waited for again."""
        book = self.books.get(req.rid)
        w = book.pending if book is not None else None
        if w is None:
            return False
        src = self.choose(req, len(req.prompt), len(req.prompt))
        if src is not None and src.frontier >= w.frontier:
            self.end_pending(req)             # published, or a source as good appeared elsewhere
            book.pending_base = w.base
            return False
        if producer is not None and producer.live and resident and producer.facts is not None \
                and producer.facts.frontier < w.frontier \
                and any(sp.frontier == w.frontier for sp in self.book(producer).save_points):
            return True
        self.end_pending(req)
        if producer is not None and producer.live and not resident:
            return False                      # its bind did not happen yet: choose again
        if self.existing_point(req, w.frontier) is not None:
            book.pending_base = w.base
        else:
            book.waited.add(w.producer)
            self.stats.pending_abandoned += 1
        return False

    def end_pending(self, req: Request) -> None:
        book = self.books.get(req.rid)
        if book is not None and book.pending is not None:
            dt = time.monotonic() - book.pending.since
            self.stats.pending_wait_s += dt
            book.waited_s += dt
            book.pending = None

    def source_wait_s(self, req: Request) -> float:
        """How long this request waited for a restore point another request was about to
        publish (a wait still open counts until now)."""
        book = self.books.get(req.rid)
        if book is None:
            return 0.0
        open_s = time.monotonic() - book.pending.since if book.pending is not None else 0.0
        return book.waited_s + open_s

    def lost_point(self, req: Request) -> dict | None:
        """The restore point its admission should have found and did not: ``{"frontier",
        "tokens" (recomputed because of it), "cause"}`` (LOST_CAUSES), or None."""
        book = self.books.get(req.rid)
        return book.lost if book is not None else None

    def waiting_on(self, req: Request) -> P.CkptRef | None:
        b = self.books.get(req.rid)
        return b.wait if b is not None else None

    def holds_waits(self, req: Request) -> bool:
        """It still holds waiting references (its source, or only carried points once the
        source was revoked)."""
        b = self.books.get(req.rid)
        return b is not None and (b.wait is not None or bool(b.carried))

    def end_wait(self, req: Request) -> list[P.Command]:
        book = self.books.get(req.rid)
        if book is None or (book.wait is None and not book.carried):
            return []
        refs = [r for r in (book.wait, *book.carried) if r is not None]
        book.wait, book.carried = None, []
        owner = WaiterOwner(req.rid)
        cmds = []
        for ref in refs:
            info = self.table.ckpts.get(ref.cid)
            if info is None or info.ref.generation != ref.generation or owner not in info.owners:
                continue                       # deleted meanwhile (revoked): nothing to release
            self._drop_use(ref.cid, owner)     # its last owner gone: the mirror forgets it too
            cmds.append(P.ReleaseOwner(ref.cid, ref.generation, owner))
        return cmds

    # ==== divergence positions ========================================================
    # rule: divergence-points
    def on_enqueued(self, req: Request, live: dict[str, Request]) -> None:
        """A new prompt's divergence position (issue 30): the longest prefix X it shares with any
        history held — cache points' tokens and live requests' prompts — when X lies at least
        ``divergence_min`` tokens beyond every restore point below it and before the prompt's
        end (its input point is there). Raw inputs carry no marker where conversations that share
        a system prompt or a document part; X is that place, and a later request sharing [0, X)
        needs a restore point there. This request offers a save at X (its prefill ends a unit on
        it: a public entry), and so does each live request sharing [0, X) that has yet to compute
        across it — this one then waits for that save (the pending-point rule) instead of
        computing the prefix as well. At most MAX_DIVERGENCE positions per request. Only the
        match is computed here: the saves go through the admission table like any capture."""
        hist = self.table.histories
        if self.divergence_min is not None and len(hist):
            m = hist.match(req.prompt)
            x = m.length
            if self.divergence_min <= x <= len(req.prompt):
                # the tails on both sides: this prompt's, and the earlier prompts' it parts from
                # (a live one's prompt; a cache point's record's input point) — theirs too when
                # this whole prompt is a prefix of theirs (a shorter copy of a document)
                if x < len(req.prompt):
                    self._note_tail(len(req.prompt) - x)
                ends = {len(q.prompt) for rid in m.live if (q := live.get(rid)) is not None and q is not req}
                for key in hist.sample(req.prompt, x, TAIL_SAMPLE):
                    if isinstance(key, tuple):
                        ends.update(self.table.ckpts[ip].frontier for rec, _ in self.table.record_of(key[1])
                                    if (ip := rec.input_point) is not None and ip in self.table.ckpts)
                for end in sorted(ends):
                    if end > x:
                        self._note_tail(end - x)
            if x < len(req.prompt) and self._divergence_gain(req.prompt, x) >= max(1, self.divergence_min):
                self._offer(req, x)
                self.book(req).diverged_from.add(x)
                for rid in sorted(m.live):
                    q = live.get(rid)
                    if q is not None and q is not req and q.live and q.ticket < req.ticket:
                        self._offer(q, x)
        hist.insert(req.rid, req.prompt, live=True)

    def _note_tail(self, d: int) -> None:
        self.tails[d] = self.tails.get(d, 0) + 1
        if len(self.tails) > TAIL_KINDS:
            del self.tails[min(self.tails, key=lambda k: (self.tails[k], -k))]

    # rule: anticipated-divergence
    def anticipated(self, req: Request) -> list[int]:
        """Where this prompt will likely part from a later one, before any later one exists
        (issue 30; the placement rule of the docs). Prompts that share a document or a
        conversation differ in their last part (a question, a tool result, a user turn), so they
        part some tail before the end: the request offers saves at its end less a doubling ladder
        of tails — ``divergence_min`` × 1, 2, 4, … (LADDER rungs: 16 … 256 tokens by default) —
        so that a later request parting anywhere in that range restores at most half its tail
        short of where it parts; and at its end less each of the ANTICIPATE tail lengths longer
        than the ladder seen most often at real divergences (twice or more: a pattern, not a
        one-off), which the ladder would cover only far short. Optional cache: each save goes
        through the admission table like any capture without demand of its own."""
        if self.divergence_min is None or not self.anticipate:
            return []
        ladder = [self.divergence_min << i for i in range(LADDER)]
        top = sorted((d for d, n in self.tails.items() if n >= 2 and d > ladder[-1]),
                     key=lambda d: (-self.tails[d], d))[:ANTICIPATE]
        n = len(req.prompt)
        return sorted({n - d for d in (*ladder, *top) if n - d >= self.divergence_min})

    def _divergence_gain(self, prompt: list[int], x: int) -> int:
        """What a restore point at ``x`` adds over the deepest one below it."""
        return x - max((c.frontier for c in self.candidates(prompt, x)), default=0)

    def _offer(self, req: Request, x: int) -> None:
        """``req`` offers a save at divergence position ``x``: at its admission (save_plan), or —
        already bound and not yet past ``x`` in its prompt — from its next unit on."""
        book = self.book(req)
        if x in book.divergence or len(book.divergence) >= MAX_DIVERGENCE or x >= len(req.prompt):
            return
        book.divergence.append(x)
        f = req.facts
        if book.record is None or f is None or f.frontier >= x or req.outputs:
            return
        if any(sp.frontier == x for sp in book.save_points) or self._has_entry(req.prompt, x):
            return
        ent = self.table.new_entry(-1, x, insert=False)
        book.save_points.append(SavePoint(x, [ent.owner], [SaveKind.DIVERGENCE], {ent.owner: ent}))
        book.save_points.sort(key=lambda sp: sp.frontier)

    def check(self, live: set[str]) -> str | None:
        """The history trie holds exactly the cache points' tokens and the live requests' prompts,
        and its own invariants hold (integrity checks)."""
        hist = self.table.histories
        want = {("ck", cid) for cid in self.table.ckpts} | set(live)
        have = hist.keys()
        if have != want:
            return f"history trie keys differ: extra {sorted(map(str, have - want))[:5]}, missing {sorted(map(str, want - have))[:5]}"
        return hist.check()

    # ==== save opportunities ===========================================================
    @staticmethod
    # rule: input-point
    def input_point(req: Request) -> int:
        """The request's input-side restore position: the frontend's C or R, else — with no
        typed rewrite — P, the raw input end (seed: P 没有 typed rewrite 的 raw/token 输入终点)."""
        r = req.spec.recovery_frontier
        return len(req.prompt) if r is None else r

    def candidate_positions(self, req: Request) -> list[int]:
        """Positions where this request offers a save: its input restore point, anchors, markers,
        divergence positions."""
        pos = set(req.spec.anchors) | set(req.spec.markers)
        pos.add(self.input_point(req))
        book = self.books.get(req.rid)
        if book is not None:
            pos.update(book.divergence)
        return sorted(pos)

    def existing_point(self, req: Request, f: int, released: set[Owner] = frozenset()) -> CkptInfo | None:
        """A cache checkpoint of exactly ``prompt[:f]`` already kept (another request computed
        it): a save there shares it instead of keeping a second physical copy. ``released``:
        waiter owners the plan lets go first (a point only they keep is gone by then)."""
        for cid in sorted(self.table.index.at(req.prompt, f)):
            info = self.table.ckpts.get(cid)
            if info is not None and info.tokens == tuple(req.prompt[:f]) and self._public(info, req.rid) \
                    and self.restorable(info) and not (info.owners and info.owners <= released):
                return info
        return None

    # rule: save-points
    def save_plan(self, req: Request, start: int, rec: PrivateRecord) -> list[SavePoint]:
        """Input restore point, anchors and markers inside (start, P] — never chunk ends.
        Same frontiers merge into one capture with several owners."""
        P_len = len(req.prompt)
        points: dict[int, SavePoint] = {}

        def add(f: int, owner: Owner, kind: SaveKind, entry: PublicEntry | None = None) -> None:
            if start < f <= P_len:
                sp = points.setdefault(f, SavePoint(f, [], []))
                sp.owners.append(owner)
                sp.kinds.append(kind)
                if entry is not None:
                    sp.entries[owner] = entry

        r = self.input_point(req)
        if not self._carried(rec.input_point, req.prompt, r):
            add(r, rec.owner(Role.INPUT), SaveKind.INPUT)
        for a in sorted(set(req.spec.anchors)):
            if not any(self._carried(c, req.prompt, a) for c in rec.anchors):    # updated in place
                add(a, rec.owner(Role.ANCHOR), SaveKind.ANCHOR)
        for m in sorted(set(req.spec.markers)):
            if start < m <= P_len and not self._has_entry(req.prompt, m):
                ent = self.table.new_entry(-1, m, insert=False)     # enters the table when captured
                add(m, ent.owner, SaveKind.MARKER, ent)
        book = self.books.get(req.rid)
        for x in book.divergence if book is not None else ():
            if start < x < P_len and x not in points and not self._has_entry(req.prompt, x):
                ent = self.table.new_entry(-1, x, insert=False)
                add(x, ent.owner, SaveKind.DIVERGENCE, ent)
        for x in self.anticipated(req):
            # only where it adds at least divergence_min over every point around it
            if start < x < P_len and all(abs(x - f) >= self.divergence_min for f in (start, *points)) \
                    and not self._has_entry(req.prompt, x):
                ent = self.table.new_entry(-1, x, insert=False)
                add(x, ent.owner, SaveKind.ANTICIPATED, ent)
        return [points[f] for f in sorted(points)]

    def _carried(self, cid: int | None, prompt: list[int], r: int) -> bool:
        info = self.table.ckpts.get(cid) if cid is not None else None
        return info is not None and info.frontier == r and tuple(prompt[:r]) == info.tokens

    def _has_entry(self, prompt: list[int], f: int) -> bool:
        """A public entry already serves exactly ``prompt[:f]`` (through the index, no scan)."""
        for cid in self.table.index.at(prompt, f):
            info = self.table.ckpts.get(cid)
            if info is not None and info.tokens == tuple(prompt[:f]) and self.table.entries_of(cid):
                return True
        return False

    # rule: retire-before-save
    def retire_for(self, req: Request, sp: SavePoint, rec: PrivateRecord | None = None) -> list[P.Retire]:
        """A needed later input point retires the record's old one before its destination is
        requested (seed: 旧点可在申请新目的之前退休；新保存失败不恢复旧点)."""
        rec = rec or self.book(req).record
        if SaveKind.INPUT not in sp.kinds or rec is None or rec.input_point is None:
            return []
        info = self.table.ckpts.get(rec.input_point)
        if info is None:
            return []
        return [P.Retire(info.cid, info.ref.generation, rec.owner(Role.INPUT))]

    # rule: anchor-replacement
    def anchor_replace(self, req: Request, sp: SavePoint, rec: PrivateRecord | None = None,
                       earlier: tuple[set[int], int] = (frozenset(), 0)) -> list[P.Retire] | None:
        """The anchor hold a new anchor at ``sp`` supersedes (seed: 锚点同位置更新，超限替换最旧
        发布点；无法安全替换则放弃本次保存): the record's anchor at the same position (its
        history changed) is updated in place; at the limit, an anchor no longer on this
        request's history goes before a still-valid one, oldest published first. Given up only
        if the save happens. None: replacing is unsafe (the point is being adopted right
        now) — the save is given up. ``earlier``: the anchors earlier saves of the same unit
        replace and how many anchors they add — decided as if those saves had happened first,
        as separate units would (the unit crosses them in that order)."""
        rec = rec or self.book(req).record
        gone, added = earlier
        live = [(cid, info) for cid in rec.anchors
                if cid not in gone and (info := self.table.ckpts.get(cid)) is not None]
        same = [cid for cid, info in live if info.frontier == sp.frontier]
        if same:
            victim = same[0]
        elif len(live) + added >= MAX_ANCHORS:
            stale = [cid for cid, info in live
                     if info.frontier > len(req.prompt) or tuple(req.prompt[: info.frontier]) != info.tokens]
            victim = (stale or [cid for cid, _ in live])[0]
        else:
            return []
        if victim in self.adopting():
            return None
        return [P.Retire(victim, self.table.ckpts[victim].ref.generation, rec.owner(Role.ANCHOR))]

    def retired(self, req: Request, retire: list[P.Retire]) -> None:
        """The worker released these holds when the unit ran (whether or not its save found
        room): mirror it."""
        rec = self.book(req).record
        for r in retire:
            if rec.e == r.cid and r.owner == rec.owner(Role.E):
                rec.e = None
            if rec.input_point == r.cid and r.owner == rec.owner(Role.INPUT):
                rec.input_point = None
            if r.cid in rec.anchors and r.owner == rec.owner(Role.ANCHOR):
                rec.anchors.remove(r.cid)
            self._drop_use(r.cid, r.owner)

    # rule: capture-terms
    def capture_terms(self, req: Request, sp: SavePoint, rec: PrivateRecord | None = None
                      ) -> tuple[int, float | None, bool]:
        """(fixed new-coverage benefit, own repeat-demand time or None, owner is reuse) for the
        admission of a capture at ``sp``."""
        f = sp.frontier
        deeper = [c.frontier for c in self.candidates(req.prompt, f) if c.frontier < f]
        benefit = f - max(deeper, default=0)
        obs = self.summary.get(digest(req.prompt[:f]), f)
        own = None
        if obs is not None and obs.repeated:
            own = obs.last
        elif obs is not None and self._computes_across(req, f) and any(r != req.rid for r in obs.requests):
            # the save rides on the unit whose commit is this request's own new computation
            # across the position, which another request already computed: the point exists
            # only once two different requests computed it (seed: 两个不同请求的真实计算也能证明
            # 重复需求 … 后续捕获仍能取得该位置的复用资格) — its demand time is this commit's
            own = time.monotonic()
        rec = rec or self.book(req).record
        return benefit, own, rec is not None and rec.level == Level.REUSE

    def _computes_across(self, req: Request, f: int) -> bool:
        """The unit that crosses or ends on ``f`` is a new prefill commit crossing a candidate position this
        request did not observe yet (``observe_prefill`` records it when it commits); a Replay
        is no observation."""
        book = self.books.get(req.rid)
        return (req.replay_target is None and f in self.candidate_positions(req)
                and (book is None or f not in book.observed))

    # ==== evidence =====================================================================
    # rule: compute-demand
    def observe_prefill(self, req: Request, start: int, end: int) -> None:
        """A new prefill commit crossing a candidate position is a real computation demand
        (once per request per position). Two different requests computing the same position
        prove repeat demand even with nothing cached."""
        observed = self.book(req).observed
        crossed = [p for p in self.candidate_positions(req) if start < p <= end and p not in observed]
        if not crossed:
            return
        now = time.monotonic()
        earlier = self.book(req).diverged_from
        for f, d in prefix_digests(req.prompt, crossed).items():
            observed.add(f)
            if f in earlier:
                # another request really computed across this divergence position (the history it
                # was found in): with this commit, two different requests computed it
                self.summary.observe(d, f, HISTORY_OBSERVER, now)
            obs = self.summary.observe(d, f, req.rid, now)
            if obs.repeated:
                self._promote(req.prompt[:f], f, now)

    # rule: repeat-demand-promotes
    def _promote(self, tokens: list[int], f: int, now: float) -> None:
        """Repeat demand lifts the owners of an existing point at that exact position to the
        reuse level; an input point proves its own position."""
        for info in self.candidates(tokens, f):
            if info.frontier != f:
                continue
            for rec, role in self.table.record_of(info.cid):
                rec.level = Level.REUSE
                rec.evidence.demand_time = max(rec.evidence.demand_time or 0.0, now)
                if role is Role.INPUT:
                    rec.evidence.proven_frontier = f
                self.table.touch(rec)
            for ent in self.table.entries_of(info.cid):
                ent.level = Level.REUSE
                ent.evidence.demand_time = max(ent.evidence.demand_time or 0.0, now)
                self.table.touch(ent)

    # rule: adoption-evidence
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
                self.table.touch(rec)
        if not takeover:
            child.evidence.demand_time = now
            child.evidence.proven_frontier = src.frontier
            child.level = Level.REUSE
            self.table.touch(child)
        for ent in self.table.entries_of(src.cid):
            ent.evidence.demand_time = now
            ent.level = Level.REUSE
            self.table.touch(ent)
        self.summary.observe(digest(src.tokens), src.frontier, req.rid, now, adopted=True)

    # ==== bookkeeping ==================================================================
    def on_bound(self, req: Request, adm: Admission, save_points: list[SavePoint]) -> None:
        """A fresh admission succeeded: count the query, take over or branch, note demand. A
        request that may restore nothing (prompt logprobs) made no query, as in vLLM."""
        if self.restore_limit(req, len(req.prompt)) > 0:
            self._count_query(req, adm.source)
        rec = adm.record
        self.table.records.setdefault(rec.id, rec)
        rec.active = req.rid
        book = self.book(req)
        book.record, book.save_points = rec, save_points
        if book.pending_base is not None:       # it waited for a pending point: what that saved
            self.stats.pending_saved_tokens += max(0, adm.frontier - book.pending_base)
            book.pending_base = None
        if adm.retire:
            self.retired(req, adm.retire)    # the worker gave these up with the admitted bind
        if adm.source is not None and adm.cached:
            self._note_adoption(req, adm.source, rec, adm.takeover)
        if adm.mode is P.BindMode.MOVE and adm.source is not None:
            self._forget(adm.source.cid, "moved")   # consumed by the Move: continued, not lost

    def on_resumed(self, req: Request, adm: Admission | None) -> None:
        """A Replay resume bound from a cache point (never a hit); a Snapshot resume moved its
        own snapshot. Either way nothing is adopted from another request."""
        self.book(req).source_cid = None

    # rule: hits-and-lost-hits
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
            cause = self.remembered[(deeper, digs[deeper])] if deeper else None
            if cause is not None and cause != "moved":   # a Moved E was continued, not lost
                s.lost_hits += 1
                s.lost_tokens += deeper - got
                s.lost_by_cause[cause] = s.lost_by_cause.get(cause, 0) + 1
                self.book(req).lost = {"frontier": deeper, "tokens": deeper - got, "cause": cause}

    def on_captured(self, req: Request, sp: SavePoint, ref: P.CkptRef, shared: bool = False) -> list[P.Command]:
        """Attach a new checkpoint to its uses (``shared``: an identical one that was already
        kept); returns AddOwner commands for the owners the capture itself did not create."""
        if not shared:
            self.stats.captures += 1
        rec = self.book(req).record
        tokens = tuple(req.ledger[: ref.frontier])
        cmds: list[P.Command] = []
        for i, (owner, kind) in enumerate(zip(sp.owners, sp.kinds)):
            if kind in PUBLIC and shared and self._has_entry(req.prompt, ref.frontier):
                continue                       # the public entry there already serves
            self.table.add_ckpt(ref, tokens, owner)
            if i > 0 or shared:
                cmds.append(P.AddOwner(ref.cid, ref.generation, owner))
            if kind in PUBLIC:
                ent = sp.entries[owner]
                ent.cid = ref.cid
                self.table.entries[ent.id] = ent
            elif kind is SaveKind.INPUT:
                rec.input_point = ref.cid
            elif kind is SaveKind.ANCHOR:
                rec.anchors.append(ref.cid)
        obs = self.summary.get(digest(tokens), ref.frontier)
        if obs is not None and obs.repeated:
            # rule: save-is-no-evidence
            # the candidate's own demand time: a pure save is no evidence (seed: 单纯保存不刷新证据)
            self._promote(list(tokens), ref.frontier, obs.last)
        return cmds

    def on_skipped(self, req: Request, sp: SavePoint, cause: str) -> None:
        """An optional save that did not happen (``cause``: one of LOST_CAUSES' skip reasons):
        nothing is kept (tentative entries never existed); a later request that matches this
        history counts a lost hit of that cause."""
        self.stats.captures_skipped += 1
        tokens = req.prompt[: sp.frontier]
        if not self.candidates(tokens, sp.frontier) or all(
                c.frontier < sp.frontier for c in self.candidates(tokens, sp.frontier)):
            self._note_missing(sp.frontier, digest(tokens), cause)

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
        self.end_pending(req)
        return self.end_wait(req)

    def _drop_use(self, cid: int, owner: Owner) -> None:
        info = self.table.ckpts.get(cid)
        if info is not None and self.table.drop_owner(cid, owner):
            self._note_missing(info.frontier, digest(info.tokens), "released")

    def _forget(self, cid: int, cause: str | None = "evicted") -> None:
        info = self.table.ckpts.get(cid)
        self.uncovered.pop(cid, None)
        self.table.forget_ckpt(cid)
        if info is not None and cause is not None:
            self._note_missing(info.frontier, digest(info.tokens), cause)

    def _note_missing(self, frontier: int, dig: bytes, cause: str) -> None:
        """Keep the digest of designed restore points that are missing (bounded), with why,
        to attribute hits lost to them — the metric users of other engines ask for."""
        self.remembered[(frontier, dig)] = cause
        self.remembered.move_to_end((frontier, dig))
        while len(self.remembered) > 256:
            self.remembered.popitem(last=False)

    def on_deleted(self, cids: list[int]) -> list[str]:
        """Physical deletions: returns the rids whose waiting reference was revoked."""
        revoked = []
        for cid in cids:
            info = self.table.ckpts.get(cid)
            waiters = [o.rid for o in info.owners if isinstance(o, WaiterOwner)] if info is not None else []
            self._forget(cid)
            for rid in waiters:
                book = self.books.get(rid)
                if book is None:
                    continue
                book.carried = [r for r in book.carried if r.cid != cid]
                if book.wait is not None and book.wait.cid == cid:
                    book.wait = None           # its source was revoked: it reselects
                    revoked.append(rid)
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
