"""The preemption chain (seed: 单元缺口 → 可选预留与普通缓存回收 → 必要时撤销等待保护与暂停快照
→ 为最老必要工作收回较年轻 resident，或暂停自身无法前进的年轻行), planned inside the cycle.

Pure: given the cycle's needs in permit order (the resume, resident rows by recovery then
ticket, one chunk, fresh binds), their demands and one quote, it decides for each need that is
short what it may do — the conditional remedies the worker commits only if, and as far as,
they cover the gap — and when the request must fail instead. Nothing here changes state.

    requester                          may
    fresh admission                    reclaim optional cache; revoke younger waiters' holds
                                       (it never preempts a resident, never revokes snapshots)
    resume, an older resident exists   reclaim optional cache only (it never pauses young
                                       borrowers just to probe)
    resume of the oldest paused        all of the below, and take back the lane and capacity of
    (no older resident)                the youngest preemptable residents
    resident row / chunk               reclaim optional cache; revoke waiters' holds and
                                       later-ticket pause snapshots; take back younger
                                       residents (youngest first); a young row that still
                                       cannot progress pauses itself

Materializing, finished and the full-recovery-permit holder are never victims. A pause frees
what it holds: a Snapshot whose unique Device content goes to the Host (admitted over optional
cache, then later-ticket snapshots), or — when the Host cannot take it — destructive (Replay).
The capacity contract error fires exactly when the oldest request, with nobody else holding or
about to release capacity, is still short after all of its legal reclaim.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from ninfer import protocol as P
from ninfer.placement import fits_count, place_first_fit
from ninfer.policy.reclaim import Candidate, Cls, Planner, Survey, stale_survey
from ninfer.policy.resources import ResourceManager
from ninfer.policy.scheduler import Scheduler
from ninfer.policy.view import RequestView as Request
from ninfer.protocol import Owner, SnapshotOwner, WaiterOwner

class ItemKind(StrEnum):
    """What an intent of the cycle is, as policy sees it."""

    FRESH = "fresh"           # a fresh admission (bind)
    RESUME = "resume"         # the oldest paused request's resume with its full recovery permit
    ROW = "row"               # a resident's Decode/Control row
    CHUNK = "chunk"           # the cycle's one prefill/replay chunk


class Waiters(StrEnum):
    """Whose waiting references a requester may revoke."""

    NONE = "none"
    YOUNGER = "younger"
    ALL = "all"


FRESH, RESUME, ROW, CHUNK = ItemKind.FRESH, ItemKind.RESUME, ItemKind.ROW, ItemKind.CHUNK


@dataclass
class Need:
    """One intent of the cycle as pressure sees it."""

    iid: int
    req: Request
    kind: ItemKind
    demand: dict[str, int] | None       # predicted (None: unknown without a quote)
    source: int | None = None           # the checkpoint a bind adopts


@dataclass(frozen=True)
class Contract:
    """The capacity contract's verdict (seed: 容量契约): ``rid`` fails with it instead of waiting
    for a releaser that does not exist — the oldest request short after all its legal reclaim,
    or, when a whole cycle moved nothing, the oldest live request (``Pressure.stalled``)."""

    rid: str
    short: dict[str, int]               # units still missing (empty: nothing could move at all)
    message: str


@dataclass
class Verdict:
    remedies: list[P.Remedy] = field(default_factory=list)
    on_short: P.Pause | None = None
    contract: Contract | None = None    # fail instead of waiting (if the worker confirms the gap)
    covered: bool = True


@dataclass
class Settlement:
    """What the cycle's settle on one quote decided (nothing else changed): a verdict per short
    need, the lane take-back's pause route, each save's room in plan order, how many of those
    rooms repeat-demand evidence admitted, and whether a plan on the scoped quote wanted Host
    candidates beyond its window (then the facts are quoted wider and it is settled again whole)."""

    verdicts: dict[int, Verdict] = field(default_factory=dict)
    take_back: tuple[bool, list[P.Delete]] | None = None     # (to the Host, its Host victims)
    rooms: list[tuple[list[P.Action], bool]] = field(default_factory=list)   # (room, refused) per save
    evidence: int = 0
    window_short: bool = False


class _Short:
    """Collects a scoped plan's 'the window was too small' (Planner's callback) for one settle."""

    def __init__(self):
        self.hit = False

    def __call__(self) -> None:
        self.hit = True


@dataclass
class Rights:
    waiters: Waiters = Waiters.NONE
    snapshots: bool = False             # later-ticket pause snapshots
    take_back: bool = False
    pause_self: bool = False


class Pressure:
    def __init__(self, sched: Scheduler, rm: ResourceManager, info: P.WorkerInfo):
        self.sched = sched
        self.rm = rm
        self.info = info
        # the owners' classes for the planners of one settlement (Planner's ``survey``)
        self._survey: dict | None = None      # the owners' survey while a settlement plans
        self._kept_survey = Survey()          # ... kept across settlements (records' changes drop entries)

    # ---- prediction (no quote) --------------------------------------------------------
    def fits(self, needs: list[Need], pools: dict[str, P.PoolState]) -> bool:
        """Whether every need fits the pools as last reported, in permit order. Demands are
        upper bounds and availability a lower bound, so True is reliable; False (or an unknown
        demand) asks for a quote first."""
        avail = {k: pools[k].available for k in (P.MAIN, P.STATE) if k in pools}
        for n in needs:
            if n.demand is None:
                return False
            if any(v > avail.get(k, 0) for k, v in n.demand.items()):
                return False
            for k, v in n.demand.items():
                avail[k] = avail.get(k, 0) - v
        return True

    # rule: quote-trigger
    def needs_quote(self, needs: list[Need], captures: int, pools: dict[str, P.PoolState], host_images: int,
                    take_back: bool) -> bool:
        """Whether the cycle needs facts before it is sent: a lane take-back, a need that may not
        fit, or saves beyond the Device slots the needs leave — more of them than the Host's free
        extents hold images, first-fit (``host_images``, from the last step's report)."""
        if take_back or not self.fits(needs, pools):
            return True
        if not captures:
            return False
        avail = {k: v.available for k, v in pools.items()}
        for n in needs:
            for k, v in (n.demand or {}).items():
                avail[k] = avail.get(k, 0) - v
        slots = avail.get(P.STATE, 0)
        return captures - max(0, slots) > host_images

    # ---- rights -----------------------------------------------------------------------
    # rule: preemption-rights
    def rights(self, n: Need) -> Rights:
        if n.kind == FRESH:
            return Rights(waiters=Waiters.YOUNGER)
        if n.kind == RESUME:
            if not self.sched.may_take_back(n.req):
                return Rights()
            return Rights(waiters=Waiters.ALL, snapshots=True, take_back=True)
        young = n.req is not self.sched.recovery and self._older_exists(n.req)
        return Rights(waiters=Waiters.ALL, snapshots=True, take_back=True, pause_self=young)

    def _older_exists(self, req: Request) -> bool:
        return any(r.ticket < req.ticket and r.live for r in (*self.sched.resident.values(), *self.sched.paused))

    # rule: revocation-rights
    def _revoker(self, req: Request, rights: Rights):
        """Which revocable holds the requester may take (seed: fresh 接纳只能撤销较年轻等待者的
        保护，不能撤销 paused 快照; 必要推进 … 再考虑票号更晚的暂停快照)."""
        tickets = {r.rid: r.ticket for r in (*self.sched.fresh, *self.sched.paused, *self.sched.resident.values())}
        snaps: dict[Owner, int] = {SnapshotOwner(r.sid): r.ticket for r in self.sched.paused if r.sid is not None}
        snaps.update({WaiterOwner(rid): t for rid, t in tickets.items()})   # revocation order: youngest first

        def may(owner: Owner) -> bool:
            if isinstance(owner, SnapshotOwner):
                return rights.snapshots and snaps.get(owner, -1) > req.ticket
            if isinstance(owner, WaiterOwner):
                if rights.waiters is Waiters.ALL:
                    return True
                return rights.waiters is Waiters.YOUNGER and tickets.get(owner.rid, 1 << 62) > req.ticket
            return False
        return may, snaps

    def protected(self, req: Request) -> set[int]:
        """Sources being adopted right now and the requester's own snapshot are never victims."""
        # rule: protected-sources
        out = set(self.rm.adopting())
        if req.snapshot is not None:
            out.add(req.snapshot.cid)
        return out

    # ---- planning on a quote ---------------------------------------------------------
    def settle_cycle(self, needs: list[Need], facts: P.Facts, demands: dict[int, dict[str, int]], tx_busy: bool,
                     keep: set[int], take_back: Request | None, saves: list[tuple[Request, object, object]],
                     protect: set[int]) -> Settlement:
        """The cycle's settlement on one quote: the needs' verdicts, the take-back's pause route
        (on the last covering plan, so its Host room is what the remedies leave), then each save's
        room after what the needs use (``saves``: request, save point, record; ``protect``: the
        plan's adopted sources and kept points)."""
        kept, touched = self._kept_survey, self.rm.table.touched_records
        kept.forget(touched)
        touched.clear()
        if os.environ.get("NINFER_CHECK_FACTS", "0") != "0" and (stale := stale_survey(kept, self.rm.table)):
            raise AssertionError(f"kept survey entries whose records changed unnoted: {stale[:5]}")
        self._survey = kept
        try:
            return self._settle_cycle(needs, facts, demands, tx_busy, keep, take_back, saves, protect)
        finally:
            self._survey = None

    def _settle_cycle(self, needs, facts, demands, tx_busy, keep, take_back, saves, protect) -> Settlement:
        short = _Short()
        verdicts, last = self.settle(needs, facts, demands, tx_busy, keep, short)
        out = Settlement(verdicts)
        if take_back is not None and take_back.live:
            planner = last or Planner(facts, self.rm.table, self.protected(take_back), lambda o: False,
                                      window_short=short, survey=self._survey)
            out.take_back = self.pause_route(take_back, planner, facts)
        used = sum(demands.get(n.iid, n.demand or {}).get(P.STATE, 0) for n in needs)
        rooms = self.save_rooms(saves, used, facts, last, protect, short)
        out.rooms = [(room, refused) for room, refused, _ in rooms]
        out.evidence = sum(1 for *_, ev in rooms if ev)
        out.window_short = short.hit
        return out

    def settle(self, needs: list[Need], facts: P.Facts, demands: dict[int, dict[str, int]],
               tx_busy: bool, keep: set[int] = frozenset(), short=None) -> tuple[dict[int, Verdict], Planner | None]:
        """Verdicts for the needs that are short, in permit order, on one quote. A need's
        remedies never touch its own source nor one an earlier intent adopts in this step; a
        later one's source is fair game (that bind then reselects). Returns the last planning
        pass too (captures plan their room after the needs)."""
        avail = {k: facts.pools[k].available for k in (P.MAIN, P.STATE)}
        verdicts: dict[int, Verdict] = {}
        prior: Planner | None = None
        taken: set[str] = set()                 # residents taken back by earlier needs
        seen: set[str] = set()                  # requests of earlier needs (they will hold capacity)
        adopted: set[int] = set()               # sources of earlier needs
        for n in needs:
            earlier = set(seen)
            seen.add(n.req.rid)
            reads = adopted | ({n.source} if n.source is not None else set())   # this step's binds read them
            protect = reads | set(keep)
            if n.source is not None:
                adopted.add(n.source)
            d = demands.get(n.iid, n.demand or {})
            gap = {k: v - avail[k] for k, v in d.items() if v > avail.get(k, 0)}
            if not gap:
                for k, v in d.items():
                    avail[k] -= v
                continue
            before = set(taken)
            v, planner, freed = self._chain(n, gap, facts, prior, taken, tx_busy or bool(earlier - taken), protect,
                                            short, reads)
            verdicts[n.iid] = v
            if v.covered:
                prior = planner
                for k, x in d.items():
                    avail[k] = max(0, avail[k] + freed.get(k, 0) - x)
            else:
                # remedies that do not cover are not committed: they claim nothing from later needs
                taken.intersection_update(before)
        return verdicts, prior

    def _chain(self, n: Need, short: dict[str, int], facts: P.Facts, prior: Planner | None,
               taken: set[str], tx_busy: bool, protect: set[int], window_short=None, reads: set[int] = frozenset()
               ) -> tuple[Verdict, Planner, dict[str, int]]:
        rights = self.rights(n)
        may, snaps = self._revoker(n.req, rights)
        mine = self.protected(n.req)
        reading, protect = mine | reads, mine | protect
        planner = Planner(facts, self.rm.table, protect, may, snaps, prior,
                          window_short=window_short, survey=self._survey, reading=reading)
        before = {k: planner.freed_so_far(k) for k in short}
        actions, covered = planner.plan(short)
        # rule: deletions-only-alternative
        if not covered:
            # the candidate list stays: deletions alone may cover what a demotion first did not
            alt = Planner(facts, self.rm.table, protect, may, snaps, prior, demote=False,
                          window_short=window_short, survey=self._survey, reading=reading)
            alt_actions, alt_covered = alt.plan(short)
            if alt_covered:
                planner, actions, covered = alt, alt_actions, True
        freed = {k: planner.freed_so_far(k) - before[k] for k in short}
        verdict = Verdict()
        # one remedy per planned step (a demotion with its Host victims, or a deletion): Native
        # commits the smallest prefix that covers the real shortfall and skips a step that no
        # longer commits (seed: Native 按实际缺口 … 裁切严格前缀)
        verdict.remedies += [P.Reclaim(step) for step in planner.steps]
        if not covered and rights.take_back:
            victims = []
            for victim in self.sched.victims_for(n.req):
                if victim.rid in taken or victim is n.req:
                    continue
                to_host, host_victims = self.pause_route(victim, planner, facts)
                verdict.remedies.append(P.TakeBack(victim.sid, to_host, host_victims))
                taken.add(victim.rid)
                victims.append(victim.sid)
                for k, x in self.freed_by_pause(victim, to_host, facts).items():
                    freed[k] = freed.get(k, 0) + x
                if all(freed.get(k, 0) >= v for k, v in short.items()):
                    covered = True
                    break
            # rule: take-back-second-pass
            if not covered and victims:
                # what the victims shared with optional cache is reclaimable once they let go
                # (and what this need already deletes may free more then)
                was = {k: planner.freed_so_far(k) for k in short}
                planner = Planner(_without(facts, victims), self.rm.table, protect, may, snaps, planner,
                                  reading=reading)
                for k in short:
                    freed[k] = freed.get(k, 0) + planner.freed_so_far(k) - was[k]
                left = {k: v - freed.get(k, 0) for k, v in short.items() if v > freed.get(k, 0)}
                covered = not left
                if left:
                    before = {k: planner.freed_so_far(k) for k in left}
                    actions, covered = planner.plan(left)
                    verdict.remedies += [P.Reclaim(step) for step in planner.steps]
                    for k in left:
                        freed[k] = freed.get(k, 0) + planner.freed_so_far(k) - before[k]
        verdict.covered = covered
        if not covered:
            if rights.pause_self and n.req.sid is not None:
                to_host, host_victims = self.pause_route(n.req, planner, facts)
                verdict.on_short = P.Pause(n.req.sid, to_host, host_victims)
            # rule: capacity-contract
            elif self.alone(n, taken, tx_busy) and not any(isinstance(r, P.TakeBack) for r in verdict.remedies):
                # (a take-back releases what it frees only as its snapshot publishes: the
                # contract is judged again once nobody is about to release anything)
                verdict.contract = self._contract(n, short, facts)
        return verdict, planner, freed

    # ---- pauses -----------------------------------------------------------------------
    # rule: pause-route
    def pause_route(self, victim: Request, planner: Planner, facts: P.Facts) -> tuple[bool, list[P.Delete]]:
        """Snapshot to the Host when its unique Device content can be placed there (admitted
        over optional cache, then pause snapshots of later tickets), else destructive."""
        if not facts.host_capacity or victim.sid is None:
            return False, []
        sizes = self.pause_sizes(victim, facts, planner.dup_pages)
        own = victim.ticket
        tickets = planner.tickets

        def admissible(c: Candidate) -> bool:
            if c.cls <= Cls.REUSE:
                return True
            owners = facts.checkpoints[c.cid].owners
            return c.cls is Cls.SNAPSHOT and all(tickets.get(o, -1) > own for o in owners if isinstance(o, SnapshotOwner))
        placed = planner.place_host(sizes, admissible, dups=False)   # a pause names deletions only
        if placed is None:
            return False, []
        return True, [a for a in planner.commit_host(sizes, placed[0]) if isinstance(a, P.Delete)]

    @staticmethod
    def _blocks_of(victim: Request, facts: P.Facts) -> list[P.BlockFact]:
        me = -victim.sid
        return [b for b in facts.blocks.values() if me in b.holders and b.device]

    def pause_sizes(self, victim: Request, facts: P.Facts, released: set[int] = frozenset()) -> list[int]:
        """Host bytes its Snapshot allocates: its StateImage, and its pages no other sequence
        reads that have no Host copy (or whose duplicate an earlier step releases)."""
        me = -victim.sid
        blocks = [b for b in self._blocks_of(victim, facts) if not any(h < 0 and h != me for h in b.holders)]
        return [facts.image_bytes] + [facts.page_bytes for b in blocks if not b.host or b.bid in released]

    def freed_by_pause(self, victim: Request, to_host: bool, facts: P.Facts) -> dict[str, int]:
        """Device units its pause frees (at once or once the snapshot's copies publish)."""
        me = -victim.sid
        pages = 0
        for b in self._blocks_of(victim, facts):
            others = [h for h in b.holders if h != me]
            if not others or (to_host and not any(h < 0 for h in others)):
                pages += 1
        res = (victim.facts.reserved if victim.facts is not None else 0)
        return {P.MAIN: pages + res, P.STATE: 1}

    # ---- the capacity contract -------------------------------------------------------
    def alone(self, n: Need, taken: set[str], tx_busy: bool) -> bool:
        """Nobody else holds capacity or is about to release it: no transfer in flight (nor an
        earlier intent of this cycle that will hold some), no other resident (the younger ones
        were all taken back), no older request waiting."""
        if tx_busy:
            return False
        req = n.req
        if any(r is not req and r.rid not in taken for r in self.sched.resident.values()):
            return False
        return not any(r.ticket < req.ticket and r is not req and r.live for r in self.sched.paused)

    def _contract(self, n: Need, short: dict[str, int], facts: P.Facts) -> Contract:
        detail = ", ".join(f"{k}: {v} more needed ({facts.pools[k].available} available of {facts.pools[k].total})"
                           for k, v in short.items() if k in facts.pools)
        return Contract(n.req.rid, dict(short), f"request {n.req.rid} cannot get a legal unit after reclaiming "
                        f"optional cache and pausing others ({detail})")

    @staticmethod
    def stalled(requests) -> Contract | None:
        """A cycle in which nothing ran, changed or was in flight, twice, although requests
        remain: the oldest live request fails with the contract (a policy gap — the per-need
        verdict above should have caught it; ``stats.stalls`` counts it)."""
        oldest = min((r for r in requests if r.live), key=lambda r: r.ticket, default=None)
        if oldest is None:
            return None
        return Contract(oldest.rid, {}, f"request {oldest.rid} cannot progress: nothing else holds or will "
                        "release capacity")

    # ---- captures ---------------------------------------------------------------------
    # rule: save-room-order
    def save_rooms(self, saves: list[tuple[Request, object, object]], slots_used: int, facts: P.Facts,
                   planner: Planner | None, protect: set[int] = frozenset(), window_short=None
                   ) -> list[tuple[list[P.Action], bool, bool]]:
        """Each save's room, in plan order (``saves``: request, save point, the record it saves
        for): a Device slot the intents leave, else the Host — as many saves as its free extents
        hold images first-fit once the intents' plan (``planner``) has placed its demotions
        there (seed: 预检以 arena 的实际放置为准) —, else what the admission table admits
        (``capture_room``). Returns the room's conditional actions, whether the table refused and
        whether repeat-demand evidence was used, per save."""
        slots = facts.pools[P.STATE].available - slots_used
        free = list(facts.host_free)
        if planner is not None and planner.host_used:
            placed = place_first_fit(free, [size for _, size in planner.host_used])
            free = placed[1] if placed is not None else []
        host = fits_count(free, facts.image_bytes)
        out: list[tuple[list[P.Action], bool, bool]] = []
        for req, sp, rec in saves:
            if slots > 0:
                slots -= 1
                out.append(([], False, False))
            elif host > 0:
                host -= 1
                out.append(([], False, False))
            else:
                room, refused, evidence = self.capture_room(req, sp, planner, facts, protect, rec, window_short)
                out.append((room or [], refused, evidence))
        return out

    def capture_room(self, req: Request, sp, planner: Planner | None, facts: P.Facts,
                     protect: set[int] = frozenset(), rec=None, window_short=None
                     ) -> tuple[list[P.Action] | None, bool, bool]:
        """An optional save that will find neither a Device slot nor Host room: what the
        admission table lets it replace (seed: 新捕获 … 准入条件), or None to skip it — and
        whether that None was the table's refusal (there were candidates) rather than nothing
        to replace, and whether own repeat-demand evidence took part. The actions are
        conditional: the worker commits them only if they make the save fit."""
        benefit, own, owner_reuse = self.rm.capture_terms(req, sp, rec)
        p = Planner(facts, self.rm.table, self.protected(req) | protect, lambda o: False, None, planner,
                    window_short=window_short, survey=self._survey)
        room = p.plan_capture(benefit, own, owner_reuse)
        return room, room is None and bool(p.cands), own is not None


def _without(facts: P.Facts, sids: list[int]) -> P.Facts:
    """The quote as it will be once these sequences have let go of their blocks (paused)."""
    gone = {-s for s in sids}
    blocks = {}
    for bid, b in facts.blocks.items():
        if gone & set(b.holders):
            holders = tuple(h for h in b.holders if h not in gone)
            b = msgspec.structs.replace(b, holders=holders, pinned=any(h < 0 for h in holders))
        blocks[bid] = b
    return msgspec.structs.replace(facts, blocks=blocks)
