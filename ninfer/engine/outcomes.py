"""What a StepReply means for the controller's books, in the order the worker did it:

    settled at point 1 -> commands -> intents (remedies committed, binds, pauses) ->
    settled at points 2 and 3 -> units (tokens, captures, accounting, recovery end)

The transaction state machine lives here: every part of the context transaction the controller
learns of (a bind's read-back, a capture, a demotion, a pause snapshot) is booked under its
transaction id; when the worker reports the transaction settled, each part's consequence is
applied — a bound request may run, a snapshot is on the Host, capacity returned (a scheduling
event) — or, when a copy failed, exactly the affected requests fail and lost checkpoints are
forgotten. Nothing else is touched.

Outcomes is the books' writer while a reply is interpreted and when the plan's decisions are
booked (the waits planning decided, the evidence a settlement used, pending waits that ended):
planning and settling only read. It holds the books it writes — the Scheduler, the
ResourceManager, the RequestBook, the TxBook, the command queue, the counters — never the core.
"""

from __future__ import annotations

import logging
import time
from ninfer import protocol as P
from ninfer.engine.books import CommandQueue, EngineStats, Follow, FreezeFollow, PauseFollow, RequestBook, TxBook, TxPart
from ninfer.engine.planning import Item, Plan, Wait, WaitKind
from ninfer.engine.request import Request
from ninfer.engine.telemetry import Telemetry
from ninfer.engine.units import Save, account
from ninfer.errors import ErrorKind
from ninfer.policy.pressure import ItemKind
from ninfer.policy.resources import ResourceManager
from ninfer.policy.scheduler import Scheduler
from ninfer.protocol import CaptureResult, Life, Outcome, Phase, Refusal, UnitKind

log = logging.getLogger("ninfer.engine")


