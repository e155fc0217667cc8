"""The writers: a live sequence's execution state — its StateImage slot and KV directory.

A sequence is bound to a source (bind: Move or Fork from a checkpoint, or the empty prefix),
writes (the runner), and lets its state go in one of two ways: handed over to a checkpoint
(freeze at a normal finish, a Snapshot pause), dropped (a destructive pause: Replay later,
release, failure). Each step keeps the seed's order: check the source, reserve, install the
state and the KV references, copy what the Device lacks (joining the context transaction),
publish; a read-back that fails releases the sequence alone.

    MATERIALIZING --bind--> RUNNING --pause--> PAUSED --bind--> ...
    (read-back in flight)      |
                               +--freeze / release / failure--> FINISHED

Invariants (``check_integrity``; the directory's coverage is kv_directory.py's): a RUNNING
sequence holds a slot; a PAUSED one holds no slot and no KV (its snapshot checkpoint, if any,
holds the state for it, owned by ``SnapshotOwner(sid)``); a MATERIALIZING one with a slot waits
for its read-back, and a release meanwhile is deferred to the settlement (``cancel_requested``);
every sequence in the table is live (not FINISHED).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ninfer.errors import IntegrityError
from ninfer.native.context.checkpoints import Checkpoints
from ninfer.native.context.host_placement import HostPlacement
from ninfer.native.context.kv_directory import KvDirectory
from ninfer.native.context.slots import StateSlots
from ninfer.native.context.transaction import ContextTx, Job, TxPart
from ninfer.native.layout import MAIN, STATE
from ninfer.native.memory import Memory
from ninfer.native.objects import Checkpoint, KvBlock, NativeError, Sequence, StateImage
from ninfer.native.stores import HostArena, IdPool, Reservation, allocate, reserve_all, settle
from ninfer.placement import place_first_fit
from ninfer.protocol import BindMode, CkptKind, Delete, Owner, Phase, Refusal, SnapshotOwner


@dataclass
class BindOutcome:
    ok: bool
    shortfall: dict[str, int] = field(default_factory=dict)
    tid: int | None = None           # set when read-back copies are in flight
    refusal: Refusal = Refusal.NONE
    detail: str = ""


@dataclass
class PauseResult:
    snapshot: Checkpoint | None      # None: destructive (Replay)
    tid: int | None
    freed: dict[str, int]            # Device units freed at once


class Writers:
    def __init__(self, pools: dict[str, IdPool], kv: KvDirectory, slots: StateSlots, cks: Checkpoints,
                 placement: HostPlacement, txn: ContextTx, sequences: dict[int, Sequence], host: HostArena,
                 mem: Memory):
        self.pools = pools
        self.kv = kv
        self.slots = slots
        self.cks = cks
        self.placement = placement
        self.txn = txn
        self.sequences = sequences                   # the live sequences: a freed one leaves it
        self.host = host
        self.mem = mem

    # ---- binding ------------------------------------------------------------------------------
    def bind_demand(self, sid: int, source: Checkpoint | None, mode: BindMode,
                    first_tokens: int) -> dict[str, int]:
        """Read-only: State, missing KV, growth and tail pages to bind and run the first unit."""
        if source is None:
            return {STATE: 1, **self.kv.unit_demand(sid, 0, [], first_tokens)}
        slot = 0 if self._slot_handover(source, mode) else 1
        missing = sum(1 for b in source.blocks[MAIN] if b.page is None)
        unit = self.kv.unit_demand(sid, source.frontier, source.blocks[MAIN], first_tokens)
        return {STATE: slot, MAIN: missing + unit[MAIN]}

    def _slot_handover(self, src: Checkpoint, mode: BindMode) -> bool:
        """Can the writer take the source's Device slot instead of a new one? Move: always.
        Fork: when slots are short and a Host replica keeps the old identity restorable
        (seed: Device 槽紧张且有 Host 副本时 … 将 Device 槽交给新的 active identity)."""
        img = src.image
        if img.slot is None or img.leases:
            return False
        return mode is BindMode.MOVE or (img.host is not None and self.pools[STATE].available == 0)

    def check_source(self, seq_ledger: list[int], src: Checkpoint, mode: BindMode, mover: Owner | None
                     ) -> tuple[Refusal, str]:
        """Adoption checks exact identity (seed: 采用前还要校验 token、位置、媒体与执行身份)."""
        f = src.frontier
        if f > len(seq_ledger) or tuple(seq_ledger[:f]) != src.tokens:
            return Refusal.NOT_EXACT, f"checkpoint {src.cid} is not an exact prefix of the sequence"
        if src.digest != self.cks.digest(src.tokens):
            return Refusal.NOT_EXACT, f"checkpoint {src.cid} has a different execution identity"
        if mode is BindMode.MOVE:
            others = [o for o in src.owners if o != mover]
            if others:
                return Refusal.NOT_MOVABLE, f"checkpoint {src.cid} cannot be moved: still held by {others}"
        if any(b.leases for b in src.blocks[MAIN]) or src.image.leases:
            return Refusal.SOURCE_IN_FLIGHT, f"a copy of checkpoint {src.cid} is in flight"
        return Refusal.NONE, ""

    def bind(self, seq: Sequence, source: Checkpoint | None, mode: BindMode = BindMode.FORK,
             first_tokens: int = 0, mover: Owner | None = None,
             retire: list[tuple[Checkpoint, Owner]] = ()) -> BindOutcome:
        """Give ``seq`` a writer state and KV directory equal to ``source`` (None = the empty
        prefix) and reserve its first unit. Move consumes the source (its owners other than
        ``mover`` must be gone); Fork keeps it. A bind that needs read-back joins the context
        transaction and leaves the sequence MATERIALIZING until it is published.

        ``retire`` lists (checkpoint, owner) holds the policy permits this bind to give up:
        what they would really free counts toward the demand, and they are released only once
        the bind is admitted (seed: 绑定先检查退休后的实际可用资源，接纳后退休获准替代的更深私有点;
        a failed bind retires nothing)."""
        if seq.slot is not None or seq.phase not in (Phase.MATERIALIZING, Phase.PAUSED):
            raise NativeError(f"sequence {seq.sid} is already bound")
        if source is not None and source.cid not in self.cks.table:
            return BindOutcome(ok=False, refusal=Refusal.STALE_SOURCE, detail=f"checkpoint {source.cid} is gone")
        if source is not None:
            why, detail = self.check_source(seq.ledger, source, mode, mover)
            if why:
                return BindOutcome(ok=False, refusal=why, detail=detail)
        demand = self.bind_demand(seq.sid, source, mode, first_tokens)
        retire = [(c, o) for c, o in retire if c is not source and c.cid in self.cks.table]
        res, short = reserve_all(self.pools, demand)
        if res is None:
            freed = self.cks.freed_by_retiring(retire)
            if not retire or any(n > freed.get(k, 0) for k, n in short.items()):
                return BindOutcome(ok=False, shortfall=short)
            self.cks.retire(retire)
            res, short = reserve_all(self.pools, demand)
            assert res is not None, "retirement freed less than simulated"
        else:
            self.cks.retire(retire)
        seq.reservation = res
        reads: list[Job] = []
        if source is None:
            seq.slot = self.slots.take(seq, res)
            self.mem.zero_slot(seq.slot)
            seq.frontier = seq.draft_base = seq.draft_frontier = 0
        else:
            reads, after, abort = self._bind_from(seq, source, mode, res)
        self._drop_own_snapshot(seq)
        if not reads:
            seq.phase = Phase.RUNNING
            return BindOutcome(ok=True)
        seq.phase = Phase.MATERIALIZING
        tid = self.txn.add(TxPart("bind", lambda: self._finish_bind(seq, after), abort), reads)
        return BindOutcome(ok=True, tid=tid)

    def _drop_own_snapshot(self, seq: Sequence) -> None:
        """A resumed sequence has no pause snapshot any more: consumed by a Move, or given up
        when it resumes from another source (Replay)."""
        snap, owner = seq.snapshot, SnapshotOwner(seq.sid)
        seq.snapshot = None
        if snap is not None and snap.cid in self.cks.table and owner in snap.owners:
            self.cks.release_owner(snap, owner)

    def _bind_from(self, seq: Sequence, src: Checkpoint, mode: BindMode, res: Reservation):
        """Install the source's state and KV references. Returns (read-back jobs, what to run
        when they are published, what to run if they fail); no jobs when all is on the Device."""
        reads: list[Job] = []
        leased: list = []
        fetched: list[KvBlock] = []
        detached = None                      # a moved image's Host extent, freed after its read
        seq.frontier = src.frontier
        img = src.image
        if self._slot_handover(src, mode):
            seq.slot = img.slot
            self.slots.hand(seq.slot, seq)
            img.slot = None
        else:
            seq.slot = self.slots.take(seq, res)
            if img.slot is not None:
                self.mem.copy_slot(img.slot, seq.slot)
            else:
                reads.append(self.mem.host_to_slot(img.host, seq.slot))
                self.txn.count(h2d=self.mem.image_bytes)
                if mode is BindMode.MOVE:
                    detached, img.host = img.host, None
                else:
                    img.leases += 1
                    leased.append(img)
        for kind, blocks in src.blocks.items():
            seq.blocks[kind] = list(blocks)
            for b in blocks:
                b.holders.add(seq.sid)
                b.note()
                if b.page is None:
                    self.kv.page_in(b, allocate(self.pools, res, kind))
                    b.leases += 1           # in-flight read-back: nobody may rely on it yet
                    leased.append(b)
                    fetched.append(b)
                    reads.append(self.mem.host_to_page(b.host, b.page))
                    self.txn.count(h2d=self.mem.page_bytes)
                    b.touch()
        seq.draft_base, seq.draft_frontier = src.draft_base, src.draft_frontier
        self.kv.claim_tail(seq)
        lost = [src.cid] if mode is BindMode.MOVE and detached is not None else []
        if mode is BindMode.MOVE:
            self.cks.delete(src, keep_content=True)

        def after() -> None:
            for obj in leased:
                self.cks.unlease(obj)
            if detached is not None:
                self.host.release(detached)

        def abort() -> tuple[list[int], list[int]]:
            """The read-back failed: the fetched pages hold nothing valid (their Host replicas
            still do); the sequence is released; a moved-out image is lost."""
            for b in fetched:
                self.kv.page_out(b)
                b.touch()
            for obj in leased:
                self.cks.unlease(obj)
            if detached is not None:
                self.host.release(detached)
            self.fail_sequence(seq)
            return [seq.sid], lost
        return reads, after, abort

    def _finish_bind(self, seq: Sequence, after: Callable[[], None]) -> None:
        after()
        if seq.phase is Phase.MATERIALIZING:
            seq.phase = Phase.RUNNING
        if seq.cancel_requested:
            self.release(seq)

    def fail_sequence(self, seq: Sequence) -> None:
        if seq.sid not in self.sequences:
            return
        settle(self.pools, seq.reservation)
        self._drop_execution(seq)
        seq.phase = Phase.FINISHED
        self.sequences.pop(seq.sid, None)

    # ---- freeze, pause, release -----------------------------------------------------------------
    def freeze(self, seq: Sequence, owner: Owner) -> Checkpoint:
        """Normal finish: the legal execution state becomes a checkpoint (the new E) and the
        sequence is released (seed: 正常结束将合法执行态 freeze 为新 E)."""
        settle(self.pools, seq.reservation)
        ck = self._handover(seq, CkptKind.CACHE, owner)
        self.sequences.pop(seq.sid)
        seq.phase = Phase.FINISHED
        return ck

    def pause(self, seq: Sequence, to_host: bool = False, victims: list[Delete] = ()) -> PauseResult:
        """Give back the lane at a stable commit boundary, freeing Device memory (seed: Snapshot
        只复制释放 Device 所缺的唯一内容 … 保存资源不足时使用不新增 Device 分配的破坏性暂停并转为 Replay).

        ``to_host``: the writer state and KV references become a SNAPSHOT checkpoint owned by
        the sequence, and its unique Device content (what no other bound sequence reads) is
        demoted to the Host — after deleting ``victims`` for the destination, all verified
        first. When the destination does not fit (or a victim changed), nothing is deleted and
        the pause is destructive: the execution state is dropped and the request resumes by
        Replay. It never pauses anyone else to save this one."""
        if seq.phase is not Phase.RUNNING:
            raise NativeError(f"only a bound sequence can pause (sequence {seq.sid} is {seq.phase.name})")
        settle(self.pools, seq.reservation)
        before = {k: self.pools[k].free for k in (MAIN, STATE)}
        snap, tid = None, None
        if to_host and self._snapshot_fits(seq, victims):
            for a in victims:
                self.cks.delete(self.cks.table[a.cid])
            blocks, _ = self.placement.pause_plan(seq)
            snap = self._handover(seq, CkptKind.SNAPSHOT, SnapshotOwner(seq.sid))
            jobs, part = self.placement.demote([snap], blocks)
            if part is not None:
                revoke = part.abort

                def abort() -> tuple[list[int], list[int]]:
                    revoke()                    # the copy failed: the snapshot is revoked (Replay)
                    if snap.cid in self.cks.table:
                        self.cks.delete(snap)
                    if seq.snapshot is snap:
                        seq.snapshot = None
                    return [], [snap.cid]
                tid = self.txn.add(TxPart("pause", part.publish, abort), jobs)
        else:
            self._drop_execution(seq)
        seq.snapshot = snap
        seq.phase = Phase.PAUSED
        return PauseResult(snap, tid, {k: self.pools[k].free - n for k, n in before.items()})

    def _snapshot_fits(self, seq: Sequence, victims: list[Delete]) -> bool:
        if any(self.cks.delete_ok(a) for a in victims):
            return False
        _, sizes = self.placement.pause_plan(seq)
        return place_first_fit(self.placement.host_holes_after({a.cid for a in victims}), sizes) is not None

    def _handover(self, seq: Sequence, kind: CkptKind, owner: Owner) -> Checkpoint:
        """Turn the writer into an immutable checkpoint at the current frontier (Move)."""
        image = StateImage(slot=seq.slot)
        ck = self.cks.new(kind, seq, image, owner)
        self.slots.hand(seq.slot, ck)
        seq.slot = None
        self.kv.drop_all(seq.sid, seq.blocks)
        seq.blocks = self.kv.empty()
        seq.drafts = []
        return ck

    def _drop_execution(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None
        self.kv.drop_all(seq.sid, seq.blocks)
        seq.blocks = self.kv.empty()
        seq.drafts = []
        seq.draft_base = seq.draft_frontier = 0
        seq.grammar = None                 # execution state too: Replay rebuilds it from the ledger

    def release(self, seq: Sequence) -> None:
        """Cancel / error / done without saving: free everything the sequence holds. While its
        read-back is in flight the release waits for the real reader (seed: 提交后等待真实
        reader 完成再释放) and happens when the transaction settles."""
        if seq.phase is Phase.MATERIALIZING and seq.slot is not None and self.txn.current is not None:
            seq.cancel_requested = True
            return
        settle(self.pools, seq.reservation)
        if seq.slot is not None or any(seq.blocks.values()):
            self._drop_execution(seq)
        if seq.snapshot is not None and seq.snapshot.cid in self.cks.table:
            self.cks.release_owner(seq.snapshot, SnapshotOwner(seq.sid))
        seq.snapshot = None
        seq.phase = Phase.FINISHED
        self.sequences.pop(seq.sid, None)

    # ---- integrity ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The invariants of the module docstring."""
        for seq in self.sequences.values():
            if seq.phase is Phase.FINISHED:
                raise IntegrityError(f"sequence {seq.sid} is finished but still live")
            if seq.phase is Phase.RUNNING and seq.slot is None:
                raise IntegrityError(f"running sequence {seq.sid} holds no state slot")
            if seq.phase is Phase.PAUSED and (seq.slot is not None or any(seq.blocks.values())):
                raise IntegrityError(f"paused sequence {seq.sid} still holds Device state or KV")
