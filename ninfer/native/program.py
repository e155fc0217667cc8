"""The Native Program: the worker's physical truth (seed: Native Program 与其 stores).

It owns the model, the Device/Host memory and the stores, and every mutable fact about them:
sequences (ledger + frontiers + KV directory + writer state slot), checkpoints (exact restore
points), reservations, leases and in-flight transfers. Policy never reaches inside; it calls
these methods (through protocol messages) and reads quotes.

Unit life cycle::

    unit_demand -> reserve_unit -> execute (allocate from the reservation, write, sample,
    commit, optional capture) -> settle (return the unused reservation)

Context transactions (at most one at a time): bind with read-back, Host capture, demotion.
They take leases and destination reservations, submit copies, and publish when the controller
settles the completion ``(tid, generation)``; a late or duplicate completion names a
transaction that no longer exists (or exists with another generation) and is ignored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from itertools import count

import torch

from ninfer.errors import NInferError
from ninfer.native import reclaim
from ninfer.native.layout import KV_KINDS, MAIN, STATE, Layout
from ninfer.native.memory import Memory
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from ninfer.native.objects import (
    Checkpoint, CkptKind, KvBlock, Sequence, SeqState, StateImage, next_generation, pages_for,
)
from ninfer.native.sampler import sample_token, stop_reason
from ninfer.native.stores import (
    HostArena, IdPool, IntegrityError, Reservation, allocate, reserve_all, settle,
)
from ninfer.native.transfer import FaultHook, TransferEngine
from ninfer.sampling_params import SamplingParams


class NativeError(NInferError):
    """A request to the Program that contradicts its physical truth (a policy bug)."""


class UnitKind(str, Enum):
    PREFILL = "prefill"
    REPLAY = "replay"
    DECODE = "decode"
    VERIFY = "verify"        # typed now; executed by the speculative backends (later wave)
    CONTROL = "control"
    NORMALIZE = "normalize"


class BindMode(str, Enum):
    MOVE = "move"    # exclusive hand-over of the source's state and KV references
    FORK = "fork"    # the immutable source stays; share full pages, copy state (and tail on write)


@dataclass
class UnitRow:
    """One row of an execute call. ``n_tokens == 0`` samples from the continuation hidden
    (an exact hit); otherwise ledger[frontier : frontier + n_tokens] are computed."""

    seq: Sequence
    n_tokens: int
    kind: UnitKind = UnitKind.DECODE
    capture_owner: str | None = None     # after the unit, save the new frontier for this owner
    capture_where: str = "auto"          # "device" | "host" | "auto" (Device first, then Host)
    capture_retire: list = field(default_factory=list)   # (checkpoint, owner) holds given up first


@dataclass
class RowResult:
    sid: int
    frontier: int
    committed: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    captured: Checkpoint | None = None
    capture_skipped: bool = False


@dataclass
class BindOutcome:
    ok: bool
    shortfall: dict[str, int] = field(default_factory=dict)
    tid: int | None = None           # set when read-back copies are in flight
    busy: bool = False               # another context transaction is running


@dataclass(eq=False)
class Transaction:
    tid: int
    generation: int
    kind: str
    publish: Callable[[], None]
    completed: bool = False


class Program:
    def __init__(self, model: HybridModel, layout: Layout, hook: FaultHook | None = None):
        self.model = model
        self.layout = layout
        self.device = model.device
        self.pools: dict[str, IdPool] = {
            kind: IdPool(kind, layout.kv_pages[kind], layout.kv_page_bytes[kind]) for kind in KV_KINDS
        }
        self.pools[STATE] = IdPool(STATE, layout.state_slots, layout.state_image_bytes)
        self.mem = Memory(model, layout.main_pages, layout.state_slots, layout.host_capacity_bytes)
        self.host = HostArena(layout.host_capacity_bytes)
        self.transfers = TransferEngine(self.device, hook)
        self.exec_identity = hashlib.blake2b(
            (repr(model.cfg) + str(model.dtype) + "torch-reference").encode(), digest_size=16).digest()
        self._ids = count(1)
        self.sequences: dict[int, Sequence] = {}
        self.checkpoints: dict[int, Checkpoint] = {}
        self.blocks: dict[int, KvBlock] = {}
        self.tx: Transaction | None = None
        self._slot_owner: dict[int, object] = {}     # state slot -> Sequence | Checkpoint | StateImage
        self._orphans: set[StateImage] = set()       # images of deleted checkpoints still being read
        self.bytes_h2d = 0                           # observation: copies submitted each way
        self.bytes_d2h = 0

    # ==== identity =====================================================================
    def input_digest(self, tokens: tuple[int, ...] | list[int], media: bytes = b"") -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(self.exec_identity)
        h.update(media)
        h.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
        return h.digest()

    # ==== sequences ====================================================================
    def new_sequence(self, ledger: list[int], prompt_len: int, params: SamplingParams,
                     eos_ids: tuple[int, ...]) -> Sequence:
        seq = Sequence(sid=next(self._ids), generation=next_generation(), ledger=list(ledger),
                       prompt_len=prompt_len, params=params, eos_ids=eos_ids)
        seq.blocks = {MAIN: []}
        self.sequences[seq.sid] = seq
        return seq

    def unit_demand(self, seq: Sequence, n_tokens: int, start: int | None = None,
                    blocks: list[KvBlock] | None = None) -> dict[str, int]:
        """Main pages a unit of ``n_tokens`` at the sequence's frontier needs: growth pages plus
        a tail copy when the frontier is inside a block this sequence may not append to."""
        f = seq.frontier if start is None else start
        have = seq.blocks[MAIN] if blocks is None else blocks
        need = pages_for(f + n_tokens) - len(have)
        cow = 1 if n_tokens and f % PAGE_SIZE and not self._can_append(have[f // PAGE_SIZE], seq.sid, f) else 0
        return {MAIN: max(0, need) + cow}

    def _can_append(self, block: KvBlock, sid: int, f: int) -> bool:
        return block.filled == f % PAGE_SIZE and block.appender in (None, sid)

    def reserve_unit(self, seq: Sequence, n_tokens: int) -> dict[str, int]:
        """Reserve the unit's typed demand on top of what the sequence already holds.
        Returns {} on success, else the exact shortfall per pool (nothing reserved)."""
        demand = self.unit_demand(seq, n_tokens)
        extra = {k: max(0, n - seq.reservation.amounts.get(k, 0)) for k, n in demand.items()}
        res, short = reserve_all(self.pools, extra)
        if res is None:
            return short
        for k, n in res.amounts.items():
            seq.reservation.amounts[k] = seq.reservation.amounts.get(k, 0) + n
        return {}

    def settle(self, seq: Sequence) -> None:
        settle(self.pools, seq.reservation)

    # ==== binding ======================================================================
    def bind_demand(self, seq: Sequence, source: Checkpoint | None, mode: BindMode,
                    first_tokens: int) -> dict[str, int]:
        """Read-only: State, missing KV, growth and tail pages to bind and run the first unit."""
        if source is None:
            return {STATE: 1, **self.unit_demand(seq, first_tokens, 0, [])}
        slot = 0 if self._slot_handover(source, mode) else 1
        missing = sum(1 for b in source.blocks[MAIN] if b.page is None)
        unit = self.unit_demand(seq, first_tokens, source.frontier, source.blocks[MAIN])
        return {STATE: slot, MAIN: missing + unit[MAIN]}

    def _slot_handover(self, src: Checkpoint, mode: BindMode) -> bool:
        """Can the writer take the source's Device slot instead of a new one? Move: always.
        Fork: when slots are short and a Host replica keeps the old identity restorable
        (seed: Device 槽紧张且有 Host 副本时 … 将 Device 槽交给新的 active identity)."""
        img = src.image
        if img.slot is None or img.leases:
            return False
        return mode is BindMode.MOVE or (img.host is not None and self.pools[STATE].available == 0)

    def bind(self, seq: Sequence, source: Checkpoint | None, mode: BindMode = BindMode.FORK,
             first_tokens: int = 0, mover: str | None = None,
             retire: list[tuple[Checkpoint, str]] = ()) -> BindOutcome:
        """Give ``seq`` a writer state and KV directory equal to ``source`` (None = the empty
        prefix) and reserve its first unit. Move consumes the source (its owners other than
        ``mover`` must be gone); Fork keeps it. A bind that needs read-back starts a context
        transaction and leaves the sequence MATERIALIZING until it is published.

        ``retire`` lists (checkpoint, owner) holds the policy permits this bind to give up:
        what they would really free counts toward the demand, and they are released only once
        the bind is admitted (seed: 绑定先检查退休后的实际可用资源，接纳后退休获准替代的更深私有点;
        a failed bind retires nothing)."""
        if seq.slot is not None or seq.state not in (SeqState.MATERIALIZING, SeqState.PAUSED):
            raise NativeError(f"sequence {seq.sid} is already bound")
        if source is not None:
            self._verify_source(seq, source, mode, mover)
            if any(b.leases for b in source.blocks[MAIN]) or source.image.leases:
                return BindOutcome(ok=False, busy=True)      # a copy of it is in flight
        demand = self.bind_demand(seq, source, mode, first_tokens)
        if source is not None:
            needs_copy = any(b.page is None for b in source.blocks[MAIN]) or source.image.slot is None
            if needs_copy and self.tx is not None:
                return BindOutcome(ok=False, busy=True)
        retire = [(c, o) for c, o in retire if c is not source and c.cid in self.checkpoints]
        res, short = reserve_all(self.pools, demand)
        if res is None:
            freed = self.freed_by_retiring(retire)
            if not retire or any(n > freed.get(k, 0) for k, n in short.items()):
                return BindOutcome(ok=False, shortfall=short)
            self._retire(retire)
            res, short = reserve_all(self.pools, demand)
            assert res is not None, "retirement freed less than simulated"
        else:
            self._retire(retire)
        seq.reservation = res
        jobs: tuple = ()
        if source is None:
            seq.slot = self._take_slot(seq, res)
            self.mem.zero_slot(seq.slot)
            seq.frontier = 0
        else:
            jobs = self._bind_from(seq, source, mode, mover, res)
        self._drop_own_snapshot(seq)
        if not jobs:
            seq.state = SeqState.BOUND
            return BindOutcome(ok=True)
        reads, after = jobs
        seq.state = SeqState.MATERIALIZING
        tid = self._begin_tx("bind", reads, lambda: self._finish_bind(seq, after))
        return BindOutcome(ok=True, tid=tid)

    def _drop_own_snapshot(self, seq: Sequence) -> None:
        """A resumed sequence has no pause snapshot any more: consumed by a Move, or given up
        when it resumes from another source (Replay)."""
        snap, owner = seq.snapshot, f"seq:{seq.sid}"
        seq.snapshot = None
        if snap is not None and snap.cid in self.checkpoints and owner in snap.owners:
            self.release_owner(snap, owner)

    def freed_by_retiring(self, retire: list[tuple[Checkpoint, str]]) -> dict[str, int]:
        """Device units that releasing these holds would really free (read-only): only
        checkpoints whose last owner is released go, and only blocks all of whose holders go."""
        gone = {c.cid for c, o in retire if c.owners == {o: 1} and not c.image.leases}
        freed = {STATE: sum(1 for c, _ in retire if c.cid in gone and c.image.slot is not None)}
        seen: set[int] = set()
        for c, _ in retire:
            if c.cid not in gone:
                continue
            for kind, blocks in c.blocks.items():
                for b in blocks:
                    if b.bid not in seen and b.page is not None and not b.leases and b.holders <= gone:
                        seen.add(b.bid)
                        freed[kind] = freed.get(kind, 0) + 1
        return freed

    def _retire(self, retire: list[tuple[Checkpoint, str]]) -> None:
        for c, owner in retire:
            if c.cid in self.checkpoints and owner in c.owners:
                self.release_owner(c, owner)

    def _verify_source(self, seq: Sequence, src: Checkpoint, mode: BindMode, mover: str | None) -> None:
        """Adoption checks exact identity (seed: 采用前还要校验 token、位置、媒体与执行身份)."""
        if src.cid not in self.checkpoints:
            raise NativeError(f"checkpoint {src.cid} no longer exists")
        f = src.frontier
        if f > len(seq.ledger) or tuple(seq.ledger[:f]) != src.tokens:
            raise NativeError(f"checkpoint {src.cid} is not an exact prefix of sequence {seq.sid}")
        if src.digest != self.input_digest(src.tokens):
            raise NativeError(f"checkpoint {src.cid} has a different execution identity")
        if mode is BindMode.MOVE:
            others = {o for o in src.owners if o != mover}
            if others:
                raise NativeError(f"checkpoint {src.cid} cannot be moved: still held by {sorted(others)}")

    def _take_slot(self, holder, res: Reservation) -> int:
        slot = allocate(self.pools, res, STATE)
        self._slot_owner[slot] = holder
        return slot

    def _bind_from(self, seq: Sequence, src: Checkpoint, mode: BindMode, mover: str | None,
                   res: Reservation) -> tuple:
        """Install the source's state and KV references. Returns () when everything was on the
        Device, else (read-back jobs, cleanup to run when they are published)."""
        reads: list = []
        leased: list = []
        detached = None                      # a moved image's Host extent, freed after its read
        seq.frontier = src.frontier
        img = src.image
        if self._slot_handover(src, mode):
            seq.slot = img.slot
            self._slot_owner[seq.slot] = seq
            img.slot = None
        else:
            seq.slot = self._take_slot(seq, res)
            if img.slot is not None:
                self.mem.copy_slot(img.slot, seq.slot)
            else:
                reads.append(self.mem.host_to_slot(img.host, seq.slot))
                self.bytes_h2d += self.mem.image_bytes
                if mode is BindMode.MOVE:
                    detached, img.host = img.host, None
                else:
                    img.leases += 1
                    leased.append(img)
        for kind, blocks in src.blocks.items():
            seq.blocks[kind] = list(blocks)
            for b in blocks:
                b.holders.add(seq.sid)
                if b.page is None:
                    b.page = allocate(self.pools, res, kind)
                    b.leases += 1           # in-flight read-back: nobody may rely on it yet
                    leased.append(b)
                    reads.append(self.mem.host_to_page(b.host, b.page))
                    self.bytes_h2d += self.mem.page_bytes
                    b.touch()
        self._claim_tail(seq)
        if mode is BindMode.MOVE:
            self._delete_checkpoint(src, keep_content=True)
        if not reads:
            return ()

        def after() -> None:
            for obj in leased:
                self.unlease(obj)
            if detached is not None:
                self.host.release(detached)
        return reads, after

    def _finish_bind(self, seq: Sequence, after: Callable[[], None]) -> None:
        after()
        if seq.state is SeqState.MATERIALIZING:
            seq.state = SeqState.BOUND
        if seq.cancel_requested:
            self.release(seq)

    def _claim_tail(self, seq: Sequence) -> None:
        blocks = seq.blocks[MAIN]
        f = seq.frontier
        if f % PAGE_SIZE and blocks and self._can_append(blocks[-1], seq.sid, f):
            blocks[-1].appender = seq.sid

    # ==== execution ====================================================================
    def execute(self, rows: list[UnitRow]) -> list[RowResult]:
        """Run one call: decode rows and at most one multi-token chunk, sample where the
        ledger ends, commit, and capture where asked. Rows must hold their reservations."""
        if sum(1 for r in rows if r.n_tokens > 1) > 1:
            raise NativeError("at most one prefill/replay chunk per call")
        compute = [r for r in rows if r.n_tokens > 0]
        seqs_in = []
        for r in compute:
            seq = r.seq
            if seq.state is not SeqState.BOUND:
                raise NativeError(f"sequence {seq.sid} is {seq.state.value}, not bound")
            end = seq.frontier + r.n_tokens
            if end > len(seq.ledger):
                raise NativeError(f"unit beyond the ledger of sequence {seq.sid}")
            self._prepare_blocks(seq, end)
            seqs_in.append(SeqInput(token_ids=seq.ledger[seq.frontier:end], start=seq.frontier,
                                    page_table=[b.page for b in seq.blocks[MAIN]], state_slot=seq.slot))
        captures = {}
        for r in rows:
            if r.capture_owner:
                host_taken = any(d and d[0] == "host" for d in captures.values())
                captures[id(r)] = self._prepare_capture(r, allow_host=not host_taken)
        logits: dict[int, torch.Tensor] = {}
        if seqs_in:
            out = self.model.forward(ForwardBatch.build(seqs_in, self.device), self.mem.cache)
            for i, r in enumerate(compute):
                seq = r.seq
                end = seq.frontier + r.n_tokens
                self._mark_written(seq, seq.frontier, end)
                seq.frontier = end
                self.mem.hidden[seq.slot] = out.hidden[i]
                logits[seq.sid] = out.logits[i]
        results = []
        for r in rows:
            seq = r.seq
            res = RowResult(sid=seq.sid, frontier=seq.frontier)
            if seq.frontier == len(seq.ledger) and not seq.finished:
                self._sample(seq, res, logits.get(seq.sid))
            if r.capture_owner:
                res.captured = self._finish_capture(seq, r.capture_owner, captures[id(r)])
                res.capture_skipped = res.captured is None
            results.append(res)
        return results

    def _sample(self, seq: Sequence, res: RowResult, logits: torch.Tensor | None) -> None:
        if logits is None:       # exact hit: sample from the continuation hidden
            logits = self.model.logits(self.mem.hidden[seq.slot][None])[0]
        pos = len(seq.ledger)
        tok = sample_token(logits, seq.params, pos, seq.ledger[:seq.prompt_len], seq.outputs)
        seq.ledger.append(tok)
        res.committed.append(tok)
        seq.finished = stop_reason(tok, seq.n_generated, seq.params, seq.eos_ids)
        res.finish_reason = seq.finished

    def _prepare_blocks(self, seq: Sequence, end: int) -> None:
        """Allocate growth pages and copy a tail the sequence may not append to (COW)."""
        blocks = seq.blocks[MAIN]
        f = seq.frontier
        if f % PAGE_SIZE and not self._can_append(blocks[f // PAGE_SIZE], seq.sid, f):
            old = blocks[f // PAGE_SIZE]
            new = self._new_block(MAIN, seq)
            if old.page is None:
                raise NativeError(f"block {old.bid} has no Device replica")
            self.mem.copy_page_prefix(old.page, new.page, f % PAGE_SIZE)
            new.filled = f % PAGE_SIZE
            blocks[f // PAGE_SIZE] = new
            self._drop_holder(old, seq.sid)
        elif f % PAGE_SIZE:
            blocks[-1].appender = seq.sid
        while len(blocks) < pages_for(end):
            blocks.append(self._new_block(MAIN, seq))
        for b in blocks:
            if b.page is None or b.leases:
                raise NativeError(f"block {b.bid} of sequence {seq.sid} is not resident")

    def _new_block(self, kind: str, seq: Sequence) -> KvBlock:
        b = KvBlock(bid=next(self._ids), kind=kind, holders={seq.sid}, appender=seq.sid)
        b.page = allocate(self.pools, seq.reservation, kind)
        self.blocks[b.bid] = b
        return b

    def _mark_written(self, seq: Sequence, start: int, end: int) -> None:
        blocks = seq.blocks[MAIN]
        for p in range(start // PAGE_SIZE, pages_for(end)):
            b = blocks[p]
            b.filled = max(b.filled, min(PAGE_SIZE, end - p * PAGE_SIZE))
            if b.host is not None and b.host_filled < b.filled:
                self._release_host(b)      # the Host copy no longer holds everything
            b.touch()

    # ==== checkpoints ==================================================================
    def _prepare_capture(self, row: UnitRow, allow_host: bool):
        """Destination first (seed: 跨过语义 frontier 前准备目的 state): a Device slot, else Host,
        else skip. Host needs the (single) context-transaction turn. Permitted old points
        retire first; a failed save does not bring them back (seed: 新保存失败不恢复旧点)."""
        self._retire(row.capture_retire)
        if row.capture_where in ("device", "auto"):
            res, _ = reserve_all(self.pools, {STATE: 1})
            if res is not None:
                return ("device", res)
        if row.capture_where in ("host", "auto") and self.tx is None and allow_host:
            ext = self.host.allocate(self.mem.image_bytes, kind="state")
            if ext is not None:
                return ("host", ext)
        return None

    def _finish_capture(self, seq: Sequence, owner: str, dest) -> Checkpoint | None:
        if dest is None:
            return None
        image = StateImage()
        ck = self._new_checkpoint(CkptKind.CACHE, seq, image, owner)
        if dest[0] == "device":
            image.slot = self._take_slot(ck, dest[1])
            self.mem.copy_slot(seq.slot, image.slot)
        else:
            image.host = dest[1]
            image.leases += 1          # not a query source until the copy is published
            job = self.mem.slot_to_host(seq.slot, dest[1], snapshot_now=True)
            self.bytes_d2h += self.mem.image_bytes

            self._begin_tx("capture", [job], lambda: self.unlease(image))
        return ck

    def _new_checkpoint(self, kind: CkptKind, seq: Sequence, image: StateImage, owner: str) -> Checkpoint:
        tokens = tuple(seq.ledger[:seq.frontier])
        ck = Checkpoint(cid=next(self._ids), generation=next_generation(), kind=kind, tokens=tokens,
                        digest=self.input_digest(tokens), image=image, blocks={}, owners={owner: 1})
        n = pages_for(seq.frontier)
        for k, blocks in seq.blocks.items():
            ck.blocks[k] = blocks[:n]
            for b in ck.blocks[k]:
                b.holders.add(ck.cid)
                b.touch()
        self.checkpoints[ck.cid] = ck
        return ck

    def add_owner(self, ck: Checkpoint, owner: str) -> None:
        ck.owners[owner] = ck.owners.get(owner, 0) + 1
        ck.touch()

    def release_owner(self, ck: Checkpoint, owner: str) -> bool:
        """Drop one logical hold; the checkpoint is deleted with its last owner. True if deleted."""
        n = ck.owners.get(owner, 0)
        if n == 0:
            raise NativeError(f"checkpoint {ck.cid} has no owner {owner!r}")
        if n == 1:
            del ck.owners[owner]
        else:
            ck.owners[owner] = n - 1
        ck.touch()
        if not ck.owners:
            self._delete_checkpoint(ck)
            return True
        return False

    def _delete_checkpoint(self, ck: Checkpoint, keep_content: bool = False) -> None:
        """Remove a checkpoint. ``keep_content``: its Device state and block holds were handed
        over. Replicas still being read are freed when their reader finishes."""
        del self.checkpoints[ck.cid]
        for blocks in ck.blocks.values():
            for b in blocks:
                self._drop_holder(b, ck.cid)
        if ck.image.leases:
            self._orphans.add(ck.image)
            if ck.image.slot is not None:
                self._slot_owner[ck.image.slot] = ck.image
        elif not keep_content:
            self._free_image(ck.image)
        elif ck.image.host is not None:
            self.host.release(ck.image.host)
            ck.image.host = None
        ck.owners.clear()

    def unlease(self, obj: KvBlock | StateImage) -> None:
        """A reader finished: drop its lease and free the replica if nobody holds it any more."""
        obj.leases -= 1
        if obj.leases:
            return
        if isinstance(obj, KvBlock):
            if not obj.holders:
                self._free_block(obj)
        elif obj in self._orphans:
            self._orphans.discard(obj)
            self._free_image(obj)

    def _free_image(self, image: StateImage) -> None:
        if image.slot is not None:
            self._release_slot(image.slot)
            image.slot = None
        if image.host is not None:
            self.host.release(image.host)
            image.host = None

    def _release_slot(self, slot: int) -> None:
        del self._slot_owner[slot]
        self.pools[STATE].release(slot)

    def _drop_holder(self, b: KvBlock, holder: int) -> None:
        b.holders.discard(holder)
        if b.appender == holder:
            b.appender = None
        b.touch()
        if not b.holders and not b.leases:
            self._free_block(b)

    def _free_block(self, b: KvBlock) -> None:
        if b.page is not None:
            self.pools[b.kind].release(b.page)
            b.page = None
        if b.host is not None:
            self.host.release(b.host)
            b.host = None
        del self.blocks[b.bid]

    def _release_host(self, b: KvBlock) -> None:
        self.host.release(b.host)
        b.host, b.host_filled = None, 0

    # ==== lifecycle ====================================================================
    def freeze(self, seq: Sequence, owner: str) -> Checkpoint:
        """Normal finish: the legal execution state becomes a checkpoint (the new E) and the
        sequence is released (seed: 正常结束将合法执行态 freeze 为新 E)."""
        self.settle(seq)
        ck = self._handover(seq, CkptKind.CACHE, owner)
        self.sequences.pop(seq.sid)
        seq.state = SeqState.RELEASED
        return ck

    def pause(self, seq: Sequence, destructive: bool = False) -> Checkpoint | None:
        """Give back the lane at a stable commit boundary. Snapshot: the writer state and KV
        references become a SNAPSHOT checkpoint owned by the sequence (no copy, no new Device
        allocation; reclaim may demote or revoke it later). Destructive: drop them (Replay)."""
        if seq.state is not SeqState.BOUND:
            raise NativeError(f"only a bound sequence can pause (sequence {seq.sid} is {seq.state.value})")
        self.settle(seq)
        if destructive:
            self._drop_execution(seq)
            seq.snapshot = None
        else:
            seq.snapshot = self._handover(seq, CkptKind.SNAPSHOT, f"seq:{seq.sid}")
        seq.state = SeqState.PAUSED
        return seq.snapshot

    def _handover(self, seq: Sequence, kind: CkptKind, owner: str) -> Checkpoint:
        """Turn the writer into an immutable checkpoint at the current frontier (Move)."""
        image = StateImage(slot=seq.slot)
        ck = self._new_checkpoint(kind, seq, image, owner)
        self._slot_owner[seq.slot] = ck
        seq.slot = None
        for blocks in seq.blocks.values():
            for b in blocks:
                self._drop_holder(b, seq.sid)
        seq.blocks = {MAIN: []}
        return ck

    def _drop_execution(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self._release_slot(seq.slot)
            seq.slot = None
        for blocks in seq.blocks.values():
            for b in blocks:
                self._drop_holder(b, seq.sid)
        seq.blocks = {MAIN: []}

    def release(self, seq: Sequence) -> None:
        """Cancel / error / done without saving: free everything the sequence holds. While its
        read-back is in flight the release waits for the real reader (seed: 提交后等待真实
        reader 完成再释放) and happens when the transfer is published."""
        if seq.state is SeqState.MATERIALIZING and seq.slot is not None and self.tx is not None:
            seq.cancel_requested = True
            return
        self.settle(seq)
        if seq.slot is not None or any(seq.blocks.values()):
            self._drop_execution(seq)
        if seq.snapshot is not None and seq.snapshot.cid in self.checkpoints:
            self.release_owner(seq.snapshot, f"seq:{seq.sid}")
        seq.snapshot = None
        seq.state = SeqState.RELEASED
        self.sequences.pop(seq.sid, None)

    # ==== transactions =================================================================
    def _begin_tx(self, kind: str, jobs: list, publish: Callable[[], None]) -> int:
        if self.tx is not None:
            raise NativeError("a context transaction is already running")
        tx = Transaction(tid=next(self._ids), generation=next_generation(), kind=kind, publish=publish)
        self.tx = tx

        def run() -> None:
            for job in jobs:
                job()
        self.transfers.submit(tx.tid, tx.generation, run)
        return tx.tid

    def poll_transfers(self) -> list[tuple[int, int]]:
        return self.transfers.drain()

    def publish(self, tid: int, generation: int) -> bool:
        """Settle one completion. A completion for a transaction that is gone, or with another
        generation (a reused descriptor), changes nothing and returns False."""
        tx = self.tx
        if tx is None or tx.tid != tid or tx.generation != generation or tx.completed:
            return False
        tx.completed = True
        self.tx = None
        self.transfers.forget((tid, generation))
        tx.publish()
        return True

    def overdue(self) -> list[tuple[int, int]]:
        """The running transaction, if its copy has finished but no completion was delivered
        (dropped). The controller calls this after its completion timeout and settles it."""
        tx = self.tx
        if tx is not None and self.transfers.finished((tx.tid, tx.generation)):
            return [(tx.tid, tx.generation)]
        return []

    def wait_transfers(self, timeout: float) -> list[tuple[int, int]]:
        """Block (without spinning) until a completion is ready or ``timeout`` passes."""
        done = self.poll_transfers()
        if not done and self.transfers.inflight:
            self.transfers.wait(timeout)
            done = self.poll_transfers()
        return done

    # ==== reclaim ======================================================================
    def quote(self) -> reclaim.Facts:
        return reclaim.quote(self)

    def commit(self, actions: list[reclaim.Action]) -> reclaim.CommitResult:
        return reclaim.commit(self, actions)

    # ==== integrity ====================================================================
    def check_integrity(self, idle: bool = False) -> None:
        """Books balance: pools, Host extents, block holders and slot ownership. ``idle``
        additionally requires no reservations, leases or transactions."""
        for pool in self.pools.values():
            pool.check_integrity()
        self.host.check_integrity()
        dirs: dict[int, list[KvBlock]] = {}
        for s in self.sequences.values():
            dirs[s.sid] = [b for bl in s.blocks.values() for b in bl]
        for c in self.checkpoints.values():
            dirs[c.cid] = [b for bl in c.blocks.values() for b in bl]
        counted: dict[int, set[int]] = {}
        for owner, blocks in dirs.items():
            for b in blocks:
                counted.setdefault(b.bid, set()).add(owner)
        for bid, b in self.blocks.items():
            if counted.get(bid, set()) != b.holders:
                raise IntegrityError(f"block {bid}: holders {sorted(b.holders)} != directories {sorted(counted.get(bid, set()))}")
        if set(counted) - set(self.blocks):
            raise IntegrityError("a directory names a deleted block")
        pages = [b.page for b in self.blocks.values() if b.page is not None]
        if len(pages) != len(set(pages)) or set(pages) != self.pools[MAIN].used_ids():
            raise IntegrityError("main pool pages and block replicas disagree")
        slots = {s.slot: s for s in self.sequences.values() if s.slot is not None}
        slots.update({c.image.slot: c for c in self.checkpoints.values() if c.image.slot is not None})
        slots.update({img.slot: img for img in self._orphans if img.slot is not None})
        if set(slots) != self.pools[STATE].used_ids() or set(slots) != set(self._slot_owner):
            raise IntegrityError("state slots and their owners disagree")
        for c in self.checkpoints.values():
            if not c.owners:
                raise IntegrityError(f"checkpoint {c.cid} has no owner")
            if c.image.slot is None and c.image.host is None:
                raise IntegrityError(f"checkpoint {c.cid} has no StateImage replica")
        if idle:
            for pool in self.pools.values():
                if pool.reserved:
                    raise IntegrityError(f"{pool.kind}: {pool.reserved} units still reserved")
            if self.tx is not None or self.transfers.inflight:
                raise IntegrityError("a transaction is still in flight")
            if any(b.leases for b in self.blocks.values()) or any(c.image.leases for c in self.checkpoints.values()):
                raise IntegrityError("a reader lease is still held")
            if self._orphans:
                raise IntegrityError("an orphaned StateImage was never freed")

    def is_empty(self) -> bool:
        """Nothing held at all (after every sequence and checkpoint is released)."""
        return (not self.sequences and not self.checkpoints and not self.blocks
                and all(p.used == 0 and p.reserved == 0 for p in self.pools.values())
                and self.host.used_bytes == 0)

    def shutdown(self) -> None:
        self.transfers.shutdown()
