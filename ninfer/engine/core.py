"""EngineCore: the controller's single control thread (seed: Engine 周期). It keeps the request
books and the transaction books, builds each cycle's plan from the policy's decisions, talks to
the worker and publishes outputs. It decides no rule itself:

    who runs, in which order, with which bounds      Scheduler        (policy/scheduler.py)
    sources, records, save points, evidence          ResourceManager  (policy/resources.py)
    remedies of a short permit, victims, pause       Pressure         (policy/pressure.py)
      routes, the capacity contract, when a cycle
      needs a quote, where each save's room comes from
    reclaim ranking and admission                    Planner          (policy/reclaim.py)
    the next unit of a request                       units.py
    the cycle's intents                              planning.py
    what a reply means for the books                 outcomes.py

One cycle, steady state one round trip::

    lifecycle (terminal, cancelled, timed out) -> plan -> [pressure: a quote (commands run
    first), remedies on the short intents] -> step (the worker: progress point 1, commands,
    intents, point 2, Control/Decode, point 3, the prefill turn) -> outcomes

Test seam: ``preempt(rid)`` pauses one resident as the chain would (route by Host room).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable

import msgspec

from ninfer import protocol as P
from ninfer.config import EngineConfig
from ninfer.engine.books import CommandQueue, EngineStats, FreezeFollow, PauseFollow, RequestBook, TxBook
from ninfer.engine.facts_mirror import FactsMirror
from ninfer.engine.monitor import RuleMonitor
from ninfer.engine.outcomes import Outcomes
from ninfer.engine.planning import CyclePlanner, Plan
from ninfer.engine.request import Request
from ninfer.engine.telemetry import Telemetry
from ninfer.engine.throughput import EngineSnapshot, EngineSummary
from ninfer.errors import ErrorKind, IntegrityError, RequestError
from ninfer.policy.pressure import Pressure, Settlement
from ninfer.policy.reclaim import Planner
from ninfer.policy.resources import ResourceManager
from ninfer.policy.scheduler import Scheduler
from ninfer.protocol import FinishReason, Life, Phase, RequestSpec

log = logging.getLogger("ninfer.engine")

HOST_WINDOW = 32         # Host candidates a scoped quote carries first
WIDEN = 4                # ... then 4x as many while they do not suffice, the whole directory last
STALL_CYCLES = 3         # cycles without any progress and nothing in flight before the oldest fails


class EngineCore:
    def __init__(self, client, config: EngineConfig, sink: Callable[[P.Event], None]):
        self.client = client
        self.config = config
        self.info = client.info()
        self.sink = sink
        self.chunk = self.info.prefill_chunk_tokens
        self.sched = Scheduler(self.info.max_concurrency)
        self.rm = ResourceManager(self.info, divergence_min=config.context_cache.divergence_min_tokens,
                                  anticipate=config.context_cache.anticipate)
        if self.info.h2d_bytes_per_s or self.info.prefill_s_per_token:   # measured by the worker at start
            self.rm.cost.calibrate(self.info.h2d_bytes_per_s, self.info.prefill_s_per_token)
        self.pressure = Pressure(self.sched, self.rm, self.info)
        self.facts_mirror = FactsMirror()       # the last quote, complete: the next one comes as a delta
        self.books = RequestBook(sink)
        self.requests, self.by_sid, self.life = self.books.requests, self.books.by_sid, self.books.life
        self.txs = TxBook()                     # transactions: parts, the running one, its first sight
        self.cmdq = CommandQueue()              # commands decided between cycles
        self.stats = EngineStats()
        self.telemetry = Telemetry()           # latency histograms and token counters
        self.planner = CyclePlanner(self.sched, self.rm, self.chunk,
                                    inner=config.context_cache.inner_saves and self.info.inner_cuts)
        self.outcomes = Outcomes(self.sched, self.rm, self.books, self.txs, self.cmdq, self.stats, self.telemetry,
                                 self.info.image_bytes)
        self._tickets = itertools.count()
        self._steps = itertools.count(1)
        # mirrors of the last reply
        self.pools: dict[str, P.PoolState] = {}
        self.host_free = 0
        self.host_largest = 0
        self.host_images = 0
        self.host_kv_pages = 0
        self.bytes = (0, 0)
        self.faults_fired: dict[str, int] = {}
        self.spec: P.SpecStats | None = None
        self.vision: P.VisionStats | None = None
        self.graphs: P.GraphStats | None = None
        self.structured: P.StructuredStats | None = None
        self._stuck = 0
        self.summary = EngineSummary(config.log_stats_interval_s, self.snapshot())
        # the seed's rules as invariants, checked every cycle (the test suite turns it on)
        self.monitor = RuleMonitor() if os.environ.get("NINFER_RULE_MONITOR") == "1" else None

    # ==== intake =========================================================================
    def add(self, spec: RequestSpec, queued_at: float | None = None, carry: Request | None = None) -> Request:
        """Queue a request (the frontend validated it: bad input never reaches the core); a
        request id already in use raises RequestError for it alone. ``queued_at``: when the
        controller accepted it (its intake; default now). ``carry``: the record of this
        request in a core that lost its worker — its arrival and published moments go on."""
        rid = spec.rid or f"req-{next(self._tickets)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        req = Request(spec=spec, rid=rid, ticket=next(self._tickets))
        if carry is not None:
            req.arrival, req.life, req.published = carry.arrival, carry.life, carry.published
        elif queued_at is not None:
            req.arrival = min(queued_at, req.arrival)
        req.usage.prompt_tokens = len(spec.prompt)
        self.requests[rid] = req
        self.rm.on_enqueued(req, self.requests)
        self.life.publish(req, Life.QUEUED, req.arrival)
        self.life.publish(req, Life.GENERATION_START, ticket=req.ticket)
        self.sched.enqueue(req)
        return req

    def cancel(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None and req.finish_reason is None:
            req.cancel_requested = True

    # ==== the cycle ======================================================================
    @property
    def tx_busy(self) -> bool:
        return self.txs.busy

    def busy(self) -> bool:
        return bool(self.requests) or bool(self.cmdq) or self.tx_busy

    def cycle(self) -> bool:
        """One engine cycle; returns False when there was nothing to do (the caller waits for
        the next real event: a transfer completion, a new request) — never a silent stall."""
        self.summary.tick(self.snapshot)
        if self.monitor is not None:
            self.monitor.begin(self)
        cmds = self._lifecycle()
        if self._overdue():
            cmds.append((P.Overdue(), None))
        self.outcomes.expire_pending_waits()
        books = self.monitor.books(self) if self.monitor is not None else None
        plan = self.planner.build(self.host_kv_pages)
        if self.monitor is not None:
            self.monitor.unchanged(self, books, "planning")
            self.monitor.planned(self, plan)
        cmds += self.outcomes.book_waits(plan.waits)
        if not cmds and not plan.items and plan.take_back is None:
            if self.tx_busy:        # advance the transaction only (woken by its completion)
                return self.outcomes.apply(self._send(P.StepPlan(next(self._steps))), Plan(), [])
            return self._guard_progress(False)
        self.stats.cycles += 1
        t0 = time.perf_counter()
        progressed = False
        if self._needs_quote(plan):
            progressed = self._quote_and_settle(plan, cmds)
            cmds = []                         # the quote step sent them
        if self.monitor is not None:
            self.monitor.settled(self, plan)
        reply = self._send(P.StepPlan(next(self._steps), commands=[c for c, _ in cmds], intents=plan.intents()))
        progressed = self.outcomes.apply(reply, plan, cmds) or progressed
        if self.monitor is not None:
            self.monitor.ended(self, plan, reply)
        self.stats.cycle_s += time.perf_counter() - t0
        return self._guard_progress(progressed)

    def idle(self) -> None:
        """The control loop found nothing to do: bookkeeping the next admission would otherwise
        do on its own path, done now (the Host order's marks, ~1 ms after a busy cycle; a trace's
        engine is idle most of the time between arrivals). No decision is taken here."""
        self.rm.fold_marks()

    def _needs_quote(self, plan: Plan) -> bool:
        return self.pressure.needs_quote(plan.needs(), len(plan.captures()), self.pools, self.host_images,
                                         plan.take_back is not None)

    def _quote_and_settle(self, plan: Plan, cmds) -> bool:
        """The quote step (it runs the lifecycle commands first) and the pressure settle on
        its facts. The quote is scoped — the Device's content plus a window of the best Host
        candidates the records rank (O(Device capacity + window), never the directory); when a
        Host placement found no admissible victims inside the window, the facts are quoted again
        without a window (no commands this time) and the plan is settled again from scratch."""
        k = HOST_WINDOW
        window = self._host_window(k)
        reply = self._quote(P.StepPlan(next(self._steps), commands=[c for c, _ in cmds], quote=True,
                                       demands=plan.queries(), host_window=window))
        progressed = self.outcomes.apply(reply, Plan(), cmds)
        while True:
            settlement = self._settle(plan, reply)
            if not settlement.window_short or window is None or not reply.facts.partial:
                break
            # the window did not place it: a window WIDEN times wider, the whole directory only
            # once the window would hold it all (a Host placement ranks every candidate of its
            # quote for every victim it adds: over the whole directory that cost grows with the
            # cache — 48 s cycles with a full 256 MiB Host in the trace bench)
            k = max(k, 1) * WIDEN
            window = self._host_window(k) if k < len(self.rm.host_order) else None
            self.stats.wide_quotes += 1
            reply = self._quote(P.StepPlan(next(self._steps), quote=True, demands=plan.queries(), host_window=window))
            progressed = self.outcomes.apply(reply, Plan(), []) or progressed
        plan.settle(settlement)          # the lane take-back too: it leads the resume's remedies
        self.outcomes.evidence_used(settlement.evidence)
        return progressed

    def _quote(self, plan: P.StepPlan) -> P.StepReply:
        """A quote step, its facts asked as a delta against the last quote and completed."""
        plan.facts_base = self.facts_mirror.base
        reply = self._send(plan)
        reply.facts = self.facts_mirror.complete(reply.facts)
        return reply

    def _host_window(self, k: int) -> list[int]:
        """The best ``k`` Host candidates the records rank, and every pause snapshot (few: one per
        paused request; candidates of their own rank)."""
        return self.rm.host_window(k) + [r.snapshot.cid for r in self.sched.paused if r.snapshot is not None]

    def _settle(self, plan: Plan, reply: P.StepReply) -> Settlement:
        """Pressure's settlement of the plan on a quote's facts (pure: the rule monitor checks
        that it leaves the books as they were): remedies and on-short pauses on the intents, the
        capacity contract, the lane take-back's route, the saves' admitted room."""
        plan.drop_dead()
        books = self.monitor.books(self) if self.monitor is not None else None
        s = self.pressure.settle_cycle(plan.needs(), reply.facts, reply.demands, reply.tx is not None, plan.keep,
                                       plan.take_back, plan.saves(), plan.sources | plan.keep)
        if self.monitor is not None:
            self.monitor.unchanged(self, books, "settling")
        return s

    def _send(self, plan: P.StepPlan) -> P.StepReply:
        self.stats.steps += 1
        reply = self.client.step(plan)
        self.stats.worker_s += reply.worker_s
        self.pools = reply.pools
        self.host_free = reply.host_free
        self.host_largest = reply.host_largest
        self.host_images = reply.host_images
        self.host_kv_pages = reply.host_kv_pages
        if reply.placement:
            self.rm.placed(reply.placement)
        self.bytes = (reply.bytes_h2d, reply.bytes_d2h)
        self.faults_fired = reply.faults_fired
        self.spec = reply.spec
        self.vision = reply.vision
        self.graphs = reply.graphs
        self.structured = reply.structured or self.structured
        self.txs.observe(reply.tx, time.monotonic())
        return reply

    def call_commands(self, cmds: list[P.Command]) -> list[P.CommandOut]:
        """A synchronous side round trip (maintenance, tests)."""
        reply = self._send(P.StepPlan(next(self._steps), commands=cmds))
        self.outcomes.apply(reply, Plan(), [(c, None) for c in cmds])
        return reply.commands

    def _overdue(self) -> bool:
        """A transaction whose completion never came (dropped) is settled after a timeout."""
        return self.txs.overdue(time.monotonic(), self.config.completion_timeout_s)

    # rule: progress-guard
    def _guard_progress(self, progressed: bool) -> bool:
        """No wait is unbounded: when nothing ran, nothing changed and nothing is in flight
        although requests remain, every waiter is woken once; if still nothing can move, the
        oldest request fails with the capacity contract instead of waiting for a releaser
        that does not exist. (A policy gap: ``stats.stalls`` counts it.)"""
        if progressed or self.tx_busy or not self.requests:
            self._stuck = 0
            return progressed
        self._stuck += 1
        if self._stuck == 1:
            self.sched.event()
            return True
        if self._stuck >= STALL_CYCLES:
            self._stuck = 0
            contract = self.pressure.stalled(self.requests.values())
            if contract is not None:
                self.stats.stalls += 1
                self.stats.capacity_errors += 1
                log.warning("no request can progress; failing the oldest (%s)", contract.rid)
                self.fail(self.requests[contract.rid], ErrorKind.CAPACITY_CONTRACT, contract.message)
                return True
        return False

    # ==== lifecycle ======================================================================
    def _lifecycle(self) -> list[tuple[P.Command, object]]:
        cmds = self.cmdq.take()
        timeout = self.config.request_timeout_s
        now = time.monotonic()
        for req in list(self.requests.values()):
            # rule: ingress-timeout
            if (timeout is not None and req.first_admitted is None and req.finish_reason is None
                    and now - req.arrival > timeout):
                # ingress timeout: counted from the original arrival until first admission; a
                # later pause does not restart it
                req.error = P.Failure(ErrorKind.TIMEOUT, f"not admitted within {timeout} s")
                req.finish_reason = FinishReason.ERROR
            if req.cancel_requested and req.finish_reason is None:
                self._end(req, FinishReason.CANCELLED, cmds)
            elif req.finish_reason is not None and req.finished_at is None:
                self._end(req, req.finish_reason, cmds)
        return cmds

    def _end(self, req: Request, reason: FinishReason, cmds: list) -> None:
        """Terminal: freeze a normal finish as the record's E, release everything else."""
        req.finish_reason = reason
        costs = self._costs(req)               # read before the records are released
        owner = self.rm.e_owner(req)
        if (req.sid is not None and req.phase is Phase.RUNNING and owner is not None
                and reason in (FinishReason.STOP, FinishReason.LENGTH)):
            cmds.append((P.Freeze(req.sid, owner), FreezeFollow(req)))
        else:
            if req.sid is not None:
                cmds.append((P.Release(req.sid), None))
            self.outcomes.release_records(req)
        self._finish(req, costs)

    def _costs(self, req: Request) -> tuple[float, dict | None]:
        return self.rm.source_wait_s(req), self.rm.lost_point(req)

    def _finish(self, req: Request, costs: tuple[float, dict | None] | None = None) -> None:
        """Terminal publication: the ``finished`` moment, the request's summary line, then its
        FinalEvent (whose timings are derived from the published events)."""
        wait, lost = costs if costs is not None else self._costs(req)
        req.finished_at = time.monotonic()
        self.life.publish(req, Life.FINISHED, req.finished_at, finish_reason=req.finish_reason,
                          error=req.error.kind if req.error is not None else None, max_output_gap_s=req.max_gap,
                          source_wait_s=wait)
        timings = self.life.timings(req)
        self.life.summary(req, timings, lost)
        self.books.move(req, Phase.FINISHED)
        self.sched.remove(req)
        self.books.close(req)
        self.stats.finished += 1
        self.stats.prefill_tokens += req.usage.prefill_tokens
        self.stats.replay_tokens += req.usage.replay_tokens
        u = req.usage
        u.completion_tokens = len(req.outputs)
        self.telemetry.finished_request(req, timings)
        self.sink(P.FinalEvent(
            rid=req.rid, finish_reason=req.finish_reason, token_ids=list(req.outputs),
            usage=msgspec.structs.replace(u),          # a copy: the record's own stays with it
            timings=timings,
            pauses=list(req.pauses), error=req.error, prompt_token_ids=list(req.prompt),
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=[None, *req.prompt_logprobs] if req.params.prompt_logprobs is not None else None))

    def fail(self, req: Request, kind: ErrorKind, message: str) -> None:
        """Fail one request with a clear error (it alone); its books close next cycle."""
        self.books.fail(req, kind, message)

    # ==== test seam ======================================================================
    def snapshot(self) -> EngineSnapshot:
        """The engine's counters and state for the periodic summary."""
        s, c = self.stats, self.rm.stats
        counters = {"prefill": s.tokens_prefilled, "replay": s.tokens_replayed, "generated": s.tokens_generated,
                    "hits": c.hits, "queries": c.queries, "hit_losses": c.lost_hits,
                    "h2d": self.bytes[0], "d2h": self.bytes[1], "preemptions": s.preemptions,
                    "finished": s.finished, "controller_s": s.cycle_s - s.worker_s, "round_trips": s.steps,
                    "protocol_bytes": self.protocol_bytes()}
        return EngineSnapshot(counters, bool(self.requests), len(self.sched.resident), len(self.sched.fresh),
                              len(self.sched.paused), self.info.host_capacity, self.host_free,
                              dict(c.lost_by_cause), s.stalls)

    def protocol_bytes(self) -> int:
        """Bytes of protocol messages to and from the worker so far (when the transport counts)."""
        return getattr(self.client, "bytes_out", 0) + getattr(self.client, "bytes_in", 0)

    def preempt(self, rid: str) -> None:
        """Pause one resident now, as the preemption chain would (Snapshot to the Host when it
        fits there, else destructive). For scenario tests that need a pause at a known point."""
        req = self.requests[rid]
        [out] = self.call_commands([P.Quote()])
        planner = Planner(out.facts, self.rm.table, self.pressure.protected(req), lambda o: False)
        to_host, victims = self.pressure.pause_route(req, planner, out.facts)
        cmd = P.Pause(req.sid, to_host, victims)
        reply = self._send(P.StepPlan(next(self._steps), commands=[cmd]))
        self.outcomes.apply(reply, Plan(), [(cmd, PauseFollow(req, tuple(victims), "forced"))])

    # ==== maintenance ====================================================================
    def stats_dict(self) -> dict:
        c, s = self.rm.stats, self.stats
        sched = self.sched
        return {
            "cache": {
                "queries": c.queries, "hits": c.hits, "queried_tokens": c.queried_tokens,
                "reused_tokens": c.reused_tokens, "hit_losses": c.lost_hits,
                "hit_loss_tokens": c.lost_tokens, "hit_losses_by_cause": dict(c.lost_by_cause),
                "captures": c.captures,
                "captures_skipped": c.captures_skipped,
                "captures_skipped_with_room": s.captures_skipped_with_room,
                "summary_hits": c.summary_hits, "waits": c.waits,
                "pending_waits": c.pending_waits, "pending_saved_tokens": c.pending_saved_tokens,
                "pending_wait_s": c.pending_wait_s, "pending_abandoned": c.pending_abandoned,
                "records": len(self.rm.table.records), "public_entries": len(self.rm.table.entries),
                "checkpoints": len(self.rm.table.ckpts),
            },
            "prefill_tokens": s.prefill_tokens, "replay_tokens": s.replay_tokens,
            "protocol_bytes": self.protocol_bytes(),
            "bytes_h2d": self.bytes[0], "bytes_d2h": self.bytes[1],
            "pauses": {"snapshot": s.resumes_snapshot, "replay": s.resumes_replay},
            "preemptions": s.preemptions, "revocations": s.revocations, "take_backs": s.take_backs,
            "wide_quotes": s.wide_quotes,
            "capacity_errors": s.capacity_errors, "copy_failures": s.copy_failures,
            "device_errors": s.device_errors, "stalls": s.stalls, "finished": s.finished,
            "cycles": s.cycles, "round_trips": s.steps, "cycle_s": s.cycle_s, "worker_s": s.worker_s,
            "running": len(sched.resident), "waiting": len(sched.fresh), "paused": len(sched.paused),
            "occupancy": {k: {"total": v.total, "available": v.available} for k, v in self.pools.items()},
            "host_free_bytes": self.host_free, "host_capacity_bytes": self.info.host_capacity,
            "faults_fired": dict(self.faults_fired), "host_largest_free_bytes": self.host_largest,
            "telemetry": self.telemetry.snapshot(),
            "speculative": self.spec.as_dict() if self.spec is not None else None,
            "vision": self.vision.as_dict() if self.vision is not None else None,
            "graphs": self.graphs.as_dict() if self.graphs is not None else None,
            "structured": self.structured.as_dict() if self.structured is not None else None,
            "cost_model": {"h2d_bytes_per_s": self.rm.cost.h2d_bytes_per_s,
                           "prefill_s_per_token": self.rm.cost.prefill_s_per_token,
                           "calibrated": bool(self.info.h2d_bytes_per_s or self.info.prefill_s_per_token)},
        }

    def drop_caches(self) -> None:
        cmds = self.rm.drop_all()
        if self.info.vision_merge:
            cmds = [*cmds, P.DropEncoderCache()]
        if cmds:
            self.call_commands(cmds)

    def check_integrity(self) -> None:
        """The worker's books balance, and the controller's mirror of checkpoint owners agrees
        with the worker's real holders (when no command is pending)."""
        idle = not self.requests and not self.tx_busy
        out, facts = self.call_commands([P.CheckIntegrity(idle=idle), P.Quote()])
        if isinstance(out, P.Failed):
            raise IntegrityError(out.message)
        if self.cmdq:
            return
        real = {cid: set(c.owners) for cid, c in facts.facts.checkpoints.items() if c.kind is P.CkptKind.CACHE}
        mirror = {cid: set(info.owners) for cid, info in self.rm.table.ckpts.items()}
        if real != mirror:
            diff = {cid: (real.get(cid), mirror.get(cid)) for cid in set(real) | set(mirror)
                    if real.get(cid) != mirror.get(cid)}
            raise IntegrityError(f"controller mirror and worker disagree on checkpoint owners: {diff}")
        why = self.rm.host_order.check({cid: c.image_device for cid, c in facts.facts.checkpoints.items()}) \
            or self.rm.check(set(self.requests))
        if why:
            raise IntegrityError(why)
