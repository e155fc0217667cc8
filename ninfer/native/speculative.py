"""The MTP backend inside Native: per-backend frontier, drafting, and what a verify row commits.

Frontiers of one sequence (seed: Main、MTP、DFlash 的 frontier 分别解释)::

    execution_frontier F     Main KV + GDN state cover positions 0 .. F-1; ledger[F] is the next input
    draft_frontier M <= F      the head's KV covers entries draft_base .. M-1, entry p = (h_p, x_{p+1})

One execute call, for a sequence with MTP::

    verify   inputs ledger[F] + drafts d_1..d_n at F .. F+n (n = 0: a plain decode row); the target
             samples every position with the same per-position seeded sampler as without
             speculation, and a draft is kept only while it equals the sampled token there — so
             speculation never changes an output token, greedy or sampled. The state rolls back
             to the last kept input (HybridModel.roll_back); pages past it are returned.
    catch-up the head's entries M .. E-1 (E = min(F', last ledger index)) from this call's target
             hiddens — the frontier-1 bridge after a restore is entry F-1 from the continuation
             hidden in the StateImage;
    drafts   n' <= k drafts for the next call, the first from entry E-1, the others from draft
             entries E .. E+n'-2 written past M (never covered, overwritten by the next catch-up).

Checkpoints carry the head's coverage [draft_base, min(M, F-1)): entry F-1 needs x_F, which is not
part of the checkpoint's input identity. A sequence restored from a point whose coverage ends
before F-1 (none kept, or dropped) restarts the head's context at the bridge (``draft_base``):
nothing of the target is recomputed and outputs stay the same; drafts just see less context
until it refills. Replay recomputes the target's hiddens, so its chunks rebuild the head's KV
along with Main.

The MTP pool is optional cache: a unit that finds no MTP page first drops the coverage of
checkpoints (Host-resident ones first), then runs without drafts — it never fails or waits for
it. Uncommitted drafts are never a restore point, and a pause drops them (rebuilt in the
resumed request's first unit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ninfer.native.layout import MTP, Layout
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.mtp import MtpEntries, MtpHead
from ninfer.native.objects import Checkpoint, Sequence, pages_for
from ninfer.native.stores import reserve_all, settle
from ninfer.protocol import SpecStats, unit_pages

if TYPE_CHECKING:
    from ninfer.native.context.kv_directory import KvDirectory
    from ninfer.native.model.model import HybridModel


class Catchup(NamedTuple):
    """One sequence's head entries start .. end-1 of this call and the drafts it wants."""

    seq: Sequence
    start: int
    end: int
    drafts: int
    hidden: torch.Tensor                 # the target hiddens h_start .. h_{end-1} (pre-norm)


@dataclass
class Pending:
    """One sequence's part of the head call after the target's forward."""

    seq: Sequence
    old_frontier: int
    prev_hidden: torch.Tensor | None     # continuation hidden before the call (position old - 1)
    rows: torch.Tensor | None            # this call's hidden of positions old .. F-1
    sampled: bool                        # the call committed a token (drafts are wanted)


