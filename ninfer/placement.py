"""First-fit placement arithmetic shared by the Host arena (native) and the reclaim planner
(policy): whether allocations fit into *contiguous* free extents — byte totals do not count."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

ALIGN = 256


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def place_first_fit(free: list[tuple[int, int]], sizes: list[int]
                    ) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Place ``sizes`` in order, each into the lowest-offset free extent (offset, size) large
    enough. Returns (offsets, the free extents left) or None if one does not fit."""
    placed = _first_fit(free, sizes)
    if placed is None:
        return None
    offsets, changed = placed
    return offsets, [h for i, h0 in enumerate(free) if (h := changed.get(i, h0))[1] > 0]


def fits_first_fit(free: list[tuple[int, int]], sizes: list[int]) -> bool:
    """Whether ``place_first_fit(free, sizes)`` places them (without building what is left)."""
    return _first_fit(free, sizes) is not None


def _first_fit(free: list[tuple[int, int]], sizes: list[int]
               ) -> tuple[list[int], dict[int, tuple[int, int]]] | None:
    """(offsets, the extents it shrank by index): ``free`` is not copied — a planner asks this
    of a long, fragmented extent list many times, for a few sizes each."""
    changed: dict[int, tuple[int, int]] = {}
    offsets = []
    for s in sizes:
        need = align(max(s, 1))
        for i, h in enumerate(free):
            if changed and i in changed:
                h = changed[i]
            if h[1] >= need:
                offsets.append(h[0])
                changed[i] = (h[0] + need, h[1] - need)
                break
        else:
            return None
    return offsets, changed


def fits_count(free: Iterable[tuple[int, int]], size: int) -> int:
    """How many allocations of ``size`` first-fit places into these extents, one after another:
    each extent takes as many as it holds whole (the same size every time, so no order can do
    better)."""
    need = align(max(size, 1))
    return sum(s // need for _, s in free)


def merge_extents(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Free extents (offset, size) with adjacent ones merged, as the arena keeps them."""
    out: list[list[int]] = []
    for off, size in sorted(extents):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += size
        else:
            out.append([off, size])
    return [(o, s) for o, s in out]


def merge_into(merged: list[tuple[int, int]], extra: Iterable[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """``merged`` (as ``merge_extents`` returns it) with ``extra`` extents put where they go and
    joined with their neighbours — a few extents into a long, fragmented list without a pass over
    it in Python. None when an extra extent overlaps or repeats one already there: the caller
    merges everything again (its duplicates may have been joined into ``merged``)."""
    out = list(merged)
    for off, size in sorted(set(extra)):
        i = bisect.bisect_left(out, (off, 0))
        end = off + size
        if (i < len(out) and out[i][0] < end) or (i > 0 and out[i - 1][0] + out[i - 1][1] > off):
            return None
        lo, hi, start = i, i, off
        if i > 0 and out[i - 1][0] + out[i - 1][1] == off:
            lo, start = i - 1, out[i - 1][0]
        if i < len(out) and out[i][0] == end:
            hi, end = i + 1, out[i][0] + out[i][1]
        out[lo:hi] = [(start, end - start)]
    return out
