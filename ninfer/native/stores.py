"""Physical stores: typed Device id pools (KV pages, StateImage slots) and the Host arena.

Stores know only occupancy — which ids / byte extents are free, reserved or used. What a page or
slot *holds*, and who refers to it, lives one level up (blocks, images, checkpoints).

Reservations charge capacity before allocation (seed: 传输目标从预留时就计费): a reserved unit is
unavailable to everyone else, then turns into a concrete id when the holder allocates. A unit's
requests over several typed pools succeed together or not at all (``reserve_all``).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
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
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._extents: list[Extent] = [Extent(0, capacity)] if capacity > 0 else []
        self._gen = 0
        # what the free extents add up to, kept until the next allocation or release: every
        # step reports the free bytes, the largest extent and how many images fit, and a full
        # Host has thousands of extents (a pass each: ~0.3 ms a step on the trace slice)
        self._summary: dict = {}

    def _summarized(self, key, compute):
        got = self._summary.get(key)
        if got is None:
            got = self._summary[key] = compute()
        return got

    # -- queries ------------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self._summarized("free", lambda: sum(e.size for e in self._extents if e.free))

    @property
    def used_bytes(self) -> int:
        return self.capacity - self.free_bytes

    def free_extents(self) -> list[tuple[int, int]]:
        return [(e.offset, e.size) for e in self._extents if e.free]

    def fits_count(self, nbytes: int) -> int:
        """How many allocations of ``nbytes`` fit first-fit into the free extents now (every
        step reports it: one pass over the extents, no list built)."""
        return self._summarized(("fits", nbytes), lambda: fits_count(
            ((e.offset, e.size) for e in self._extents if e.free), nbytes))

    def largest_free(self) -> int:
        return self._summarized("largest", lambda: max((e.size for e in self._extents if e.free), default=0))

    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._extents:
            if not e.free:
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
        for i, e in enumerate(self._extents):
            if e.free and e.size >= need:
                self._gen += 1
                self._summary.clear()
                used = Extent(e.offset, need, free=False, kind=kind, generation=self._gen)
                if e.size == need:
                    self._extents[i] = used
                else:
                    self._extents[i:i + 1] = [used, Extent(e.offset + need, e.size - need)]
                return used
        return None

    def release(self, ext: Extent) -> None:
        i = self._index(ext)
        cur = self._extents[i]
        _check(not cur.free and cur.generation == ext.generation,
               f"host: double or stale free of extent at {ext.offset}")
        cur.free, cur.kind = True, ""
        self._summary.clear()
        # merge with the right, then the left neighbour
        if i + 1 < len(self._extents) and self._extents[i + 1].free:
            cur.size += self._extents.pop(i + 1).size
        if i > 0 and self._extents[i - 1].free:
            prev = self._extents[i - 1]
            prev.size += cur.size
            self._extents.pop(i)

    def _index(self, ext: Extent) -> int:
        offsets = [e.offset for e in self._extents]
        i = bisect_left(offsets, ext.offset)
        _check(i < len(offsets) and offsets[i] == ext.offset, f"host: no extent at {ext.offset}")
        return i

    def check_integrity(self) -> None:
        pos = 0
        for a, b in zip(self._extents, self._extents[1:]):
            _check(not (a.free and b.free), "host: two adjacent free extents were not merged")
        for e in self._extents:
            _check(e.offset == pos and e.size > 0, f"host: gap or overlap at {e.offset}")
            pos += e.size
        _check(pos == self.capacity, "host: extents do not cover the capacity exactly")
