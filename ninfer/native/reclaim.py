"""Quotes and commits of reclaim actions (seed: Native 根据实际 State/KV 引用枚举有限的降级和删除动作).

A quote is a read-only snapshot of physical facts — pools, Host extents, every checkpoint with
its owners and replicas, every KV block with its real holder set — taken in one synchronous
call, so deletion and migration candidates are judged on the same facts. It takes no
references. A commit names the actions and the versions it relied on; the Program re-checks
generations, versions, holders and pins and executes all of them, or none ("stale").

Actions:
    Delete(cid)            the checkpoint disappears for all its owners; blocks whose last
                           holder it was are freed on every medium
    DemoteState(cid)       its StateImage leaves the Device (free at once if a Host replica
                           exists, else D2H first)
    DemoteBlocks(cid, ..)  a page group of its KV leaves the Device (same rule per block)
Migrations of one commit share one context transaction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ninfer.placement import place_first_fit
from ninfer.protocol import (  # noqa: F401  (re-exported for native callers)
    MAIN, STATE, Action, BlockFact, CheckpointFact, CommitResult, Delete, DemoteBlocks, DemoteState, Facts,
    PoolFact,
)

if TYPE_CHECKING:
    from ninfer.native.objects import Checkpoint, KvBlock
    from ninfer.native.program import Program


# ---- quote ------------------------------------------------------------------------------

def _holder_ids(prog: "Program", b: "KvBlock") -> tuple[int, ...]:
    return tuple(sorted(h if h in prog.checkpoints else -h for h in b.holders))


def _pinned(prog: "Program", b: "KvBlock") -> bool:
    return b.leases > 0 or any(h in prog.sequences for h in b.holders)


def quote(prog: "Program") -> Facts:
    def at(ext):
        return (ext.offset, ext.size) if ext is not None else None

    blocks = {
        bid: BlockFact(bid, b.version, b.kind, _holder_ids(prog, b), _pinned(prog, b), b.page is not None,
                       b.host is not None and b.host_filled >= b.filled, b.filled, at(b.host))
        for bid, b in prog.blocks.items()
    }
    cks = {
        cid: CheckpointFact(cid, c.generation, c.version, c.kind.value, c.frontier, tuple(sorted(c.owners)),
                            c.image.slot is not None, c.image.host is not None, c.image.leases > 0,
                            tuple(b.bid for b in c.blocks[MAIN]), at(c.image.host))
        for cid, c in prog.checkpoints.items()
    }
    pools = {k: PoolFact(k, p.size, p.free, p.reserved) for k, p in prog.pools.items()}
    return Facts(pools=pools, host_capacity=prog.host.capacity, host_free=tuple(prog.host.free_extents()),
                 image_bytes=prog.mem.image_bytes, page_bytes=prog.mem.page_bytes, checkpoints=cks,
                 blocks=blocks, tx_busy=prog.tx is not None)


# ---- commit -----------------------------------------------------------------------------

def _current(prog: "Program", cid: int, generation: int) -> "Checkpoint | None":
    ck = prog.checkpoints.get(cid)
    return ck if ck is not None and ck.generation == generation else None


def _verify(prog: "Program", actions: list[Action]) -> str:
    deleted = [a.cid for a in actions if isinstance(a, Delete)]
    if len(set(deleted)) != len(deleted):
        return "a checkpoint is deleted twice in one commit"
    if any(a.cid in set(deleted) for a in actions if not isinstance(a, Delete)):
        return "a checkpoint is both deleted and migrated in one commit"
    for a in actions:
        ck = _current(prog, a.cid, a.generation)
        if ck is None:
            return f"checkpoint {a.cid} is gone"
        if isinstance(a, (Delete, DemoteState)) and ck.version != a.version:
            return f"checkpoint {a.cid} changed since the quote"
        if isinstance(a, Delete) and (ck.image.leases or any(b.leases for b in ck.blocks[MAIN])):
            return f"checkpoint {a.cid} is being read"
        if isinstance(a, DemoteState) and (ck.image.slot is None or ck.image.leases):
            return f"checkpoint {a.cid} has no movable Device state"
        if isinstance(a, DemoteBlocks):
            for bid, ver in zip(a.bids, a.versions):
                b = prog.blocks.get(bid)
                if b is None or b.version != ver or ck.cid not in b.holders:
                    return f"block {bid} changed since the quote"
                if b.page is None or _pinned(prog, b):
                    return f"block {bid} is pinned or already off the Device"
    return ""


def commit(prog: "Program", actions: list[Action]) -> CommitResult:
    """Execute every action or none. Deletes free at once; migrations whose Host replica is
    missing reserve their destinations first-fit and run as one transaction."""
    why = _verify(prog, actions)
    if why:
        return CommitResult(ok=False, reason=f"stale: {why}")
    migrations = [a for a in actions if not isinstance(a, Delete)]
    needs_copy = _copy_sizes(prog, migrations)
    if needs_copy and prog.tx is not None:
        return CommitResult(ok=False, reason="busy: another context transaction is running")
    if needs_copy:
        holes = _holes_after(prog, {a.cid for a in actions if isinstance(a, Delete)})
        if place_first_fit(holes, [size for _, size in needs_copy]) is None:
            return CommitResult(ok=False, reason="host: the destinations do not fit first-fit")
    before = {k: prog.pools[k].free for k in (MAIN, STATE)}
    for a in actions:
        if isinstance(a, Delete):
            prog._delete_checkpoint(prog.checkpoints[a.cid])
    jobs, after = _migrate(prog, migrations)
    tid = prog._begin_tx("demote", jobs, after) if jobs else None
    freed = {k: prog.pools[k].free - n for k, n in before.items()}
    return CommitResult(ok=True, tid=tid, freed=freed)


def _holes_after(prog: "Program", deleted: set[int]) -> list[tuple[int, int]]:
    """Free Host extents once the deleted checkpoints' exclusive Host replicas are gone
    (adjacent extents merge, as the arena does)."""
    extents = list(prog.host.free_extents())
    for cid in deleted:
        ck = prog.checkpoints[cid]
        if ck.image.host is not None:
            extents.append((ck.image.host.offset, ck.image.host.size))
        for b in ck.blocks[MAIN]:
            if b.host is not None and not b.leases and b.holders <= deleted:
                extents.append((b.host.offset, b.host.size))
    merged: list[list[int]] = []
    for off, size in sorted(set(extents)):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1][1] += size
        else:
            merged.append([off, size])
    return [(o, n) for o, n in merged]


def _copy_sizes(prog: "Program", migrations: list[Action]) -> list[tuple[object, int]]:
    out = []
    for a in migrations:
        ck = prog.checkpoints[a.cid]
        if isinstance(a, DemoteState) and ck.image.host is None:
            out.append((ck.image, prog.mem.image_bytes))
        elif isinstance(a, DemoteBlocks):
            for bid in a.bids:
                b = prog.blocks[bid]
                if b.host is None or b.host_filled < b.filled:
                    out.append((b, prog.mem.page_bytes))
    return out


def _migrate(prog: "Program", migrations: list[Action]):
    """Free Device replicas that already have a full Host copy; D2H the rest (leased until
    published, then their Device replica is freed)."""
    jobs, moving_images, moving_blocks = [], [], []
    for a in migrations:
        ck = prog.checkpoints[a.cid]
        if isinstance(a, DemoteState):
            img = ck.image
            if img.host is not None:
                prog._release_slot(img.slot)
                img.slot = None
                ck.touch()
            else:
                img.host = prog.host.allocate(prog.mem.image_bytes, kind="state")
                img.leases += 1
                jobs.append(prog.mem.slot_to_host(img.slot, img.host, snapshot_now=False))
                prog.bytes_d2h += prog.mem.image_bytes
                moving_images.append(ck)
        else:
            for bid in a.bids:
                b = prog.blocks[bid]
                if b.host is not None and b.host_filled >= b.filled:
                    prog.pools[b.kind].release(b.page)
                    b.page = None
                    b.touch()
                    continue
                if b.host is not None:
                    prog._release_host(b)
                b.host = prog.host.allocate(prog.mem.page_bytes, kind=f"kv:{b.kind}")
                b.host_filled = b.filled
                b.leases += 1
                jobs.append(prog.mem.page_to_host(b.page, b.host))
                prog.bytes_d2h += prog.mem.page_bytes
                moving_blocks.append(b)

    def after() -> None:
        for ck in moving_images:
            img = ck.image
            if img.slot is not None and img not in prog._orphans:
                prog._release_slot(img.slot)
                img.slot = None
                ck.touch()
            prog.unlease(img)
        for b in moving_blocks:
            if b.page is not None and b.holders:
                prog.pools[b.kind].release(b.page)
                b.page = None
                b.touch()
            prog.unlease(b)
    return jobs, after
