"""The Native Program: the worker's physical truth (seed: Native Program 与其 stores) — a façade.

It owns the model, the Device/Host memory and the stores, and every mutable fact about them:
sequences (ledger + frontiers + KV directory + writer state slot), checkpoints (exact restore
points), reservations, leases and the context transaction. Policy never reaches inside; the
worker calls these verbs for the plan's intents and reports what they did. Each verb's
docstring says what it reads and what it writes; the work is done by one part per job::

    Program (the worker's verbs)
      ├─ runner.ModelRunner                    one forward call: verify, sample, commit
      ├─ context.writers.Writers               bind (Move / Fork, read-back), freeze, pause, release
      ├─ context.captures.Captures             save destinations, the saves themselves
      ├─ context.host_placement.HostPlacement  demotions, Host holes, safe duplicates
      ├─ context.checkpoints.Checkpoints       the checkpoint table and its owners
      ├─ context.kv_directory.KvDirectory      KV blocks: pages, Host replicas, holders, COW
      ├─ context.slots.StateSlots              state slots and their holders
      └─ context.transaction.ContextTx         the one context transaction

The parts know each other only through their public methods, wired here; the draft backends
(speculative.py, dflash.py) reach their pool through the KV directory's. The read side and the
one reclaim writer (``apply``) form the ``ContextCache`` contract (context/contract.py) that
reclaim.py and the worker's permit checks rely on; ``check_integrity`` runs every part's
invariants.

Unit life cycle::

    seq_demand -> reserve_unit -> [prepare_capture] -> execute (allocate from the reservation,
    write, sample, commit, capture) -> settle (return the unused reservation)
"""

from __future__ import annotations

import hashlib
import logging
from itertools import count

import msgspec

from ninfer.faults import FaultPlan
from ninfer.native import calibration, graphs, reclaim
from ninfer.native.context.captures import CaptureDest, Captures
from ninfer.native.context.checkpoints import Checkpoints
from ninfer.native.context.host_placement import HostPlacement
from ninfer.native.context.kv_directory import KvDirectory
from ninfer.native.context.slots import StateSlots
from ninfer.native.context.transaction import ContextTx, Transaction, TxSettled
from ninfer.native.context.writers import BindOutcome, PauseResult, Writers
from ninfer.native.dflash import DFlashBackend
from ninfer.native.layout import KV_KINDS, MAIN, STATE, Layout
from ninfer.native.memory import Memory
from ninfer.native.model.model import HybridModel
from ninfer.native.objects import Checkpoint, KvBlock, NativeError, Sequence, next_generation
from ninfer.native.runner import ModelRunner, RowResult, UnitRow
from ninfer.native.speculative import MtpBackend
from ninfer.native.stores import Extent, HostArena, IdPool, IntegrityError, reserve_all, settle
from ninfer.native.transfer import TransferEngine
from ninfer.placement import place_first_fit
from ninfer.protocol import Action, BindMode, CommitResult, Delete, DropHostCopy, Owner, Refusal, UnitKind
from ninfer.sampling_params import SamplingParams

log = logging.getLogger("ninfer.native")

# the names the worker and the tests take from here
__all__ = ["Program", "NativeError", "CaptureDest", "UnitRow", "RowResult", "BindOutcome", "PauseResult",
           "TxSettled", "BindMode", "UnitKind"]


