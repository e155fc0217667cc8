"""The GPU worker as a plain class: it holds the Program and executes one ``StepPlan`` per call.

It decides nothing. Every order, budget, victim and route comes in the plan; the worker
verifies against physical truth and executes, in this order:

    progress point 1   publish (or abort) the context transaction if its completion came
    commands           in plan order
    intents            in plan order; a guard that holds skips one; a short permit commits
                       the smallest prefix of its remedies that covers the gap now (else one
                       that covers it once its copies publish: WAIT; else none), then its
                       on_short pause if still short
    progress point 2   binds whose read-back published here run their first unit now
    Control/Decode     one compact batch of the permitted units of at most one token
    progress point 3
    prefill turn       the one multi-token unit (its permit refreshed if it was short)

and answers with typed outcomes keyed by intent id. A forward error fails the rows of that
call alone; a copy error arrives as an aborted transaction. The Ray actor and the in-process
transport wrap exactly this class.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ninfer import protocol as P
from ninfer.config import EngineConfig
from ninfer.faults import Fault, FaultInjected, FaultPlan
from ninfer.native import reclaim
from ninfer.native.heap import keep_freed_memory
from ninfer.native.layout import resolve_layout
from ninfer.native.model.config import load_eos_ids
from ninfer.native.model.model import HybridModel
from ninfer.native.objects import Checkpoint, Sequence
from ninfer.native.program import CaptureDest, NativeError, PauseResult, Program, TxSettled, UnitRow
from ninfer.native.stores import IntegrityError
from ninfer.native.threads import on_own_thread
from ninfer.native.threads import pin as pin_threads
from ninfer.placement import place_first_fit

log = logging.getLogger("ninfer.worker")


class WorkerDeath(Exception):
    """An injected worker death (``faults``): the hosting process must die here."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def ckpt_ref(ck: Checkpoint | None) -> P.CkptRef | None:
    if ck is None:
        return None
    return P.CkptRef(ck.cid, ck.generation, ck.frontier, ck.kind, ck.image.slot is not None,
                     ck.image.host is not None)


def _settled(r: TxSettled, point: int) -> P.Settled:
    return P.Settled(r.tid, r.generation, r.ok, point, r.error, r.failed_sids, r.lost_cids)


def _pause_out(sid: int, r: PauseResult) -> P.PauseOut:
    return P.PauseOut(sid, ckpt_ref(r.snapshot), r.tid, r.freed)


def load_vision_tower(model_dir: str | Path, model: HybridModel, device):
    """The Qwen3.5 vision tower when config.json has a ``vision_config`` (strict loading), with
    its spatial merge size; (None, 0) for a text-only model."""
    import json
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if not isinstance(raw.get("vision_config"), dict):
        return None, 0
    from ninfer.native.model.vision import VisionTower, parse_vision_config
    vcfg = parse_vision_config(raw)
    return VisionTower.load(model_dir, vcfg, model.dtype, device), vcfg.spatial_merge_size


