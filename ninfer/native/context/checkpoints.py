"""Checkpoints and their owners: exact restore points, held by opaque logical owners.

A checkpoint (objects.py) is an input identity (tokens + execution identity), a StateImage at
its frontier and a KV directory covering it. Native never interprets an owner (a private
record, a public entry, a waiting reference, a pause snapshot's sequence): it counts holds and
deletes the checkpoint with its last one (seed: 检查点由其所有持有者共同保留).

Invariants (``check_integrity``):

- every checkpoint in the table has at least one owner, each counted ≥ 1; a deleted one has none
  and is in no directory (its blocks and its slot were let go on deletion);
- its StateImage has a replica: a Device slot, a Host extent, or both, and no negative lease.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ninfer.errors import IntegrityError
from ninfer.native.context.kv_directory import KvDirectory
from ninfer.native.context.slots import StateSlots
from ninfer.native.layout import MAIN, STATE
from ninfer.native.objects import Checkpoint, KvBlock, NativeError, Sequence, StateImage, next_generation, pages_for
from ninfer.native.stores import HostArena
from ninfer.protocol import CkptKind, Delete, Owner

if TYPE_CHECKING:
    from ninfer.native.speculative import DraftBackend


def _int64_bytes(tokens: tuple[int, ...] | list[int]) -> bytes:
    """The tokens as native int64 bytes — what ``torch.tensor(tokens, dtype=torch.int64)`` holds,
    through ``struct`` (~4-8x faster for a prompt's tokens: a checkpoint's digest hashes its whole
    prefix, several points an admission); whatever ``struct`` refuses goes through torch, which
    raises as it always did."""
    try:
        return struct.pack(f"{len(tokens)}q", *tokens)
    except struct.error:
        return torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()


class Checkpoints:
    """The checkpoint table (``table``: cid -> Checkpoint) and everything that creates, holds or
    deletes an entry."""

    def __init__(self, kv: KvDirectory, slots: StateSlots, host: HostArena, ids: Iterator[int],
                 exec_identity: bytes):
        self.kv = kv
        self.slots = slots
        self.host = host
        self.exec_identity = exec_identity
        self.table: dict[int, Checkpoint] = {}
        self.draft: DraftBackend | None = None       # the draft backend, set once by the Program
        self._ids = ids
        self._changed: set[int] = set()              # placement changed since the last report
        self.noted: set[int] = set()                 # any fact changed since the last quote (objects.py _Noted)

    # ---- reads ---------------------------------------------------------------------------------
    def digest(self, tokens: tuple[int, ...] | list[int], media: bytes = b"") -> bytes:
        """The input identity of ``tokens`` under this Program's execution identity."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.exec_identity)
        h.update(media)
        h.update(_int64_bytes(tokens))
        return h.digest()

    def get(self, cid: int, generation: int) -> Checkpoint | None:
        """The checkpoint a (cid, generation) reference names, or None when it is gone."""
        ck = self.table.get(cid)
        return ck if ck is not None and ck.generation == generation else None

    def delete_ok(self, a: Delete) -> str:
        """Why a quoted deletion may not be committed now ("" = it may)."""
        ck = self.table.get(a.cid)
        if ck is None or ck.generation != a.generation:
            return f"checkpoint {a.cid} is gone"
        if ck.version != a.version:
            return f"checkpoint {a.cid} changed since the quote"
        if ck.image.leases or any(b.leases for b in ck.blocks[MAIN]):
            return f"checkpoint {a.cid} is being read"
        return ""

    def freed_by_retiring(self, retire: list[tuple[Checkpoint, Owner]]) -> dict[str, int]:
        """Device units that releasing these holds would really free (read-only): only
        checkpoints whose last owner is released go, and only blocks all of whose holders go."""
        gone = {c.cid for c, o in retire if c.owners == {o: 1} and not c.image.leases}
        return self.freed_by_deleting(gone)

    def freed_by_deleting(self, gone: set[int], also_gone_sids: set[int] = frozenset()) -> dict[str, int]:
        """Device units freed if these checkpoints (and sequences' holds) disappeared."""
        freed = {STATE: sum(1 for cid in gone if self.table[cid].image.slot is not None
                            and not self.table[cid].image.leases)}
        seen: set[int] = set()
        for cid in gone:
            for kind, blocks in self.table[cid].blocks.items():
                for b in blocks:
                    if (b.bid not in seen and b.page is not None and not b.leases
                            and b.holders <= gone | also_gone_sids):
                        seen.add(b.bid)
                        freed[kind] = freed.get(kind, 0) + 1
        return freed

    def device_checkpoints(self) -> set[int]:
        """Checkpoints with any Device content (a state slot or a KV page) — found through the
        slots and the paged blocks, so O(Device capacity), never a directory scan."""
        out = self.slots.checkpoint_ids()
        out.update(h for h in self.kv.paged_holders() if h in self.table)
        return out

    # ---- writes --------------------------------------------------------------------------------
    def new(self, kind: CkptKind, seq: Sequence, image: StateImage, owner: Owner, at: int | None = None) -> Checkpoint:
        """A checkpoint of ``seq`` at its frontier, over ``image``: it holds the prefix of the
        sequence's directories its coverage needs (Main: [0, frontier); the draft backend's:
        what the backend says a checkpoint carries). ``at``: an inner cut before the frontier
        (a position its last call crossed; no draft backend) — the prefix [0, at) of the same
        blocks (the sequence, their appender, wrote past it: a binder copies the tail first)."""
        f = seq.frontier if at is None else at
        if at is not None and (self.draft is not None or not 0 < at <= seq.frontier):
            raise NativeError(f"no checkpoint at {at} of sequence {seq.sid} (frontier {seq.frontier})")
        tokens = tuple(seq.ledger[:f])
        ck = Checkpoint(sink=self._changed, cid=next(self._ids), generation=next_generation(), kind=kind, tokens=tokens,
                        digest=self.digest(tokens), image=image, blocks={}, owners={owner: 1}, noted=self.noted)
        image.noted_as, image.noted = ck.cid, self.noted
        cover = {MAIN: f}
        if self.draft is not None:
            ck.draft_base, ck.draft_frontier = self.draft.coverage(seq)
            cover[self.draft.kind] = ck.draft_frontier
        for k, blocks in seq.blocks.items():
            # a coverage that starts at the same base as the sequence's directory: a prefix of it
            ck.blocks[k] = blocks[:max(0, pages_for(cover[k]) - self.kv.page0(ck, k))]
            self.kv.hold(ck.blocks[k], ck.cid)
        self.table[ck.cid] = ck
        if self.draft is not None:
            self.draft.noted(ck)
        return ck

    def add_owner(self, ck: Checkpoint, owner: Owner) -> None:
        ck.owners[owner] = ck.owners.get(owner, 0) + 1
        ck.touch()

    def release_owner(self, ck: Checkpoint, owner: Owner) -> bool:
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
            self.delete(ck)
            return True
        return False

    def retire(self, retire: list[tuple[Checkpoint, Owner]]) -> None:
        """Release the permitted holds that are still there."""
        for c, owner in retire:
            if c.cid in self.table and owner in c.owners:
                self.release_owner(c, owner)

    def delete(self, ck: Checkpoint, keep_content: bool = False) -> None:
        """Remove a checkpoint. ``keep_content``: its Device state and block holds were handed
        over. Replicas still being read are freed when their reader finishes."""
        del self.table[ck.cid]
        self.kv.drop_all(ck.cid, ck.blocks)
        if ck.image.leases:
            self.slots.orphan(ck.image)
        elif not keep_content:
            self.slots.free_image(ck.image)
        elif ck.image.host is not None:
            self.host.release(ck.image.host)
            ck.image.host = None
        ck.owners.clear()
        ck.note()

    def unlease(self, obj: KvBlock | StateImage) -> None:
        """A reader finished: drop its lease and free the replica if nobody holds it any more."""
        if isinstance(obj, KvBlock):
            self.kv.unlease(obj)
        else:
            self.slots.unlease(obj)

    def changed(self, ck: Checkpoint) -> None:
        """Report ``ck``'s placement in the next placement report (its content is unchanged)."""
        self._changed.add(ck.cid)

    def placement_changes(self) -> list[tuple[int, int, bool, int]]:
        """(cid, generation, image on the Device, Main pages only on the Host) of every
        checkpoint whose placement changed since the last call — O(what changed), so the
        controller's restore-cost mirror never needs a scan of the directory."""
        cids = {c for c in self._changed if c in self.table}
        cids.update(h for h in self.kv.take_changed() if h in self.table)
        self._changed.clear()
        out = []
        for cid in sorted(cids):
            ck = self.table[cid]
            host_pages = sum(1 for b in ck.blocks.get(MAIN, ()) if b.page is None)
            out.append((cid, ck.generation, ck.image.slot is not None, host_pages))
        return out

    # ---- integrity ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The invariants of the module docstring."""
        for c in self.table.values():
            if not c.owners or any(n < 1 for n in c.owners.values()):
                raise IntegrityError(f"checkpoint {c.cid} has no owner")
            if c.image.slot is None and c.image.host is None:
                raise IntegrityError(f"checkpoint {c.cid} has no StateImage replica")
            if c.image.leases < 0:
                raise IntegrityError(f"checkpoint {c.cid}'s StateImage has {c.image.leases} leases")

    def leased(self) -> bool:
        return any(c.image.leases for c in self.table.values())
