"""Images inside the Program: a sequence's media spans, its MRoPE rows, and the vision tower's
outputs as an optional cache.

A prompt with images carries, at each image's pads, the image's *identity ids*
(``protocol.media_token_ids``: ids >= vocab_size derived from the media digest). Everything
that compares tokens — prefix index, records, checkpoints' ``tokens`` and input digests, the
adoption check — thereby compares media identity. The model never embeds those ids: for a
chunk that covers part of an image the Program builds the call's ``embeds`` (token
embeddings, the image's tower rows substituted at its positions) and its MRoPE rows::

    prompt   text … [img 0: identity ids ×N0] … text … [img 1 ×N1] … text | outputs
    rope     mrope.mrope_positions over the prompt ([3, prompt_len], the decode delta);
             index i >= prompt_len runs at i + delta on all three rows

Tower outputs live in ``EncoderCache`` (LRU by digest within a byte budget). A chunk needing
an image whose output is gone re-encodes it from the sequence's own pixel_values: the same
input, the same deterministic tower, identical rows. Replay after a pause therefore recomputes
exactly what the first prefill computed (positions come from the spans, never from state).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ninfer import protocol as P
from ninfer.native.model.mrope import mrope_positions
from ninfer.native.model.vision import VisionTower


@dataclass
class SeqMedia:
    """One sequence's images (in prompt order) and its MRoPE table over the prompt."""

    items: list[P.MediaItem]
    rope: torch.Tensor          # [3, prompt_len] long
    delta: int

    @staticmethod
    def build(ledger: list[int], prompt_len: int, items: list[P.MediaItem], merge: int) -> SeqMedia:
        ids = torch.tensor(ledger[:prompt_len], dtype=torch.long)
        grids = torch.tensor([list(it.grid_thw) for it in items], dtype=torch.long)
        # no real token id is negative: the spans mark themselves, alternating so that two
        # adjacent spans stay two runs
        for k, it in enumerate(items):
            ids[it.offset:it.offset + it.num_tokens] = -1 - (k % 2)
        rope, delta = _positions(ids, grids, merge)
        return SeqMedia(list(items), rope, delta)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """MRoPE rows [3, end - start] of positions start .. end-1."""
        n = self.rope.shape[1]
        parts = []
        if start < n:
            parts.append(self.rope[:, start:min(end, n)])
        if end > n:
            lo = max(start, n)
            parts.append(torch.arange(lo + self.delta, end + self.delta).expand(3, -1))
        return torch.cat(parts, dim=1)

    def overlapping(self, start: int, end: int) -> list[P.MediaItem]:
        return [it for it in self.items if it.offset < end and start < it.offset + it.num_tokens]


def _positions(ids: torch.Tensor, grids: torch.Tensor, merge: int) -> tuple[torch.Tensor, int]:
    """mrope_positions' rule, run by run, with image runs marked by negative ids (alternating
    -1 / -2, so adjacent spans stay apart). Spans are sorted and non-overlapping (validate_spec)."""
    img = ids < 0
    if not bool(img.any()):
        return mrope_positions(ids, -1, grids.reshape(0, 3), merge)
    # adjacent spans (no text between) are rare; handle the general case run by run
    pieces, pos, g, k = [], 0, 0, 0
    n = len(ids)
    while k < n:
        if not img[k]:
            j = k
            while j < n and not img[j]:
                j += 1
            pieces.append(torch.arange(pos, pos + j - k).expand(3, -1))
            pos += j - k
            k = j
            continue
        mark = int(ids[k])
        j = k
        while j < n and int(ids[j]) == mark:
            j += 1
        one, _ = mrope_positions(torch.full((j - k,), -1), -1, grids[g:g + 1], merge)
        pieces.append(one + pos)
        _, h, w = grids[g].tolist()
        pos += max(h, w) // merge
        g += 1
        k = j
    rope = torch.cat(pieces, dim=1)
    return rope, int(rope.max()) + 1 - n


class EncoderCache:
    """Vision-tower outputs by media digest, least recently used evicted first, within
    ``budget_bytes`` (0: nothing is kept; every use encodes)."""

    def __init__(self, tower: VisionTower, budget_bytes: int):
        self.tower = tower
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.stats = P.VisionStats(budget_bytes=budget_bytes)

    def rows(self, item: P.MediaItem) -> torch.Tensor:
        """The image's tower output [num_tokens, hidden]."""
        hit = self._entries.get(item.digest)
        if hit is not None:
            self._entries.move_to_end(item.digest)
            self.stats.hits += 1
            return hit
        px = np.frombuffer(item.pixel_values, dtype="<f4").reshape(item.shape)
        with torch.no_grad():
            out = self.tower.encode(torch.from_numpy(px.copy()), torch.tensor([list(item.grid_thw)]))
        self.stats.encodes += 1
        if out.shape[0] != item.num_tokens:
            raise ValueError(f"the tower gave {out.shape[0]} rows for an image of {item.num_tokens} tokens")
        size = out.numel() * out.element_size()
        if size <= self.budget_bytes:
            self._entries[item.digest] = out
            self.stats.bytes += size
            while self.stats.bytes > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self.stats.bytes -= old.numel() * old.element_size()
                self.stats.evictions += 1
        self.stats.entries = len(self._entries)
        return out

    def clear(self) -> None:
        self._entries.clear()
        self.stats.bytes = self.stats.entries = 0


def call_embeds(embed: torch.Tensor, input_ids: list[int], row_starts: list[int], row_media: list[tuple[int, int,
                SeqMedia | None]], cache: EncoderCache, vocab_size: int) -> torch.Tensor:
    """Embeddings [T, H] of one call: token embeddings (identity ids embed as id 0, then are
    overwritten), each row's image positions replaced by the tower's rows. ``row_media``: per
    sequence of the call, its (start position, n tokens, media)."""
    ids = torch.tensor(input_ids, dtype=torch.long)
    ids = torch.where(ids < vocab_size, ids, torch.zeros_like(ids)).to(embed.device)
    x = F.embedding(ids, embed).clone()
    for base, (start, n, media) in zip(row_starts, row_media):
        if media is None:
            continue
        for it in media.overlapping(start, start + n):
            lo, hi = max(start, it.offset), min(start + n, it.offset + it.num_tokens)
            rows = cache.rows(it)
            x[base + lo - start:base + hi - start] = rows[lo - it.offset:hi - it.offset].to(x.dtype)
    return x
