"""The preemption chain (seed: 单元缺口 → 可选预留与普通缓存回收 → 必要时撤销等待保护与暂停快照
→ 为最老必要工作收回较年轻 resident，或暂停自身无法前进的年轻行).

One shortfall is handled per cycle — the most privileged one: the recovery holder, then
resident rows and chunks by original ticket, then the oldest paused request's resume, then
the fresh head. Fresh admission may only reclaim optional cache (and younger waiters); it never
preempts a resident. A paused request with an older resident present behaves the same way.
Necessary work may also revoke later-ticket pause snapshots and, failing that, take back
younger residents (or pause itself when it is the young row that cannot progress). When the
sole remaining request still cannot get a legal unit, it fails with CapacityContractError
instead of waiting for a releaser that does not exist.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ninfer import protocol as P
from ninfer.engine.request import Phase, Request
from ninfer.errors import CapacityContractError
from ninfer.policy.reclaim import Planner

if TYPE_CHECKING:
    from ninfer.engine.core import EngineCore

PRIORITY = {"row": 1, "chunk": 1, "resume": 2, "fresh": 3}


class Pressure:
    def __init__(self, core: "EngineCore"):
        self.core = core

    # ---- entry ------------------------------------------------------------------------
    def relieve(self, shorts: list[tuple[Request, dict[str, int], str]]) -> bool:
        """Act on the most privileged shortfall; True if something changed."""
        live = [(r, s, k) for r, s, k in shorts if r.finish_reason is None and not r.cancel_requested]
        if not live:
            return False
        core = self.core
        req, short, kind = min(live, key=lambda x: (x[0] is not core.sched.recovery, PRIORITY[x[2]], x[0].ticket))
        if core.tx_busy:
            return False      # a transfer in flight will change capacity: wait for it (no spin)
        necessary = kind in ("row", "chunk") or (kind == "resume" and not core.sched.older_resident_than(req))
        if self._reclaim(req, short, necessary):
            return True
        if necessary and self._preempt(req):
            return True
        if self._alone(req):
            self._capacity_error(req, short)
            return True
        return False

    # ---- reclaim ----------------------------------------------------------------------
    def _reclaim(self, req: Request, short: dict[str, int], necessary: bool) -> bool:
        core = self.core
        [out] = core.call_commands([P.Quote()])
        facts = out.facts
        planner = Planner(facts, core.rm.table, self.protected(req), self._revoker(req, necessary),
                          self.snapshot_tickets())
        actions, covered = planner.plan(short)
        if not actions or not (covered or necessary):
            return False
        [res] = core.call_commands([P.Commit(actions)])
        if not res.result.ok and len(planner.steps) > 1:
            actions = planner.steps[0]               # the batch failed: try its first step alone
            [res] = core.call_commands([P.Commit(actions)])
        if not res.result.ok:
            return False
        self.applied(actions, res.result)
        return True

    def snapshot_tickets(self) -> dict[str, int]:
        return {f"seq:{r.sid}": r.ticket for r in self.core.sched.paused if r.sid is not None}

    def applied(self, actions: list[P.Action], result: P.CommitResult) -> None:
        """Mirror a committed reclaim: deletions revoke snapshots or forget records."""
        core = self.core
        snapshots = {r.snapshot.cid: r for r in core.sched.paused if r.snapshot is not None}
        deleted = [a.cid for a in actions if isinstance(a, P.Delete)]
        causes = {snapshots[a.cid].rid for a in actions if a.cid in snapshots}
        for cid in deleted:
            req = snapshots.get(cid)
            if req is not None:
                req.snapshot = None            # revoked: this request resumes by Replay
                core.stats.revocations += 1
        for rid in core.rm.on_deleted([c for c in deleted if c not in snapshots]):
            waiter = core.requests.get(rid)
            if waiter is not None:
                waiter.wait = None             # revoked: it reselects its source
        for a in actions:
            if isinstance(a, P.DemoteState):
                info = core.rm.table.ckpts.get(a.cid)
                if info is not None:
                    info.ref = P.CkptRef(info.ref.cid, info.ref.generation, info.ref.frontier, info.ref.kind,
                                         False, True)
        if result.tid is not None:
            core._tx[result.tid] = ("demote", None, frozenset(causes))
        core.sched.event(causes)               # real capacity release / revocation

    def protected(self, req: Request) -> set[int]:
        """Sources being adopted right now and the requester's own snapshot are never victims."""
        out = {r.source_cid for r in self.core.requests.values() if r.phase is Phase.BINDING and r.source_cid}
        if req.source_cid is not None:
            out.add(req.source_cid)            # its own source is always kept
        if req.snapshot is not None:
            out.add(req.snapshot.cid)
        return out

    def _revoker(self, req: Request, necessary: bool):
        """Which revocable holds the requester may take: only necessary work may revoke pause
        snapshots, and only those of later tickets (seed: 可选缓存，再考虑票号更晚的暂停快照)."""
        by_sid = {r.sid: r for r in self.core.sched.paused if r.sid is not None}
        requests = self.core.requests

        def may(owner: str) -> bool:
            if owner.startswith("seq:") and necessary:
                other = by_sid.get(int(owner[4:]))
                return other is not None and other.ticket > req.ticket
            if owner.startswith("w:"):
                # fresh admission may revoke only younger waiters; necessary progress any
                other = requests.get(owner[2:])
                return other is None or necessary or other.ticket > req.ticket
            return False
        return may

    # ---- preemption -------------------------------------------------------------------
    def _preempt(self, req: Request) -> bool:
        core = self.core
        victims = core.sched.victims_for(req)
        if victims:
            self.pause(victims[0])
            return True
        if req.resident and req.phase is Phase.RUNNING and core.sched.older_resident_than(req) \
                and core.sched.recovery is not req:
            self.pause(req)                    # the young row that cannot progress
            return True
        return False

    def pause(self, victim: Request) -> None:
        """Pause at a stable commit boundary: Snapshot (no copy, no new Device allocation);
        reclaim may later demote the snapshot or revoke it (→ Replay)."""
        core = self.core
        [out] = core.call_commands([P.Pause(victim.sid)])
        victim.snapshot = out.ref if isinstance(out, P.CkptOut) else None
        victim.replay_target = victim.frontier
        victim.phase = Phase.PAUSED
        victim.pauses.append({"route": "snapshot" if victim.snapshot else "replay",
                              "frontier": victim.frontier, "paused_at": time.monotonic()})
        core.sched.pause(victim)
        core.stats.preemptions += 1

    # ---- capacity contract --------------------------------------------------------------
    def _alone(self, req: Request) -> bool:
        """Nobody else holds or will release capacity: no other resident, no paused request,
        no transfer in flight."""
        sched = self.core.sched
        others = [r for r in sched.resident.values() if r is not req]
        paused = [r for r in sched.paused if r is not req]
        return not others and not paused and not self.core.tx_busy

    def _capacity_error(self, req: Request, short: dict[str, int]) -> None:
        core = self.core
        totals = {k: (v.total, v.available) for k, v in core.pools.items() if k in short}
        detail = ", ".join(f"{k}: {n} more needed ({totals[k][1]} available of {totals[k][0]})"
                           for k, n in short.items() if k in totals)
        core.stats.capacity_errors += 1
        core.fail(req, CapacityContractError(
            f"request {req.rid} cannot get a legal unit after reclaiming optional cache and pausing "
            f"others ({detail})"))
