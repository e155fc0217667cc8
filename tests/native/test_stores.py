"""Property-based tests for the physical stores (``ninfer.native.stores``).

Two stateful models drive the stores with random operation sequences and compare them after
every step with a shadow kept in plain Python:

* ``IdPoolMachine`` — several typed ``IdPool``s with ``reserve_all`` / ``allocate`` /
  ``settle`` / ``release``.
* ``HostArenaMachine`` — one ``HostArena`` with first-fit allocation, release and
  ``can_place``.

Plain ``@given`` tests cover ``place_first_fit`` against the arena, the capacity-0 arena and
full release merging back into one extent.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ninfer.native.stores import (
    ALIGN,
    Extent,
    HostArena,
    IdPool,
    IntegrityError,
    Reservation,
    align,
    allocate,
    place_first_fit,
    reserve_all,
    settle,
)

STATEFUL = settings(max_examples=150, stateful_step_count=40, deadline=None)
PLAIN = settings(max_examples=150, deadline=None)

POOL_SIZES = {"main": 7, "mtp": 3, "state": 4}
KINDS = sorted(POOL_SIZES)


# =========================================================================================
# Typed id pools + reservations
# =========================================================================================

def _pool_snapshot(pools: dict[str, IdPool]) -> dict[str, tuple]:
    """Everything observable about the pools, to prove an operation changed nothing."""
    return {k: (p.free, p.used, p.reserved, frozenset(p.used_ids())) for k, p in pools.items()}


class IdPoolMachine(RuleBasedStateMachine):
    """Random reserve / allocate / settle / release traffic over several typed pools.

    Model: ``used[kind]`` is the set of ids handed out and not yet released; ``open`` maps
    each live reservation to the amounts it still holds (what the pool must still count as
    reserved on its behalf); ``settled`` keeps spent reservations for misuse checks.
    """

    def __init__(self):
        super().__init__()
        self.pools = {k: IdPool(k, n, unit_bytes=64) for k, n in POOL_SIZES.items()}
        self.used: dict[str, set[int]] = {k: set() for k in KINDS}
        self.open: list[tuple[Reservation, dict[str, int]]] = []
        self.settled: list[Reservation] = []

    # -- model queries ----------------------------------------------------------------------
    def model_reserved(self, kind: str) -> int:
        return sum(amounts.get(kind, 0) for _, amounts in self.open)

    def model_available(self, kind: str) -> int:
        return POOL_SIZES[kind] - len(self.used[kind]) - self.model_reserved(kind)

    def allocatable(self) -> list[tuple[int, str]]:
        return [(i, k) for i, (_, amounts) in enumerate(self.open)
                for k, n in sorted(amounts.items()) if n > 0]

    # -- rules ------------------------------------------------------------------------------
    @rule(demand=st.dictionaries(st.sampled_from(KINDS), st.integers(0, 9), max_size=3))
    def reserve(self, demand):
        """reserve_all is atomic: success charges exactly the demand; failure reports
        demand - available for exactly the short pools and leaves nothing reserved."""
        before = _pool_snapshot(self.pools)
        avail = {k: self.model_available(k) for k in KINDS}
        expected_short = {k: n - avail[k] for k, n in demand.items() if n > avail[k]}

        res, short = reserve_all(self.pools, demand)

        if expected_short:
            assert res is None
            assert short == expected_short
            assert _pool_snapshot(self.pools) == before
            return
        assert res is not None and short == {}
        assert {k: n for k, n in res.amounts.items() if n} == {k: n for k, n in demand.items() if n}
        assert res.total() == sum(demand.values())
        for k in KINDS:
            assert self.pools[k].available == avail[k] - demand.get(k, 0)
            assert self.pools[k].free == before[k][0]          # reserving frees nothing
        self.open.append((res, dict(res.amounts)))

    @precondition(lambda self: self.allocatable())
    @rule(data=st.data())
    def allocate_from_reservation(self, data):
        """Allocation turns one reserved unit into the lowest free id, unique while used."""
        i, kind = data.draw(st.sampled_from(self.allocatable()))
        res, amounts = self.open[i]
        pool = self.pools[kind]
        free_ids = set(range(POOL_SIZES[kind])) - self.used[kind]
        reserved_before, available_before = pool.reserved, pool.available

        uid = allocate(self.pools, res, kind)

        assert uid == min(free_ids)
        assert uid not in self.used[kind]
        assert pool.is_used(uid)
        assert pool.reserved == reserved_before - 1
        assert pool.available == available_before        # it was already charged
        amounts[kind] -= 1
        assert res.amounts[kind] == amounts[kind]
        self.used[kind].add(uid)

    @rule(data=st.data())
    def allocate_without_reservation(self, data):
        """Allocating a kind the reservation no longer (or never) holds raises and changes
        nothing — neither the pools nor the reservation."""
        candidates = [(res, k) for res, amounts in self.open for k in KINDS if amounts.get(k, 0) == 0]
        candidates += [(res, k) for res in self.settled for k in KINDS]
        candidates.append((Reservation(), data.draw(st.sampled_from(KINDS))))
        res, kind = data.draw(st.sampled_from(candidates))
        before, amounts_before = _pool_snapshot(self.pools), dict(res.amounts)
        with pytest.raises(IntegrityError):
            allocate(self.pools, res, kind)
        assert _pool_snapshot(self.pools) == before
        assert res.amounts == amounts_before

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def settle_reservation(self, data):
        """Settling returns exactly the unused part of a reservation and empties it."""
        i = data.draw(st.integers(0, len(self.open) - 1))
        res, amounts = self.open.pop(i)
        before = {k: (p.reserved, p.available, p.free) for k, p in self.pools.items()}

        settle(self.pools, res)

        assert res.amounts == {} and res.total() == 0
        for k, p in self.pools.items():
            reserved, available, free = before[k]
            assert p.reserved == reserved - amounts.get(k, 0)
            assert p.available == available + amounts.get(k, 0)
            assert p.free == free
        self.settled.append(res)

    @precondition(lambda self: self.settled)
    @rule(data=st.data())
    def settle_twice(self, data):
        """Settling a spent reservation again is a no-op."""
        res = data.draw(st.sampled_from(self.settled))
        before = _pool_snapshot(self.pools)
        settle(self.pools, res)
        assert _pool_snapshot(self.pools) == before

    @precondition(lambda self: any(self.used.values()))
    @rule(data=st.data())
    def release(self, data):
        """Releasing a used id makes it free (and available) again."""
        kind = data.draw(st.sampled_from([k for k in KINDS if self.used[k]]))
        uid = data.draw(st.sampled_from(sorted(self.used[kind])))
        pool = self.pools[kind]
        free_before, available_before = pool.free, pool.available

        pool.release(uid)

        assert not pool.is_used(uid)
        assert pool.free == free_before + 1
        assert pool.available == available_before + 1
        self.used[kind].remove(uid)

    @rule(data=st.data())
    def double_free(self, data):
        """Releasing an id that is not in use (already freed, never handed out, or out of
        range) raises IntegrityError and changes nothing."""
        kind = data.draw(st.sampled_from(KINDS))
        not_used = sorted(set(range(-1, POOL_SIZES[kind] + 1)) - self.used[kind])
        uid = data.draw(st.sampled_from(not_used))
        before = _pool_snapshot(self.pools)
        with pytest.raises(IntegrityError):
            self.pools[kind].release(uid)
        assert _pool_snapshot(self.pools) == before

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def books_balance(self):
        """free + used == size, reserved <= free, available == free - reserved, and the pools
        agree with the model on which ids are used and how much is reserved."""
        for k, p in self.pools.items():
            p.check_integrity()
            assert p.free + p.used == p.size == POOL_SIZES[k]
            assert 0 <= p.reserved <= p.free
            assert p.available == p.free - p.reserved >= 0
            assert p.used_ids() == self.used[k]
            assert p.reserved == self.model_reserved(k)

    def teardown(self):
        """After releasing every id and settling every reservation each pool is full again."""
        for res, _ in self.open:
            settle(self.pools, res)
        for k, ids in self.used.items():
            for uid in ids:
                self.pools[k].release(uid)
        for k, p in self.pools.items():
            p.check_integrity()
            assert (p.free, p.used, p.reserved, p.available) == (p.size, 0, 0, p.size)


TestIdPools = IdPoolMachine.TestCase
TestIdPools.settings = STATEFUL


def test_reserve_negative_amount_is_rejected():
    """IdPool.reserve refuses a negative amount outright."""
    pool = IdPool("main", 4, 64)
    with pytest.raises(ValueError):
        pool.reserve(-1)
    assert pool.reserved == 0 and pool.available == 4


def test_reserve_all_failure_reports_every_short_pool():
    """Worked example: two short pools, one fine pool; nothing is reserved."""
    pools = {k: IdPool(k, n, 64) for k, n in POOL_SIZES.items()}
    res, short = reserve_all(pools, {"main": 9, "mtp": 1, "state": 6})
    assert res is None and short == {"main": 2, "state": 2}
    assert all(p.reserved == 0 for p in pools.values())


# =========================================================================================
# Host arena
# =========================================================================================

def _arena_snapshot(arena: HostArena) -> list[tuple]:
    return [(e.offset, e.size, e.free, e.kind, e.generation) for e in arena.extents()]


def _holes(live: list[tuple[int, int]], capacity: int) -> list[tuple[int, int]]:
    """Maximal free extents (offset, size) left by ``live`` (offset, size) intervals."""
    holes, pos = [], 0
    for off, size in sorted(live):
        if off > pos:
            holes.append((pos, off - pos))
        pos = off + size
    if pos < capacity:
        holes.append((pos, capacity - pos))
    return holes


def _first_fit(holes: list[tuple[int, int]], need: int) -> int | None:
    return next((off for off, size in holes if size >= need), None)


capacities = st.one_of(
    st.integers(0, 24).map(lambda k: k * ALIGN),          # aligned
    st.integers(0, 24 * ALIGN),                           # arbitrary, incl. < ALIGN
)
KIND_TAGS = st.sampled_from(["state", "kv:main", "kv:mtp", ""])


class HostArenaMachine(RuleBasedStateMachine):
    """Random allocate / release traffic on one arena, checked against a shadow list of live
    extents (offset, size). Free extents are derived from the shadow as the maximal gaps, so
    comparing them with the arena also proves adjacent free extents are merged."""

    def __init__(self):
        super().__init__()
        self.arena: HostArena | None = None
        self.capacity = 0
        self.live: dict[int, tuple[Extent, int, int]] = {}   # key -> (handle, offset, size)
        self.next_key = 0
        self.stale: list[tuple[Extent, int, int]] = []        # released handles (offset, gen)
        self.last_gen = 0

    @initialize(capacity=st.one_of(capacities, *[st.integers(8, 32).map(lambda k: k * ALIGN)] * 3))
    def make_arena(self, capacity):
        self.capacity = capacity
        self.arena = HostArena(capacity)

    # -- helpers ------------------------------------------------------------------------------
    def live_intervals(self) -> list[tuple[int, int]]:
        return [(off, size) for _, off, size in self.live.values()]

    def holes(self) -> list[tuple[int, int]]:
        return _holes(self.live_intervals(), self.capacity)

    def size_strategy(self):
        """Sizes for ``allocate``: mostly small (so the arena fragments), plus the edges."""
        largest = max((s for _, s in self.holes()), default=0)
        return st.one_of(
            st.just(1),
            st.integers(1, 2).map(lambda k: k * ALIGN),            # exact multiples
            st.integers(1, 2 * ALIGN),
            st.integers(-ALIGN, 0),                                 # non-positive: one unit
            st.integers(1, self.capacity + 2 * ALIGN),
            st.just(largest + 1),                                   # larger than any hole
            st.just(self.capacity + 1),                             # larger than capacity
        )

    def check_allocate(self, nbytes, kind):
        """First fit: the extent starts at the lowest-offset hole large enough for the
        aligned size, never overlaps a live extent, carries a fresh generation; a failed
        allocation returns None and changes nothing."""
        need = align(max(nbytes, 1))
        expected = _first_fit(self.holes(), need)
        before = _arena_snapshot(self.arena)

        ext = self.arena.allocate(nbytes, kind)

        if expected is None:
            assert ext is None
            assert _arena_snapshot(self.arena) == before
            return
        assert ext is not None
        assert ext.offset == expected
        assert ext.size == need and ext.size % ALIGN == 0 and ext.size >= nbytes
        assert ext.offset % ALIGN == 0
        assert not ext.free and ext.kind == kind
        assert ext.generation > self.last_gen
        for off, size in self.live_intervals():
            assert ext.offset + ext.size <= off or off + size <= ext.offset
        self.last_gen = ext.generation
        self.live[self.next_key] = (ext, ext.offset, ext.size)
        self.next_key += 1

    # -- rules ------------------------------------------------------------------------------
    @rule(nbytes=st.integers(1, 2 * ALIGN), kind=KIND_TAGS)
    def allocate_small(self, nbytes, kind):
        """First-fit allocation of a small size (see ``check_allocate``)."""
        self.check_allocate(nbytes, kind)

    @rule(sizes=st.lists(st.integers(1, 3 * ALIGN), min_size=1, max_size=8), kind=KIND_TAGS)
    def allocate_batch(self, sizes, kind):
        """Several small allocations in a row, each checked (see ``check_allocate``)."""
        for nbytes in sizes:
            self.check_allocate(nbytes, kind)

    @rule(data=st.data(), kind=KIND_TAGS)
    def allocate(self, data, kind):
        """First-fit allocation of any size, edges included (see ``check_allocate``)."""
        self.check_allocate(data.draw(self.size_strategy(), label="nbytes"), kind)

    def check_release(self, key):
        """Releasing a live extent returns exactly its bytes to the free pool."""
        ext, off, size = self.live.pop(key)
        free_before = self.arena.free_bytes
        gen = ext.generation

        self.arena.release(ext)

        assert self.arena.free_bytes == free_before + size
        self.stale.append((ext, off, gen))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        """Release a random live extent (see ``check_release``)."""
        self.check_release(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: len(self.live) >= 2)
    @rule()
    def release_alternate(self):
        """Release every other live extent in offset order: fragments the arena into holes of
        assorted sizes, where first fit and other placement policies disagree (each release
        is checked as in ``check_release``)."""
        by_offset = sorted(self.live, key=lambda k: self.live[k][1])
        for key in by_offset[::2]:
            self.check_release(key)

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def release_stale(self, data):
        """Releasing an already-released handle (whose bytes may since have been merged or
        handed out again) raises IntegrityError and changes nothing."""
        ext, off, gen = data.draw(st.sampled_from(self.stale))
        # The arena may have mutated the released handle in place; rebuild the caller's view.
        handle = Extent(off, ext.size, free=False, generation=gen)
        before = _arena_snapshot(self.arena)
        with pytest.raises(IntegrityError):
            self.arena.release(handle)
        with pytest.raises(IntegrityError):
            self.arena.release(ext)                                 # the very object, too
        assert _arena_snapshot(self.arena) == before

    @precondition(lambda self: self.capacity > 0)
    @rule(data=st.data())
    def release_forged(self, data):
        """Releasing an extent that was never handed out — a free region or an offset inside
        another extent — raises IntegrityError and changes nothing."""
        off = data.draw(st.integers(0, self.capacity - 1))
        starts = {o for o, _ in self.live_intervals()}
        forged = Extent(off, ALIGN, free=False, generation=self.last_gen + 1)
        if off in starts:                                           # right offset, wrong generation
            forged.generation = 0
        before = _arena_snapshot(self.arena)
        with pytest.raises(IntegrityError):
            self.arena.release(forged)
        assert _arena_snapshot(self.arena) == before

    @rule(data=st.data())
    def can_place_agrees_with_allocation(self, data):
        """can_place(sizes) is True exactly when allocating the sizes in order succeeds, and
        place_first_fit predicts the offsets; releasing them restores the free extents."""
        sizes = data.draw(st.lists(self.size_strategy(), max_size=5), label="sizes")
        before = _arena_snapshot(self.arena)
        predicted = place_first_fit(self.arena.free_extents(), sizes)
        verdict = self.arena.can_place(sizes)
        assert verdict == (predicted is not None)
        assert _arena_snapshot(self.arena) == before                # a pure query

        trial = copy.deepcopy(self.arena)
        got = []
        for s in sizes:
            ext = trial.allocate(s)
            if ext is None:
                break
            got.append(ext)
        assert verdict == (len(got) == len(sizes))
        if predicted is not None:
            assert [e.offset for e in got] == predicted[0]
        trial.check_integrity()
        for ext in data.draw(st.permutations(got), label="release order"):
            trial.release(ext)
        trial.check_integrity()
        assert trial.free_extents() == self.arena.free_extents()

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def arena_matches_shadow(self):
        """Extents tile the capacity; free extents are exactly the maximal gaps between live
        extents (so adjacent free extents are merged); free + live bytes == capacity."""
        if self.arena is None:
            return
        self.arena.check_integrity()
        live = sorted(self.live_intervals())
        for (a_off, a_size), (b_off, _) in zip(live, live[1:]):
            assert a_off + a_size <= b_off, "live extents overlap"
        assert self.arena.free_bytes + sum(s for _, s in live) == self.capacity
        assert self.arena.used_bytes == sum(s for _, s in live)
        free = self.arena.free_extents()
        assert free == self.holes()
        for (a_off, a_size), (b_off, _) in zip(free, free[1:]):
            assert a_off + a_size < b_off, "adjacent free extents not merged"
        assert self.arena.largest_free() == max((s for _, s in free), default=0)
        for n in (1, ALIGN + 1, 3 * ALIGN):      # kept summaries (until the next change) agree too
            assert self.arena.fits_count(n) == sum(s // align(n) for _, s in free)
        assert sum(self.arena.bytes_by_kind().values()) == self.arena.used_bytes

    def teardown(self):
        """Releasing everything merges back into one free extent covering the capacity."""
        if self.arena is None:
            return
        for ext, _, _ in self.live.values():
            self.arena.release(ext)
        self.arena.check_integrity()
        assert self.arena.free_extents() == ([(0, self.capacity)] if self.capacity else [])
        assert self.arena.free_bytes == self.capacity


TestHostArena = HostArenaMachine.TestCase
TestHostArena.settings = STATEFUL


# ---- plain properties -----------------------------------------------------------------------

@st.composite
def fragmented_arenas(draw):
    """An arena filled with random-sized extents, then a random subset released (so it has
    holes of assorted sizes), then a few more allocations."""
    arena = HostArena(draw(capacities))
    live = []
    for size in draw(st.lists(st.integers(1, 3 * ALIGN), max_size=30)):
        ext = arena.allocate(size)
        if ext is not None:
            live.append(ext)
    keep = draw(st.lists(st.booleans(), min_size=len(live), max_size=len(live)))
    for ext, kept in zip(live, keep):
        if not kept:
            arena.release(ext)
    for size in draw(st.lists(st.integers(1, 3 * ALIGN), max_size=3)):
        arena.allocate(size)
    return arena


@PLAIN
@given(arena=fragmented_arenas(), sizes=st.lists(st.integers(-1, 4 * ALIGN), max_size=6))
def test_place_first_fit_matches_arena(arena, sizes):
    """place_first_fit over the arena's free extents returns the offsets the arena assigns
    when the same sizes are allocated in order (or None exactly when one of them fails)."""
    predicted = place_first_fit(arena.free_extents(), sizes)
    got = []
    for s in sizes:
        ext = arena.allocate(s)
        if ext is None:
            break
        got.append(ext.offset)
    if predicted is None:
        assert len(got) < len(sizes)
    else:
        assert got == predicted[0]
    arena.check_integrity()


def test_place_first_fit_worked_example():
    """Holes [0,256) and [512,1280): 256 fills the first hole, 300 rounds to 512 and takes the
    front of the second, the next 256 fits in what is left of it, and a further 512 fails."""
    holes = [(0, 256), (512, 768)]
    assert place_first_fit(holes, [256, 300, 256]) == ([0, 512, 1024], [])
    assert place_first_fit(holes, [256, 300, 256, 512]) is None
    assert place_first_fit(holes, []) == ([], holes)
    assert holes == [(0, 256), (512, 768)]                           # input not mutated


@PLAIN
@given(nbytes=st.integers(-ALIGN, 10 * ALIGN))
def test_capacity_zero_arena_refuses_everything(nbytes):
    """A capacity-0 arena has no extents and refuses every allocation."""
    arena = HostArena(0)
    assert arena.allocate(nbytes) is None
    assert not arena.can_place([nbytes])
    assert arena.can_place([])
    assert arena.free_extents() == [] and arena.free_bytes == 0 and arena.largest_free() == 0
    arena.check_integrity()


@PLAIN
@given(capacity=st.integers(1, ALIGN - 1), nbytes=st.integers(-ALIGN, 4 * ALIGN))
def test_sub_alignment_arena_refuses_everything(capacity, nbytes):
    """An arena smaller than one alignment unit can hold nothing (sizes round up)."""
    arena = HostArena(capacity)
    assert arena.allocate(nbytes) is None
    assert arena.free_extents() == [(0, capacity)]


@PLAIN
@given(data=st.data(), capacity=capacities,
       sizes=st.lists(st.integers(1, 3 * ALIGN), min_size=1, max_size=12))
def test_release_everything_merges_into_one_extent(data, capacity, sizes):
    """Whatever fits, released in any order, leaves one free extent covering the capacity."""
    arena = HostArena(capacity)
    live = [e for e in (arena.allocate(s) for s in sizes) if e is not None]
    for ext in data.draw(st.permutations(live)):
        arena.release(ext)
        arena.check_integrity()
    assert arena.free_extents() == ([(0, capacity)] if capacity else [])
    assert arena.free_bytes == capacity and arena.used_bytes == 0


def test_the_host_arena_is_pinned_at_its_exact_size(monkeypatch):
    """On CUDA the arena's backing is registered page-locked memory of exactly the asked size
    (the caching host allocator would round 8.6 GB up to 16 GiB); the registration is undone
    when the backing is collected; a refused registration falls back to pinned memory."""
    import gc

    import torch

    from ninfer.native import memory

    class Cudart:
        def __init__(self, err=0):
            self.err, self.calls = err, []

        def cudaHostRegister(self, ptr, n, flags):
            self.calls.append(("register", ptr, n, flags))
            return self.err

        def cudaHostUnregister(self, ptr):
            self.calls.append(("unregister", ptr))
            return 0
    rt = Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    size = (1 << 20) + 12345                     # not a power of two
    t = memory.host_backing(size, pin=True)
    assert t.numel() == size and rt.calls == [("register", t.data_ptr(), size, 0)]
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert rt.calls[-1] == ("unregister", ptr)
    refused = Cudart(err=1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: refused)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.numel()) or self)
    assert memory.host_backing(size, pin=True).numel() == size and pinned == [size]
    assert memory.host_backing(size, pin=False).numel() == size


@PLAIN
@given(data=st.data(), capacity=capacities, sizes=st.lists(st.integers(1, 3 * ALIGN), min_size=1, max_size=16))
def test_the_high_water_mark_is_told_as_it_rises(data, capacity, sizes):
    """``HostArena.high`` is the end of the highest extent ever handed out, and ``on_grow`` hears
    each rise once, in order — what the Host backing's prefault follows (native/memory.py)."""
    told: list[int] = []
    arena = HostArena(capacity, on_grow=told.append)
    live, highest = [], 0
    for size in sizes:
        if live and data.draw(st.booleans()):
            arena.release(live.pop(data.draw(st.integers(0, len(live) - 1))))
        ext = arena.allocate(size)
        if ext is not None:
            live.append(ext)
            if ext.offset + ext.size > highest:
                highest = ext.offset + ext.size
                assert told[-1] == highest
        assert arena.high == highest
    assert told == sorted(set(told)) and (told[-1] if told else 0) == highest
