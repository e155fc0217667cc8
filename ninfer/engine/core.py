"""EngineCore: the controller's single control thread (seed: Engine 周期).

One ``cycle`` builds one StepPlan and makes one round trip to the worker:

    1. settle: publish transfer completions, finish terminal requests (freeze E / release),
       carry out cancellations
    2. rows: resident Decode/Control units in permit order (recovery first, then ticket)
    3. binds: the oldest paused request's full resume (on a real capacity event), then the
       fresh scan (head + up to C followers, bounded overtaking) with the free lanes
    4. chunks: one Prefill/Replay chunk, rotating among residents (recovery first)
    -> worker executes, settles, reports
    5. process: publish tokens (never twice), terminal states, captures, accounting
    6. pressure: the oldest necessary shortfall goes through the preemption chain

The policy decisions live in the Scheduler (who runs) and the ResourceManager (what is kept);
this class keeps the books of requests and transactions and talks to the worker.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ninfer import protocol as P
from ninfer.config import EngineConfig
from ninfer.policy.pressure import Pressure
from ninfer.engine.request import Phase, Request, RequestSpec
from ninfer.engine.units import Unit, account, next_unit
from ninfer.frontend.validate import validate_spec
from ninfer.errors import CapacityContractError, IntegrityError, RequestError
from ninfer.policy.reclaim import Planner
from ninfer.policy.resources import Admission, ResourceManager, SavePoint
from ninfer.policy.scheduler import Scheduler

log = logging.getLogger("ninfer.engine")


@dataclass
class CycleCtx:
    """What each entry of this cycle's plan means, to interpret the reply."""

    pre: list[Callable[[P.CommandOut], None]] = field(default_factory=list)
    units: dict[int, tuple[Request, Unit]] = field(default_factory=dict)       # sid -> unit
    binds: list[tuple[Request, str, Admission | None, Unit]] = field(default_factory=list)
    fresh: list[Request] = field(default_factory=list)
    short: list[tuple[Request, dict[str, int], str]] = field(default_factory=list)


@dataclass
class EngineStats:
    cycles: int = 0
    steps: int = 0
    preemptions: int = 0
    revocations: int = 0
    resumes_snapshot: int = 0
    resumes_replay: int = 0
    capacity_errors: int = 0
    cycle_s: float = 0.0            # wall time of cycles that made a round trip
    worker_s: float = 0.0           # of which the worker was busy
    prefill_tokens: int = 0
    replay_tokens: int = 0
    finished: int = 0