class Worker:
    def __init__(self, model_dir: str | Path, config: EngineConfig, notify: Callable[[], None] | None = None,
                 faults: list[Fault] | None = None):
        self.threads = config.cpu_threads
        device = pick_device(config.device)
        if device.type == "cpu":
            keep_freed_memory()     # the forward's temporaries reuse freed memory (native/heap.py)
            # built and calibrated on a thread of its own at ``cpu_threads``, which then exits: an
            # OpenMP team left on the caller's thread would put the process over its cores, and
            # libgomp then lets the forward's team sleep between ops instead of spinning (measured,
            # 2 threads on 2 cores: 4.3k tokens/s instead of 13.6k). The caller's own count is untouched.
            on_own_thread(lambda: self._build(model_dir, config, notify, faults, device), self.threads,
                          "ninfer-worker-build")
        else:
            pin_threads(self.threads)
            self._build(model_dir, config, notify, faults, device)

    def _build(self, model_dir: str | Path, config: EngineConfig, notify: Callable[[], None] | None,
               faults: list[Fault] | None, device: torch.device) -> None:
        model = HybridModel.load(model_dir, config.dtype, device)
        self.eos_ids = load_eos_ids(model_dir, model.cfg)
        self.faults = FaultPlan(config.faults if faults is None else faults)
        self.facts_sender = reclaim.FactsSender()       # quotes go out as deltas against the last one
        tower, merge = load_vision_tower(model_dir, model, device)
        self.prog = Program(model, resolve_layout(model.cfg, config, device), self.faults, config.copy_engine,
                            tower, merge, config.context_cache.encoder_cache_bytes, config.enforce_eager)
        if notify is not None:
            self.prog.transfers.on_done = notify
        self._held = 0
        if config.prefill_chunk_tokens == "auto":
            self.prog.size_chunk()
        self.calibration = self.prog.calibrate() if config.cost_calibration else (0.0, 0.0)

    # ---- info ---------------------------------------------------------------------------
    def info(self) -> P.WorkerInfo:
        lay, cfg = self.prog.layout, self.prog.model.cfg
        return P.WorkerInfo(
            protocol=P.PROTOCOL_VERSION, model_type=cfg.model_type, vocab_size=cfg.vocab_size,
            max_context=lay.max_context, eos_ids=list(self.eos_ids), max_concurrency=lay.max_concurrency,
            kv_pages=lay.main_pages, state_slots=lay.state_slots, page_bytes=self.prog.page_bytes,
            image_bytes=self.prog.image_bytes, host_capacity=lay.host_capacity_bytes,
            prefill_chunk_tokens=lay.prefill_chunk_tokens, exec_identity=self.prog.exec_identity,
            dtype=lay.dtype, h2d_bytes_per_s=self.calibration[0], prefill_s_per_token=self.calibration[1],
            vision_merge=self.prog.vision_merge, inner_cuts=self.prog.inner_cuts,
        )

    def handle(self, data: bytes) -> bytes:
        """The wire entry point: bytes in, bytes out (same for every transport). The forward runs on
        the caller's thread (the control thread in process, the step channel's in the actor):
        ``cpu_threads`` torch threads there, whatever another thread set (``native/threads.py``)."""
        if torch.get_num_threads() != self.threads:
            pin_threads(self.threads)
        return P.encode(self.step(P.decode_plan(data)))

    def wait(self, timeout: float) -> None:
        """Block (no spinning) until a transfer completion is ready or ``timeout`` passes."""
        self.prog.wait_transfers(timeout)

    def shutdown(self) -> None:
        self.prog.shutdown()

    # ---- one step -----------------------------------------------------------------------
    def step(self, plan: P.StepPlan) -> P.StepReply:
        t0 = time.perf_counter()
        self._die("before_execute")
        reply = P.StepReply(seq=plan.seq)
        run = _StepRun(self, reply)
        run.progress(1)
        reply.commands = [self._command(c, reply) for c in plan.commands]
        for intent in plan.intents:
            reply.intents.append(run.intent(intent))
        run.progress(2)
        run.execute(decode=True)
        run.progress(3)
        run.execute(decode=False)
        run.report_unrun()
        if self.prog.tx is not None:
            self._die("mid_transaction")
        self._die("after_execute")
        if plan.quote:
            reply.facts = self.facts_sender.send(reclaim.quote(self.prog, plan.host_window), plan.facts_base)
            reply.demands = {q.iid: self._demand(q) for q in plan.demands}
        self._pools(reply)
        reply.worker_s = time.perf_counter() - t0
        return reply

    def _die(self, point: str) -> None:
        if self.faults.fire("worker_death", point):
            raise WorkerDeath(f"injected worker death ({point})")
        hang = self.faults.fire("worker_hang", point)
        if hang is not None:
            time.sleep(hang.seconds)

    def seq_facts(self, seq: Sequence) -> P.SeqFacts:
        return P.SeqFacts(frontier=seq.frontier, ledger_len=len(seq.ledger), blocks=len(seq.blocks[P.MAIN]),
                          tail_ok=self.prog.tail_ok(seq), reserved=seq.reservation.amounts.get(P.MAIN, 0),
                          spec=self.prog.spec_peak(seq, 1))

    def checkpoint(self, cid: int, generation: int) -> Checkpoint | None:
        return self.prog.checkpoint(cid, generation)

    def retires(self, retire: list[P.Retire]) -> list[tuple[Checkpoint, P.Owner]]:
        return [(ck, r.owner) for r in retire if (ck := self.checkpoint(r.cid, r.generation)) is not None]

    def _demand(self, q: P.DemandQuery) -> dict[str, int]:
        """Read-only: what an intent would need now."""
        prog = self.prog
        if not q.bind:
            seq = prog.sequences.get(q.sid)
            return prog.seq_demand(seq, q.n_tokens) if seq is not None else {}
        src = self.checkpoint(q.source.cid, q.source.generation) if q.source is not None else None
        if q.source is not None and src is None:
            return {}
        return prog.bind_demand(q.sid or -1, src, q.mode, q.first_tokens)

    def _pools(self, reply: P.StepReply) -> None:
        prog = self.prog
        reply.pools = {k: P.PoolState(p.size, p.available) for k, p in prog.pools.items()}
        reply.host_free = prog.host.free_bytes
        reply.host_largest = prog.host.largest_free()
        reply.host_images = prog.host.fits_count(prog.image_bytes)
        reply.placement = prog.placement_changes()
        reply.host_kv_pages = prog.host_only_pages
        reply.tx = P.TxRef(prog.tx.tid, prog.tx.generation) if prog.tx is not None else None
        reply.bytes_h2d, reply.bytes_d2h = prog.bytes_h2d, prog.bytes_d2h
        reply.faults_fired = self.faults.fired()
        reply.spec = prog.spec.stats if prog.spec is not None else None
        reply.uncovered = prog.take_uncovered()
        reply.vision = prog.encoder.stats if prog.encoder is not None else None
        reply.graphs = prog.graphs.stats if prog.graphs is not None else None
        g = prog.grammar_stats
        reply.structured = P.StructuredStats(g.requests, g.masks, g.mask_s, g.rebuilt) if g is not None else None

    # ---- commands -----------------------------------------------------------------------
    def _command(self, c, reply: P.StepReply) -> P.CommandOut:
        try:
            return self._run(c, reply)
        except (NativeError, IntegrityError) as exc:
            return P.Failed(str(exc))

    def _run(self, c, reply: P.StepReply) -> P.CommandOut:
        prog = self.prog
        if isinstance(c, P.NewSeq):
            seq = prog.new_sequence(P.unpack_tokens(c.tokens), c.prompt_len, c.params, self.eos_ids, c.media)
            return P.SeqCreated(seq.sid, seq.generation)
        if isinstance(c, P.DropEncoderCache):
            if prog.encoder is not None:
                prog.encoder.clear()
            return P.Ack()
        if isinstance(c, P.Pause):
            seq = self._bound(c.sid)
            return _pause_out(c.sid, prog.pause(seq, c.to_host, c.host_victims))
        if isinstance(c, P.Freeze):
            return P.CkptOut(ckpt_ref(prog.freeze(self._bound(c.sid), c.owner)))
        if isinstance(c, P.Release):
            seq = prog.sequences.get(c.sid)
            if seq is not None:
                prog.release(seq)
            return P.Ack(seq is not None)
        if isinstance(c, P.AddOwner):
            ck = self.checkpoint(c.cid, c.generation)
            if ck is None:
                raise NativeError(f"checkpoint {c.cid} is gone (stale reference)")
            prog.add_owner(ck, c.owner)
            return P.Ack()
        if isinstance(c, P.ReleaseOwner):
            ck = self.checkpoint(c.cid, c.generation)
            if ck is None or c.owner not in ck.owners:
                return P.Ack(False)
            return P.Ack(prog.release_owner(ck, c.owner))
        if isinstance(c, P.Overdue):
            done = prog.overdue()
            reply.settled += [_settled(r, 1) for r in done]
            return P.CompletionsOut([P.TxRef(r.tid, r.generation) for r in done])
        if isinstance(c, P.Commit):
            return P.CommitOut(prog.apply(c.actions))
        if isinstance(c, P.Quote):
            return P.FactsOut(reclaim.quote(prog))
        if isinstance(c, P.CheckIntegrity):
            prog.check_integrity(idle=c.idle)
            return P.Ack()
        if isinstance(c, P.Settle):
            seq = prog.sequences.get(c.sid)
            if seq is not None:
                prog.settle(seq)
            return P.Ack(seq is not None)
        if isinstance(c, P.HoldPages):
            return P.Ack(self._hold(c.pages))
        raise NativeError(f"unknown command {type(c).__name__}")

    def _bound(self, sid: int) -> Sequence:
        seq = self.prog.sequences.get(sid)
        if seq is None or seq.phase is not P.Phase.RUNNING:
            raise NativeError(f"sequence {sid} is not bound")
        return seq

    def _hold(self, pages: int) -> bool:
        """Test hook: an outside party keeps ``pages`` Main pages reserved."""
        pool = self.prog.pools[P.MAIN]
        if self._held:
            pool.unreserve(self._held)
            self._held = 0
        if pages and pool.reserve(pages):
            self._held = pages
        return self._held == pages


