"""Physical stores: typed Device id pools (KV pages, StateImage slots) and the Host arena.

Stores know only occupancy — which ids / byte extents are free, reserved or used. What a page or
slot *holds*, and who refers to it, lives one level up (blocks, images, checkpoints).

Reservations charge capacity before allocation (seed: 传输目标从预留时就计费): a reserved unit is
unavailable to everyone else, then turns into a concrete id when the holder allocates. A unit's
requests over several typed pools succeed together or not at all (``reserve_all``).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass, field

from ninfer.errors import IntegrityError
from ninfer.placement import ALIGN, align, fits_count, place_first_fit  # noqa: F401  (re-exported)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise IntegrityError(msg)


class IdPool:
    """``size`` interchangeable Device units (64-token KV pages of one type, or StateImage slots).

    Lowest free id first, so runs are reproducible.
    """

    def __init__(self, kind: str, size: int, unit_bytes: int):
        self.kind = kind
        self.size = size
        self.unit_bytes = unit_bytes
        self._free = list(range(size))
        heapq.heapify(self._free)
        self._used: set[int] = set()
        self.reserved = 0

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._used)

    @property
    def available(self) -> int:
        """Free units nobody has reserved."""
        return len(self._free) - self.reserved

    def reserve(self, n: int) -> bool:
        if n < 0:
            raise ValueError("cannot reserve a negative amount")
        if n > self.available:
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        _check(0 <= n <= self.reserved, f"{self.kind}: unreserve {n} of {self.reserved} reserved")
        self.reserved -= n

    def allocate_reserved(self) -> int:
        """Turn one reserved unit into a concrete id."""
        _check(self.reserved > 0 and self._free, f"{self.kind}: allocate without a reservation")
        self.reserved -= 1
        uid = heapq.heappop(self._free)
        self._used.add(uid)
        return uid

    def release(self, uid: int) -> None:
        _check(uid in self._used, f"{self.kind}: double free of unit {uid}")
        self._used.remove(uid)
        heapq.heappush(self._free, uid)

    def is_used(self, uid: int) -> bool:
        return uid in self._used

    def used_ids(self) -> set[int]:
        return set(self._used)

    def check_integrity(self) -> None:
        _check(len(self._free) + len(self._used) == self.size, f"{self.kind}: free + used != total")
        _check(not (set(self._free) & self._used), f"{self.kind}: a unit is both free and used")
        _check(len(set(self._free)) == len(self._free), f"{self.kind}: duplicate free unit")
        _check(0 <= self.reserved <= len(self._free), f"{self.kind}: reserved {self.reserved} > free")


@dataclass
class Reservation:
    """Capacity charged to one holder across typed pools, consumed by allocation."""

    amounts: dict[str, int] = field(default_factory=dict)

    def total(self) -> int:
        return sum(self.amounts.values())


def reserve_all(pools: dict[str, IdPool], demand: dict[str, int]) -> tuple[Reservation | None, dict[str, int]]:
    """Reserve every typed demand together. Returns (reservation, {}) or (None, shortfall per
    pool) with nothing left reserved."""
    if any(n < 0 for n in demand.values()):
        raise ValueError(f"negative demand {demand}")
    short = {k: n - pools[k].available for k, n in demand.items() if n > pools[k].available}
    if short:
        return None, short
    for k, n in demand.items():
        if n:
            pools[k].reserve(n)
    return Reservation({k: n for k, n in demand.items() if n}), {}


def allocate(pools: dict[str, IdPool], res: Reservation, kind: str) -> int:
    _check(res.amounts.get(kind, 0) > 0, f"{kind}: reservation exhausted")
    res.amounts[kind] -= 1
    return pools[kind].allocate_reserved()


def settle(pools: dict[str, IdPool], res: Reservation) -> None:
    """Return what a reservation did not use."""
    for k, n in res.amounts.items():
        if n:
            pools[k].unreserve(n)
    res.amounts.clear()


# ---- Host arena ---------------------------------------------------------------------------


@dataclass
class Extent:
    offset: int
    size: int
    free: bool = True
    kind: str = ""          # observation only: "state" | "kv:main" | ...
    generation: int = 0     # bumps on every (re)allocation: detects stale references


class HostArena:
    """One backing of ``capacity`` bytes shared by StateImages, KV pages, pause snapshots and
    transfer destinations. First-fit over contiguous free extents; split on allocation, merge
    on release. An allocated extent is charged from the moment it is handed out (reservation
    and publication do not change occupancy). Per-kind byte counts are for observation only.

        [ used 0..a ][ free a..b ][ used b..c ][ free c..capacity ]

    The used extents are kept by offset and the free ones apart (by offset, in offset order,
    and by end): an allocation scans the free extents only and a release finds its neighbours
    by key — a Host full of cache holds thousands of used extents, and a pass over all of them
    per allocation or release cost ~0.1 ms each on the trace slice.
    """

    def __init__(self, capacity: int, on_grow: Callable[[int], None] | None = None):
        self.capacity = capacity
        # the end of the highest extent ever handed out, told to ``on_grow`` as it rises (the
        # Host backing's pages above it have never been written: native/memory.py prefaults them)
        self.high = 0
        self._on_grow = on_grow
        self._used: dict[int, Extent] = {}                    # offset -> the handle given out
        self._free: dict[int, int] = {0: capacity} if capacity > 0 else {}    # offset -> size
        self._free_end: dict[int, int] = {capacity: 0} if capacity > 0 else {}  # end -> offset
        self._starts: list[int] = [0] if capacity > 0 else []  # free offsets, ascending
        self._gen = 0
        # what the free extents add up to, kept until the next allocation or release: every
        # step reports the free bytes, the largest extent and how many images fit
        self._summary: dict = {}

    def _summarized(self, key, compute):
        got = self._summary.get(key)
        if got is None:
            got = self._summary[key] = compute()
        return got

    # -- queries ------------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self._summarized("free", lambda: sum(self._free.values()))

    @property
    def used_bytes(self) -> int:
        return self.capacity - self.free_bytes

    def free_extents(self) -> list[tuple[int, int]]:
        free = self._free
        return [(o, free[o]) for o in self._starts]

    def extents(self) -> list[Extent]:
        """Every extent in offset order, used (the handles given out) and free (fresh
        objects, generation 0): they tile the capacity."""
        out = list(self._used.values()) + [Extent(o, n) for o, n in self._free.items()]
        out.sort(key=lambda e: e.offset)
        return out

    def fits_count(self, nbytes: int) -> int:
        """How many allocations of ``nbytes`` fit first-fit into the free extents now (every
        step reports it: one pass over the free extents, no list built)."""
        return self._summarized(("fits", nbytes), lambda: fits_count(self.free_extents(), nbytes))

    def largest_free(self) -> int:
        return self._summarized("largest", lambda: max(self._free.values(), default=0))

    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._used.values():
            out[e.kind] = out.get(e.kind, 0) + e.size
        return out

    def can_place(self, sizes: list[int]) -> bool:
        """Would these allocations all fit first-fit, in order, into the current free extents?"""
        return place_first_fit(self.free_extents(), sizes) is not None

    # -- mutation -----------------------------------------------------------------------
    def allocate(self, nbytes: int, kind: str = "") -> Extent | None:
        """First-fit allocation of ``nbytes`` (rounded up to the alignment); None if no
        contiguous free extent is large enough (free byte totals do not count)."""
        need = align(max(nbytes, 1))
        free = self._free
        for i, off in enumerate(self._starts):
            size = free[off]
            if size >= need:
                self._gen += 1
                self._summary.clear()
                used = Extent(off, need, free=False, kind=kind, generation=self._gen)
                self._used[off] = used
                del free[off]
                if size == need:
                    del self._free_end[off + size]
                    del self._starts[i]
                else:                            # the rest stays free, in the same place in order
                    free[off + need] = size - need
                    self._free_end[off + size] = off + need
                    self._starts[i] = off + need
                if off + need > self.high:
                    self.high = off + need
                    if self._on_grow is not None:
                        self._on_grow(self.high)
                return used
        return None

    def release(self, ext: Extent) -> None:
        cur = self._used.get(ext.offset)
        _check(cur is not None, f"host: no extent at {ext.offset}")
        _check(not cur.free and cur.generation == ext.generation,
               f"host: double or stale free of extent at {ext.offset}")
        del self._used[ext.offset]
        cur.free, cur.kind = True, ""
        self._summary.clear()
        off, end = cur.offset, cur.offset + cur.size
        free, ends = self._free, self._free_end
        # merge with the right, then the left neighbour
        right = free.pop(end, None)
        if right is not None:
            del ends[end + right]
            del self._starts[bisect_left(self._starts, end)]
            end += right
        left = ends.pop(off, None)
        if left is not None:
            off = left                            # the left neighbour grows: its start stays listed
        else:
            insort(self._starts, off)
        free[off] = end - off
        ends[end] = off

    def check_integrity(self) -> None:
        pos = 0
        extents = self.extents()
        for a, b in zip(extents, extents[1:]):
            _check(not (a.free and b.free), "host: two adjacent free extents were not merged")
        for e in extents:
            _check(e.offset == pos and e.size > 0, f"host: gap or overlap at {e.offset}")
            pos += e.size
        _check(pos == self.capacity, "host: extents do not cover the capacity exactly")
        _check(self._starts == sorted(self._free) and self._free_end == {o + n: o for o, n in self._free.items()},
               "host: the free extents' indexes disagree")
        _check(all(o == e.offset and not e.free for o, e in self._used.items()), "host: a used extent misfiled")
