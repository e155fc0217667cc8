"""The KV directory: every KV block of every kind, its Device page and Host replica, its holders.

A directory (``Sequence.blocks`` / ``Checkpoint.blocks``) lists, per KV kind, the blocks that
cover its positions; Main's list starts at page 0, a draft backend's at ``draft_base // 64``
(``page0``). Blocks are shared: a checkpoint taken from a sequence holds the same blocks, and the
append claim lets the one writer keep filling a shared tail (objects.py)::

    seq.blocks[MAIN]   [b0][b1][b2 ...filled|free]      positions 0 .. frontier-1
    ck.blocks[MAIN]    [b0][b1][b2 ...filled]           the same blocks, a prefix of them

Invariants (``check_integrity``; SGLang's radix caches state theirs beside their nodes):

- ``b.holders`` is exactly the set of directories (sequence ids, checkpoint ids) listing ``b``;
  a block with no holder and no reader lease is freed at once, so every block kept here has one;
- every block has a replica: a Device page, a Host extent, or both;
- a Host replica is complete (``host_filled == filled``): a write past it releases it;
- the append claim (``appender``) is None or one of the block's holders;
- the Device pages of each kind are exactly its pool's used ids, each once, and the paged-block
  index lists exactly the blocks with a page;
- between calls a running sequence's Main directory covers its frontier exactly, and a draft
  directory (a sequence's or a checkpoint's) its coverage [draft_base, draft_frontier).

The draft backends (speculative.py, dflash.py) reach their own pool's blocks through this public
API only: ``can_append``, ``prepare``, ``mark_written``, ``drop_holder``, ``page0``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from ninfer.errors import IntegrityError
from ninfer.native.layout import MAIN, MTP
from ninfer.native.memory import Memory
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.objects import Checkpoint, KvBlock, NativeError, Sequence, pages_for
from ninfer.native.stores import HostArena, IdPool, Reservation, allocate
from ninfer.protocol import Phase, unit_pages

CopyPrefix = Callable[[int, int, int], None]      # (src page, dst page, positions)


class KvDirectory:
    """The blocks of every KV kind this Program keeps: Main, and the draft backend's pool when
    one is attached (``attach_draft``)."""

    def __init__(self, pools: dict[str, IdPool], host: HostArena, mem: Memory, ids: Iterator[int]):
        self.pools = pools
        self.host = host
        self.blocks: dict[int, KvBlock] = {}
        self.draft_kind: str | None = None           # the draft backend's pool (MTP or DFLASH)
        self._ids = ids
        self._copy: dict[str, CopyPrefix] = {MAIN: mem.copy_page_prefix}
        self._paged: dict[int, KvBlock] = {}         # blocks with a Device page
        self._host_only: set[int] = set()            # blocks with only a Host replica
        self._changed: set[int] = set()              # placement changed since the last report
        self.noted: set[int] = set()                 # any fact changed since the last quote (objects.py _Noted)

    def attach_draft(self, kind: str, copy_prefix: CopyPrefix) -> None:
        """A draft backend keeps a directory of ``kind`` beside Main; ``copy_prefix`` copies the
        written prefix of one of its pages into another (the tail COW)."""
        self.draft_kind = kind
        self._copy[kind] = copy_prefix

    # ---- directories ------------------------------------------------------------------------
    @property
    def kinds(self) -> tuple[str, ...]:
        return (MAIN, self.draft_kind) if self.draft_kind is not None else (MAIN,)

    def empty(self) -> dict[str, list[KvBlock]]:
        """An empty KV directory per kind this Program keeps."""
        return {MAIN: [], self.draft_kind: []} if self.draft_kind is not None else {MAIN: []}

    @staticmethod
    def page0(obj: Sequence | Checkpoint, kind: str) -> int:
        """The page number of a directory's first entry: a draft backend's directory starts at
        its base (DraftBackend.page0), Main's at 0."""
        return 0 if kind == MAIN else obj.draft_base // PAGE_SIZE

    # ---- reads ---------------------------------------------------------------------------------
    @staticmethod
    def can_append(block: KvBlock, sid: int, f: int) -> bool:
        """May sequence ``sid`` write position ``f`` into ``block`` in place (its append claim)?"""
        return block.filled == f % PAGE_SIZE and block.appender in (None, sid)

    def unit_demand(self, sid: int, frontier: int, blocks: list[KvBlock], n_tokens: int) -> dict[str, int]:
        """Main pages a unit of ``n_tokens`` at ``frontier`` over ``blocks`` needs: growth pages
        plus a tail copy when the frontier is inside a block this writer may not append to."""
        tail = not frontier % PAGE_SIZE or self.can_append(blocks[frontier // PAGE_SIZE], sid, frontier)
        return {MAIN: unit_pages(frontier, n_tokens, len(blocks), tail)}

    def tail_ok(self, seq: Sequence) -> bool:
        f, blocks = seq.frontier, seq.blocks[MAIN]
        return not f % PAGE_SIZE or (bool(blocks) and self.can_append(blocks[f // PAGE_SIZE], seq.sid, f))

    def paged_holders(self) -> set[int]:
        """Holders of every block with a Device page — O(Device pages), never a directory scan."""
        out: set[int] = set()
        for b in self._paged.values():
            out.update(b.holders)
        return out

    @property
    def host_only_pages(self) -> int:
        return len(self._host_only)

    # ---- writes --------------------------------------------------------------------------------
    def claim_tail(self, seq: Sequence) -> None:
        """A sequence bound to a source takes the append claim of its partly filled tails."""
        for kind, f in ((MAIN, seq.frontier), (self.draft_kind or MTP, seq.draft_frontier)):
            blocks = seq.blocks.get(kind)
            if f % PAGE_SIZE and blocks and len(blocks) == pages_for(f) - self.page0(seq, kind) \
                    and self.can_append(blocks[-1], seq.sid, f):
                blocks[-1].appender = seq.sid

    def prepare(self, seq: Sequence, end: int, kind: str = MAIN, f: int | None = None,
                res: Reservation | None = None) -> None:
        """Allocate growth pages and copy a tail the sequence may not append to (COW), for the
        ``kind`` directory written from ``f`` (default: Main at the execution frontier)."""
        blocks, p0 = seq.blocks[kind], self.page0(seq, kind)
        f = seq.frontier if f is None else f
        i = f // PAGE_SIZE - p0
        tail = blocks[i] if f % PAGE_SIZE and len(blocks) > i else None
        if tail is not None and not self.can_append(tail, seq.sid, f):
            new = self._new_block(kind, seq, res)
            if tail.page is None:
                raise NativeError(f"block {tail.bid} has no Device replica")
            self._copy[kind](tail.page, new.page, f % PAGE_SIZE)
            new.filled = f % PAGE_SIZE
            blocks[i] = new
            self.drop_holder(tail, seq.sid)
        elif tail is not None:
            tail.appender = seq.sid
        while len(blocks) < pages_for(end) - p0:
            blocks.append(self._new_block(kind, seq, res))
        for b in blocks:
            if b.page is None or b.leases:
                raise NativeError(f"block {b.bid} of sequence {seq.sid} is not resident")

    def _new_block(self, kind: str, seq: Sequence, res: Reservation | None = None) -> KvBlock:
        b = KvBlock(bid=next(self._ids), kind=kind, holders={seq.sid}, appender=seq.sid, sink=self._changed,
                    noted=self.noted)
        self.page_in(b, allocate(self.pools, res if res is not None else seq.reservation, kind))
        self.blocks[b.bid] = b
        return b

    def mark_written(self, seq: Sequence, start: int, end: int, kind: str = MAIN) -> None:
        """Positions start .. end-1 of the ``kind`` directory now hold this sequence's KV."""
        blocks, p0 = seq.blocks[kind], self.page0(seq, kind)
        for p in range(start // PAGE_SIZE, pages_for(end)):
            b = blocks[p - p0]
            b.filled = max(b.filled, min(PAGE_SIZE, end - p * PAGE_SIZE))
            if b.host is not None and b.host_filled < b.filled:
                self.release_host(b)      # the Host copy no longer holds everything
            b.touch()

    def trim(self, seq: Sequence) -> None:
        """Pages past the frontier's last (a verify row's rejected tail) go back to the pool."""
        blocks = seq.blocks[MAIN]
        keep = pages_for(seq.frontier)
        for b in blocks[keep:]:
            self.drop_holder(b, seq.sid)
        del blocks[keep:]

    def hold(self, blocks: Iterable[KvBlock], holder: int) -> None:
        """A new directory ``holder`` lists these blocks (a checkpoint taken at a frontier)."""
        for b in blocks:
            b.holders.add(holder)
            b.bump()

    def drop_holder(self, b: KvBlock, holder: int) -> None:
        """``holder``'s directory no longer lists ``b``; its last holder gone (and no reader), the
        block is freed on every medium."""
        b.holders.discard(holder)
        if b.appender == holder:
            b.appender = None
        b.bump()
        if not b.holders and not b.leases:
            self._free_block(b)

    def drop_all(self, holder: int, dirs: dict[str, list[KvBlock]]) -> None:
        """``holder`` lets go of every block of its directories."""
        for blocks in dirs.values():
            for b in blocks:
                self.drop_holder(b, holder)

    def unlease(self, b: KvBlock) -> None:
        """A reader of ``b`` finished: free it if nobody holds it any more."""
        b.leases -= 1
        if not b.leases and not b.holders:
            self._free_block(b)

    def _free_block(self, b: KvBlock) -> None:
        if b.page is not None:
            self.page_out(b)
        if b.host is not None:
            self.host.release(b.host)
            b.host = None
        del self.blocks[b.bid]
        self._host_only.discard(b.bid)

    def page_in(self, b: KvBlock, page: int) -> None:
        """``b`` gets the Device page ``page`` (allocated by the caller)."""
        b.page = page
        self._paged[b.bid] = b

    def page_out(self, b: KvBlock) -> None:
        """``b``'s Device page goes back to its pool."""
        self.pools[b.kind].release(b.page)
        b.page = None
        self._paged.pop(b.bid, None)

    def release_host(self, b: KvBlock) -> None:
        self.host.release(b.host)
        b.host, b.host_filled = None, 0

    def changed(self, b: KvBlock) -> None:
        """Report ``b``'s placement in the next placement report (its content is unchanged)."""
        self._changed.add(b.bid)

    def take_changed(self) -> set[int]:
        """Holders of every block whose placement changed since the last call; the Host-only
        index is brought up to date on the way — O(what changed)."""
        holders: set[int] = set()
        for bid in self._changed:
            b = self.blocks.get(bid)
            if b is None:
                self._host_only.discard(bid)
                continue
            if b.page is None:
                self._host_only.add(bid)
            else:
                self._host_only.discard(bid)
            holders.update(b.holders)
        self._changed.clear()
        return holders

    # ---- integrity ---------------------------------------------------------------------------
    def check_integrity(self, sequences: Iterable[Sequence], checkpoints: Iterable[Checkpoint]) -> None:
        """The invariants of the module docstring."""
        dirs: dict[int, list[KvBlock]] = {}
        sequences, checkpoints = list(sequences), list(checkpoints)
        for s in sequences:
            dirs[s.sid] = [b for bl in s.blocks.values() for b in bl]
        for c in checkpoints:
            dirs[c.cid] = [b for bl in c.blocks.values() for b in bl]
        counted: dict[int, set[int]] = {}
        for owner, blocks in dirs.items():
            for b in blocks:
                counted.setdefault(b.bid, set()).add(owner)
        for bid, b in self.blocks.items():
            if counted.get(bid, set()) != b.holders:
                raise IntegrityError(f"block {bid}: holders {sorted(b.holders)} != directories {sorted(counted.get(bid, set()))}")
            if b.page is None and b.host is None:
                raise IntegrityError(f"block {bid} has no replica")
            if not b.holders and not b.leases:
                raise IntegrityError(f"block {bid} is kept with no holder and no reader")
            if b.host is not None and b.host_filled != b.filled:
                raise IntegrityError(f"block {bid}'s Host replica holds {b.host_filled} of {b.filled} positions")
            if b.appender is not None and b.appender not in b.holders:
                raise IntegrityError(f"block {bid}'s append claim is held by {b.appender}, not a holder")
        if set(counted) - set(self.blocks):
            raise IntegrityError("a directory names a deleted block")
        for kind in self.kinds:
            pages = [b.page for b in self.blocks.values() if b.page is not None and b.kind == kind]
            if len(pages) != len(set(pages)) or set(pages) != self.pools[kind].used_ids():
                raise IntegrityError(f"{kind} pool pages and block replicas disagree")
        if {b.bid for b in self.blocks.values() if b.page is not None} != set(self._paged):
            raise IntegrityError("the paged-block index disagrees with the blocks")
        draft = self.draft_kind
        for sq in sequences:      # between calls a directory covers its frontier exactly
            if sq.phase is Phase.RUNNING and len(sq.blocks[MAIN]) != pages_for(sq.frontier):
                raise IntegrityError(f"sequence {sq.sid} holds {len(sq.blocks[MAIN])} Main pages at frontier {sq.frontier}")
            if sq.phase is Phase.RUNNING and draft is not None and \
                    len(sq.blocks[draft]) != pages_for(sq.draft_frontier) - self.page0(sq, draft):
                raise IntegrityError(f"sequence {sq.sid} holds {len(sq.blocks[draft])} draft pages over its "
                                     f"draft coverage [{sq.draft_base}, {sq.draft_frontier})")
        for c in checkpoints:
            if draft is not None and \
                    len(c.blocks.get(draft, ())) != max(0, pages_for(c.draft_frontier) - self.page0(c, draft)):
                raise IntegrityError(f"checkpoint {c.cid}'s draft pages disagree with its coverage "
                                     f"[{c.draft_base}, {c.draft_frontier})")

    def leased(self) -> bool:
        return any(b.leases for b in self.blocks.values())
