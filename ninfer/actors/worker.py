"""The GPU worker as a plain class: it holds the Program and runs one ``StepPlan`` per call.

It makes no policy decisions. It executes the plan's commands in order, requests the rows'
unit permits in the given order (a short row is skipped, the others run), runs the binds with
the headroom left, picks the first chunk candidate that holds its permit, executes one call,
settles, and reports what happened together with drained transfer completions. The Ray actor
(later) and the in-process transport wrap exactly this class.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from ninfer import protocol as P
from ninfer.config import EngineConfig
from ninfer.native.layout import resolve_layout
from ninfer.native.model.config import PAGE_SIZE, load_eos_ids
from ninfer.native.model.model import HybridModel
from ninfer.native.objects import Checkpoint, Sequence, SeqState
from ninfer.native.program import BindMode, NativeError, Program, UnitKind, UnitRow
from ninfer.native.stores import IntegrityError
from ninfer.native.transfer import FaultHook

log = logging.getLogger("ninfer.worker")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def ckpt_ref(ck: Checkpoint | None) -> P.CkptRef | None:
    if ck is None:
        return None
    return P.CkptRef(ck.cid, ck.generation, ck.frontier, ck.kind.value, ck.image.slot is not None,
                     ck.image.host is not None)


class Worker:
    def __init__(self, model_dir: str | Path, config: EngineConfig, hook: FaultHook | None = None,
                 notify: Callable[[], None] | None = None):
        device = pick_device(config.device)
        model = HybridModel.load(model_dir, config.dtype, device)
        self.eos_ids = load_eos_ids(model_dir, model.cfg)
        self.prog = Program(model, resolve_layout(model.cfg, config, device), hook)
        if notify is not None:
            self.prog.transfers.on_done = notify

    # ---- info ---------------------------------------------------------------------------
    def info(self) -> P.WorkerInfo:
        lay, cfg = self.prog.layout, self.prog.model.cfg
        return P.WorkerInfo(
            protocol=P.PROTOCOL_VERSION, model_type=cfg.model_type, vocab_size=cfg.vocab_size,
            max_context=lay.max_context, eos_ids=list(self.eos_ids), max_concurrency=lay.max_concurrency,
            kv_pages=lay.main_pages, state_slots=lay.state_slots, page_bytes=self.prog.mem.page_bytes,
            image_bytes=self.prog.mem.image_bytes, host_capacity=lay.host_capacity_bytes,
            prefill_chunk_tokens=lay.prefill_chunk_tokens, exec_identity=self.prog.exec_identity,
            dtype=lay.dtype,
        )

    def handle(self, data: bytes) -> bytes:
        """The wire entry point: bytes in, bytes out (same for every transport)."""
        return P.encode(self.step(P.decode_plan(data)))

    def wait(self, timeout: float) -> bool:
        """Block (no spinning) until a transfer completion is ready or ``timeout`` passes."""
        if not self.prog.transfers.inflight:
            return False
        return self.prog.transfers.wait(timeout)

    def shutdown(self) -> None:
        self.prog.shutdown()

    def _hold(self, pages: int) -> bool:
        """Test hook: an outside party keeps ``pages`` Main pages reserved."""
        pool = self.prog.pools[P.MAIN]
        held = getattr(self, "_held", 0)
        if held:
            pool.unreserve(held)
            self._held = 0
        if pages and pool.reserve(pages):
            self._held = pages
        return self._held == pages

    # ---- one cycle ----------------------------------------------------------------------
    def step(self, plan: P.StepPlan) -> P.StepReply:
        """Seed cycle order: full resume first, then resident unit permits (rows, then the
        first chunk candidate that gets its permit), then fresh admission with the headroom
        left; one compact call; settle."""
        t0 = time.perf_counter()
        reply = P.StepReply(seq=plan.seq)
        reply.pre = [self._command(c) for c in plan.pre]
        units: list[tuple[P.RowSpec, Sequence]] = []
        chunks = list(enumerate(plan.chunks))
        outs: dict[int, P.BindOut] = {}
        self._binds(plan, [b for b in plan.binds if not b.fresh], units, chunks, outs)
        for spec in plan.rows:
            out, seq = self._permit(spec)
            reply.rows.append(out)
            if seq is not None:
                units.append((spec, seq))
        chunk = self._pick_chunk(chunks, reply)
        fresh_chunks: list = []
        self._binds(plan, [b for b in plan.binds if b.fresh], units, fresh_chunks, outs)
        if chunk is None:
            chunk = self._pick_chunk(fresh_chunks, reply)
        reply.binds = [outs[id(b)] for b in plan.binds]
        if chunk is not None:
            units.append(chunk)
        if units:
            results = self._execute(units)
            for i, row in enumerate(reply.rows):
                if row.ran:
                    reply.rows[i] = results.pop(row.sid)
            if chunk is not None:
                reply.chunk = results.pop(chunk[0].sid)
            reply.rows.extend(results.values())     # first units of this cycle's binds
        reply.completions = self.prog.poll_transfers()
        self._pools(reply)
        reply.worker_s = time.perf_counter() - t0
        return reply

    def _seq(self, sid: int) -> Sequence:
        seq = self.prog.sequences.get(sid)
        if seq is None:
            raise NativeError(f"sequence {sid} does not exist")
        return seq

    def _ckpt(self, cid: int, generation: int) -> Checkpoint:
        ck = self.prog.checkpoints.get(cid)
        if ck is None or ck.generation != generation:
            raise NativeError(f"checkpoint {cid} is gone (stale reference)")
        return ck

    def facts(self, seq: Sequence) -> P.SeqFacts:
        blocks = seq.blocks[P.MAIN]
        f = seq.frontier
        tail_ok = not (f % PAGE_SIZE) or (bool(blocks) and self.prog._can_append(blocks[f // PAGE_SIZE], seq.sid, f))
        return P.SeqFacts(frontier=f, ledger_len=len(seq.ledger), blocks=len(blocks), tail_ok=tail_ok,
                          reserved=seq.reservation.amounts.get(P.MAIN, 0))

    def _permit(self, spec: P.RowSpec) -> tuple[P.RowOut, Sequence | None]:
        try:
            seq = self._seq(spec.sid)
            if seq.state is not SeqState.BOUND:
                return P.RowOut(spec.sid, ran=False, error=f"sequence is {seq.state.value}"), None
            short = self.prog.reserve_unit(seq, spec.n_tokens)
        except NativeError as exc:
            return P.RowOut(spec.sid, ran=False, error=str(exc)), None
        if short:
            return P.RowOut(spec.sid, ran=False, shortfall=short, facts=self.facts(seq)), None
        return P.RowOut(spec.sid, ran=True), seq

    def _binds(self, plan: P.StepPlan, binds: list[P.BindSpec], units: list, chunks: list,
               outs: dict[int, P.BindOut]) -> None:
        """Binds in order with the headroom left. Fresh admissions stop at ``max_new``
        successes and, after a failed fresh bind, at its overtaking budget."""
        admitted, budget = 0, None
        for b in binds:
            if b.fresh and (admitted >= plan.max_new or budget == 0):
                outs[id(b)] = P.BindOut(b.sid, ok=False, skipped=True)
                continue
            out, seq = self._bind(b)
            outs[id(b)] = out
            if out.ok:
                if b.fresh:
                    admitted += 1
                    budget = None if budget is None else budget - 1
                if b.unit is not None and seq.state is SeqState.BOUND:
                    unit = msgspec.structs.replace(b.unit, sid=seq.sid)
                    if unit.n_tokens <= 1:
                        units.append((unit, seq))
                    else:
                        chunks.append((b.rank, unit))
            elif b.fresh and b.budget is not None:
                budget = b.budget if budget is None else min(budget, b.budget)

    def _bind(self, b: P.BindSpec) -> tuple[P.BindOut, Sequence | None]:
        seq = None
        try:
            if b.new is not None:
                c = b.new
                seq = self.prog.new_sequence(P.unpack_tokens(c.tokens), c.prompt_len, c.params, self.eos_ids)
            else:
                seq = self._seq(b.sid)
            src = self._ckpt(b.source.cid, b.source.generation) if b.source is not None else None
            retire = [(self._ckpt(r.cid, r.generation), r.owner) for r in b.retire
                      if r.cid in self.prog.checkpoints]
            out = self.prog.bind(seq, src, BindMode(b.mode), b.first_tokens, b.mover, retire)
        except NativeError as exc:
            out = None
            error = str(exc)
        sid = seq.sid if seq is not None else b.sid
        if out is None or not out.ok:
            if b.new is not None and seq is not None:
                self.prog.release(seq)          # nothing of a failed fresh admission lingers
                sid = 0
            if out is None:
                return P.BindOut(sid, ok=False, error=error), None
            return P.BindOut(sid, ok=False, shortfall=out.shortfall, busy=out.busy), None
        return P.BindOut(sid, ok=True, tid=out.tid, facts=self.facts(seq)), seq

    def _pick_chunk(self, chunks: list[tuple[int, P.RowSpec]], reply: P.StepReply):
        """The first candidate (by rank) that holds or gets its permit; the others keep none."""
        for _, spec in sorted(chunks, key=lambda x: x[0]):
            seq = self.prog.sequences.get(spec.sid)
            if seq is None or seq.state is not SeqState.BOUND:
                continue
            short = self.prog.reserve_unit(seq, spec.n_tokens)
            if short:
                reply.chunk_short[spec.sid] = short
                continue
            return spec, seq
        return None

    def _execute(self, units: list[tuple[P.RowSpec, Sequence]]) -> dict[int, P.RowOut]:
        rows = []
        for spec, seq in units:
            retire = [(self.prog.checkpoints[r.cid], r.owner) for r in spec.capture_retire
                      if r.cid in self.prog.checkpoints and self.prog.checkpoints[r.cid].generation == r.generation]
            rows.append(UnitRow(seq, spec.n_tokens, UnitKind(spec.kind), spec.capture_owner,
                                spec.capture_where, retire))
        try:
            results = self.prog.execute(rows)
            error = None
        except Exception as exc:        # device or programming error: every row of the call fails
            log.exception("execute failed")
            results, error = None, f"{type(exc).__name__}: {exc}"
        outs: dict[int, P.RowOut] = {}
        for i, (spec, seq) in enumerate(units):
            if error is None:
                r = results[i]
                out = P.RowOut(spec.sid, ran=True, committed=r.committed, finish=r.finish_reason,
                               captured=ckpt_ref(r.captured), capture_skipped=r.capture_skipped)
            else:
                out = P.RowOut(spec.sid, ran=False, error=error)
            if not spec.hold:
                self.prog.settle(seq)
            out.facts = self.facts(seq)
            outs[spec.sid] = out
        return outs

    def _pools(self, reply: P.StepReply) -> None:
        reply.pools = {k: P.PoolState(p.size, p.available) for k, p in self.prog.pools.items()}
        reply.host_free = self.prog.host.free_bytes
        reply.host_largest = self.prog.host.largest_free()
        reply.tx_busy = self.prog.tx is not None
        reply.bytes_h2d, reply.bytes_d2h = self.prog.bytes_h2d, self.prog.bytes_d2h

    # ---- commands -----------------------------------------------------------------------
    def _command(self, c) -> P.CommandOut:
        try:
            return self._run(c)
        except (NativeError, IntegrityError) as exc:
            return P.Failed(str(exc))

    def _run(self, c) -> P.CommandOut:
        prog = self.prog
        if isinstance(c, P.NewSeq):
            seq = prog.new_sequence(P.unpack_tokens(c.tokens), c.prompt_len, c.params, self.eos_ids)
            return P.SeqCreated(seq.sid, seq.generation)
        if isinstance(c, P.Pause):
            return P.CkptOut(ckpt_ref(prog.pause(self._seq(c.sid), c.destructive)))
        if isinstance(c, P.Freeze):
            return P.CkptOut(ckpt_ref(prog.freeze(self._seq(c.sid), c.owner)))
        if isinstance(c, P.Release):
            seq = prog.sequences.get(c.sid)
            if seq is not None:
                prog.release(seq)
            return P.Ack(seq is not None)
        if isinstance(c, P.AddOwner):
            prog.add_owner(self._ckpt(c.cid, c.generation), c.owner)
            return P.Ack()
        if isinstance(c, P.ReleaseOwner):
            ck = prog.checkpoints.get(c.cid)
            if ck is None or ck.generation != c.generation or c.owner not in ck.owners:
                return P.Ack(False)
            return P.Ack(prog.release_owner(ck, c.owner))
        if isinstance(c, P.Publish):
            return P.Ack(prog.publish(c.tid, c.generation))
        if isinstance(c, P.Overdue):
            return P.CompletionsOut(prog.overdue())
        if isinstance(c, P.Commit):
            return P.CommitOut(prog.commit(c.actions))
        if isinstance(c, P.Quote):
            return P.FactsOut(prog.quote())
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
