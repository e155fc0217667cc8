"""The rule monitor: the seed's scheduling and cache rules stated as invariants over what the
policy decides, checked on every cycle of an engine that runs with ``NINFER_RULE_MONITOR=1``
(the test suite sets it: every engine test, the oracle sweeps, the Ray tests). A mutation list
pins the breakages it names; these invariants fail for a rule broken in any other way too — a
bound shifted by one, a tie-break swapped, a guard dropped, a branch inverted (issue 36, move 7).

    lanes          residents <= C; a resident is neither queued nor paused; queues in ticket order
    recovery       at most one full recovery permit; it is the Scheduler's recovery holder
    overtaking     no fresh request has been overtaken by more than C younger successes
    permit order   rows: the recovery holder first, then ascending ticket
    scan           the head of the fresh queue and at most C followers, in queue order
    one chunk      at most one prefill/replay chunk runs per cycle; the recovery holder's first
    resume         only the oldest paused request, only while nobody holds the permit; a
                   take-back only without an older resident, of the youngest preemptable lane
    rights         a fresh admission never takes a resident back, never pauses, never revokes a
                   pause snapshot or an older request's waiting reference; a resume behind an
                   older resident revokes nothing and takes nothing back
    victims        younger, running, live, not the recovery holder, youngest first
    fresh lanes    fresh successes never exceed the free lanes
    evidence       queries, waits, resumes and finishes change no demand evidence and no hit
                   count: hits grow only by admitted binds from a source; a record's demand
                   time moves only in a cycle that adopted a source, committed a prefill or
                   captured a point
    contract       a capacity contract error only for a request nobody else holds capacity for
    purity         planning and settling leave the books as they were: the Scheduler's queues
                   and per-request state, the ResourceManager's records, entries, checkpoint
                   owners, per-request books and counters, the requests' phases and sequences

The monitor reads the controller's books and the cycle's plan and reply; it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ninfer import protocol as P
from ninfer.policy.pressure import ItemKind
from ninfer.policy.resources import CacheBook
from ninfer.policy.scheduler import SchedState
from ninfer.protocol import Outcome, Phase, WaiterOwner

if TYPE_CHECKING:
    from ninfer.engine.core import EngineCore
    from ninfer.engine.planning import Plan


class RuleViolation(AssertionError):
    """A rule of the seed did not hold in a cycle (names the rule and what was seen)."""


@dataclass
class _Before:
    resident: set[str]
    lanes_free: int
    recovery: str | None
    paused: list[str]
    older_resident: dict[str, bool]
    tickets: dict[str, int]
    hits: int
    evidence: dict[tuple[str, int], float | None]
    running_young: dict[str, bool] = field(default_factory=dict)


def _fail(rule: str, why: str) -> None:
    raise RuleViolation(f"rule {rule}: {why}")


class RuleMonitor:
    def __init__(self):
        self.cycles = 0
        self._before: _Before | None = None

    # ---- purity ------------------------------------------------------------------------------
    @staticmethod
    def books(core: "EngineCore") -> tuple:
        """What the books say now (compared by ``unchanged``)."""
        sched, rm, table = core.sched, core.rm, core.rm.table
        default = SchedState()
        return (
            [r.rid for r in sched.fresh], sorted(sched.waiting), sorted(sched.resident), [r.rid for r in sched.paused],
            sched.recovery.rid if sched.recovery is not None else None, sched.epoch, sched.lanes_free,
            {rid: repr(st) for rid, st in sched.state.items() if st != default},
            {cid: (c.ref, frozenset(c.owners), c.host_pages) for cid, c in table.ckpts.items()},
            repr(table.records), repr(table.entries), dict(table.sessions), set(table.dirty),
            {rid: repr(b) for rid, b in rm.books.items() if b != CacheBook()}, repr(rm.stats), dict(rm.uncovered),
            {r.rid: (r.phase, r.sid, r.snapshot, r.recovery_pending, r.replay_target, r.finish_reason)
             for r in core.requests.values()},
            dict(core.by_sid), len(core.cmdq.items), dict(core.txs.parts))

    @staticmethod
    def unchanged(core: "EngineCore", before: tuple, phase: str) -> None:
        after = RuleMonitor.books(core)
        if after != before:
            parts = ["fresh", "waiting", "resident", "paused", "recovery", "epoch", "lanes", "sched state",
                     "checkpoints", "records", "entries", "sessions", "dirty", "cache books", "cache stats",
                     "uncovered", "requests", "sequences", "queued commands", "transactions"]
            moved = [name for name, a, b in zip(parts, before, after) if a != b]
            if "cache books" in moved:
                a, b = before[parts.index("cache books")], after[parts.index("cache books")]
                moved.append({k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
            _fail("pure-planning", f"{phase} changed the books: {moved}")

    # ---- the cycle's moments ----------------------------------------------------------------
    def begin(self, core: "EngineCore") -> None:
        sched = core.sched
        self._before = _Before(
            resident=set(sched.resident), lanes_free=sched.lanes_free,
            recovery=sched.recovery.rid if sched.recovery is not None else None,
            paused=[r.rid for r in sched.paused],
            older_resident={r.rid: sched.older_resident_than(r) for r in sched.paused},
            tickets={r.rid: r.ticket for r in core.requests.values()},
            hits=core.rm.stats.hits, evidence=_evidence(core))

    def planned(self, core: "EngineCore", plan: "Plan") -> None:
        """Decisions of the plan, before anything is sent."""
        sched, b = core.sched, self._before
        # as planning saw them (after the cycle's lifecycle; planning moves no request)
        b.recovery = sched.recovery.rid if sched.recovery is not None else None
        b.paused = [r.rid for r in sched.paused]
        b.older_resident = {r.rid: sched.older_resident_than(r) for r in sched.paused}
        rows = [i.req for i in plan.items if i.kind is ItemKind.ROW]
        keys = [(r is not sched.recovery, r.ticket) for r in rows]
        if keys != sorted(keys):
            _fail("permit-order", f"rows permitted as {[(r.rid, r.ticket) for r in rows]}")
        resumes = [i for i in plan.items if i.kind is ItemKind.RESUME]
        if len(resumes) > 1:
            _fail("resume-candidate", "two resumes in one cycle")
        for item in resumes:
            if b.recovery is not None:
                holder = core.requests.get(b.recovery)
                _fail("resume-candidate", f"{item.req.rid} resumes while {b.recovery} holds the full recovery permit "
                      f"({holder.phase.name if holder else 'gone'}, pending {holder.recovery_pending if holder else None}, "
                      f"paused {b.paused}, residents {sorted(sched.resident)})")
            if not b.paused or b.paused[0] != item.req.rid:
                _fail("resume-candidate", f"{item.req.rid} resumes, the oldest paused is {b.paused[:1]}")
        if plan.take_back is not None:
            if not resumes:
                _fail("lane-take-back", "a take-back without a resume")
            req = resumes[0].req
            if b.older_resident.get(req.rid, True):
                _fail("take-back-gate", f"{req.rid} takes a lane back although an older resident exists")
            cands = [r for r in sched.resident.values() if r.ticket > req.ticket and r.phase is Phase.RUNNING
                     and r is not sched.recovery and r.live]
            if plan.take_back not in cands or plan.take_back.ticket != max(r.ticket for r in cands):
                _fail("lane-take-back", f"took back {plan.take_back.rid}, the youngest preemptable is "
                      f"{max(cands, key=lambda r: r.ticket).rid if cands else None}")
        self._scan(core, plan)
        chunks = [i for i in plan.items if i.kind in (ItemKind.CHUNK, ItemKind.RESUME) and i.spec is not None
                  and i.spec.n_tokens > 1 and not i.intent.guards]
        if len(chunks) > 1:
            _fail("one-chunk-per-cycle", f"{len(chunks)} unguarded chunks: {[i.req.rid for i in chunks]}")
        rec = sched.recovery
        if rec is not None and rec in sched.chunk_order() and not resumes:
            taken = [i for i in plan.items if i.kind is ItemKind.CHUNK]
            if taken and taken[0].req is not rec:
                _fail("chunk-order", f"the prefill turn went to {taken[0].req.rid}, not the recovery holder {rec.rid}")

    def _scan(self, core: "EngineCore", plan: "Plan") -> None:
        """The scan looked at the head of the fresh queue and up to C followers (waiting requests
        are not looked at), skipped the dead and those that failed under this event, and stopped
        after a request with no overtaking budget left — restated over the queue it saw."""
        sched = core.sched
        got = sched.last_scan
        if got is None:
            return
        seen, epoch, out = got
        sched.last_scan = None
        want = expected_scan(seen, epoch, sched.C)
        if [r.rid for r in out] != [r.rid for r in want]:
            _fail("fresh-scan", f"the scan looked at {[r.rid for r in out]}, the rule says {[r.rid for r in want]}")
        scanned = [r for r in plan.scanned]
        if any(r not in out for r in scanned):
            _fail("fresh-scan", "a request was planned that the scan did not look at")

    def settled(self, core: "EngineCore", plan: "Plan") -> None:
        """The remedies each need was given: rights, victims, the capacity contract."""
        sched = core.sched
        tickets = {r.rid: r.ticket for r in core.requests.values()}
        snap_ticket = {r.snapshot.cid: r.ticket for r in sched.paused if r.snapshot is not None}
        by_sid = {r.sid: r for r in sched.resident.values() if r.sid is not None}
        taken = {plan.take_back.rid} if plan.take_back is not None else set()
        for item in plan.items:
            intent, req = item.intent, item.req
            remedies = getattr(intent, "remedies", [])
            takes = [r for r in remedies if isinstance(r, P.TakeBack)]
            behind = item.kind is ItemKind.RESUME and self._before.older_resident.get(req.rid, False)
            if item.kind is ItemKind.FRESH and (takes or getattr(intent, "on_short", None) is not None):
                _fail("preemption-rights", f"the fresh admission of {req.rid} pauses a resident")
            if behind and takes:
                _fail("preemption-rights", f"{req.rid} resumes behind an older resident and takes a lane back")
            for cid, owners in _deleted(core, remedies):
                if cid in snap_ticket and (item.kind is ItemKind.FRESH or behind or snap_ticket[cid] <= req.ticket):
                    _fail("revocation-rights", f"{item.kind} {req.rid} revokes the pause snapshot of ticket "
                          f"{snap_ticket[cid]}")
                for o in owners:
                    if not isinstance(o, WaiterOwner) or o.rid == req.rid:
                        continue
                    if behind or (item.kind is ItemKind.FRESH and tickets.get(o.rid, 1 << 62) < req.ticket):
                        _fail("revocation-rights", f"{item.kind} {req.rid} revokes {o.rid}'s waiting reference")
            last = None
            for t in takes:
                v = by_sid.get(t.sid)
                if v is None or v.ticket <= req.ticket or v.phase is not Phase.RUNNING or v is sched.recovery \
                        or not v.live:
                    _fail("victims", f"{req.rid} takes back sequence {t.sid} ({v.rid if v else 'not resident'})")
                if last is not None and v.ticket > last:
                    _fail("victims", f"{req.rid} takes back {v.rid} after a younger one (youngest first)")
                last = v.ticket
                taken.add(v.rid)
            if item.contract is not None:
                others = [r.rid for r in sched.resident.values() if r is not req and r.live and r.rid not in taken]
                older = [r.rid for r in sched.paused if r.ticket < req.ticket and r.live]
                if others or older or core.tx_busy:
                    _fail("capacity-contract", f"{req.rid} would fail the capacity contract beside {others + older} "
                          f"(transfer in flight: {core.tx_busy})")

    def ended(self, core: "EngineCore", plan: "Plan", reply: P.StepReply) -> None:
        """Outcomes and the state the cycle left."""
        self.cycles += 1
        b = self._before
        by_iid = {o.iid: o for o in reply.intents}
        fresh_ok = [i for i in plan.items if i.kind is ItemKind.FRESH and by_iid.get(i.iid) is not None
                    and by_iid[i.iid].outcome is Outcome.OK]
        resumed = [i for i in plan.items if i.kind is ItemKind.RESUME and by_iid.get(i.iid) is not None
                   and by_iid[i.iid].outcome is Outcome.OK]
        taken = 1 if plan.take_back is not None else 0
        if len(fresh_ok) > max(0, b.lanes_free + taken - len(resumed)) + _left(b, core):
            _fail("lane-bound", f"{len(fresh_ok)} fresh admissions with {b.lanes_free} free lanes")
        chunks = [u for u in reply.units if u.ran and _chunk(plan, u)]
        if len(chunks) > 1:
            _fail("one-chunk-per-cycle", f"{len(chunks)} prefill/replay chunks ran in one cycle")
        hits = core.rm.stats.hits - b.hits
        sourced = sum(1 for i in fresh_ok if i.adm is not None and i.adm.source is not None)
        if hits > sourced or hits < 0:
            _fail("hits-and-lost-hits", f"hits grew by {hits} with {sourced} admissions from a source")
        self._evidence(core, plan, reply, fresh_ok)
        self.state(core)

    def _evidence(self, core, plan, reply, fresh_ok) -> None:
        now = _evidence(core)
        moved = [k for k, t in now.items() if k in self._before.evidence and t != self._before.evidence[k]]
        if not moved:
            return
        adopted = any(i.adm is not None and i.adm.cached for i in fresh_ok)
        items = {i.req.sid: i for i in plan.items if i.unit is not None}
        computed = any(any(c.captured is not None for c in u.captures) or (u.ran and u.sid in items and (
            items[u.sid].unit.kind is P.UnitKind.PREFILL
            or (items[u.sid].unit.kind is P.UnitKind.DECODE and len(items[u.sid].req.outputs) <= len(u.committed))))
            for u in reply.units)
        if not adopted and not computed:
            _fail("adoption-evidence", f"demand evidence of {moved[:3]} moved in a cycle with no adoption, "
                  "no prefill commit and no capture")

    def state(self, core: "EngineCore") -> None:
        """Invariants of the books between cycles."""
        sched = core.sched
        if len(sched.resident) > sched.C:
            _fail("lane-bound", f"{len(sched.resident)} residents with C = {sched.C}")
        fresh, paused = {r.rid for r in sched.fresh}, {r.rid for r in sched.paused}
        if fresh & paused or (fresh | paused) & set(sched.resident):
            _fail("lane-bound", "a request is in two of the fresh queue, the paused queue and the residents")
        for q, name in ((sched.fresh, "fresh"), (sched.paused, "paused")):
            t = [r.ticket for r in q]
            if t != sorted(t):
                _fail("fresh-scan" if name == "fresh" else "resume-candidate", f"the {name} queue is out of ticket order")
        holders = [r for r in core.requests.values() if r.recovery_pending and r.live]
        if len(holders) > 1:
            _fail("resume-candidate", f"{len(holders)} full recovery permits: {[r.rid for r in holders]}")
        if holders and sched.recovery is not holders[0] and holders[0].rid in sched.resident:
            _fail("resume-candidate", f"{holders[0].rid} holds the permit, the Scheduler names "
                  f"{sched.recovery.rid if sched.recovery else None}")
        for r in sched.fresh:
            if sched.st(r).overtaken > sched.C:
                _fail("overtaking-bound", f"{r.rid} was overtaken {sched.st(r).overtaken} times with C = {sched.C}")


def expected_scan(seen, epoch: int, C: int) -> list:
    """The scan rule restated: of the fresh queue as seen ((request, waiting, failed epoch,
    overtaken) in ticket order), the head and up to C followers that are not waiting; the dead
    are passed over, those that failed under this event — or wait for their reclaim's copies
    (wait-for-release) — are not quoted again, and a request that may not be overtaken again
    (overtaken C times) is the last one looked at."""
    want = []
    for req, _waiting, failed, overtaken in [x for x in seen if not x[1]][: 1 + C]:
        if not req.live:
            continue
        if failed != epoch and not req.awaiting_release:
            want.append(req)
        if overtaken >= C:
            break
    return want


def _left(b: _Before, core) -> int:
    """Lanes residents gave back inside the cycle (a row that paused itself, a finish): fresh
    binds after them may use those."""
    return len(b.resident - set(core.sched.resident))


def _chunk(plan: "Plan", u: P.UnitOut) -> bool:
    item = next((i for i in plan.items if i.req.sid == u.sid and i.unit is not None), None)
    return item is not None and item.unit.kind in (P.UnitKind.PREFILL, P.UnitKind.REPLAY) and item.unit.n_tokens > 1 \
        and item.spec is not None


def _deleted(core, remedies) -> list[tuple[int, set]]:
    """(checkpoint, its owners) of every deletion among ``remedies`` (pause snapshots included)."""
    out = []
    for r in remedies:
        acts = r.actions if isinstance(r, P.Reclaim) else r.host_victims
        for a in acts:
            if isinstance(a, P.Delete):
                info = core.rm.table.ckpts.get(a.cid)
                out.append((a.cid, info.owners if info is not None else set()))
    return out


def _evidence(core) -> dict[tuple[str, int], float | None]:
    table = core.rm.table
    out = {("rec", r.id): r.evidence.demand_time for r in table.records.values()}
    out.update({("ent", e.id): e.evidence.demand_time for e in table.entries.values()})
    return out