class EngineCore:
    def __init__(self, client, config: EngineConfig, sink: Callable[[P.Event], None]):
        self.client = client
        self.config = config
        self.info = client.info()
        self.sink = sink
        self.chunk = self.info.prefill_chunk_tokens
        self.sched = Scheduler(self.info.max_concurrency)
        self.rm = ResourceManager(self.info)
        self.pressure = Pressure(self)
        self.requests: dict[str, Request] = {}
        self.by_sid: dict[int, Request] = {}
        self.stats = EngineStats()
        self._tickets = itertools.count()
        self._steps = itertools.count(1)
        self._pending: list[tuple[P.Command, Callable[[P.CommandOut], None]]] = []
        self._completions: list[tuple[int, int]] = []
        self._tx: dict[int, tuple[str, Request | None]] = {}    # tid -> (purpose, request)
        self._tx_since: float | None = None
        self.tx_busy = False
        self.pools: dict[str, P.PoolState] = {}
        self.host_free = 0
        self.host_largest = 0
        self.bytes = (0, 0)

    # ==== intake =========================================================================
    def add(self, spec: RequestSpec) -> Request:
        """Validate and queue a request; bad input raises RequestError for it alone."""
        validate_spec(spec, self.info)
        rid = spec.rid or f"req-{next(self._tickets)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        req = Request(spec=spec, rid=rid, ticket=next(self._tickets))
        req.usage.prompt_tokens = len(spec.prompt)
        self.requests[rid] = req
        self.sched.enqueue(req)
        return req

    def cancel(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None and req.finish_reason is None:
            req.cancel_requested = True

    # ==== the cycle ======================================================================
    def busy(self) -> bool:
        return bool(self.requests) or bool(self._pending) or bool(self._completions) or self.tx_busy

    def cycle(self) -> bool:
        """One engine cycle; returns False when there was nothing to do."""
        ctx = CycleCtx()
        plan = P.StepPlan(seq=next(self._steps))
        self._check_overdue()
        self._settle(plan, ctx)
        self._plan_units(self.sched.rows(), plan.rows, ctx)           # 2. rows
        self._plan_binds(plan, ctx)
        self._plan_units(self.sched.chunk_order(), plan.chunks, ctx)  # 4. chunks
        if not (plan.pre or plan.rows or plan.binds or plan.chunks):
            if self.tx_busy:
                self._call(plan)                # poll: drain completions (woken by the worker)
                return bool(self._completions)
            return False
        self.stats.cycles += 1
        t0 = time.perf_counter()
        reply = self._call(plan)
        self.stats.cycle_s += time.perf_counter() - t0
        progressed = self._process(reply, ctx) or bool(plan.pre)
        acted = self.pressure.relieve(ctx.short)
        # A cycle in which nothing ran and nothing changed waits for the next real event
        # (a transfer completion, a new request): incomplete async events are never spun on.
        return progressed or acted or bool(self._completions)

    def _call(self, plan: P.StepPlan) -> P.StepReply:
        self.stats.steps += 1
        reply = self.client.step(plan)
        self.stats.worker_s += reply.worker_s
        self.pools = reply.pools
        self.host_free = reply.host_free
        self.host_largest = reply.host_largest
        self.bytes = (reply.bytes_h2d, reply.bytes_d2h)
        self.tx_busy = reply.tx_busy
        if reply.completions:
            self._completions.extend(reply.completions)
        if self.tx_busy and self._tx_since is None:
            self._tx_since = time.monotonic()
        elif not self.tx_busy:
            self._tx_since = None
        return reply

    def call_commands(self, cmds: list[P.Command]) -> list[P.CommandOut]:
        """A synchronous side round trip (pressure paths, quotes, maintenance)."""
        return self._call(P.StepPlan(seq=next(self._steps), pre=cmds)).pre

    def queue(self, cmd: P.Command, then: Callable[[P.CommandOut], None] | None = None) -> None:
        self._pending.append((cmd, then or (lambda out: None)))

    def _check_overdue(self, timeout: float = 2.0) -> bool:
        """A transaction whose completion never came (dropped) is settled after a timeout."""
        if self._tx_since is not None and time.monotonic() - self._tx_since > timeout:
            [out] = self.call_commands([P.Overdue()])
            self._completions.extend(out.done)
            self._tx_since = time.monotonic()
            return bool(out.done)
        return False

    # ---- 1. settle ----------------------------------------------------------------------
    def _settle(self, plan: P.StepPlan, ctx: CycleCtx) -> None:
        for tid, gen in self._completions:
            purpose = self._tx.get(tid)
            plan.pre.append(P.Publish(tid, gen))
            ctx.pre.append(lambda out, tid=tid, purpose=purpose: self._published(tid, purpose, out))
        self._completions = []
        for cmd, then in self._pending:
            plan.pre.append(cmd)
            ctx.pre.append(then)
        self._pending = []
        timeout = self.config.request_timeout_s
        now = time.monotonic()
        for req in list(self.requests.values()):
            if (timeout is not None and req.first_admitted is None and req.finish_reason is None
                    and now - req.arrival > timeout):
                # ingress timeout: counted from the original arrival until first admission; a
                # later pause does not restart it
                req.error = {"type": "timeout", "message": f"not admitted within {timeout} s"}
                req.finish_reason = "error"
            if req.cancel_requested and req.finish_reason is None:
                self._end(req, "cancelled", plan, ctx)
            elif req.finish_reason is not None and req.finished_at is None:
                self._end(req, req.finish_reason, plan, ctx)

    def _published(self, tid: int, purpose, out: P.CommandOut) -> None:
        if not (isinstance(out, P.Ack) and out.value):
            return                      # late or duplicate completion: ignored by the worker
        self._tx.pop(tid, None)
        kind, req, causes = purpose if purpose is not None else (None, None, frozenset())
        self.sched.event(causes)        # transfer completion re-opens the scan
        if kind == "bind" and req is not None and req.phase is Phase.BINDING:
            req.phase = Phase.RUNNING
            req.source_cid = None

    def _end(self, req: Request, reason: str, plan: P.StepPlan, ctx: CycleCtx, error: dict | None = None) -> None:
        """Terminal: freeze a normal finish as the record's E, release everything else."""
        req.finish_reason = reason
        req.error = error or req.error
        if req.sid is not None and req.resident and reason in ("stop", "length") and req.phase is Phase.RUNNING:
            plan.pre.append(P.Freeze(req.sid, req.record.owner("E")))
            ctx.pre.append(lambda out, req=req: self._frozen(req, out))
        elif req.sid is not None:
            plan.pre.append(P.Release(req.sid))
            ctx.pre.append(lambda out: None)
            self._release_records(req)
        else:
            self._release_records(req)
        self._finish(req)

    def _release_records(self, req: Request) -> None:
        for cmd in self.rm.on_released(req):
            self.queue(cmd)

    def _frozen(self, req: Request, out: P.CommandOut) -> None:
        if isinstance(out, P.CkptOut) and out.ref is not None:
            for cmd in self.rm.on_finished(req, out.ref):
                self.queue(cmd)
        else:
            self._release_records(req)

    def _finish(self, req: Request) -> None:
        req.finished_at = time.monotonic()
        self.sched.remove(req)
        self.requests.pop(req.rid, None)
        if req.sid is not None:
            self.by_sid.pop(req.sid, None)
        self.stats.finished += 1
        self.stats.prefill_tokens += req.usage.prefill_tokens
        self.stats.replay_tokens += req.usage.replay_tokens
        u = req.usage
        u.completion_tokens = len(req.outputs)
        self.sink(P.FinalEvent(
            rid=req.rid, finish_reason=req.finish_reason, token_ids=list(req.outputs),
            usage={"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                   "cached_tokens": u.cached_tokens, "prefill_tokens": u.prefill_tokens,
                   "replay_tokens": u.replay_tokens},
            timings={**{k: getattr(req.timings(), k) for k in ("ttft_s", "e2e_s", "max_output_gap_s", "queue_s")},
                     "arrival": req.arrival, "admitted_at": req.first_admitted},
            pauses=list(req.pauses), error=req.error, prompt_token_ids=list(req.prompt)))

    def fail(self, req: Request, exc: Exception) -> None:
        """Fail one request with a clear error (it alone)."""
        kind = "capacity_contract" if isinstance(exc, CapacityContractError) else type(exc).__name__
        req.error = {"type": kind, "message": str(exc)}
        req.finish_reason = "error"

    # ---- 2. rows and 4. chunks ------------------------------------------------------------
    def _unit_for(self, req: Request) -> Unit:
        f = req.facts
        return next_unit(req, f.frontier, f.ledger_len, self.chunk)

    def _row_spec(self, req: Request, unit: Unit, sid: int, binding_slots: int = 0) -> P.RowSpec:
        spec = P.RowSpec(sid=sid, n_tokens=unit.n_tokens, kind=unit.kind, hold=req.recovery_pending)
        if (unit.save_index is not None and not req.recovery_pending
                and self._admit_capture(req, unit, binding_slots)):
            sp: SavePoint = req.save_points[unit.save_index]
            spec.capture_owner = sp.owners[0]
            spec.capture_retire = self.rm.retire_for(req, sp)
            if "a" in sp.kinds:
                spec.capture_retire += self.rm.anchor_overflow(req)
            unit.retire = list(spec.capture_retire)
        return spec

    def _waits_for_turn(self, req: Request, unit: Unit, binding_slots: int = 0) -> bool:
        """A save that would go to the Host needs the single context-transaction turn: while
        another transfer is in flight, this unit waits for it (one cycle of this request only;
        everything else keeps running) instead of losing the save."""
        if unit.save_index is None or req.recovery_pending or not self.tx_busy:
            return False
        state = self.pools.get(P.STATE)
        return state is not None and state.available <= binding_slots

    def _admit_capture(self, req: Request, unit: Unit, binding_slots: int) -> bool:
        """A capture is an optional cache write: with a free Device slot or Host room it just
        goes; otherwise the admission table decides what, if anything, it may replace. A save
        that is not admitted is skipped — it never blocks necessary execution.
        ``binding_slots``: slots this cycle's bind takes before the capture (its writer)."""
        state = self.pools.get(P.STATE)
        if state is None or state.available > binding_slots or self.host_largest >= self.info.image_bytes:
            return True
        sp: SavePoint = req.save_points[unit.save_index]
        if self.tx_busy:
            unit.declined = True       # room would come through a transaction: skip, don't wait
            return False
        benefit, own, owner_reuse = self.rm.capture_terms(req, sp)
        [out] = self.call_commands([P.Quote()])
        planner = Planner(out.facts, self.rm.table, self.pressure.protected(req), lambda owner: False)
        actions: list[P.Action] = []
        for _ in range(binding_slots + 1 - max(0, state.available)):   # its writer's slot too
            more = planner.plan_capture(benefit, own, owner_reuse)
            if more is None:
                unit.declined = True
                return False
            actions += more
        if actions:
            [res] = self.call_commands([P.Commit(actions)])
            if not res.result.ok:
                return False
            self.pressure.applied(actions, res.result)
        return True

    def _plan_units(self, reqs, out: list, ctx: CycleCtx) -> None:
        """Rows (step 2) and chunks (step 4): live requests whose unit has its turn."""
        for req in reqs:
            if req.finish_reason is not None or req.cancel_requested:
                continue
            unit = self._unit_for(req)
            if self._waits_for_turn(req, unit):
                continue
            out.append(self._row_spec(req, unit, req.sid))
            ctx.units[req.sid] = (req, unit)

    # ---- 3. binds -----------------------------------------------------------------------
    def _plan_binds(self, plan: P.StepPlan, ctx: CycleCtx) -> None:
        lanes = self.sched.lanes_free
        resume = self._resume_candidate()
        if resume is not None and lanes > 0:
            self._plan_resume(resume, plan, ctx)
            lanes -= 1
        if lanes <= 0:
            self._keep_sources()
            return
        plan.max_new = lanes
        rank = 1000
        for req, budget in self.sched.fresh_candidates():
            adm = self.rm.plan_admission(req)
            req.record = adm.record                # tentative until the bind succeeds
            req.source_cid = adm.source.cid if adm.source else None
            if req.wait is not None and (adm.source is None or adm.source.cid != req.wait.cid or adm.mode == "move"):
                plan.pre.extend(self.rm.end_wait(req))     # reselected, or handed over by the Move
                ctx.pre.extend([lambda out: None] * (len(plan.pre) - len(ctx.pre)))
            req.save_points = self.rm.save_plan(req, adm.frontier)
            unit = next_unit(req, adm.frontier, len(req.prompt), self.chunk)
            rank += 1
            plan.binds.append(P.BindSpec(
                new=P.NewSeq(req.rid, P.pack_tokens(req.prompt), len(req.prompt), req.params),
                source=adm.source.ref if adm.source else None, mode=adm.mode,
                first_tokens=unit.n_tokens, mover=adm.mover, retire=adm.retire,
                unit=None if self._waits_for_turn(req, unit, 0 if adm.mode == "move" else 1)
                else self._row_spec(req, unit, 0, 0 if adm.mode == "move" else 1),
                rank=rank, fresh=True, budget=budget))
            ctx.binds.append((req, "fresh", adm, unit))
            ctx.fresh.append(req)

    def _keep_sources(self) -> None:
        """No free lane: the scanned requests still keep their chosen valuable sources with
        waiting references (seed: 没有空 lane 时仍可保留选中的恢复来源)."""
        cands = self.sched.fresh_candidates()
        for req, _ in cands:
            adm = self.rm.plan_admission(req)
            req.source_cid = adm.source.cid if adm.source else None
            if adm.cached:
                for cmd in self.rm.wait_on(req, adm):
                    self.queue(cmd)
        if cands:
            self.sched.after_scan([], set())

    def _resume_candidate(self) -> Request | None:
        """The oldest paused request tries a full resume on a real capacity event (not its own
        release), unless another request holds the recovery permit."""
        req = self.sched.oldest_paused()
        if req is None or self.sched.recovery is not None:
            return None
        return req if req.wake else None

    def _plan_resume(self, req: Request, plan: P.StepPlan, ctx: CycleCtx) -> None:
        """Full recovery permit: State, missing KV, tail, rebuild to the old frontier and the
        first real new unit — requested together. Own Snapshot first, else Replay."""
        target = req.replay_target or 0
        ledger_len = len(req.ledger)
        if req.snapshot is not None:
            route, adm = "snapshot", None
            source, mode, mover, start = req.snapshot, "move", f"seq:{req.sid}", req.snapshot.frontier
        else:
            route = "replay"
            adm = self.rm.plan_replay(req)
            req.source_cid = adm.source.cid if adm.source else None
            source = adm.source.ref if adm.source else None
            mode, mover, start = "fork", None, adm.frontier
        unit = next_unit(req, start, ledger_len, self.chunk)
        after = next_unit(req, max(start, target), ledger_len, self.chunk) if start < target else unit
        first = max(0, target - start) + (after.n_tokens if start < target else unit.n_tokens)
        spec = P.RowSpec(sid=req.sid, n_tokens=unit.n_tokens, kind=unit.kind, hold=True)
        plan.binds.append(P.BindSpec(sid=req.sid, source=source, mode=mode, first_tokens=first,
                                     mover=mover, unit=spec, rank=-1))
        ctx.binds.append((req, route, adm, unit))

    # ==== 5. process the reply ===========================================================
    def _process(self, reply: P.StepReply, ctx: CycleCtx) -> bool:
        """Interpret the reply; True if anything ran or was admitted."""
        for then, out in zip(ctx.pre, reply.pre):
            then(out)
        admitted: set[str] = set()
        for (req, route, adm, unit), out in zip(ctx.binds, reply.binds):
            if self._bound(req, route, adm, unit, out, ctx):
                admitted.add(req.rid)
        if ctx.fresh:
            self.sched.after_scan(ctx.fresh, admitted)
        for out in reply.rows:
            self._ran(out, ctx)
        if reply.chunk is not None:
            self._ran(reply.chunk, ctx)
            req = self.by_sid.get(reply.chunk.sid)
            if req is not None:
                self.sched.rotate(req)
        for sid, short in reply.chunk_short.items():
            req = self.by_sid.get(sid)
            if req is not None:
                ctx.short.append((req, short, "chunk"))
        return bool(admitted) or reply.chunk is not None or any(r.ran for r in reply.rows)

    def _bound(self, req: Request, route: str, adm: Admission | None, unit: Unit,
               out: P.BindOut, ctx: CycleCtx) -> bool:
        if not out.ok:
            if out.error:
                log.info("bind of %s refused: %s", req.rid, out.error)
                if adm is not None and adm.source is not None and "stale" in out.error:
                    # self-healing: the worker no longer has it; forget it and reselect
                    for cmd in self.rm.end_wait(req):
                        self.queue(cmd)
                    self.rm.on_deleted([adm.source.cid])
            if route == "fresh" and adm is not None and adm.cached and not out.error:
                for cmd in self.rm.wait_on(req, adm):      # keep the valuable source and wait
                    self.queue(cmd)
            if out.shortfall and not out.skipped:
                ctx.short.append((req, out.shortfall, "fresh" if route == "fresh" else "resume"))
            if route != "fresh":
                req.wake = False               # wait for the next real event (never spin)
            return False
        now = time.monotonic()
        req.sid = out.sid
        self.by_sid[out.sid] = req
        req.facts = out.facts
        req.phase = Phase.BINDING if out.tid is not None else Phase.RUNNING
        if out.tid is not None:
            self._tx[out.tid] = ("bind", req, frozenset())
        else:
            req.source_cid = None                          # bound: the source is in use no more
        self.sched.admit(req)
        if route == "fresh":
            if req.first_admitted is None:
                req.first_admitted = now
            self.rm.on_bound(req, adm)
            req.usage.cached_tokens = adm.cached
            for cmd in self.rm.end_wait(req):              # the adopted source is bound now
                self.queue(cmd)
        else:
            self.sched.recovery = req
            req.recovery_pending = True
            req.pauses[-1]["route"] = route
            req.pauses[-1]["resumed_at"] = now
            req.snapshot = None
            if route == "snapshot":
                self.stats.resumes_snapshot += 1
            else:
                self.stats.resumes_replay += 1
        ctx.units[out.sid] = (req, unit)
        return True

    def _ran(self, out: P.RowOut, ctx: CycleCtx) -> None:
        entry = ctx.units.get(out.sid)
        req = self.by_sid.get(out.sid)
        if entry is None or req is None:
            return
        _, unit = entry
        if out.facts is not None:
            req.facts = out.facts
        if out.error:
            self.fail(req, RuntimeError(f"execution failed: {out.error}"))
            return
        if not out.ran:
            if out.shortfall:
                ctx.short.append((req, out.shortfall, "row"))
            return
        account(req, unit)
        if unit.kind == "prefill" or (unit.kind == "decode" and not req.outputs):
            self.rm.observe_prefill(req, req.frontier - unit.n_tokens, req.frontier)
        if req.replay_target is not None and req.frontier >= req.replay_target:
            req.replay_target = None
        if unit.save_index is not None:
            self._saved(req, unit, out)
        if out.committed:
            index = len(req.outputs)
            req.note_tokens(out.committed, time.monotonic())
            self.sink(P.TokensEvent(req.rid, index, list(out.committed)))
        if req.recovery_pending and (out.committed or (unit.kind == "prefill")):
            self._recovered(req)           # only new progress ends the recovery permit
        if out.finish:
            req.finish_reason = out.finish

    def _saved(self, req: Request, unit: Unit, out: P.RowOut) -> None:
        """The unit ended on a save point: attach the capture, or count the skipped save."""
        sp = req.save_points.pop(unit.save_index)
        self.rm.retired(req, unit.retire)
        if out.captured is not None:
            for cmd in self.rm.on_captured(req, sp, out.captured):
                self.queue(cmd)
        elif out.capture_skipped or unit.declined:
            self.rm.on_skipped(sp)

    def _recovered(self, req: Request) -> None:
        req.recovery_pending = False
        if self.sched.recovery is req:
            self.sched.recovery = None
        self.queue(P.Settle(req.sid))      # return what is left of the recovery permit

    # ==== maintenance ====================================================================
    def stats_dict(self) -> dict:
        c, s = self.rm.stats, self.stats
        sched = self.sched
        return {
            "cache": {
                "queries": c.queries, "hits": c.hits, "queried_tokens": c.queried_tokens,
                "reused_tokens": c.reused_tokens, "hit_losses": c.lost_hits,
                "hit_loss_tokens": c.lost_tokens, "captures": c.captures,
                "captures_skipped": c.captures_skipped, "summary_hits": c.summary_hits,
                "records": len(self.rm.table.records), "public_entries": len(self.rm.table.entries),
                "checkpoints": len(self.rm.table.ckpts),
            },
            "prefill_tokens": s.prefill_tokens, "replay_tokens": s.replay_tokens,
            "bytes_h2d": self.bytes[0], "bytes_d2h": self.bytes[1],
            "pauses": {"snapshot": s.resumes_snapshot, "replay": s.resumes_replay},
            "preemptions": s.preemptions, "revocations": s.revocations,
            "capacity_errors": s.capacity_errors, "finished": s.finished,
            "cycles": s.cycles, "round_trips": s.steps, "cycle_s": s.cycle_s, "worker_s": s.worker_s,
            "running": len(sched.resident), "waiting": len(sched.fresh), "paused": len(sched.paused),
            "occupancy": {k: {"total": v.total, "available": v.available} for k, v in self.pools.items()},
            "host_free_bytes": self.host_free, "host_capacity_bytes": self.info.host_capacity,
        }

    def drop_caches(self) -> None:
        cmds = self.rm.drop_all()
        if cmds:
            self.call_commands(cmds)

    def check_integrity(self) -> None:
        """The worker's books balance, and the controller's mirror of checkpoint owners agrees
        with the worker's real holders (when no command is pending)."""
        idle = not self.requests and not self.tx_busy
        out, facts = self.call_commands([P.CheckIntegrity(idle=idle), P.Quote()])
        if isinstance(out, P.Failed):
            raise IntegrityError(out.message)
        if self._pending or self._completions:
            return
        real = {cid: set(c.owners) for cid, c in facts.facts.checkpoints.items() if c.kind == "cache"}
        mirror = {cid: set(info.owners) for cid, info in self.rm.table.ckpts.items()}
        if real != mirror:
            diff = {cid: (real.get(cid), mirror.get(cid)) for cid in set(real) | set(mirror)
                    if real.get(cid) != mirror.get(cid)}
            raise IntegrityError(f"controller mirror and worker disagree on checkpoint owners: {diff}")