class DraftBackend:
    """What every draft backend shares: its typed pool and directory (``kind``), the coverage
    [draft_base, draft_frontier) of sequences and checkpoints, the pending drafts of a decode
    row, the counters. A directory lists the pages from ``draft_base // 64`` on (``page0``):
    positions below the base (a restarted or windowed context) hold no page. Its blocks live in
    the Program's KV directory and are reached through its public API only; the checkpoint
    table is read (never written) to pick the coverage to drop when the pool is short."""

    kind: str = MTP
    needs_prev: bool = False           # after_call wants the continuation hidden before the call
    taps: tuple[int, ...] = ()         # target layers whose outputs the backend reads

    def __init__(self, kv: "KvDirectory", checkpoints: dict[int, Checkpoint], layout: Layout,
                 model: "HybridModel", method: str):
        self.kv = kv
        self.checkpoints = checkpoints
        self.layout = layout
        self.device = model.device
        self.k = layout.spec_tokens
        self.stats = SpecStats(method=method, by_position=[0] * self.k, offered=[0] * self.k)
        # checkpoints that lack the coverage their restore needs (DFlash), for the next reply
        self.uncovered: list[tuple[int, int]] = []
        kv.attach_draft(self.kind, self.copy_page_prefix)

    def take_uncovered(self) -> list[tuple[int, int]]:
        out, self.uncovered = self.uncovered, []
        return out

    # ---- verify -------------------------------------------------------------------------
    def drafts_for(self, seq: Sequence, n_tokens: int) -> list[int]:
        """The drafts a unit of ``n_tokens`` verifies: the pending ones of a decode row."""
        return list(seq.drafts) if n_tokens == 1 and seq.frontier == len(seq.ledger) - 1 else []

    def note_verify(self, drafts: list[int], committed: list[int]) -> None:
        st = self.stats
        st.decode_rows += 1
        st.committed += len(committed)
        if not drafts:
            return
        st.verify_rows += 1
        kept = 0
        for i, d in enumerate(drafts[:len(committed)]):
            st.offered[i] += 1
            if committed[i] != d:
                break
            kept += 1
            st.by_position[i] += 1
        st.drafted += len(drafts)
        st.accepted += kept

    def _budget(self, seq: Sequence) -> int:
        """Drafts the next verify may carry: within max_tokens (the bonus token included) and the context."""
        left = seq.params.max_tokens - seq.n_generated - 1
        room = self.layout.max_context - 1 - seq.frontier
        return max(0, min(self.k, left, room))

    # ---- the directory ----------------------------------------------------------------------
    @staticmethod
    def page0(obj: Sequence | Checkpoint) -> int:
        return obj.draft_base // PAGE_SIZE

    def _pages(self, seq: Sequence) -> list[int]:
        """The page table by absolute page number (pages below the base: -1, never read)."""
        return [-1] * self.page0(seq) + [b.page for b in seq.blocks[self.kind]]

    def _room(self, seq: Sequence, m: int, end: int) -> bool:
        """Allocate the pages for positions m .. end-1 (tail copy included) from the pool;
        short, drop checkpoints' coverage first. False: still short (nothing held)."""
        kv, kind = self.kv, self.kind
        blocks, p0 = seq.blocks[kind], self.page0(seq)
        i = m // PAGE_SIZE - p0
        tail = not m % PAGE_SIZE or len(blocks) <= i or kv.can_append(blocks[i], seq.sid, m)
        need = unit_pages(m, end - m, p0 + len(blocks), tail)
        res, short = reserve_all(kv.pools, {kind: need})
        if res is None:
            self._drop_coverage(short[kind])
            res, short = reserve_all(kv.pools, {kind: need})
            if res is None:
                return False
        kv.prepare(seq, end, kind, m, res)
        settle(kv.pools, res)
        return True

    def _trim(self, seq: Sequence) -> None:
        """Pages past the backend's frontier (draft entries) are garbage once drafted: return them."""
        blocks = seq.blocks[self.kind]
        keep = pages_for(seq.draft_frontier) - self.page0(seq)
        for b in blocks[keep:]:
            self.kv.drop_holder(b, seq.sid)
        del blocks[keep:]

    def _restart(self, seq: Sequence, base: int) -> None:
        """The backend's context restarts at ``base``: positions below it are never covered."""
        for b in seq.blocks[self.kind]:
            self.kv.drop_holder(b, seq.sid)
        seq.blocks[self.kind] = []
        seq.draft_base = seq.draft_frontier = base
        self.stats.restarts += 1

    def _drop_coverage(self, pages: int) -> None:
        """Free pages by dropping checkpoints' coverage (outputs never depend on it): Host-resident
        points first, then the oldest. O(checkpoints), only when the pool is short."""
        cks = sorted((c for c in self.checkpoints.values() if c.blocks.get(self.kind)),
                     key=lambda c: (c.image.slot is not None, c.cid))
        for ck in cks:
            if self.kv.pools[self.kind].available >= pages:
                return
            self.drop_coverage(ck)

    def drop_coverage(self, ck: Checkpoint) -> None:
        for b in ck.blocks.get(self.kind, ()):
            self.kv.drop_holder(b, ck.cid)
        ck.blocks[self.kind] = []
        ck.draft_base = ck.draft_frontier = 0
        ck.touch()
        self.stats.coverage_dropped += 1
        self.noted(ck)

    def noted(self, ck: Checkpoint) -> None:
        """A new or changed checkpoint: a backend whose restore needs coverage reports a point
        that lacks it (``uncovered``) so the policy stops offering it as a source."""

    def copy_page_prefix(self, src: int, dst: int, n: int) -> None:
        """Tail copy (COW) of the backend's page ``src`` into ``dst``: its first n positions."""
        self.cache.k[:, dst, :n] = self.cache.k[:, src, :n]
        self.cache.v[:, dst, :n] = self.cache.v[:, src, :n]

    def rows(self, out, lo: int, keep: int) -> torch.Tensor:
        """What ``after_call`` reads of one sequence's rows lo .. lo+keep-1 of the call's output."""
        raise NotImplementedError

    def after_call(self, pending: list["Pending"]) -> None:
        raise NotImplementedError

    @staticmethod
    def coverage(seq: Sequence) -> tuple[int, int]:
        raise NotImplementedError


