"""One cycle's plan, built from the Scheduler's and the ResourceManager's decisions (pure: it
changes no books — the waits it decides come back in the plan as data, ``Plan.waits``, and
Outcomes books them before the step is sent; the rule monitor checks every cycle that building
left the books as they were).

    1. resume      the oldest paused request on a real capacity event (Scheduler), with its
                   full recovery permit: State, missing KV, tail, rebuild to the old frontier
                   and the first real new unit; own Snapshot first, else Replay. With no free
                   lane and no older resident it takes back the youngest preemptable lane.
    2. rows        resident Decode/Control units in permit order (recovery first, then ticket)
    3. chunk       one Prefill/Replay chunk, rotating among residents (recovery first); when
                   the resume's unit is a chunk and an older resident exists, a resident's chunk
                   too, skipped if the resume binds (its wait constrains only itself)
    4. fresh       the scan (head + up to C followers) with the lane and overtaking bounds as
                   guards; no free lane: the scanned keep their valuable sources (waiting refs)

Every unit carries a capture for each save point it crosses or ends on, unless a full recovery
permit is active (seed: 恢复期跳过可选 capture).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ninfer import protocol as P
from ninfer.engine.request import Request
from ninfer.engine.units import Save, Unit, next_unit
from ninfer.policy.pressure import CHUNK, FRESH, RESUME, ROW, Contract, ItemKind, Need, Settlement, Verdict
from ninfer.policy.resources import OPTIONAL_CUTS, Admission, SaveKind, SavePoint
from ninfer.protocol import BindMode, SnapshotOwner, WaiterOwner, unit_pages

if TYPE_CHECKING:
    from ninfer.policy.resources import ResourceManager
    from ninfer.policy.scheduler import Scheduler


@dataclass
class Item:
    """One intent of the plan and what it means to the controller."""

    iid: int
    req: Request
    kind: ItemKind
    intent: P.RowIntent | P.BindIntent
    unit: Unit | None
    need: Need
    adm: Admission | None = None
    route: str = ""                          # a resume: "snapshot" | "replay" (the public pause route)
    save_points: list[SavePoint] = field(default_factory=list)   # a fresh bind's, tentative
    contract: Contract | None = None         # the capacity contract fails it if still short

    @property
    def spec(self) -> P.UnitSpec | None:
        return self.intent.unit


class WaitKind(enum.Enum):
    KEEP = "keep"            # a queued request keeps its valuable source (waiting references)
    END = "end"              # it lets its waiting references go (reselected, or it moves its source)
    PENDING = "pending"      # it waits for a deeper point another request is about to publish


@dataclass(frozen=True)
class Wait:
    """A wait the plan decided for a fresh request (seed: 等待引用, 等待待发布的点)."""

    kind: WaitKind
    req: Request
    adm: Admission | None = None          # KEEP: the source and record it keeps
    producer: str = ""                    # PENDING: who will publish the point ...
    frontier: int = 0                     # ... at which position
    base: int = 0                         # ... and the complete source it would start from now


@dataclass
class Plan:
    items: list[Item] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)           # in scan order
    take_back: Request | None = None         # a lane to take back for the resume
    scanned: list[Request] = field(default_factory=list)      # the fresh scan, in order
    sources: set[int] = field(default_factory=set)            # sources this plan adopts
    keep: set[int] = field(default_factory=set)               # kept points saves will join

    def drop_dead(self) -> None:
        """Items of requests that ended meanwhile (the quote's reply may fail one) are not sent."""
        self.items = [i for i in self.items if i.req.live]

    def settle(self, s: Settlement) -> None:
        """The one place the plan takes its settlement: the remedies, on-short pauses and the
        capacity contract of its intents, and its saves' rooms (a settle on a wider quote
        replaces an earlier one whole)."""
        for item in self.items:
            v = s.verdicts.get(item.iid, Verdict())
            item.intent.remedies = v.remedies
            item.contract = v.contract       # fails it only if the worker confirms it is still short
            if isinstance(item.intent, P.RowIntent):
                item.intent.on_short = v.on_short
        for (_, save), (room, refused) in zip(self.captures(), s.rooms):
            save.capture.room, save.room_refused = room, refused
        if s.take_back is not None and self.take_back is not None:
            # the lane take-back leads the resume's remedies (the resume is the plan's first item)
            to_host, victims = s.take_back
            resume = next((i for i in self.items if i.kind is RESUME), None)
            if resume is not None:
                resume.intent.remedies.insert(0, P.TakeBack(self.take_back.sid, to_host, victims, lane=True))

    def saves(self) -> list[tuple[Request, SavePoint, object]]:
        """The saves' (request, save point, record) for their room, in plan order."""
        return [(i.req, sv.sp, i.adm.record if i.adm is not None else None) for i, sv in self.captures()]

    def by_iid(self) -> dict[int, Item]:
        return {i.iid: i for i in self.items}

    def needs(self) -> list[Need]:
        return [i.need for i in self.items]

    def intents(self) -> list[P.Intent]:
        return [i.intent for i in self.items]

    def captures(self) -> list[tuple[Item, Save]]:
        """Every save with a capture sent, by item and position (the order of the step's captures)."""
        return [(i, sv) for i in self.items if i.spec is not None and i.unit is not None
                for sv in i.unit.saves if sv.capture is not None]

    def queries(self) -> list[P.DemandQuery]:
        out = []
        for i in self.items:
            it = i.intent
            if isinstance(it, P.BindIntent):
                out.append(P.DemandQuery(i.iid, sid=it.sid, source=it.source, mode=it.mode,
                                         first_tokens=it.first_tokens, bind=True))
            else:
                out.append(P.DemandQuery(i.iid, sid=it.sid, n_tokens=it.unit.n_tokens))
        return out


class CyclePlanner:
    """Builds each cycle's plan from the Scheduler's and the ResourceManager's decisions. It
    holds those two, never the core;
    what the last reply said that planning needs comes in as an argument of ``build``."""

    def __init__(self, sched: "Scheduler", rm: "ResourceManager", chunk: int, inner: bool = False):
        """``inner``: the worker takes saves inside a unit (``WorkerInfo.inner_cuts``) and the
        config wants it — a unit then ends on no save point (units.py)."""
        self.sched, self.rm, self.chunk, self.inner = sched, rm, chunk, inner
        self.host_kv_pages = 0
        self._iids = itertools.count(1)

    def build(self, host_kv_pages: int) -> Plan:
        """``host_kv_pages``: Main KV pages on the Host in the last reply (a bind's demand is then
        only known from a quote)."""
        self.host_kv_pages = host_kv_pages
        sched, plan = self.sched, Plan()
        self.keep = plan.keep
        lanes = sched.lanes_free
        resume = sched.resume_candidate()
        recovery = sched.recovery is not None or resume is not None
        # rule: lane-take-back
        if resume is not None and lanes <= 0 and sched.may_take_back(resume):
            victims = sched.victims_for(resume)
            if victims:
                plan.take_back = victims[0]          # seed: 收回较年轻请求占用的 lane
                lanes += 1
        chunk_taken, fallback = False, None
        if resume is not None and lanes > 0:
            item = self._resume(resume)
            plan.items.append(item)
            if item.intent.source is not None:
                plan.sources.add(item.intent.source.cid)
            chunk_taken = item.spec.n_tokens > 1
            # rule: resume-fallback-chunk
            if chunk_taken and sched.older_resident_than(resume):
                # with an older resident the resume only tries free and optional space, and a
                # paused request's wait constrains only itself: if it does not bind, the
                # cycle's prefill turn goes to a resident (skipped when the resume bound)
                fallback = P.Guard((), (item.iid,), 1)
            lanes -= 1
        # rule: fresh-after-residents
        skip = plan.take_back
        for req in sched.rows():
            if req is not skip:
                plan.items.append(self._resident(req, ROW, recovery))
        # rule: one-chunk-per-cycle
        if not chunk_taken or fallback is not None:
            for req in sched.chunk_order():
                if req is not skip:
                    item = self._resident(req, CHUNK, recovery)
                    if fallback is not None:
                        item.intent.guards = [fallback]
                    plan.items.append(item)
                    chunk_taken = True
                    break
        self._fresh(plan, lanes, chunk_taken, recovery)
        return plan

    # ---- residents ------------------------------------------------------------------
    def _captures(self, req: Request, unit: Unit, recovery: bool, rec=None,
                  released: set = frozenset()) -> list[P.Capture]:
        """Each save of the unit decided (declined, shared, or a capture), in position order;
        the captures to send."""
        out: list[P.Capture] = []
        anchors: tuple[set[int], int] = (set(), 0)        # earlier anchor saves: replaced, added
        for save in unit.saves:
            cap = self._capture(req, save, recovery, rec, released, anchors)
            if SaveKind.ANCHOR in save.sp.kinds and not save.declined:
                anchors = (anchors[0] | {r.cid for r in save.replace}, anchors[1] + 1)
            if cap is not None:
                save.capture = cap
                out.append(cap)
        return out

    def _capture(self, req: Request, save: Save, recovery: bool, rec, released: set,
                 anchors: tuple[set[int], int]) -> P.Capture | None:
        sp = save.sp
        # rule: recovery-skips-captures
        if recovery:
            save.declined = True             # a full recovery permit is active: no optional save
            return None
        rm = self.rm
        retire = rm.retire_for(req, sp, rec)
        replace: list[P.Retire] = []
        if SaveKind.ANCHOR in sp.kinds:
            got = rm.anchor_replace(req, sp, rec, anchors)
            if got is None:
                save.declined = True         # no safe replacement: the save is given up
                return None
            replace = got
        save.retire, save.replace = list(retire), list(replace)
        # rule: one-physical-point
        existing = rm.existing_point(req, sp.frontier, released)
        if existing is not None:
            # the same position and identity is already kept: one physical point, several
            # logical holders (its owners are added once the unit ran; kept safe meanwhile)
            save.shared = existing
            self.keep.add(existing.cid)
            return None
        return P.Capture(sp.owners[0], retire, replace=replace, at=sp.frontier if save.inner else 0)

    def _resident(self, req: Request, kind: ItemKind, recovery: bool) -> Item:
        f = req.facts
        points = _cuts(self.rm.book(req).save_points, recovery)
        unit = next_unit(req, f.frontier, f.ledger_len, self.chunk, points, self.inner)
        if unit.kind is P.UnitKind.DECODE and f.spec:
            unit.kind = P.UnitKind.VERIFY    # the decode row also verifies f.spec drafts (seed: Decode/Verify)
        caps = self._captures(req, unit, recovery)
        spec = P.UnitSpec(unit.n_tokens, unit.kind, hold=req.recovery_pending, captures=caps)
        iid = next(self._iids)
        # rule: verify-peak-demand
        n = unit.n_tokens + (f.spec if unit.kind is P.UnitKind.VERIFY else 0)   # the speculative peak
        demand = {P.MAIN: max(0, unit_pages(f.frontier, n, f.blocks, f.tail_ok) - f.reserved)}
        return Item(iid, req, kind, P.RowIntent(iid, req.sid, spec), unit, Need(iid, req, kind, demand))

    # ---- resume ---------------------------------------------------------------------
    def _resume(self, req: Request) -> Item:
        """Full recovery permit: State, missing KV, tail, rebuild to the old frontier and the
        first real new unit — requested together. Own Snapshot first, else Replay."""
        target = req.replay_target or 0
        ledger_len = len(req.ledger)
        adm = None
        # rule: resume-route
        if req.snapshot is not None:
            route, source, mode = "snapshot", req.snapshot, BindMode.MOVE
            mover, start = SnapshotOwner(req.sid), req.snapshot.frontier
        else:
            route, adm = "replay", self.rm.plan_replay(req)
            source = adm.source.ref if adm.source else None
            mode, mover, start = BindMode.FORK, None, adm.frontier
        unit = next_unit(req, start, ledger_len, self.chunk)
        if start < target:
            after = next_unit(req, target, ledger_len, self.chunk)
            first = target - start + after.n_tokens
        else:
            first = unit.n_tokens
        iid = next(self._iids)
        # rule: recovery-permit-held
        spec = P.UnitSpec(unit.n_tokens, unit.kind, hold=True)
        intent = P.BindIntent(iid, sid=req.sid, source=source, mode=mode, first_tokens=first, mover=mover, unit=spec)
        need = Need(iid, req, RESUME, self._bind_demand(source, mode, start, first),
                    source.cid if source is not None else None)
        return Item(iid, req, RESUME, intent, unit, need, adm=adm, route=route)

    def _bind_demand(self, source: P.CkptRef | None, mode: BindMode, start: int, first: int) -> dict | None:
        """An upper bound of what the bind needs, or None when only a quote can tell (KV pages
        of the source may be on the Host)."""
        if source is None:
            return {P.STATE: 1, P.MAIN: unit_pages(0, first, 0, True)}
        if self.host_kv_pages:
            return None
        state = 0 if mode is BindMode.MOVE and source.device else 1
        return {P.STATE: state, P.MAIN: unit_pages(start, first, -(-start // P.PAGE), False)}

    # ---- fresh ----------------------------------------------------------------------
    def _producers(self) -> list:
        """Residents with saves still ahead: (request, frontier now, pending save points)."""
        rm = self.rm
        return [(r, r.facts.frontier, rm.books[r.rid].save_points) for r in self.sched.resident.values()
                if r.live and r.facts is not None and r.rid in rm.books and rm.books[r.rid].save_points]

    def _fresh(self, plan: Plan, lanes: int, chunk_taken: bool, recovery: bool) -> None:
        sched, rm = self.sched, self.rm
        cands = sched.fresh_candidates()
        if not cands:
            return
        # rule: no-lane-keeps-sources
        if lanes <= 0:
            # no free lane: the scanned still keep their chosen valuable sources (seed: 没有空
            # lane 时仍可保留选中的恢复来源)
            for req, _ in cands:
                adm = rm.plan_admission(req, sched.fresh)
                if adm.cached:
                    plan.waits.append(Wait(WaitKind.KEEP, req, adm))
            plan.scanned = [r for r, _ in cands]
            return
        items, budgets = [], []
        producers = self._producers()
        released: set[WaiterOwner] = set()         # waits this scan ends: a later bind may Move past them
        pending_now: set[str] = set()
        for req, budget in cands:
            adm = rm.plan_admission(req, sched.fresh, released)
            pending = rm.pending_source(req, adm.frontier, producers)
            # rule: pending-wait
            if pending is not None:
                # another request will publish a deeper point for this prefix: wait for it,
                # holding nothing (seed: 等待引用; the point is no source until complete)
                plan.waits.append(Wait(WaitKind.PENDING, req, producer=pending[0], frontier=pending[1],
                                       base=adm.frontier))
                pending_now.add(req.rid)
                continue
            wait = rm.waiting_on(req)
            if rm.holds_waits(req) and (wait is None or adm.source is None or adm.source.cid != wait.cid
                                        or adm.mode is BindMode.MOVE):
                plan.waits.append(Wait(WaitKind.END, req))     # reselected, or moved
                released.add(WaiterOwner(req.rid))
            save_points = rm.save_plan(req, adm.frontier, adm.record)
            points = _cuts(save_points, recovery)
            unit = next_unit(req, adm.frontier, len(req.prompt), self.chunk, points, self.inner)
            caps = self._captures(req, unit, recovery, adm.record, released)
            iid = next(self._iids)
            spec = P.UnitSpec(unit.n_tokens, unit.kind, captures=caps)
            source = adm.source.ref if adm.source else None
            if source is not None:
                plan.sources.add(source.cid)
            intent = P.BindIntent(iid, new=P.NewSeq(req.rid, P.pack_tokens(req.prompt), len(req.prompt), req.params,
                                                                   req.spec.media),
                                  source=source, mode=adm.mode, first_tokens=unit.n_tokens, mover=adm.mover,
                                  retire=adm.retire, unit=spec)
            need = Need(iid, req, FRESH, self._bind_demand(source, adm.mode, adm.frontier, unit.n_tokens),
                        source.cid if source is not None else None)
            items.append(Item(iid, req, FRESH, intent, unit, need, adm=adm, save_points=save_points))
            budgets.append(budget)
            producers.append((req, adm.frontier, save_points))
        guards = sched.fresh_guards([i.iid for i in items], budgets, lanes)
        chunks: list[int] = []
        for item, g in zip(items, guards):
            item.intent.guards = g
            # rule: fresh-chunk-turn
            if item.unit.n_tokens > 1:
                if chunk_taken:
                    item.intent.unit = None            # bound now; its chunk waits for its turn
                else:
                    item.intent.unit_guards = [P.Guard((), tuple(chunks), 1)]
                    chunks.append(item.iid)
        plan.items += items
        plan.scanned = [r for r, _ in cands if r.rid not in pending_now]


def _cuts(save_points: list[SavePoint], recovery: bool) -> list[SavePoint]:
    """The save points a unit may end on: while a full recovery permit is active no optional save
    is taken, and a divergence or anticipated position — no input boundary of this request — then
    cuts nothing."""
    if not recovery:
        return save_points
    return [sp for sp in save_points if not set(sp.kinds) <= OPTIONAL_CUTS]
