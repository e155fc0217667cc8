"""First-fit placement arithmetic shared by the Host arena (native) and the reclaim planner
(policy): whether allocations fit into *contiguous* free extents — byte totals do not count."""

from __future__ import annotations

ALIGN = 256


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def place_first_fit(free: list[tuple[int, int]], sizes: list[int]
                    ) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Place ``sizes`` in order, each into the lowest-offset free extent (offset, size) large
    enough. Returns (offsets, the free extents left) or None if one does not fit."""
    holes = [list(h) for h in free]
    offsets = []
    for s in sizes:
        need = align(max(s, 1))
        for h in holes:
            if h[1] >= need:
                offsets.append(h[0])
                h[0] += need
                h[1] -= need
                break
        else:
            return None
    return offsets, [(o, n) for o, n in holes if n > 0]


def merge_extents(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Free extents (offset, size) with adjacent ones merged, as the arena keeps them."""
    out: list[list[int]] = []
    for off, size in sorted(extents):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += size
        else:
            out.append([off, size])
    return [(o, s) for o, s in out]
