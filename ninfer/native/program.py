"""The Native Program: the worker's physical truth (seed: Native Program 与其 stores).

It owns the model, the Device/Host memory and the stores, and every mutable fact about them:
sequences (ledger + frontiers + KV directory + writer state slot), checkpoints (exact restore
points), reservations, leases and the context transaction. Policy never reaches inside; the
worker calls these methods for the plan's intents and reports what they did.

Unit life cycle::

    unit_demand -> reserve_unit -> execute (allocate from the reservation, write, sample,
    commit, optional capture) -> settle (return the unused reservation)

The context transaction (at most one at a time; seed: Program 同时至多有一个上下文事务) carries
binds with read-back, Host captures, demotions and pause snapshots. A later copy joins the
running transaction while its copies are still in flight; its completion comes once all of
them finished. Each part follows the seed's order (sources and destinations → leases and
reservations → copies → completion → publish → release sources) and knows how to abort: a copy
error aborts the whole transaction — leases dropped, destinations freed, sequences whose
read-back failed released, captures and pause snapshots that could not be written deleted —
and the report names exactly what it cost. A late or duplicate completion names a transaction
that is gone (or has another generation) and changes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import time
from itertools import count

import torch

from ninfer.faults import FaultPlan
from ninfer.native import graphs
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
from ninfer.protocol import BindMode, Delete, Owner, Refusal, UnitKind
from ninfer.sampling_params import SamplingParams

log = logging.getLogger("ninfer.native")


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
        self.host = HostArena(layout.host_capacity_bytes)
        self.transfers = TransferEngine(self.device, copy_engine, faults)
        self.exec_identity = hashlib.blake2b(
            (repr(model.cfg) + str(model.dtype) + model.path.name).encode(), digest_size=16).digest()
        self._ids = count(1)
        self.txn = ContextTx(self.transfers, self._ids)
        self.kv = KvDirectory(self.pools, self.host, self.mem, self._ids)
        self.slots = StateSlots(self.pools, self.host)
        self.cks = Checkpoints(self.kv, self.slots, self.host, self._ids, self.exec_identity)
        self.sequences: dict[int, Sequence] = {}
        self.checkpoints = self.cks.table
        self.blocks = self.kv.blocks
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

    # ==== identity =====================================================================
    def input_digest(self, tokens: tuple[int, ...] | list[int], media: bytes = b"") -> bytes:
        return self.cks.digest(tokens, media)

    # ==== sequences ====================================================================
    def new_sequence(self, ledger: list[int], prompt_len: int, params: SamplingParams,
                     eos_ids: tuple[int, ...], media: list = ()) -> Sequence:
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

    def take_uncovered(self) -> list[tuple[int, int]]:
        """(cid, generation) of the checkpoints found to lack the coverage their restore needs
        (DFlash) since the last call, for the next reply."""
        return self.spec.take_uncovered() if self.spec is not None else []

    def spec_peak(self, seq: Sequence, n_tokens: int) -> int:
        """Drafts a unit of ``n_tokens`` verifies (its speculative peak)."""
        return len(self.spec.drafts_for(seq, n_tokens)) if self.spec is not None else 0

    def seq_demand(self, seq: Sequence, n_tokens: int) -> dict[str, int]:
        """What reserving the sequence's next unit adds to what it already holds reserved."""
        demand = self.kv.unit_demand(seq.sid, seq.frontier, seq.blocks[MAIN], n_tokens + self.spec_peak(seq, n_tokens))
        return {k: max(0, n - seq.reservation.amounts.get(k, 0)) for k, n in demand.items()}

    def tail_ok(self, seq: Sequence) -> bool:
        return self.kv.tail_ok(seq)

    def reserve_unit(self, seq: Sequence, n_tokens: int) -> dict[str, int]:
        """Reserve the unit's typed demand on top of what the sequence already holds.
        Returns {} on success, else the exact shortfall per pool (nothing reserved)."""
        res, short = reserve_all(self.pools, self.seq_demand(seq, n_tokens))
        if res is None:
            return short
        for k, n in res.amounts.items():
            seq.reservation.amounts[k] = seq.reservation.amounts.get(k, 0) + n
        return {}

    def settle(self, seq: Sequence) -> None:
        settle(self.pools, seq.reservation)

    def shortfall(self, demand: dict[str, int]) -> dict[str, int]:
        return {k: n - self.pools[k].available for k, n in demand.items() if n > self.pools[k].available}

    # ==== binding ======================================================================
    def bind_demand(self, sid: int, source: Checkpoint | None, mode: BindMode,
                    first_tokens: int) -> dict[str, int]:
        return self.writers.bind_demand(sid, source, mode, first_tokens)

    def check_source(self, seq_ledger: list[int], src: Checkpoint, mode: BindMode, mover: Owner | None
                     ) -> tuple[Refusal, str]:
        return self.writers.check_source(seq_ledger, src, mode, mover)

    def bind(self, seq: Sequence, source: Checkpoint | None, mode: BindMode = BindMode.FORK,
             first_tokens: int = 0, mover: Owner | None = None,
             retire: list[tuple[Checkpoint, Owner]] = ()) -> BindOutcome:
        return self.writers.bind(seq, source, mode, first_tokens, mover, retire)

    def freed_by_retiring(self, retire: list[tuple[Checkpoint, Owner]]) -> dict[str, int]:
        return self.cks.freed_by_retiring(retire)

    def fail_sequence(self, seq: Sequence) -> None:
        self.writers.fail_sequence(seq)

    def freeze(self, seq: Sequence, owner: Owner) -> Checkpoint:
        return self.writers.freeze(seq, owner)

    def pause(self, seq: Sequence, to_host: bool = False, victims: list[Delete] = ()) -> PauseResult:
        return self.writers.pause(seq, to_host, victims)

    def release(self, seq: Sequence) -> None:
        self.writers.release(seq)

    # ==== captures =====================================================================
    def prepare_capture(self, owner: Owner, retire: list[tuple[Checkpoint, Owner]] = (),
                        replace: list[tuple[Checkpoint, Owner]] = ()) -> CaptureDest | None:
        return self.captures.prepare(owner, retire, replace)

    def drop_capture(self, dest: CaptureDest) -> None:
        self.captures.drop(dest)

    # ==== execution ====================================================================
    def execute(self, rows: list[UnitRow]) -> list[RowResult]:
        results = self.runner.execute(rows)
        for r, res in zip(rows, results):
            if r.capture is not None:
                res.captured, res.capture_tid = self.captures.finish(r.seq, r.capture)
                r.capture = None
        return results

    @property
    def graphs(self) -> graphs.GraphRunner | None:
        return self.runner.graphs

    @property
    def grammar_stats(self):
        return self.runner.grammar_stats

    # ==== checkpoints ==================================================================
    def add_owner(self, ck: Checkpoint, owner: Owner) -> None:
        self.cks.add_owner(ck, owner)

    def release_owner(self, ck: Checkpoint, owner: Owner) -> bool:
        return self.cks.release_owner(ck, owner)

    def delete_ok(self, a: Delete) -> str:
        return self.cks.delete_ok(a)

    def device_checkpoints(self) -> set[int]:
        return self.cks.device_checkpoints()

    def delete_checkpoint(self, ck: Checkpoint) -> None:
        self.cks.delete(ck)

    # ==== calibration =================================================================
    def calibrate(self, tokens: int = 32) -> tuple[float, float]:
        """Measured (Host→Device bytes/s, prefill seconds per token) for the source cost model
        (seed: 机器传输与 artifact prefill 校准影响排序): a StateImage-sized copy from (pinned)
        Host memory to the device, and a scratch prefill through the real execute path (the
        second of two, after warm-up). Leaves nothing held."""
        n = max(self.mem.image_bytes, 1 << 16)
        pin = self.device.type == "cuda"
        src = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
        dst = torch.empty(n, dtype=torch.uint8, device=self.device)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            if pin:
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
        h2d = n / max(best, 1e-9)
        tokens = max(2, min(tokens, self.layout.max_context - 1, self.layout.main_pages * 64 - 1))
        vocab = self.model.cfg.vocab_size
        per_token = 0.0
        for _ in range(2):
            seq = self.new_sequence([(7 * i + 3) % vocab for i in range(tokens)], tokens,
                                    SamplingParams(max_tokens=1, ignore_eos=True), eos_ids=())
            if not self.bind(seq, None).ok or self.reserve_unit(seq, tokens - 1):
                self.release(seq)
                return h2d, 0.0
            t0 = time.perf_counter()
            self.execute([UnitRow(seq, tokens - 1, UnitKind.PREFILL)])
            per_token = (time.perf_counter() - t0) / (tokens - 1)
            self.settle(seq)
            self.release(seq)
        return h2d, per_token

    # ==== placement reports ===========================================================
    def placement_changes(self) -> list[tuple[int, int, bool, int]]:
        """(cid, generation, image on the Device, Main pages only on the Host) of every
        checkpoint whose placement changed since the last call — O(what changed), so the
        controller's restore-cost mirror never needs a scan of the directory."""
        return self.cks.placement_changes()

    @property
    def host_only_pages(self) -> int:
        return self.kv.host_only_pages

    # ==== Host placement ================================================================
    def demotion_sizes(self, images: list[Checkpoint], blocks: list[KvBlock],
                       dropped: set[int] = frozenset()) -> list[int]:
        return self.placement.demotion_sizes(images, blocks, dropped)

    def host_holes_after(self, deleted: set[int], dropped: set[int] = frozenset()) -> list[tuple[int, int]]:
        return self.placement.host_holes_after(deleted, dropped)

    def host_duplicates(self, ck: Checkpoint) -> list[Extent]:
        return self.placement.host_duplicates(ck)

    def pause_plan(self, seq: Sequence) -> tuple[list[KvBlock], list[int]]:
        return self.placement.pause_plan(seq)

    # ==== the context transaction ======================================================
    @property
    def tx(self) -> Transaction | None:
        return self.txn.current

    @property
    def bytes_h2d(self) -> int:
        return self.txn.bytes_h2d

    @property
    def bytes_d2h(self) -> int:
        return self.txn.bytes_d2h

    def progress(self) -> list[TxSettled]:
        return self.txn.progress()

    def publish(self, tid: int, generation: int, error: str = "") -> TxSettled | None:
        return self.txn.publish(tid, generation, error)

    def overdue(self) -> list[TxSettled]:
        return self.txn.overdue()

    def wait_transfers(self, timeout: float) -> None:
        self.txn.wait(timeout)

    # ==== integrity ====================================================================
    def check_integrity(self, idle: bool = False) -> None:
        """Books balance: pools, Host extents, block holders and slot ownership. ``idle``
        additionally requires no reservations, leases or transactions."""
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
        self.transfers.shutdown()