class Outcomes:
    def __init__(self, sched: Scheduler, rm: ResourceManager, books: RequestBook, txs: TxBook,
                 cmdq: CommandQueue, stats: EngineStats, telemetry: Telemetry, image_bytes: int):
        self.sched, self.rm, self.books, self.txs, self.cmdq = sched, rm, books, txs, cmdq
        self.stats, self.telemetry, self.image_bytes = stats, telemetry, image_bytes

    # ---- the plan's decisions, booked before the step is sent ----------------------------
    def expire_pending_waits(self) -> None:
        """Fresh requests waiting for another's pending save rejoin the scan once it is
        published, or once it will not come (before the cycle is planned)."""
        sched, rm = self.sched, self.rm
        for req in list(sched.waiting.values()):   # O(waiters), not O(queue)
            w = rm.books[req.rid].pending if req.rid in rm.books else None
            producer = self.books.requests.get(w.producer) if w is not None else None
            if not rm.pending_holds(req, producer, producer is not None and producer.rid in sched.resident):
                sched.wait_pending(req, False)        # it chooses again now

    def book_waits(self, waits: list[Wait]) -> list[tuple[P.Command, Follow]]:
        """Book the waits the plan decided, in scan order; the owner commands they need."""
        cmds: list[P.Command] = []
        for w in waits:
            if w.kind is WaitKind.KEEP:
                cmds += self.rm.wait_on(w.req, w.adm)
            elif w.kind is WaitKind.END:
                cmds += self.rm.end_wait(w.req)
            else:
                self.rm.wait_pending(w.req, w.producer, w.frontier, w.base)
                self.sched.wait_pending(w.req, True)
        return [(c, None) for c in cmds]

    def evidence_used(self, n: int) -> None:
        """Saves the settlement admitted on repeat-demand evidence (retention only, never a hit)."""
        self.rm.stats.summary_hits += n

    # ---- a reply ------------------------------------------------------------------------
    def apply(self, reply: P.StepReply, plan: Plan, cmds: list[tuple[P.Command, Follow]]) -> bool:
        """Interpret one reply; True if anything ran, was admitted, paused or settled."""
        progressed = False
        for s in reply.settled:
            if s.point <= 1:
                progressed = self.settled(s) or progressed
        for (cmd, follow), out in zip(cmds, reply.commands):
            self._follow(follow, out)
            progressed = True
        by_iid = plan.by_iid()
        admitted: set[str] = set()
        units: dict[int, Item] = {}
        for out in reply.intents:
            item = by_iid[out.iid]
            progressed = self._intent(item, out, admitted) or progressed
            if item.req.sid is not None:
                units[item.req.sid] = item
        if plan.scanned:
            self.sched.after_scan(plan.scanned, admitted)
        for s in reply.settled:
            if s.point > 1:
                progressed = self.settled(s) or progressed
        host_room = reply.host_largest >= self.image_bytes
        for u in reply.units:
            progressed = self._unit(u, units.get(u.sid), host_room) or progressed
        if reply.uncovered:                  # after the captures above: a new point may be one
            self.rm.uncover(reply.uncovered)
        return progressed

    def _follow(self, follow: Follow, out: P.CommandOut) -> None:
        """What a command's reply means, as its typed follow-up says."""
        if isinstance(follow, PauseFollow):
            self.paused(follow.req, out, list(follow.victims), follow.reason)
        elif isinstance(follow, FreezeFollow):
            self._frozen(follow.req, out)

    # ---- a request's end -------------------------------------------------------------
    def release_records(self, req: Request) -> None:
        self.cmdq.extend(self.rm.on_released(req))
        self.rm.forget(req)

    def _frozen(self, req: Request, out: P.CommandOut) -> None:
        """A finished request's generation end frozen: its record's E (else released)."""
        if isinstance(out, P.CkptOut) and out.ref is not None:
            self.cmdq.extend(self.rm.on_finished(req, out.ref))
            self.rm.forget(req)
        else:
            self.release_records(req)

    # ---- the transaction state machine ------------------------------------------------
    def settled(self, s: P.Settled) -> bool:
        parts = self.txs.settle(s.tid)
        causes: set[str] = set()
        for kind, req in parts:
            if req is None:
                continue
            if kind is TxPart.BIND and s.ok and req.phase is Phase.MATERIALIZING:
                self.books.move(req, Phase.RUNNING)
                self.rm.book(req).source_cid = None
            elif kind is TxPart.RELEASE:
                req.awaiting_release.discard(s.tid)    # published or aborted: its gap is asked again
            elif kind is TxPart.PAUSE:
                causes.add(req.rid)            # its own release is not a resume event for it
                snap = req.snapshot
                if s.ok and snap is not None:
                    req.snapshot = P.CkptRef(snap.cid, snap.generation, snap.frontier, snap.kind, False, True)
        if not s.ok:
            self.stats.copy_failures += 1
            log.warning("transaction %d aborted: %s", s.tid, s.error)
            for sid in s.failed_sids:
                req = self.books.of_sid(sid)
                if req is not None:
                    self.books.unbind(req)     # the worker released the sequence
                    self.books.fail(req, ErrorKind.COPY_FAILED, f"a copy of this request's content failed ({s.error})")
            self._lost(s.lost_cids)
        self.sched.event(causes)               # a transfer completion: capacity may have returned
        return True

    def _lost(self, cids: list[int]) -> None:
        snaps = {r.snapshot.cid: r for r in self.sched.paused if r.snapshot is not None}
        for cid in cids:
            req = snaps.get(cid)
            if req is not None:
                req.snapshot = None            # its snapshot could not be written: Replay
        self.rm.on_deleted([c for c in cids if c not in snaps])

    # ---- remedies ---------------------------------------------------------------------
    def committed(self, actions: list[P.Action], result: P.CommitResult) -> None:
        """Mirror a committed reclaim: deletions revoke snapshots or waiters and forget
        records."""
        if not result.ok:
            return
        snapshots = {r.snapshot.cid: r for r in self.sched.paused if r.snapshot is not None}
        deleted = [a.cid for a in actions if isinstance(a, P.Delete)]
        causes = {snapshots[c].rid for c in deleted if c in snapshots}
        for cid in deleted:
            req = snapshots.get(cid)
            if req is not None:
                req.snapshot = None            # revoked: this request resumes by Replay
                self.stats.revocations += 1
        self.rm.on_deleted([c for c in deleted if c not in snapshots])
        # demotions: the mirror follows the worker's placement reports (a demotion's copies
        # may still fail and keep the Device replica; a free-at-once one is reported already)
        self.txs.book(result.tid, TxPart.DEMOTE, None)
        self.sched.event(causes)               # real capacity release / revocation

    def paused(self, req: Request, out: P.CommandOut | P.PauseOut, victims: list[P.Delete] = (),
               reason: str = "taken_back") -> None:
        """A pause at a stable commit boundary: Snapshot (its unique content going to the
        Host, after deleting ``victims`` for its destination) or destructive (Replay: nothing
        was deleted for it). ``reason``: taken_back (a younger resident, for an older request's
        unit), lane_take_back (for the oldest paused request's resume), cannot_progress (a young
        row that could not get its unit paused itself), forced (the test seam)."""
        if not isinstance(out, P.PauseOut):
            log.warning("pause of %s refused: %s", req.rid, getattr(out, "message", out))
            return
        if out.snapshot is not None and victims:
            self.committed(list(victims), P.CommitResult(ok=True))
        req.snapshot = out.snapshot
        req.replay_target = req.frontier
        self.books.move(req, Phase.PAUSED)
        req.recovery_pending = False          # a pause ends the permit it held (its sequence let go)
        now = time.monotonic()
        route = "snapshot" if out.snapshot else "replay"
        req.pauses.append(P.PauseEntry(route, req.frontier, now))
        self.books.life.publish(req, Life.PAUSED, now, route=route, reason=reason, frontier=req.frontier)
        self.sched.pause(req)
        self.stats.preemptions += 1
        self.txs.book(out.tid, TxPart.PAUSE, req)

    def _applied(self, item: Item, out: P.IntentOut) -> None:
        for a in out.applied:
            remedy = item.intent.remedies[a.index]
            if a.commit is not None:
                self.committed(remedy.actions, a.commit)
            if a.paused is not None:
                victim = self.books.of_sid(a.paused.sid)
                if victim is not None:
                    self.paused(victim, a.paused, remedy.host_victims,
                                "lane_take_back" if remedy.lane else "taken_back")
                if remedy.lane:
                    self.stats.take_backs += 1
        if out.paused is not None:
            self.paused(item.req, out.paused, item.intent.on_short.host_victims, "cannot_progress")

    # ---- intents ------------------------------------------------------------------------
    def _intent(self, item: Item, out: P.IntentOut, admitted: set[str]) -> bool:
        self._applied(item, out)
        req = item.req
        if out.outcome is Outcome.FAILED:
            self.books.fail(req, ErrorKind.RUNTIME_ERROR, f"execution failed: {out.detail}")
            return True
        if item.contract is not None and out.outcome is Outcome.SHORT and out.paused is None:
            # the sole request that holds or needs capacity, short after all legal reclaim (the
            # worker's exact check agrees)
            # rule: unfit-source-reselect
            if item.need is not None and item.need.source is not None:
                self.cmdq.extend(self.rm.unfit_source(req, item.need.source))   # reselect without it:
                self.sched.event()                 # computing from a shallower point may fit where restoring cannot
                return True
            # the capacity contract, not a wait for nobody
            self.stats.capacity_errors += 1
            self.books.fail(req, ErrorKind.CAPACITY_CONTRACT, item.contract.message)
            return True
        if item.kind in (ItemKind.ROW, ItemKind.CHUNK):
            if out.facts is not None and req.phase is Phase.RUNNING:
                req.facts = out.facts
            if out.outcome is Outcome.WAIT:
                # the reclaim committed for this unit frees its capacity once its copies publish
                # (the unit may still run in this step, after the Control/Decode batch)
                self._await_release(req, out)
            # rule: chunk-short-gives-turn
            if item.kind is ItemKind.CHUNK and out.outcome is Outcome.SHORT and req.phase is Phase.RUNNING:
                self.sched.rotate(req)             # a chunk that cannot run gives up its turn
            return bool(out.applied) or out.paused is not None
        if item.kind is ItemKind.FRESH:
            return self._fresh(item, out, admitted)
        return self._resume(item, out)

    def _await_release(self, req: Request, out: P.IntentOut) -> None:
        """Its permit came back WAIT: it waits for the transactions of the reclaim committed
        for it (rule wait-for-release)."""
        for tid in {a.commit.tid for a in out.applied if a.commit is not None and a.commit.tid is not None}:
            req.awaiting_release.add(tid)
            self.txs.book(tid, TxPart.RELEASE, req)

    def _fresh(self, item: Item, out: P.IntentOut, admitted: set[str]) -> bool:
        req, adm, rm = item.req, item.adm, self.rm
        if out.outcome is Outcome.OK:
            self._bound(req, out)
            if req.first_admitted is None:
                req.first_admitted = time.monotonic()
                self.books.life.publish(req, Life.ADMITTED, req.first_admitted)
            rm.on_bound(req, adm, item.save_points)
            req.usage.cached_tokens = adm.cached
            self.cmdq.extend(rm.end_wait(req))     # the adopted source is bound now
            rm.book(req).source_cid = adm.source.cid if (adm.source and out.tid is not None) else None
            admitted.add(req.rid)
            return True
        if out.outcome is Outcome.REFUSED and out.refusal is Refusal.STALE_SOURCE and adm.source is not None:
            self.cmdq.extend(rm.end_wait(req))     # self-healing: the worker no longer has it
            rm.on_deleted([adm.source.cid])
            self.sched.event()
            return bool(out.applied)
        if out.outcome is Outcome.WAIT:
            # its reclaim frees the capacity once the copies publish: not quoted again before
            # (wait-for-release, as for a resident's unit; the commit's own partial release
            # would otherwise re-open the scan and reclaim for the same gap)
            self._await_release(req, out)
        if out.outcome in (Outcome.SHORT, Outcome.WAIT) or out.refusal is Refusal.SOURCE_IN_FLIGHT:
            if adm.cached:
                self.cmdq.extend(rm.wait_on(req, adm))   # keep the valuable source and wait
        elif out.outcome is Outcome.REFUSED:
            log.warning("fresh bind of %s refused: %s", req.rid, out.detail)
        return bool(out.applied)

    def _resume(self, item: Item, out: P.IntentOut) -> bool:
        req = item.req
        st = self.sched.st(req)
        if out.outcome is Outcome.OK:
            self._bound(req, out)
            self.sched.begin_recovery(req)
            req.recovery_pending = True
            now = time.monotonic()
            req.pauses[-1].route = item.route
            req.pauses[-1].resumed_at = now
            self.books.life.publish(req, Life.RESUMED, now, route=item.route, frontier=req.frontier)
            req.snapshot = None
            self.rm.on_resumed(req, item.adm)
            if item.route == "snapshot":
                self.stats.resumes_snapshot += 1
            else:
                self.stats.resumes_replay += 1
            return True
        if out.outcome is Outcome.REFUSED and out.refusal is Refusal.STALE_SOURCE:
            if item.route == "snapshot":
                req.snapshot = None                # gone: Replay next time
            elif item.adm is not None and item.adm.source is not None:
                self.rm.on_deleted([item.adm.source.cid])
            return True                            # retry at once with the other route
        if out.outcome is not Outcome.WAIT:
            st.wake = False                        # wait for the next real event (never spin)
        return bool(out.applied)

    def _bound(self, req: Request, out: P.IntentOut) -> None:
        self.books.bind(req, out.sid, out.tid is not None)
        req.facts = out.facts
        self.txs.book(out.tid, TxPart.BIND, req)
        self.sched.admit(req)

    # ---- units --------------------------------------------------------------------------
    def _unit(self, u: P.UnitOut, item: Item | None, host_room: bool) -> bool:
        req = self.books.of_sid(u.sid)
        if req is None or item is None:
            return False
        if u.error:
            self.stats.device_errors += 1
            for save, c in self._capture_outs(item, u):
                if c.result is not CaptureResult.NONE:
                    self._save_prepared(req, save, c)
            self.books.unbind(req)
            self.books.fail(req, ErrorKind.DEVICE_ERROR, f"the forward call failed: {u.error}")
            return True
        if u.facts is not None:
            req.facts = u.facts
        if not u.ran:
            return False
        req.awaiting_release.clear()         # its permit was refreshed after Control/Decode and ran
        unit = item.unit
        before = (req.usage.prefill_tokens, req.usage.replay_tokens)
        account(req, unit)
        self.stats.tokens_prefilled += req.usage.prefill_tokens - before[0]
        self.stats.tokens_replayed += req.usage.replay_tokens - before[1]
        if unit.kind is UnitKind.PREFILL or (unit.kind is UnitKind.DECODE and not req.outputs):
            self.rm.observe_prefill(req, req.frontier - unit.n_tokens, req.frontier)
        if req.replay_target is not None and req.frontier >= req.replay_target:
            req.replay_target = None
        for save, c in self._capture_outs(item, u):
            self._saved(req, save, c, host_room)
        if req.params.prompt_logprobs is not None and not self._prompt_logprobs(req, u):
            return True
        if u.committed:
            index, now = len(req.outputs), time.monotonic()
            self.telemetry.token_gap(req.note_tokens(u.committed, now, u.logprobs))
            self.stats.tokens_generated += len(u.committed)
            if index == 0:
                self.books.life.publish(req, Life.FIRST_TOKEN, now)
            self.books.sink(P.TokensEvent(req.rid, index, list(u.committed),
                                    list(u.logprobs) if req.params.logprobs is not None else None,
                                    [None, *req.prompt_logprobs]
                                    if index == 0 and req.params.prompt_logprobs is not None else None))
        # rule: recovery-ends-on-progress
        if req.recovery_pending and (u.committed or unit.kind is UnitKind.PREFILL):
            self._recovered(req)                   # only new progress ends the recovery permit
        if u.finish is not None:
            req.finish_reason = u.finish
        # rule: chunk-rotation
        if unit.n_tokens > 1:
            self.sched.rotate(req)
        return True

    def _prompt_logprobs(self, req: Request, u: P.UnitOut) -> bool:
        """Keep the prompt logprobs a unit computed (vLLM's prompt_logprobs), each position once.
        Every prompt position must have its entry by the first output token; a restore that
        skipped positions (which ResourceManager.restore_limit rules out) fails the request
        rather than answer with holes."""
        ok = not u.prompt_logprobs or req.note_prompt_logprobs(u.prompt_from, u.prompt_logprobs)
        if ok and (not u.committed or req.outputs or len(req.prompt_logprobs) >= len(req.prompt) - 1):
            return True
        have = len(req.prompt_logprobs)
        last = u.prompt_from - 1 if not ok else len(req.prompt) - 1
        self.books.fail(req, ErrorKind.PROMPT_LOGPROBS, f"prompt_logprobs: the entries of prompt tokens "
                       f"{have + 1}..{last} were never computed (a restored prefix skipped them)")
        return False

    @staticmethod
    def _capture_outs(item: Item, u: P.UnitOut) -> list[tuple[Save, P.CaptureOut]]:
        """Each save of the unit with what became of its capture (``CaptureOut()``, NONE, for a
        save that sent none: declined or shared) — the worker answers the captures in order."""
        outs = iter(u.captures)
        return [(sv, next(outs, P.CaptureOut()) if sv.capture is not None else P.CaptureOut())
                for sv in item.unit.saves]

    def _save_prepared(self, req: Request, save: Save, c: P.CaptureOut) -> None:
        """The unit failed after its save was prepared: the worker had given up the retired
        holds, the superseded ones too when it found a destination (SAVED), and committed the
        admitted room — a failed save does not bring them back, so the mirror follows."""
        rm = self.rm
        rm.retired(req, save.retire)
        if c.result is CaptureResult.SAVED:
            rm.retired(req, save.replace)
        if c.room_applied is not None:
            self.committed(save.capture.room, c.room_applied)

    def _saved(self, req: Request, save: Save, c: P.CaptureOut, host_room: bool) -> None:
        """The unit crossed or ended on a save point: attach the capture, or count the skipped save."""
        rm = self.rm
        book = rm.book(req)
        if save.sp in book.save_points:
            book.save_points.remove(save.sp)
        if save.shared is not None and save.shared.cid in rm.table.ckpts:
            for r in save.retire + save.replace:   # no capture ran to give them up
                self.cmdq.put(P.ReleaseOwner(r.cid, r.generation, r.owner))
            rm.retired(req, save.retire + save.replace)
            self.cmdq.extend(rm.on_captured(req, save.sp, save.shared.ref, shared=True))
            return
        rm.retired(req, save.retire)
        if c.room_applied is not None:
            self.committed(save.capture.room, c.room_applied)
        if c.captured is not None:
            rm.retired(req, save.replace)         # superseded by the save that happened
            self.txs.book(c.tid, TxPart.CAPTURE, req)
            self.cmdq.extend(rm.on_captured(req, save.sp, c.captured))
        elif c.result is not CaptureResult.NONE or save.declined:
            if save.declined:
                cause = "skipped_no_turn"
            elif save.room_refused:
                cause = "skipped_no_admission"
            else:
                cause = "skipped_no_room"
            rm.on_skipped(req, save.sp, cause)
            if c.result is not CaptureResult.NONE and host_room:
                self.stats.captures_skipped_with_room += 1

    def _recovered(self, req: Request) -> None:
        req.recovery_pending = False
        self.sched.end_recovery(req)               # a returned permit balance is a capacity event
        self.cmdq.put(P.Settle(req.sid))           # return what is left of the recovery permit