class _StepRun:
    """The state of one step: outcomes by intent id and the units permitted so far."""

    def __init__(self, worker: Worker, reply: P.StepReply):
        self.w = worker
        self.prog = worker.prog
        self.reply = reply
        self.outcomes: dict[int, P.Outcome] = {}
        self.units: list[tuple[int, P.UnitSpec, Sequence, bool]] = []    # (iid, unit, seq, permitted)
        self.ran: set[int] = set()

    def progress(self, point: int) -> None:
        self.reply.settled += [_settled(r, point) for r in self.prog.progress()]

    # ---- intents ------------------------------------------------------------------------
    def _skipped(self, guards: list[P.Guard]) -> bool:
        ok = P.Outcome.OK
        for g in guards:
            if (not any(self.outcomes.get(i) is ok for i in g.unless_ok)
                    and sum(1 for i in g.ok_among if self.outcomes.get(i) is ok) >= g.at_least):
                return True
        return False

    def intent(self, it: P.Intent) -> P.IntentOut:
        if self._skipped(it.guards):
            out = P.IntentOut(it.iid, P.Outcome.SKIPPED)
        else:
            try:
                out = self._row(it) if isinstance(it, P.RowIntent) else self._bind(it)
            except (NativeError, IntegrityError) as exc:
                log.exception("intent %d failed", it.iid)
                out = P.IntentOut(it.iid, P.Outcome.FAILED, detail=str(exc))
        self.outcomes[it.iid] = out.outcome
        return out

    def _row(self, it: P.RowIntent) -> P.IntentOut:
        seq = self.prog.sequences.get(it.sid)
        if seq is None or seq.phase is not P.Phase.RUNNING:
            return P.IntentOut(it.iid, P.Outcome.REFUSED, P.Refusal.NOT_BOUND, detail=f"sequence {it.sid} is not bound")
        out = P.IntentOut(it.iid, P.Outcome.OK)
        n = it.unit.n_tokens
        out.outcome = self._permit(lambda: self.prog.seq_demand(seq, n), {}, it.remedies, out)
        if out.outcome is P.Outcome.OK:
            if self.prog.reserve_unit(seq, n):
                raise NativeError(f"the permit of sequence {seq.sid} fell short after it was covered")
            self.units.append((it.iid, it.unit, seq, True))
        elif out.outcome is P.Outcome.SHORT and it.on_short is not None:
            p = it.on_short
            out.paused = _pause_out(seq.sid, self.prog.pause(seq, p.to_host, p.host_victims))
        elif n > 1:
            self.units.append((it.iid, it.unit, seq, False))      # refreshed after Control/Decode
        out.facts = self.w.seq_facts(seq) if seq.sid in self.prog.sequences else None
        return out

    def _permit(self, demand: Callable[[], dict[str, int]], credit: dict[str, int],
                remedies: list[P.Remedy], out: P.IntentOut, first: int = 0,
                touched: dict[tuple[int, int], int] | None = None) -> P.Outcome:
        """The permit check with its remedies: OK when it fits now (after committing the
        smallest prefix of remedies that makes it fit), WAIT when a prefix makes it fit once
        its copies publish (committed) and they have not all landed by the progress point
        taken at once (``_progress_in_admission``), else SHORT with nothing committed.
        ``first``: the index of ``remedies[0]`` in the intent's list (after a lane take-back it
        committed); ``touched``: blocks that take-back let go of (see ``_remedy``)."""
        short = self._short(demand(), credit)
        if not short:
            return P.Outcome.OK
        out.shortfall = short
        if not remedies:
            return P.Outcome.SHORT
        skipped: set[int] = set()
        # rule: remedy-prefix
        freed = reclaim.simulate(self.prog, remedies, skipped)
        for wait in (False, True):
            for k, f in enumerate(freed):
                if f.covers(short, wait):
                    touched = {} if touched is None else touched
                    for i in range(k + 1):
                        if i not in skipped:
                            out.applied.append(self._remedy(first + i, remedies[i], touched))
                    # rule: retry-on-the-spot
                    if wait:
                        self._progress_in_admission()
                    short = self._short(demand(), credit)
                    if wait and short:
                        return P.Outcome.WAIT
                    out.shortfall = short
                    return P.Outcome.SHORT if short else P.Outcome.OK
        return P.Outcome.SHORT

    def _progress_in_admission(self) -> None:
        """A progress point inside admission, after committing a reclaim whose capacity arrives
        once its copies publish: copies that have all finished already (``inline``, or a copy
        thread quicker than the step) settle here, and the permit is retried on the spot (seed:
        同步回收已经改变容量时，当场重试当前许可；需要等待传输完成时才交回调度周期). What
        settles is reported at point 2, after the intents — the controller books each commit
        with its intent first, as it does for what settles at point 2 itself."""
        self.reply.settled += [_settled(r, 2) for r in self.prog.progress()]

    def _short(self, demand: dict[str, int], credit: dict[str, int]) -> dict[str, int]:
        short = self.prog.shortfall(demand)
        return {k: n - credit.get(k, 0) for k, n in short.items() if n > credit.get(k, 0)}

    def _remedy(self, index: int, r: P.Remedy, touched: dict[tuple[int, int], int]) -> P.Applied:
        """Commit one remedy of a chain. ``touched``: (block, version quoted) -> its version now,
        for the blocks the chain's own take-backs let go of (a pause touches them): a later
        step names them as quoted, and that is no change since the quote."""
        if isinstance(r, P.Reclaim):
            return P.Applied(index, commit=self.prog.apply(reclaim.as_touched(r.actions, touched)))
        seq = self.prog.sequences[r.sid]
        held = [(b, b.version) for blocks in seq.blocks.values() for b in blocks]
        paused = self.prog.pause(seq, r.to_host, r.host_victims)
        touched.update({(b.bid, v): b.version for b, v in held if b.version != v})
        return P.Applied(index, paused=_pause_out(r.sid, paused))

    def _bind(self, it: P.BindIntent) -> P.IntentOut:
        prog = self.prog
        out = P.IntentOut(it.iid, P.Outcome.OK)
        src = None
        if it.source is not None:
            src = self.w.checkpoint(it.source.cid, it.source.generation)
            if src is None:
                return P.IntentOut(it.iid, P.Outcome.REFUSED, P.Refusal.STALE_SOURCE,
                                   detail=f"checkpoint {it.source.cid} is gone (stale reference)")
        if it.new is not None:
            c = it.new
            seq = prog.new_sequence(P.unpack_tokens(c.tokens), c.prompt_len, c.params, self.w.eos_ids, c.media)
        else:
            seq = prog.sequences.get(it.sid)
            if seq is None or seq.phase is not P.Phase.PAUSED:
                return P.IntentOut(it.iid, P.Outcome.REFUSED, P.Refusal.NOT_BOUND,
                                   detail=f"sequence {it.sid} is not paused")
        if src is not None:
            why, detail = prog.check_source(seq.ledger, src, it.mode, it.mover)
            if why:
                self._drop_new(it, seq)
                return P.IntentOut(it.iid, P.Outcome.REFUSED, why, detail=detail)
        retire = self.w.retires(it.retire)
        credit = prog.freed_by_retiring([(c, o) for c, o in retire if c is not src])
        # a lane take-back leads the remedies: committed whatever the shortfall (the lane is
        # what the resume needs of it), before the permit is checked
        touched: dict[tuple[int, int], int] = {}
        lead = 0
        while lead < len(it.remedies) and isinstance(r := it.remedies[lead], P.TakeBack) and r.lane:
            if r.sid in prog.sequences and prog.sequences[r.sid].phase is P.Phase.RUNNING:
                out.applied.append(self._remedy(lead, r, touched))
            lead += 1
        out.outcome = self._permit(lambda: prog.bind_demand(seq.sid, src, it.mode, it.first_tokens),
                                   credit, it.remedies[lead:], out, lead, touched)
        if out.outcome is not P.Outcome.OK:
            self._drop_new(it, seq)
            return out
        b = prog.bind(seq, src, it.mode, it.first_tokens, it.mover, retire)
        if not b.ok:
            self._drop_new(it, seq)
            out.outcome = P.Outcome.REFUSED if b.refusal else P.Outcome.SHORT
            out.refusal, out.detail, out.shortfall = b.refusal, b.detail, b.shortfall
            return out
        out.sid, out.tid = seq.sid, b.tid
        out.facts = self.w.seq_facts(seq)
        if it.unit is not None and not self._skipped(it.unit_guards):
            self.units.append((it.iid, it.unit, seq, True))
        return out

    def _drop_new(self, it: P.BindIntent, seq: Sequence) -> None:
        if it.new is not None:
            self.prog.release(seq)      # nothing of a failed fresh admission lingers

    # ---- execution ----------------------------------------------------------------------
    def execute(self, decode: bool) -> None:
        """Run the permitted units of this turn: the Control/Decode batch (units of at most one
        token) or the prefill turn (the multi-token unit, its permit refreshed if it was
        short). Units of sequences still materializing wait for a later step."""
        batch = []
        for iid, unit, seq, permitted in self.units:
            if iid in self.ran or (unit.n_tokens <= 1) != decode or seq.phase is not P.Phase.RUNNING:
                continue
            if not permitted and self.prog.reserve_unit(seq, unit.n_tokens):
                continue
            batch.append((iid, unit, seq))
        if not batch:
            return
        rows, outs = [], []
        for iid, unit, seq in batch:
            row, caps = UnitRow(seq, unit.n_tokens, unit.kind), []
            for cap in unit.captures:         # in position order, each destination before the unit
                dest, result, room = self._capture(cap)
                caps.append(P.CaptureOut(result, room_applied=room))
                if dest is not None:
                    row.captures.append((cap.at or None, dest))
            rows.append(row)
            outs.append(caps)
        try:
            if self.w.faults.fire("forward_error"):
                raise FaultInjected("injected forward error")
            results = self.prog.execute(rows)
        except Exception as exc:            # device or programming error: this call's rows fail
            log.exception("execute failed")
            error = f"{type(exc).__name__}: {exc}"
            for (iid, unit, seq), row, caps in zip(batch, rows, outs):
                self.ran.add(iid)
                for _, dest in row.captures:
                    self.prog.drop_capture(dest)
                self.prog.fail_sequence(seq)
                # what the save's preparation already did stands (seed: 新保存失败不恢复旧点):
                # its retirements, its superseded holds when it had found a destination, its room
                self.reply.units.append(P.UnitOut(seq.sid, ran=False, error=error, captures=caps))
            return
        for (iid, unit, seq), r, caps in zip(batch, results, outs):
            self.ran.add(iid)
            if not unit.hold:
                self.prog.settle(seq)
            made = iter(r.saved)           # the saved ones, in order
            for c in caps:
                if c.result is P.CaptureResult.SAVED:
                    ck, c.tid = next(made)
                    c.captured = ckpt_ref(ck)
            u = P.UnitOut(seq.sid, ran=True, committed=r.committed,
                          finish=P.FinishReason[r.finish_reason.upper()] if r.finish_reason else None,
                          captures=caps, facts=self.w.seq_facts(seq), logprobs=r.logprobs,
                          prompt_logprobs=r.prompt_logprobs, prompt_from=r.prompt_from)
            self.reply.units.append(u)

    def _capture(self, cap: P.Capture) -> tuple[CaptureDest | None, P.CaptureResult, P.CommitResult | None]:
        """A save's destination: a Device slot, else the Host, else the admitted room (only
        when committing it makes the save fit: a Device slot freed now or the Host placing
        the image), else skipped — an optional save never blocks the unit."""
        prog = self.prog
        dest = prog.prepare_capture(cap.owner, self.w.retires(cap.retire), self.w.retires(cap.replace))
        if dest is not None:
            return dest, P.CaptureResult.SAVED, None
        if not cap.room:
            return None, P.CaptureResult.NO_ROOM, None
        stale: set[int] = set()
        freed = reclaim.simulate(prog, [P.Reclaim(cap.room)], stale)
        if stale:
            return None, P.CaptureResult.STALE_ROOM, None
        deleted = {a.cid for a in cap.room if isinstance(a, P.Delete)}
        images, blocks = reclaim.migrations_of(prog, cap.room)
        sizes = prog.demotion_sizes(images, blocks) + [prog.image_bytes]
        dropped = {a.cid for a in cap.room if isinstance(a, P.DropHostCopy)}
        fits_host = place_first_fit(prog.host_holes_after(deleted, dropped), sizes) is not None
        if freed[0].now.get(P.STATE, 0) < 1 and not fits_host:
            return None, P.CaptureResult.NO_ROOM, None
        res = prog.apply(cap.room)
        dest = prog.prepare_capture(cap.owner, (), self.w.retires(cap.replace)) if res.ok else None
        if dest is None:
            return None, P.CaptureResult.STALE_ROOM if not res.ok else P.CaptureResult.NO_ROOM, res
        return dest, P.CaptureResult.SAVED, res

    def report_unrun(self) -> None:
        """Permitted units that did not run this step (their sequence is still materializing,
        or the refreshed chunk permit was still short) keep their reservation."""
        for iid, unit, seq, _ in self.units:
            if iid not in self.ran and seq.sid in self.prog.sequences:
                self.reply.units.append(P.UnitOut(seq.sid, ran=False, facts=self.w.seq_facts(seq)))