class MtpBackend(DraftBackend):
    kind = MTP
    needs_prev = True

    def __init__(self, kv: "KvDirectory", checkpoints: dict[int, Checkpoint], layout: Layout,
                 model: "HybridModel"):
        super().__init__(kv, checkpoints, layout, model, "mtp")
        self.head = MtpHead(model)
        self.cache = self.head.new_cache(layout.kv_pages[MTP])

    def rows(self, out, lo: int, keep: int) -> torch.Tensor:
        return out.all_hidden[lo:lo + keep]

    # ---- the head after the target's forward ----------------------------------------------
    def after_call(self, pending: list[Pending]) -> None:
        """Catch the head up on every sequence of the call and draft for the next one."""
        head = self.head
        work: list[Catchup] = []
        for p in pending:
            seq = p.seq
            seq.drafts = []
            if seq.finished:
                continue
            f0 = p.old_frontier
            if seq.draft_frontier < f0 - 1:        # hiddens below f0 - 1 are gone: a gap
                self._restart(seq, max(f0 - 1, 0))
            m = seq.draft_frontier
            end = min(seq.frontier, len(seq.ledger) - 1)
            if end <= m:
                continue
            n = self._budget(seq) if p.sampled else 0
            if not self._room(seq, m, end + max(n - 1, 0)):
                self.stats.short += 1
                continue                  # the gap restarts the head at the next bridge
            parts = ([p.prev_hidden[None]] if p.prev_hidden is not None else []) + (
                [p.rows] if p.rows is not None else [])
            first = f0 - 1 if p.prev_hidden is not None else f0      # position of parts' first row
            work.append(Catchup(seq, m, end, n, torch.cat(parts)[m - first:end - first]))
        if not work:
            return
        entries = [MtpEntries(tokens=w.seq.ledger[w.start + 1:w.end + 1], prev=head.feature(w.hidden), start=w.start,
                              page_table=self._pages(w.seq), base=w.seq.draft_base) for w in work]
        with torch.no_grad():
            out = head.forward(entries, self.cache)
            for w in work:
                self.kv.mark_written(w.seq, w.start, w.end, MTP)
                w.seq.draft_frontier = w.end
                self.stats.entries += w.end - w.start
            rows = [i for i, w in enumerate(work) if w.drafts > 0]
            if rows:
                self._draft([work[i] for i in rows], out[rows])
        for w in work:
            self._trim(w.seq)

    def _draft(self, work: list[Catchup], h: torch.Tensor) -> None:
        """Chain up to k drafts per sequence from ``h`` (each one's last catch-up ``out``): entry
        E-1 gives d_1, draft entry E-1+s (written past the frontier) gives d_{s+1}."""
        head = self.head
        for w, t in zip(work, head.logits(h).argmax(-1).tolist()):
            w.seq.drafts.append(t)
        live = list(range(len(work)))
        for step in range(1, self.k):
            live = [j for j in live if work[j].drafts > step]
            if not live:
                return
            entries = [MtpEntries(tokens=[work[j].seq.drafts[-1]], prev=h[j:j + 1], start=work[j].end - 1 + step,
                                  page_table=self._pages(work[j].seq), base=work[j].seq.draft_base) for j in live]
            o = head.forward(entries, self.cache, step)
            for i, (j, t) in enumerate(zip(live, head.logits(o).argmax(-1).tolist())):
                work[j].seq.drafts.append(t)
                h[j] = o[i]

    @staticmethod
    def coverage(seq: Sequence) -> tuple[int, int]:
        """(base, frontier) of the head's coverage a checkpoint of ``seq`` at its frontier gets."""
        end = min(seq.draft_frontier, seq.frontier - 1)
        return (seq.draft_base, end) if end > seq.draft_base else (0, 0)
