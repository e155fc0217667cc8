"""Device state slots: who holds each one.

A slot holds one StateImage's Device replica (every GDN/conv state and the continuation hidden,
memory.py). Its holder is the sequence writing in it, the checkpoint whose image lies in it, or
an orphaned image — the image of a deleted checkpoint that a copy still reads, freed when its
last reader finishes.

Invariants (``check_integrity``):

- the used slots of the state pool are exactly the slots named by a sequence, a checkpoint's
  image or an orphaned image, and each has exactly one holder here — the one that names it;
- an orphaned image is being read (``leases > 0``); idle, there is none.
"""

from __future__ import annotations

from collections.abc import Iterable

from ninfer.errors import IntegrityError
from ninfer.native.layout import STATE
from ninfer.native.objects import Checkpoint, Sequence, StateImage
from ninfer.native.stores import HostArena, IdPool, Reservation, allocate

Holder = Sequence | Checkpoint | StateImage


class StateSlots:
    def __init__(self, pools: dict[str, IdPool], host: HostArena):
        self.pools = pools
        self.host = host
        self._owner: dict[int, Holder] = {}            # state slot -> its holder
        self._orphans: set[StateImage] = set()         # images of deleted checkpoints still being read

    def take(self, holder: Holder, res: Reservation) -> int:
        """A slot from ``res`` for ``holder``."""
        slot = allocate(self.pools, res, STATE)
        self._owner[slot] = holder
        return slot

    def hand(self, slot: int, holder: Holder) -> None:
        """The slot changes hands without a copy (a writer becomes a checkpoint, or takes a
        checkpoint's slot)."""
        self._owner[slot] = holder

    def release(self, slot: int) -> None:
        del self._owner[slot]
        self.pools[STATE].release(slot)

    def free_image(self, image: StateImage) -> None:
        """Free both replicas of an image nobody reads."""
        if image.slot is not None:
            self.release(image.slot)
            image.slot = None
        if image.host is not None:
            self.host.release(image.host)
            image.host = None

    def orphan(self, image: StateImage) -> None:
        """The checkpoint of a leased image is deleted: the image is freed by its last reader."""
        self._orphans.add(image)
        if image.slot is not None:
            self._owner[image.slot] = image

    def is_orphan(self, image: StateImage) -> bool:
        return image in self._orphans

    def unlease(self, image: StateImage) -> None:
        """A reader of ``image`` finished: an orphan with no reader left is freed."""
        image.leases -= 1
        if image.leases:
            return
        if image in self._orphans:
            self._orphans.discard(image)
            self.free_image(image)

    def checkpoint_ids(self) -> set[int]:
        """Checkpoints whose image has a Device slot — O(slots)."""
        return {o.cid for o in self._owner.values() if isinstance(o, Checkpoint)}

    def check_integrity(self, sequences: Iterable[Sequence], checkpoints: Iterable[Checkpoint],
                        idle: bool = False) -> None:
        """The invariants of the module docstring."""
        for slot, holder in self._owner.items():
            if isinstance(holder, Checkpoint) and holder.image.slot != slot:
                raise IntegrityError(f"slot {slot} names checkpoint {holder.cid}, which is not in it")
            if isinstance(holder, Sequence) and holder.slot != slot:
                raise IntegrityError(f"slot {slot} names sequence {holder.sid}, which is not in it")
        slots: dict[int, Holder] = {s.slot: s for s in sequences if s.slot is not None}
        slots.update({c.image.slot: c for c in checkpoints if c.image.slot is not None})
        slots.update({img.slot: img for img in self._orphans if img.slot is not None})
        if set(slots) != self.pools[STATE].used_ids() or set(slots) != set(self._owner):
            raise IntegrityError("state slots and their owners disagree")
        if any(img.leases <= 0 for img in self._orphans):
            raise IntegrityError("an orphaned StateImage nobody reads was not freed")
        if idle and self._orphans:
            raise IntegrityError("an orphaned StateImage was never freed")