class Program:
    def __init__(self, model: HybridModel, layout: Layout, faults: FaultPlan | None = None,
                 copy_engine: str = "auto", tower=None, vision_merge: int = 0, encoder_cache_bytes: int = 0,
                 enforce_eager: bool = False):
        self.model = model
        self.vision_merge = vision_merge              # 0: no vision tower (text-only model)
        self.encoder = None                           # media.EncoderCache: tower outputs by digest
        if tower is not None:
            from ninfer.native.media import EncoderCache
            self.encoder = EncoderCache(tower, encoder_cache_bytes)
        self.layout = layout
        self.device = model.device
        self.pools: dict[str, IdPool] = {
            kind: IdPool(kind, layout.kv_pages[kind], layout.kv_page_bytes[kind]) for kind in KV_KINDS
        }
        self.pools[STATE] = IdPool(STATE, layout.state_slots, layout.state_image_bytes)
        backend = graphs.backend_for(model.device, enforce_eager)
        why = graphs.GraphRunner.usable(model) if backend is not None else ""
        if why:
            log.info("no CUDA graphs: %s", why)
            backend = None
        self.mem = Memory(model, layout.main_pages, layout.state_slots, layout.host_capacity_bytes,
                          scratch=backend is not None)
        self.host = HostArena(layout.host_capacity_bytes,
                              on_grow=self.mem.prefault.grew if self.mem.prefault is not None else None)
        self.transfers = TransferEngine(self.device, copy_engine, faults)
        self.exec_identity = hashlib.blake2b(
            (repr(model.cfg) + str(model.dtype) + model.path.name).encode(), digest_size=16).digest()
        self._ids = count(1)                          # sids, cids, bids, tids: one id space
        self.sequences: dict[int, Sequence] = {}     # the live sequences
        self.txn = ContextTx(self.transfers, self._ids)
        self.kv = KvDirectory(self.pools, self.host, self.mem, self._ids)
        self.slots = StateSlots(self.pools, self.host)
        self.cks = Checkpoints(self.kv, self.slots, self.host, self._ids, self.exec_identity)
        self.checkpoints = self.cks.table
        self.blocks = self.kv.blocks
        self.facts_memo = reclaim.FactsMemo(self.cks.noted, self.kv.noted)
        self.placement = HostPlacement(self.kv, self.slots, self.cks, self.sequences, self.host, self.mem, self.txn)
        self.writers = Writers(self.pools, self.kv, self.slots, self.cks, self.placement, self.txn, self.sequences,
                               self.host, self.mem)
        self.captures = Captures(self.pools, self.cks, self.slots, self.host, self.mem, self.txn)
        self.spec = None                             # the draft backend (speculative.py), when configured
        if layout.spec_method == "mtp":
            self.spec = MtpBackend(self.kv, self.checkpoints, layout, model)
        elif layout.spec_method:
            self.spec = DFlashBackend(self.kv, self.checkpoints, layout, model)
        self.cks.draft = self.spec
        self.runner = ModelRunner(model, self.mem, self.kv, self.spec, self.encoder, layout, backend)

    # ==== sizes and observation ==========================================================
    @property
    def inner_cuts(self) -> bool:
        """Whether a unit may save at positions inside it (``UnitRow.captures``): the eager
        forward keeps those images itself. Not with a draft backend (its coverage exists only
        at a unit's end), nor where chunks replay graphs (a graph keeps no inner state: such a
        chunk would run eagerly, so a save ends its unit instead, as before)."""
        return self.spec is None and not (self.runner.graphs is not None and self.runner.graphs.chunk_sizes)

    @property
    def image_bytes(self) -> int:
        return self.mem.image_bytes

    @property
    def page_bytes(self) -> int:
        return self.mem.page_bytes

    @property
    def tx(self) -> Transaction | None:
        return self.txn.current

    @property
    def bytes_h2d(self) -> int:
        return self.txn.bytes_h2d

    @property
    def bytes_d2h(self) -> int:
        return self.txn.bytes_d2h

    @property
    def host_only_pages(self) -> int:
        return self.kv.host_only_pages

    @property
    def graphs(self) -> graphs.GraphRunner | None:
        return self.runner.graphs

    @property
    def grammar_stats(self):
        return self.runner.grammar_stats

    def input_digest(self, tokens: tuple[int, ...] | list[int], media: bytes = b"") -> bytes:
        """The input identity of ``tokens`` under this Program's execution identity. Reads nothing mutable."""
        return self.cks.digest(tokens, media)

    # ==== sequences and units =============================================================
    def new_sequence(self, ledger: list[int], prompt_len: int, params: SamplingParams,
                     eos_ids: tuple[int, ...], media: list = ()) -> Sequence:
        """A new unbound sequence (MATERIALIZING, nothing held). Writes: the live sequences."""
        if media and self.encoder is None:
            raise NativeError("a prompt with images on a model without a vision tower")
        seq = Sequence(sid=next(self._ids), generation=next_generation(), ledger=list(ledger),
                       prompt_len=prompt_len, params=params, eos_ids=eos_ids)
        if media:
            from ninfer.native.media import SeqMedia
            seq.media = SeqMedia.build(seq.ledger, prompt_len, list(media), self.vision_merge)
        seq.blocks = self.kv.empty()
        self.sequences[seq.sid] = seq
        return seq

    def spec_peak(self, seq: Sequence, n_tokens: int) -> int:
        """Drafts a unit of ``n_tokens`` verifies (its speculative peak). Reads: the pending drafts."""
        return len(self.spec.drafts_for(seq, n_tokens)) if self.spec is not None else 0

    def seq_demand(self, seq: Sequence, n_tokens: int) -> dict[str, int]:
        """What reserving the sequence's next unit adds to what it already holds reserved.
        Reads: its frontier, Main directory (tail claim), pending drafts and reservation."""
        demand = self.kv.unit_demand(seq.sid, seq.frontier, seq.blocks[MAIN], n_tokens + self.spec_peak(seq, n_tokens))
        return {k: max(0, n - seq.reservation.amounts.get(k, 0)) for k, n in demand.items()}

    def tail_ok(self, seq: Sequence) -> bool:
        """May the sequence append at its frontier without a tail copy? Reads its tail block."""
        return self.kv.tail_ok(seq)

    def shortfall(self, demand: dict[str, int]) -> dict[str, int]:
        """Per pool, what the unreserved free units lack for ``demand``. Reads the pools."""
        return {k: n - self.pools[k].available for k, n in demand.items() if n > self.pools[k].available}

    def reserve_unit(self, seq: Sequence, n_tokens: int) -> dict[str, int]:
        """Reserve the unit's typed demand on top of what the sequence already holds.
        Returns {} on success, else the exact shortfall per pool (nothing reserved).
        Writes: the pools' reservations and the sequence's reservation."""
        res, short = reserve_all(self.pools, self.seq_demand(seq, n_tokens))
        if res is None:
            return short
        for k, n in res.amounts.items():
            seq.reservation.amounts[k] = seq.reservation.amounts.get(k, 0) + n
        return {}

    def settle(self, seq: Sequence) -> None:
        """Return what the sequence's reservation did not use. Writes: the pools' reservations."""
        settle(self.pools, seq.reservation)

    def execute(self, rows: list[UnitRow]) -> list[RowResult]:
        """Run one call (runner.py), then finish the captures its rows prepared.
        Reads: the rows' ledgers, reservations and drafts. Writes: their KV directories, state
        slots, frontiers and ledgers (committed tokens), the draft backend's coverage, and per
        capture a new checkpoint (a Device slot copy, or a Host copy joining the transaction), at
        the row's end or at an inner cut (the image the forward kept there)."""
        results = self.runner.execute(rows)
        for r, res in zip(rows, results):
            for at, dest in r.captures:
                cut = (at, res.cut_images.pop(at)) if at is not None else None
                res.saved.append(self.captures.finish(r.seq, dest, cut))
            r.captures = []
        return results

    def prepare_capture(self, owner: Owner, retire: list[tuple[Checkpoint, Owner]] = (),
                        replace: list[tuple[Checkpoint, Owner]] = ()) -> CaptureDest | None:
        """A save's destination before the unit runs: a reserved Device slot, else a Host extent,
        else None (captures.py). Writes: releases the ``retire`` holds, and the ``replace``
        holds only with a destination; reserves the slot or allocates the extent."""
        return self.captures.prepare(owner, retire, replace)

    def drop_capture(self, dest: CaptureDest) -> None:
        """Return an unused destination (its unit did not run). Writes: the pool or the Host."""
        self.captures.drop(dest)

    # ==== binding and the sequence's end ===================================================
    def bind_demand(self, sid: int, source: Checkpoint | None, mode: BindMode,
                    first_tokens: int) -> dict[str, int]:
        """State, missing KV, growth and tail pages to bind and run the first unit. Reads the
        source's replicas and leases and the state pool."""
        return self.writers.bind_demand(sid, source, mode, first_tokens)

    def check_source(self, seq_ledger: list[int], src: Checkpoint, mode: BindMode, mover: Owner | None
                     ) -> tuple[Refusal, str]:
        """Why ``src`` may not be adopted (exact prefix, execution identity, owners for a Move,
        copies in flight), or (NONE, ""). Reads the source."""
        return self.writers.check_source(seq_ledger, src, mode, mover)

    def bind(self, seq: Sequence, source: Checkpoint | None, mode: BindMode = BindMode.FORK,
             first_tokens: int = 0, mover: Owner | None = None,
             retire: list[tuple[Checkpoint, Owner]] = ()) -> BindOutcome:
        """Give ``seq`` a writer state and KV directory equal to ``source`` (None: the empty
        prefix) and reserve its first unit (writers.py). Writes: the pools, a state slot, the
        source's blocks (a new holder, pages read back), the source itself on a Move (consumed),
        the permitted ``retire`` holds (released once admitted), the sequence's own snapshot
        (given up), and the context transaction when something is read back."""
        return self.writers.bind(seq, source, mode, first_tokens, mover, retire)

    def freed_by_retiring(self, retire: list[tuple[Checkpoint, Owner]]) -> dict[str, int]:
        """Device units releasing these holds would free. Reads their checkpoints and blocks."""
        return self.cks.freed_by_retiring(retire)

    def freeze(self, seq: Sequence, owner: Owner) -> Checkpoint:
        """Normal finish: the writer state becomes a checkpoint owned by ``owner`` (the new E)
        and the sequence leaves. Writes: its reservation (settled), a new checkpoint that takes
        its slot and blocks, the live sequences."""
        return self.writers.freeze(seq, owner)

    def pause(self, seq: Sequence, to_host: bool = False, victims: list[Delete] = ()) -> PauseResult:
        """Give back the lane (writers.py): a Snapshot to the Host when it fits after deleting
        ``victims``, else destructive (Replay). Writes: its reservation, the victims, a SNAPSHOT
        checkpoint and the demotion of its unique content (joining the transaction), or the
        sequence's slot and blocks (dropped)."""
        return self.writers.pause(seq, to_host, victims)

    def release(self, seq: Sequence) -> None:
        """Cancel / error / done without saving: free everything the sequence holds (deferred
        to the settlement while its read-back is in flight). Writes: its reservation, slot,
        blocks and snapshot hold, the live sequences."""
        self.writers.release(seq)

    def fail_sequence(self, seq: Sequence) -> None:
        """Its unit failed: drop its execution state and let it go. Writes as ``release``."""
        self.writers.fail_sequence(seq)

    # ==== checkpoints =====================================================================
    def checkpoint(self, cid: int, generation: int) -> Checkpoint | None:
        """The checkpoint a reference names, or None when it is gone. Reads the table."""
        return self.cks.get(cid, generation)

    def add_owner(self, ck: Checkpoint, owner: Owner) -> None:
        """One more logical hold. Writes: its owners and version."""
        self.cks.add_owner(ck, owner)

    def release_owner(self, ck: Checkpoint, owner: Owner) -> bool:
        """Drop one hold; the checkpoint is deleted with its last (True). Writes: its owners and
        version; on deletion the table, its blocks' holders and its image's replicas."""
        return self.cks.release_owner(ck, owner)

    def delete_ok(self, a: Delete) -> str:
        """Why a quoted deletion may not be committed now ("" = it may). Reads the checkpoint."""
        return self.cks.delete_ok(a)

    def device_checkpoints(self) -> set[int]:
        """Checkpoints with Device content. Reads the slots and the paged blocks."""
        return self.cks.device_checkpoints()

    # ==== Host placement and reclaim ========================================================
    def demotion_sizes(self, images: list[Checkpoint], blocks: list[KvBlock],
                       dropped: set[int] = frozenset()) -> list[int]:
        """Host bytes these demotions allocate, in order. Reads the replicas."""
        return self.placement.demotion_sizes(images, blocks, dropped)

    def host_holes_after(self, deleted: set[int], dropped: set[int] = frozenset()) -> list[tuple[int, int]]:
        """The Host's free extents once these checkpoints' replicas are gone. Reads the arena."""
        return self.placement.host_holes_after(deleted, dropped)

    def host_duplicates(self, ck: Checkpoint) -> list[Extent]:
        """Its safe Host duplicates. Reads its replicas and the live sequences."""
        return self.placement.host_duplicates(ck)

    def pause_plan(self, seq: Sequence) -> tuple[list[KvBlock], list[int]]:
        """The blocks a Snapshot pause demotes and the Host bytes it allocates. Reads its blocks."""
        return self.placement.pause_plan(seq)

    def apply(self, actions: list[Action]) -> CommitResult:
        """The one writer of reclaim (context/contract.py): every action or none. Reads the
        actions' checkpoints and blocks (reclaim.verify) and the Host's free extents. Writes:
        the named safe Host duplicates (released), checkpoints (deleted) and replicas (demoted:
        the copies join the context transaction)."""
        why = reclaim.verify(self, actions)
        if why:
            return CommitResult(ok=False, reason=f"stale: {why}")
        deleted = {a.cid for a in actions if isinstance(a, Delete)}
        dropped = {a.cid for a in actions if isinstance(a, DropHostCopy)}
        images, blocks = reclaim.migrations_of(self, actions)
        sizes = self.placement.demotion_sizes(images, blocks, dropped)
        if sizes and place_first_fit(self.placement.host_holes_after(deleted, dropped), sizes) is None:
            return CommitResult(ok=False, reason="host: the destinations do not fit first-fit")
        before = {k: self.pools[k].free for k in (MAIN, STATE)}
        for cid in sorted(dropped):                 # safe duplicates first: nothing is lost
            self.placement.drop_host_copy(self.checkpoints[cid])
        for cid in sorted(deleted):
            self.cks.delete(self.checkpoints[cid])
        jobs, part = self.placement.demote(images, blocks)
        tid = self.txn.add(part, jobs) if part is not None else None
        return CommitResult(ok=True, tid=tid, freed={k: self.pools[k].free - n for k, n in before.items()})

    # ==== reports ===========================================================================
    def placement_changes(self) -> list[tuple[int, int, bool, int]]:
        """(cid, generation, image on the Device, Main pages only on the Host) of every
        checkpoint whose placement changed since the last call — O(what changed). Writes: the
        change marks (cleared) and the Host-only page index."""
        return self.cks.placement_changes()

    def take_uncovered(self) -> list[tuple[int, int]]:
        """(cid, generation) of the checkpoints found to lack the coverage their restore needs
        (DFlash) since the last call. Writes: that list (emptied)."""
        return self.spec.take_uncovered() if self.spec is not None else []

    def calibrate(self, tokens: int = 32) -> tuple[float, float]:
        """Measured (Host→Device bytes/s, prefill seconds per token) (calibration.py). Leaves
        nothing held."""
        return calibration.calibrate(self, tokens)

    def size_chunk(self) -> int:
        """``prefill_chunk_tokens="auto"``: the chunk measured to fit (``calibration.auto_chunk``)
        becomes the layout's, within the budget the layout was sized for. Leaves nothing held."""
        chunk, fixed, per_token = calibration.auto_chunk(self)
        log.info("prefill_chunk_tokens=auto: %d tokens (forward %.1f ms + %.1f us a token)", chunk,
                 1e3 * fixed, 1e6 * per_token)
        self.layout = msgspec.structs.replace(self.layout, prefill_chunk_tokens=chunk)
        return chunk

    # ==== the context transaction ============================================================
    def progress(self) -> list[TxSettled]:
        """One progress point: settle every delivered completion (publish, or abort all parts)."""
        return self.txn.progress()

    def publish(self, tid: int, generation: int, error: str = "") -> TxSettled | None:
        """Settle one completion; a stale one (gone, other generation) changes nothing."""
        return self.txn.publish(tid, generation, error)

    def overdue(self) -> list[TxSettled]:
        """Settle the transaction whose copies finished but whose completion never came."""
        return self.txn.overdue()

    def wait_transfers(self, timeout: float) -> None:
        """Block (without spinning) until a copy finishes or ``timeout`` passes."""
        self.txn.wait(timeout)

    # ==== integrity ==========================================================================
    def check_integrity(self, idle: bool = False) -> None:
        """Books balance: pools, Host extents, and every part's invariants (written beside the
        structures they govern). ``idle`` additionally requires no reservations, leases,
        orphaned images or transactions. Reads everything, writes nothing."""
        for pool in self.pools.values():
            pool.check_integrity()
        self.host.check_integrity()
        self.kv.check_integrity(self.sequences.values(), self.checkpoints.values())
        self.slots.check_integrity(self.sequences.values(), self.checkpoints.values(), idle)
        self.cks.check_integrity()
        self.writers.check_integrity()
        if idle:
            for pool in self.pools.values():
                if pool.reserved:
                    raise IntegrityError(f"{pool.kind}: {pool.reserved} units still reserved")
            self.txn.check_integrity(idle)
            if self.kv.leased() or self.cks.leased():
                raise IntegrityError("a reader lease is still held")

    def is_empty(self) -> bool:
        """Nothing held at all (after every sequence and checkpoint is released)."""
        return (not self.sequences and not self.checkpoints and not self.blocks
                and all(p.used == 0 and p.reserved == 0 for p in self.pools.values())
                and self.host.used_bytes == 0)

    def shutdown(self) -> None:
        """Stop the copy path (its thread or stream); nothing else is released."""
        self.transfers.shutdown()
