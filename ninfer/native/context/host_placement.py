"""Host placement: which Device replicas move to the Host, where they go, what that frees.

The Host arena (stores.py) is first-fit over contiguous extents; every placement here is
simulated on the arena's free extents first (``host_holes_after``, ``demotion_sizes``,
``placement.place_first_fit``) and only then allocated, so a demotion never finds its
destination missing. A demotion copies a replica that has no complete Host copy and frees its
Device replica when the copy is published (the context transaction); a replica with one is freed
at once. Host duplicates — content both media hold and nobody reads — are the safe first thing
to release (seed: Host 先释放安全的重复副本).

Invariant: a replica being copied is leased (no one deletes or overwrites it meanwhile); a
block's Host replica is complete or absent (kv_directory.py checks it).
"""

from __future__ import annotations

from ninfer.native.context.checkpoints import Checkpoints
from ninfer.native.context.kv_directory import KvDirectory
from ninfer.native.context.slots import StateSlots
from ninfer.native.context.transaction import ContextTx, Job, TxPart
from ninfer.native.layout import MAIN
from ninfer.native.memory import Memory
from ninfer.native.objects import Checkpoint, KvBlock, NativeError, Sequence
from ninfer.native.stores import Extent, HostArena
from ninfer.placement import merge_extents


class HostPlacement:
    def __init__(self, kv: KvDirectory, slots: StateSlots, cks: Checkpoints, sequences: dict[int, Sequence],
                 host: HostArena, mem: Memory, txn: ContextTx):
        self.kv = kv
        self.slots = slots
        self.cks = cks
        self.sequences = sequences                   # the live sequences (read only)
        self.host = host
        self.mem = mem
        self.txn = txn

    # ---- demotion (Device -> Host) ------------------------------------------------------------
    def demote(self, images: list[Checkpoint], blocks: list[KvBlock]) -> tuple[list[Job], TxPart | None]:
        """Move these Device replicas to the Host: a replica that already has a complete Host
        copy is freed at once, the others get a Host destination (first-fit; the caller checked
        the placement), are leased and copied; their Device replica is freed when the copies
        are published. An abort keeps the Device replicas and frees the destinations."""
        jobs: list[Job] = []
        moving_images: list[Checkpoint] = []
        moving_blocks: list[KvBlock] = []
        for ck in images:
            img = ck.image
            if img.host is not None:
                self.slots.release(img.slot)
                img.slot = None
                ck.touch()
                continue
            img.host = self.host.allocate(self.mem.image_bytes, kind="state")
            if img.host is None:
                raise NativeError("a demotion's Host destination does not fit (placement was not checked)")
            img.leases += 1
            jobs.append(self.mem.slot_to_host(img.slot, img.host, snapshot_now=False))
            self.txn.count(d2h=self.mem.image_bytes)
            moving_images.append(ck)
        for b in blocks:
            if b.leases:
                raise NativeError(f"block {b.bid} is being read: it cannot be demoted now")
            if b.host is not None and b.host_filled >= b.filled:
                self.kv.page_out(b)
                b.touch()
                continue
            if b.host is not None:
                self.kv.release_host(b)
            b.host = self.host.allocate(self.mem.page_bytes, kind=f"kv:{b.kind}")
            if b.host is None:
                raise NativeError("a demotion's Host destination does not fit (placement was not checked)")
            b.host_filled = b.filled
            b.leases += 1
            jobs.append(self.mem.page_to_host(b.page, b.host))
            self.txn.count(d2h=self.mem.page_bytes)
            moving_blocks.append(b)
        if not jobs:
            return [], None

        def publish() -> None:
            for ck in moving_images:
                img = ck.image
                if img.slot is not None and not self.slots.is_orphan(img):
                    self.slots.release(img.slot)
                    img.slot = None
                    ck.touch()
                self.slots.unlease(img)
            for b in moving_blocks:
                if b.page is not None and b.holders:
                    self.kv.page_out(b)
                    b.touch()
                self.kv.unlease(b)

        def abort() -> tuple[list[int], list[int]]:
            """The copies failed: the Device replicas stay (reported as a placement change,
            so the controller's mirror, which moved them on commit, is corrected)."""
            for ck in moving_images:
                img = ck.image
                if img.host is not None:
                    self.host.release(img.host)
                    img.host = None
                self.slots.unlease(img)
                self.cks.changed(ck)
            for b in moving_blocks:
                if b.host is not None and b.bid in self.kv.blocks:
                    self.kv.release_host(b)
                self.kv.unlease(b)
                self.kv.changed(b)
            return [], []
        return jobs, TxPart("demote", publish, abort)

    def demotion_sizes(self, images: list[Checkpoint], blocks: list[KvBlock],
                       dropped: set[int] = frozenset()) -> list[int]:
        """Host bytes the demotion of these replicas allocates, in allocation order —
        ``dropped``: checkpoints whose Host duplicates are released first (their copies must
        then be written again)."""
        cks = [self.cks.table[cid] for cid in dropped if cid in self.cks.table]
        gone_images = {ck.cid for ck in cks if ck.image.slot is not None and ck.image.host is not None}
        gone_pages = {b.bid for ck in cks for b in self._dup_pages(ck)}
        return ([self.mem.image_bytes for ck in images if ck.image.host is None or ck.cid in gone_images]
                + [self.mem.page_bytes for b in blocks
                   if not (b.host is not None and b.host_filled >= b.filled) or b.bid in gone_pages])

    def host_holes_after(self, deleted: set[int], dropped: set[int] = frozenset()) -> list[tuple[int, int]]:
        """Free Host extents once the deleted checkpoints' exclusive Host replicas, and the
        safe Host duplicates of the ``dropped`` ones, are gone (adjacent extents merge, as the
        arena does)."""
        extents = list(self.host.free_extents())
        for cid in deleted:
            ck = self.cks.table[cid]
            if ck.image.host is not None:
                extents.append((ck.image.host.offset, ck.image.host.size))
            for b in ck.blocks[MAIN]:
                if b.host is not None and not b.leases and b.holders <= deleted:
                    extents.append((b.host.offset, b.host.size))
        for cid in dropped:
            extents += [(e.offset, e.size) for e in self.host_duplicates(self.cks.table[cid])]
        return merge_extents(sorted(set(extents)))

    def host_duplicates(self, ck: Checkpoint) -> list[Extent]:
        """The Host replicas of this checkpoint's content that the Device holds too and nobody
        reads: its StateImage's, and its Main KV pages' (a restore reads pages back and keeps
        their Host copies). Releasing them loses nothing."""
        img = ck.image
        out = [img.host] if img.slot is not None and img.host is not None and not img.leases else []
        return out + [b.host for b in self._dup_pages(ck)]

    def _dup_pages(self, ck: Checkpoint) -> list[KvBlock]:
        """Its pages on both media that nobody reads or writes now (a live sequence's page keeps
        its copy: a Snapshot pause would need it)."""
        return [b for b in ck.blocks[MAIN] if b.page is not None and b.host is not None and not b.leases
                and not any(h in self.sequences for h in b.holders)]

    def drop_host_copy(self, ck: Checkpoint) -> None:
        """Release a checkpoint's safe Host duplicates (seed: Host 先释放安全的重复副本)."""
        img = ck.image
        if img.slot is not None and img.host is not None and not img.leases:
            self.host.release(img.host)
            img.host = None
            ck.touch()
        for b in self._dup_pages(ck):          # its content is unchanged: no new version
            self.kv.release_host(b)
            self.kv.changed(b)

    # ---- pauses ---------------------------------------------------------------------------
    def pause_plan(self, seq: Sequence) -> tuple[list[KvBlock], list[int]]:
        """Read-only: the blocks a Snapshot pause demotes — those no other bound sequence reads
        (seed: 其他 active 正在使用的不可变页可以继续共享) — and the Host bytes it allocates (its
        StateImage first)."""
        blocks = [b for b in seq.blocks[MAIN] if b.page is not None and not b.leases
                  and not any(h in self.sequences and h != seq.sid for h in b.holders)]
        sizes = [self.mem.image_bytes] + [self.mem.page_bytes for b in blocks
                                          if not (b.host is not None and b.host_filled >= b.filled)]
        return blocks, sizes
