"""The DFlash / DFlash2 backend inside Native: the draft's context, its append, block drafting.

A DFlash draft (native/model/dflash.py) reads the target's outputs at a few tap layers: the
context K/V of position p in every draft layer depends only on the taps at p, so Native stores
it in the DFLASH pool's 64-position pages, as Main stores the target's KV::

    execution_frontier F     Main KV + GDN state cover positions 0 .. F-1; ledger[F] is the anchor
    draft_frontier D <= F    the draft's context covers positions draft_base .. D-1

One execute call, for a sequence with DFlash::

    verify   ledger[F] + drafts d_1..d_n as one row (speculative.py's verify rule: a draft is kept
             only while it equals the token the target samples there);
    append   the context of the positions this call committed (the kept rows' taps) — before any
             capture, so no checkpoint ever exposes target KV without the draft's context (the
             DFlash context append Native completes, seed §检查点);
    block    n <= k drafts for the next call from [anchor = ledger[F'], mask × n] over the
             context; the block's own KV never persists.

Coverage rules. A checkpoint at F covers [draft_base, F): unlike MTP there is no bridge, the
tap at F-1 belongs to the checkpoint's input identity. Its restore needs the whole context
(DFlash) or the window's (DFlash2: positions >= F - W + 1): a checkpoint without it is no
restore point of this engine (``noted``: the policy stops offering it; a request that would
have hit it prefills — rebuilding the context — and counts as prefill, not as a hit). Replay
recomputes the taps, so its chunks rebuild the context along with Main.

DFlash2's sliding window W: a context position below F - W + 1 is never read again by this
sequence, so its pages leave the directory (``draft_base`` moves up by whole pages); checkpoints
that still need them keep them.

The pool mirrors Main (layout.draft_pages). Short — Main pages moved to the Host while their
DFlash twins stayed, or a fixed ``speculative.draft_pages`` — the backend drops checkpoints'
coverage (Host-resident first), then restarts this sequence's context at its frontier: outputs
never change, drafts see less context and its next checkpoints are no restore points until a
prefill rebuilds one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ninfer.native.layout import DFLASH, Layout
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.dflash import DFlashDraft, DraftBlock
from ninfer.native.objects import Checkpoint, Sequence
from ninfer.native.speculative import DraftBackend, Pending

if TYPE_CHECKING:
    from ninfer.native.context.kv_directory import KvDirectory
    from ninfer.native.model.model import HybridModel


class DFlashBackend(DraftBackend):
    kind = DFLASH

    def __init__(self, kv: "KvDirectory", checkpoints: dict[int, Checkpoint], layout: Layout,
                 model: "HybridModel"):
        super().__init__(kv, checkpoints, layout, model, layout.spec_method)
        self.draft = DFlashDraft.load(layout.draft_dir, model)
        self.taps = self.draft.taps
        self.window = self.draft.cfg.window            # the draft's sliding window (DFlash2), or None
        self.cache = self.draft.new_cache(layout.kv_pages[DFLASH])

    def rows(self, out, lo: int, keep: int) -> torch.Tensor:
        return out.taps[lo:lo + keep]

    # ---- coverage ---------------------------------------------------------------------------
    def needed_from(self, frontier: int) -> int:
        """The first context position a block at ``frontier`` reads."""
        return 0 if self.window is None else max(0, frontier - self.window + 1)

    @staticmethod
    def coverage(seq: Sequence) -> tuple[int, int]:
        end = min(seq.draft_frontier, seq.frontier)
        return (seq.draft_base, end) if end > seq.draft_base else (0, 0)

    def complete(self, ck: Checkpoint) -> bool:
        """The checkpoint's coverage is what a restore at its frontier needs."""
        f = ck.frontier
        return f == 0 or (ck.draft_frontier == f and ck.draft_base <= self.needed_from(f))

    def noted(self, ck: Checkpoint) -> None:
        if not self.complete(ck):
            self.uncovered.append((ck.cid, ck.generation))

    # ---- after the target's forward -----------------------------------------------------
    def after_call(self, pending: list[Pending]) -> None:
        """Append every sequence's new context, then draft a block for those that sampled."""
        append_rows, positions, slots = [], [], []
        blocks: list[tuple[Sequence, int]] = []
        for p in pending:
            seq = p.seq
            seq.drafts = []
            f0, f = p.old_frontier, seq.frontier
            if seq.draft_frontier < f0:
                self._restart(seq, f0)           # the taps below f0 are gone: a gap
            d = seq.draft_frontier
            if p.rows is not None and f > d:
                if not self._room(seq, d, f):
                    self.stats.short += 1
                    self._restart(seq, f)
                    continue
                table = torch.tensor(self._pages(seq), dtype=torch.long)
                pos = torch.arange(d, f)
                append_rows.append(p.rows[d - f0:f - f0])
                positions.append(pos)
                slots.append(table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
                self.kv.mark_written(seq, d, f, DFLASH)
                seq.draft_frontier = f
                self.stats.entries += f - d
            self._slide(seq)
            n = self._budget(seq) if p.sampled and not seq.finished else 0
            if n > 0 and seq.draft_frontier == f and f > seq.draft_base:
                blocks.append((seq, n))
        with torch.no_grad():
            if append_rows:
                dev = self.device
                self.draft.append(self.cache, torch.cat(append_rows), torch.cat(positions).to(dev),
                                  torch.cat(slots).to(dev))
            if blocks:
                spec = [DraftBlock(anchor=seq.ledger[seq.frontier], start=seq.frontier, n=n,
                                   page_table=self._pages(seq), base=seq.draft_base) for seq, n in blocks]
                for (seq, _), drafts in zip(blocks, self.draft.draft(spec, self.cache)):
                    seq.drafts = list(drafts)

    def _slide(self, seq: Sequence) -> None:
        """DFlash2: pages wholly below the window leave the sequence's directory."""
        if self.window is None:
            return
        first = min(self.needed_from(seq.frontier), seq.draft_frontier) // PAGE_SIZE
        drop = first - self.page0(seq)
        if drop <= 0:
            return
        blocks = seq.blocks[DFLASH]
        for b in blocks[:drop]:
            self.kv.drop_holder(b, seq.sid)
        del blocks[:drop]
        seq.draft_base = first * PAGE_SIZE
