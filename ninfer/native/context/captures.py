"""Captures: a save of the writer's state at a semantic position, taken during a unit.

The destination comes first (seed: 跨过语义 frontier 前准备目的 state): a Device slot, else a
Host extent (the copy joins the context transaction), else nothing — an optional save never
blocks the unit. Permitted old points retire first and a failed save does not bring them back
(seed: 新保存失败不恢复旧点). The checkpoint is made after the unit's forward (``finish``): a
Device slot gets a copy of the writer's slot at once; a Host capture is leased (no query source)
until its copy is published, and deleted if the copy fails.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.native.context.checkpoints import Checkpoints
from ninfer.native.context.slots import StateSlots
from ninfer.native.context.transaction import ContextTx, TxPart
from ninfer.native.layout import STATE
from ninfer.native.memory import Memory
from ninfer.native.objects import Checkpoint, Sequence, StateImage
from ninfer.native.stores import Extent, HostArena, IdPool, Reservation, reserve_all, settle
from ninfer.protocol import CkptKind, Owner


@dataclass
class CaptureDest:
    """A save's destination, prepared before the unit crosses the frontier."""

    owner: Owner
    res: Reservation | None = None      # a Device slot (reserved)
    ext: Extent | None = None           # or a Host extent


class Captures:
    def __init__(self, pools: dict[str, IdPool], cks: Checkpoints, slots: StateSlots, host: HostArena,
                 mem: Memory, txn: ContextTx):
        self.pools = pools
        self.cks = cks
        self.slots = slots
        self.host = host
        self.mem = mem
        self.txn = txn

    def prepare(self, owner: Owner, retire: list[tuple[Checkpoint, Owner]] = (),
                replace: list[tuple[Checkpoint, Owner]] = ()) -> CaptureDest | None:
        """Destination first (seed: 跨过语义 frontier 前准备目的 state): a Device slot, else the
        Host (its copy joins the context transaction), else nothing. Permitted old points
        retire first; a failed save does not bring them back (seed: 新保存失败不恢复旧点).
        ``replace`` holds go only with a save that happens: released once a destination is
        found, or first when releasing them is what frees the destination."""
        self.cks.retire(list(retire))
        replace = [(c, o) for c, o in replace if c.cid in self.cks.table and o in c.owners]
        dest = self._capture_dest(owner)
        if dest is None and replace and self._retiring_frees_a_destination(replace):
            self.cks.retire(replace)
            return self._capture_dest(owner)
        if dest is not None:
            self.cks.retire(replace)
        return dest

    def _retiring_frees_a_destination(self, retire: list[tuple[Checkpoint, Owner]]) -> bool:
        if self.cks.freed_by_retiring(retire).get(STATE, 0) >= 1:
            return True
        return any(c.owners == {o: 1} and not c.image.leases and c.image.host is not None
                   and c.image.host.size >= self.mem.image_bytes for c, o in retire)

    def _capture_dest(self, owner: Owner) -> CaptureDest | None:
        res, _ = reserve_all(self.pools, {STATE: 1})
        if res is not None:
            return CaptureDest(owner, res=res)
        ext = self.host.allocate(self.mem.image_bytes, kind="state")
        if ext is not None:
            return CaptureDest(owner, ext=ext)
        return None

    def drop(self, dest: CaptureDest) -> None:
        """Return an unused destination (the unit did not run)."""
        if dest.res is not None:
            settle(self.pools, dest.res)
        if dest.ext is not None:
            self.host.release(dest.ext)

    def finish(self, seq: Sequence, dest: CaptureDest, cut: tuple[int, tuple] | None = None
               ) -> tuple[Checkpoint, int | None]:
        """The checkpoint of the save: at the sequence's frontier from its slot, or at an inner
        ``cut`` — (position, the image the forward kept there) — from that image."""
        image = StateImage()
        ck = self.cks.new(CkptKind.CACHE, seq, image, dest.owner, at=cut[0] if cut is not None else None)
        if dest.res is not None:
            image.slot = self.slots.take(ck, dest.res)
            if cut is not None:
                self.mem.write_image(image.slot, cut[1])
            else:
                self.mem.copy_slot(seq.slot, image.slot)
            return ck, None
        image.host = dest.ext
        image.leases += 1          # not a query source until the copy is published
        if cut is not None:        # the forward's own tensors: nothing overwrites them
            job = self.mem.image_to_host(cut[1], dest.ext, snapshot_now=self.mem.device.type == "cuda")
        else:
            job = self.mem.slot_to_host(seq.slot, dest.ext, snapshot_now=True)
        self.txn.count(d2h=self.mem.image_bytes)

        def abort() -> tuple[list[int], list[int]]:
            self.cks.unlease(image)
            if ck.cid in self.cks.table:
                self.cks.delete(ck)
            return [], [ck.cid]
        return ck, self.txn.add(TxPart("capture", lambda: self.cks.unlease(image), abort), [job])
