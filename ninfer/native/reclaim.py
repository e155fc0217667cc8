"""Quotes, verified commits and simulations of reclaim (seed: Native 根据实际 State/KV 引用枚举有限的
降级和删除动作 … 提交仍针对选中对象核对当前完整持有者、内容版本与 pin).

A quote is a read-only snapshot of physical facts — pools, Host extents, every checkpoint with
its owners and replicas, every KV block with its real holder set — taken in one synchronous
call, so deletion and migration candidates are judged on the same facts. It takes no
references. A commit names the actions and the versions it relied on; the Program re-checks
generations, versions, holders and pins (``verify``) and executes all of them, or none
("stale"): ``ContextCache.apply``, the context cache's one writer of these actions.

Everything here reads the context cache through its contract (context/contract.py) and changes
nothing.

Actions:
    Delete(cid)            the checkpoint disappears for all its owners; blocks whose last
                           holder it was are freed on every medium
    DemoteState(cid)       its StateImage leaves the Device (free at once if a Host replica
                           exists, else D2H first)
    DemoteBlocks(cid, ..)  a page group of its KV leaves the Device (same rule per block)
    DropHostCopy(cid)      the Host replica of its StateImage, which the Device also holds,
                           is released (a safe duplicate: nothing is lost; Host placement
                           tries these before any victim)
Migrations join the context transaction.

``simulate`` answers, without changing anything, what each prefix of an intent's remedies
would free on the Device now and once its copies publish: the worker commits only the
smallest prefix that covers the intent's gap (seed: irreversible actions run only inside the
step that needs them, when the permit they serve will succeed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from ninfer.placement import place_first_fit
from ninfer.protocol import (
    MAIN, STATE, Action, BlockFact, CheckpointFact, Delete, DemoteBlocks, DemoteState, DropHostCopy, Facts,
    PoolFact, Reclaim, Remedy, TakeBack, encode,
)

if TYPE_CHECKING:
    from ninfer.native.context.contract import ContextCache
    from ninfer.native.objects import Checkpoint, KvBlock


# ---- quote ------------------------------------------------------------------------------

def _holder_ids(prog: "ContextCache", b) -> tuple[int, ...]:
    return tuple(sorted(h if h in prog.checkpoints else -h for h in b.holders))


def _pinned(prog: "ContextCache", b, released: set[int] = frozenset()) -> bool:
    """A read is in flight or a sequence holds it (``released``: sequences an earlier remedy of
    the same chain pauses destructively — they will have let go)."""
    return b.leases > 0 or any(h in prog.sequences and h not in released for h in b.holders)


def _block_fact(prog: "ContextCache", b) -> BlockFact:
    return BlockFact(b.bid, b.version, b.kind, _holder_ids(prog, b), _pinned(prog, b), b.page is not None,
                     b.host is not None and b.host_filled >= b.filled, b.filled, _at(b.host))


def _checkpoint_fact(c) -> CheckpointFact:
    return CheckpointFact(c.cid, c.generation, c.version, c.kind, c.frontier, tuple(c.owners),
                          c.image.slot is not None, c.image.host is not None, c.image.leases > 0,
                          tuple(b.bid for b in c.blocks[MAIN]), _at(c.image.host))


def _at(ext):
    return (ext.offset, ext.size) if ext is not None else None


class FactsMemo:
    """The fact messages of every checkpoint and block, kept between quotes: a quote rebuilds
    only those of the objects noted since the last one (objects.py ``_Noted``: every attribute
    write and every in-place change of holders or owners notes its object), so it costs
    O(what changed + what it lists), not a rebuild of ~1,000 messages. A block's fact also reads
    whether each holder is a checkpoint or a sequence: a holder comes and goes only with a
    change of the block's holders, which notes it. ``NINFER_CHECK_FACTS=1`` (the test suite
    sets it) makes every quote compare itself with one built from scratch."""

    def __init__(self, noted_checkpoints: set[int], noted_blocks: set[int]):
        self.noted_checkpoints = noted_checkpoints
        self.noted_blocks = noted_blocks
        self.checkpoints: dict[int, CheckpointFact] = {}
        self.bids: dict[int, tuple[int, ...]] = {}       # per checkpoint: its blocks of every kind
        self.blocks: dict[int, BlockFact] = {}

    def refresh(self, prog: "ContextCache") -> None:
        for cid in self.noted_checkpoints:
            c = prog.checkpoints.get(cid)
            if c is None:
                self.checkpoints.pop(cid, None)
                self.bids.pop(cid, None)
            else:
                self.checkpoints[cid] = _checkpoint_fact(c)
                self.bids[cid] = tuple(b.bid for bl in c.blocks.values() for b in bl)
        self.noted_checkpoints.clear()
        for bid in self.noted_blocks:
            b = prog.blocks.get(bid)
            if b is None:
                self.blocks.pop(bid, None)
            else:
                self.blocks[bid] = _block_fact(prog, b)
        self.noted_blocks.clear()


class FactsSender:
    """The worker's side of facts deltas: the last quote it sent, numbered. A quote asked
    against that number goes out as a delta — the messages that are not the very objects the
    last quote held (``FactsMemo`` keeps an unchanged message as the same object), and every
    id in its order — so a quote of a full Device ships tens of messages, not ~1,000 (their
    encoding and decoding were ~1 ms of each admission on the trace slice). Any other base (0,
    an older number, a restarted worker's) gets the quote complete."""

    def __init__(self):
        self.seq = 0
        self.last: Facts | None = None

    def send(self, facts: Facts, base: int) -> Facts:
        self.seq += 1
        last, self.last = self.last, facts
        if last is None or base != self.seq - 1 or base == 0:
            return msgspec.structs.replace(facts, seq=self.seq)
        lc, lb = last.checkpoints, last.blocks
        cks = {k: v for k, v in facts.checkpoints.items() if lc.get(k) is not v}
        blocks = {k: v for k, v in facts.blocks.items() if lb.get(k) is not v}
        check = (encode(msgspec.structs.replace(facts, seq=self.seq))
                 if os.environ.get("NINFER_CHECK_FACTS", "0") != "0" else b"")
        return msgspec.structs.replace(facts, checkpoints=cks, blocks=blocks, seq=self.seq, base=base,
                                       order=(tuple(facts.checkpoints), tuple(facts.blocks)), check=check)


def _scoped(prog: "ContextCache", host_window: list[int]) -> list[int]:
    """The checkpoints of a scoped quote, in id order: every one with Device content and the
    listed Host-resident ones."""
    return sorted(prog.device_checkpoints() | {c for c in host_window if c in prog.checkpoints})


def quote(prog: "ContextCache", host_window: list[int] | None = None) -> Facts:
    """Physical facts. ``host_window`` None: every checkpoint and block. A list: a scoped
    quote — every checkpoint with Device content (so every Device reclaim candidate and every
    co-holder of a Device page), the listed Host-resident checkpoints, and the blocks of these
    and of the live sequences; O(Device capacity + window), not O(directory). The messages come
    from ``prog.facts_memo`` (rebuilt for what changed since the last quote)."""
    memo = prog.facts_memo
    memo.refresh(prog)
    if host_window is None:
        cks = {cid: memo.checkpoints[cid] for cid in prog.checkpoints}
        blocks = {bid: memo.blocks[bid] for bid in prog.blocks}
    else:
        cks = {cid: memo.checkpoints[cid] for cid in _scoped(prog, host_window)}
        mb = memo.blocks
        blocks = {bid: mb[bid] for cid in cks for bid in memo.bids[cid]}
        for seq in prog.sequences.values():
            blocks.update((b.bid, mb[b.bid]) for bl in seq.blocks.values() for b in bl)
    facts = _facts(prog, cks, blocks)
    if os.environ.get("NINFER_CHECK_FACTS", "0") != "0":
        _check_against_scratch(prog, host_window, facts)
    return facts


def quote_from_scratch(prog: "ContextCache", host_window: list[int] | None = None) -> Facts:
    """``quote`` without the memo: every message built from the objects (the reference the memo
    is checked against)."""
    if host_window is None:
        cks_in, blocks_in = prog.checkpoints, prog.blocks
    else:
        cks_in = {cid: prog.checkpoints[cid] for cid in _scoped(prog, host_window)}
        blocks_in = {b.bid: b for ck in cks_in.values() for bl in ck.blocks.values() for b in bl}
        for seq in prog.sequences.values():
            blocks_in.update((b.bid, b) for bl in seq.blocks.values() for b in bl)
    blocks = {bid: _block_fact(prog, b) for bid, b in blocks_in.items()}
    cks = {cid: _checkpoint_fact(c) for cid, c in cks_in.items()}
    return _facts(prog, cks, blocks)


def _facts(prog: "ContextCache", cks: dict[int, CheckpointFact], blocks: dict[int, BlockFact]) -> Facts:
    """A quote of these checkpoint and block messages, with the pools and the Host as they are."""
    pools = {k: PoolFact(k, p.size, p.free, p.reserved) for k, p in prog.pools.items()}
    return Facts(pools=pools, host_capacity=prog.host.capacity, host_free=tuple(prog.host.free_extents()),
                 image_bytes=prog.image_bytes, page_bytes=prog.page_bytes, checkpoints=cks,
                 blocks=blocks, tx_busy=prog.tx is not None, partial=len(cks) < len(prog.checkpoints))


def _check_against_scratch(prog: "ContextCache", host_window: list[int] | None, facts: Facts) -> None:
    ref = quote_from_scratch(prog, host_window)
    if facts != ref or list(facts.checkpoints) != list(ref.checkpoints) or list(facts.blocks) != list(ref.blocks):
        cks = sorted(c for c in ref.checkpoints.keys() | facts.checkpoints.keys()
                     if ref.checkpoints.get(c) != facts.checkpoints.get(c))
        bids = sorted(b for b in ref.blocks.keys() | facts.blocks.keys() if ref.blocks.get(b) != facts.blocks.get(b))
        raise AssertionError(f"memoised facts differ from a quote from scratch: checkpoints {cks[:5]} "
                             f"(memo {[facts.checkpoints.get(c) for c in cks[:2]]}, scratch "
                             f"{[ref.checkpoints.get(c) for c in cks[:2]]}); blocks {bids[:5]} (memo "
                             f"{[facts.blocks.get(b) for b in bids[:2]]}, scratch {[ref.blocks.get(b) for b in bids[:2]]})")


# ---- commit -----------------------------------------------------------------------------

def _current(prog: "ContextCache", cid: int, generation: int) -> "Checkpoint | None":
    return prog.checkpoint(cid, generation)


def verify(prog: "ContextCache", actions: list[Action], gone: set[int] = frozenset(),
           released: set[int] = frozenset()) -> str:
    """Why these actions may not be committed now ("" = they may). ``gone``: checkpoints an
    earlier remedy of the same intent deletes; ``released``: sequences an earlier remedy of it
    pauses destructively (a simulation: the chain as it will be after its earlier steps)."""
    deleted = [a.cid for a in actions if isinstance(a, Delete)]
    if len(set(deleted)) != len(deleted):
        return "a checkpoint is deleted twice in one commit"
    if any(a.cid in set(deleted) for a in actions if not isinstance(a, Delete)):
        return "a checkpoint is both deleted and migrated in one commit"
    for a in actions:
        ck = _current(prog, a.cid, a.generation)
        if ck is None or a.cid in gone:
            return f"checkpoint {a.cid} is gone"
        if isinstance(a, Delete):
            why = prog.delete_ok(a)
            if why:
                return why
        if isinstance(a, DropHostCopy) and (ck.version != a.version or not prog.host_duplicates(ck)):
            return f"checkpoint {a.cid} has no safe Host duplicate (changed since the quote)"
        if isinstance(a, DemoteState) and ck.version != a.version:
            return f"checkpoint {a.cid} changed since the quote"
        if isinstance(a, DemoteState) and (ck.image.slot is None or ck.image.leases):
            return f"checkpoint {a.cid} has no movable Device state"
        if isinstance(a, DemoteBlocks):
            for bid, ver in zip(a.bids, a.versions):
                b = prog.blocks.get(bid)
                if b is None or b.version != ver or ck.cid not in b.holders:
                    return f"block {bid} changed since the quote"
                if b.page is None or _pinned(prog, b, released):
                    return f"block {bid} is pinned or already off the Device"
    return ""


def as_touched(actions: list[Action], touched: dict[tuple[int, int], int]) -> list[Action]:
    """The actions with the block versions an earlier take-back of the same chain moved on
    (``touched``: (block, version quoted) -> version now): the victim letting go is the change
    the chain planned, not a change since the quote."""
    if not touched:
        return actions
    return [msgspec.structs.replace(a, versions=tuple(touched.get((bid, v), v) for bid, v in zip(a.bids, a.versions)))
            if isinstance(a, DemoteBlocks) else a for a in actions]


def migrations_of(prog: "ContextCache", actions: list[Action]):
    """The replicas a commit migrates, each once (checkpoints that share a block both name it)."""
    images = list({a.cid: prog.checkpoints[a.cid] for a in actions if isinstance(a, DemoteState)}.values())
    blocks = list({bid: prog.blocks[bid] for a in actions if isinstance(a, DemoteBlocks) for bid in a.bids}.values())
    return images, blocks


# ---- simulation ---------------------------------------------------------------------------

@dataclass
class Freed:
    """Device units a prefix of remedies frees at once (``now``) and after its copies
    publish (``later``)."""

    now: dict[str, int] = field(default_factory=dict)
    later: dict[str, int] = field(default_factory=dict)

    def covers(self, short: dict[str, int], wait: bool = False) -> bool:
        return all(n <= self.now.get(k, 0) + (self.later.get(k, 0) if wait else 0) for k, n in short.items())


@dataclass
class _Sim:
    gone: set[int] = field(default_factory=set)            # checkpoints deleted
    dropped: set[int] = field(default_factory=set)         # sequences paused destructively
    snapped: set[int] = field(default_factory=set)         # sequences paused to the Host
    images: set[int] = field(default_factory=set)          # checkpoint images demoted
    blocks: set[int] = field(default_factory=set)          # blocks demoted explicitly
    sizes: list[int] = field(default_factory=list)         # Host bytes allocated so far
    copies: set[int] = field(default_factory=set)          # checkpoints whose Host duplicates go


def simulate(prog: "ContextCache", remedies: list[Remedy], skipped: set[int] | None = None) -> list[Freed]:
    """Cumulative Freed after each remedy. A reclaim step that could not be committed
    (changed since its quote, or its Host destinations do not fit after the steps before it)
    is skipped — its index goes to ``skipped`` — and the later steps are still tried one by one
    (seed: 批量预约失败时仍可依次尝试单个迁移和删除备选); a take-back that cannot happen stops."""
    sim, out = _Sim(), []
    for i, r in enumerate(remedies):
        if isinstance(r, Reclaim):
            deleted = {a.cid for a in r.actions if isinstance(a, Delete)}
            dropped = {a.cid for a in r.actions if isinstance(a, DropHostCopy)}
            images, blocks = migrations_of(prog, r.actions) if not verify(prog, r.actions, sim.gone, sim.dropped) \
                else (None, None)
            # Host duplicates released by this step or an earlier one: the demotion allocates anew
            sizes = prog.demotion_sizes(images, blocks, sim.copies | dropped) if images is not None else []
            if images is None or (sizes and place_first_fit(
                    prog.host_holes_after(sim.gone | deleted, (sim.copies | dropped) - sim.gone - deleted),
                    sim.sizes + sizes) is None):
                if skipped is not None:
                    skipped.add(i)
                out.append(_freed(prog, sim))
                continue
            sim.gone |= deleted
            sim.copies |= dropped
            sim.images |= {ck.cid for ck in images}
            sim.blocks |= {b.bid for b in blocks}
            sim.sizes += sizes
        elif isinstance(r, TakeBack):
            seq = prog.sequences.get(r.sid)
            if seq is None or seq.slot is None or r.sid in sim.dropped | sim.snapped:
                break
            victims = {a.cid for a in r.host_victims}
            ok = not any(prog.delete_ok(a) or a.cid in sim.gone for a in r.host_victims)
            blocks, sizes = prog.pause_plan(seq)
            if sim.copies:                        # pages whose Host duplicate an earlier step released
                gone = prog.demotion_sizes([], blocks, sim.copies)
                sizes = sizes[:1] + gone
            if r.to_host and ok and place_first_fit(prog.host_holes_after(sim.gone | victims, sim.copies - sim.gone - victims),
                                                    sim.sizes + sizes) is not None:
                sim.gone |= victims
                sim.snapped.add(r.sid)
                sim.sizes += sizes
            else:
                sim.dropped.add(r.sid)
        out.append(_freed(prog, sim))
    return out


def _freed(prog: "ContextCache", sim: _Sim) -> Freed:
    """What the simulated remedies free — looking only at what they touch (their checkpoints,
    the paused sequences, the demoted blocks), never at the whole directory."""
    now = {STATE: 0, MAIN: 0}
    later = {STATE: 0, MAIN: 0}
    touched: dict[int, "KvBlock"] = {}
    for cid in sim.gone | sim.images:
        ck = prog.checkpoints.get(cid)
        if ck is None:
            continue
        for b in ck.blocks.get(MAIN, ()):
            touched[b.bid] = b
        img = ck.image
        if img.slot is None or img.leases:
            continue
        if cid in sim.gone:
            now[STATE] += 1
        else:
            (now if img.host is not None else later)[STATE] += 1
    for sid in sim.dropped | sim.snapped:        # a pause settles its reservation at once
        for k, n in prog.sequences[sid].reservation.amounts.items():
            now[k] = now.get(k, 0) + n
    for sid in sim.dropped:
        now[STATE] += 1
    for sid in sim.snapped:
        later[STATE] += 1
    for sid in sim.dropped | sim.snapped:
        for b in prog.sequences[sid].blocks.get(MAIN, ()):
            touched[b.bid] = b
    for bid in sim.blocks:
        b = prog.blocks.get(bid)
        if b is not None:
            touched[bid] = b
    live = set(prog.sequences) - sim.dropped - sim.snapped
    for b in touched.values():
        if b.page is None or b.leases or b.kind != MAIN:
            continue
        left = b.holders - sim.gone - sim.dropped
        if not left:
            now[MAIN] += 1
            continue
        demoted = b.bid in sim.blocks or (bool(left & sim.snapped) and not (left & live))
        if demoted:
            (now if b.host is not None and b.host_filled >= b.filled else later)[MAIN] += 1
    return Freed(now, later)


__all__ = ["quote", "verify", "simulate", "Freed", "BlockFact", "CheckpointFact", "PoolFact"]
