"""The reclaim planner's lazy choice equals the exhaustive one (seed: 回收与准入).

``Planner._choose`` evaluates options in the order of a lower bound of their rank and stops at
the first bound that is not below the best found; ``Planner._options`` evaluates every option.
On random quotes — nested and identical points of a few histories, pages shared by the points
that list them, sequence holders and pins, Host copies, a Host too small for some demotions,
ties in demand — every choice of every plan must be the exhaustive minimum."""

from __future__ import annotations

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ninfer import protocol as P
from ninfer.placement import align
from ninfer.policy.reclaim import Planner
from ninfer.policy.records import Level, RecordTable

IMG, PAGE, UNIT = align(1000), align(500), 16


def _by_member(facts: P.Facts, victims: set[int]) -> tuple[dict, dict]:
    """The blocks a deletion of each checkpoint might free and the groups of two or more holders
    left on a block, computed from scratch (what ``FactsIndex.entries`` and ``groups`` keep)."""
    listers: dict[int, list[int]] = {}
    for cid, c in facts.checkpoints.items():
        for bid in c.blocks:
            listers.setdefault(bid, []).append(cid)
    by_member: dict[int, set] = {}
    groups: dict[frozenset[int], set[int]] = {}
    for bid, b in facts.blocks.items():
        if not b.device or b.pinned:
            continue
        rest = frozenset(h for h in b.holders if h not in victims)
        if any(h < 0 for h in rest):
            continue
        lst = tuple(sorted(listers.get(bid, ())))
        for m in rest or lst:
            by_member.setdefault(m, set()).add((bid, frozenset(b.holders), lst))
        if len(rest) > 1:
            groups.setdefault(rest, set()).add(bid)
    return by_member, groups


class Checked(Planner):
    """A planner whose every choice is compared with the exhaustive minimum, and whose block
    index with the one computed from scratch."""

    choices = 0

    def _choose(self, pool, short):
        by_member, groups = _by_member(self.f, self.victims)
        assert {g: set(b) for g, b in self._groups().items()} == groups
        for m in self.cands:
            assert {(b, h, tuple(sorted(lst))) for b, h, lst in self._entries(m)} == by_member.get(m, set()), m
        got = super()._choose(pool, short)
        options = self._options(pool, short)
        want = min(options, key=lambda o: self._rank(*o[:5])) if options else None
        assert (got is None) == (want is None), (pool, short, got, want)
        if got is not None:
            assert got[:5] == want[:5] and got[5:] == want[5:], (pool, short, got, want)
        Checked.choices += 1
        return got


point = st.tuples(st.integers(0, 2),                 # history
                  st.integers(1, 6),                 # frontier in pages
                  st.sampled_from([Level.NORMAL, Level.NORMAL, Level.REUSE]),
                  st.sampled_from([0.0, 0.0, 1.0, 2.0]),     # demand time (ties are common)
                  st.booleans(),                     # image on the Device
                  st.booleans())                     # image on the Host


def _quote(points, page_flags, host_pages, main_free):
    """Facts and records for ``points``: a point of frontier k pages on history h lists pages
    0..k-1 of h, and every point listing a page holds it."""
    table = RecordTable()
    cks: dict[int, P.CheckpointFact] = {}
    listing: dict[tuple[int, int], list[int]] = {}
    for i, (h, k, *_rest) in enumerate(points):
        for j in range(k):
            listing.setdefault((h, j), []).append(i + 1)
    bid_of = {key: 1000 + n for n, key in enumerate(sorted(listing))}
    used: list[tuple[int, int]] = []

    def host(size):
        off = sum(s for _, s in used)
        used.append((off, size))
        return off, size
    blocks: dict[int, P.BlockFact] = {}
    for n, (key, holders) in enumerate(sorted(listing.items())):
        on_device, on_host, pinned, seq, other = page_flags[n % len(page_flags)]
        on_device = on_device or not on_host
        # mostly its listers hold a page; sometimes another point holds it too, or a lister does not
        hold = tuple(holders) + ((-1,) if seq else ())
        if other == 1 and len(points) > 1:
            hold += ((holders[0] % len(points)) + 1,) if (holders[0] % len(points)) + 1 not in holders else ()
        elif other == 2 and len(holders) > 1:
            hold = hold[1:]
        blocks[bid_of[key]] = P.BlockFact(bid_of[key], 1, "main", hold, pinned and seq, on_device, on_host, UNIT,
                                          host(PAGE) if on_host else None)
    for i, (h, k, level, demand, img_dev, img_host) in enumerate(points):
        cid = i + 1
        rec = table.new_record(None)
        rec.level, rec.evidence.demand_time = level, demand
        owner = rec.owner("E")
        img_dev = img_dev or not img_host
        bids = tuple(bid_of[(h, j)] for j in range(k))
        cks[cid] = P.CheckpointFact(cid, 1, 1, P.CkptKind.CACHE, k * UNIT, (owner,), img_dev, img_host, False, bids,
                                    host(IMG) if img_host else None)
        toks = tuple(range(h * 10_000, h * 10_000 + k * UNIT))
        table.add_ckpt(P.CkptRef(cid, 1, k * UNIT, P.CkptKind.CACHE, img_dev, img_host), toks, owner)
        rec.e = cid
    cap = sum(s for _, s in used) + host_pages * PAGE
    free, pos = [], 0
    for off, size in sorted(used):
        pos = off + size
    if pos < cap:
        free.append((pos, cap - pos))
    dev_pages = sum(1 for b in blocks.values() if b.device)
    slots = sum(1 for c in cks.values() if c.image_device)
    pools = {P.MAIN: P.PoolFact(P.MAIN, dev_pages + main_free, main_free, 0),
             P.STATE: P.PoolFact(P.STATE, slots, 0, 0)}
    facts = P.Facts(pools=pools, host_capacity=cap, host_free=tuple(free), image_bytes=IMG, page_bytes=PAGE,
                    checkpoints=cks, blocks=blocks, tx_busy=False)
    return facts, table


@settings(max_examples=400, deadline=None, derandomize=True)
@given(points=st.lists(point, min_size=1, max_size=8),
       page_flags=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans(),
                                          st.integers(0, 2)), min_size=1,
                           max_size=6),
       host_pages=st.integers(0, 4), main_free=st.integers(0, 1),
       need_state=st.integers(0, 2), need_main=st.integers(0, 8), demote=st.booleans(),
       protect=st.sets(st.integers(1, 8), max_size=2))
# three identical points, two of them holding their page: deleting those two together loses
# nothing (the third survives) and wins over every demotion; a fourth, longer point makes the
# least losses differ (a floor of the groups taken too high would skip the pair)
@example(points=[(0, 1, Level.NORMAL, 0.0, True, False)] * 3 + [(1, 6, Level.NORMAL, 0.0, True, False)],
         page_flags=[(True, False, False, False, 2), (True, False, False, False, 0)], host_pages=4, main_free=0,
         need_state=0, need_main=1, demote=True, protect=set())
# a protected point holds its page with two others: the three may not go together
@example(points=[(0, 1, Level.NORMAL, 0.0, True, False)] * 3,
         page_flags=[(True, False, False, False, 0)], host_pages=0, main_free=0,
         need_state=0, need_main=1, demote=False, protect={1})
# two identical points and a longer one hold the first page, the longer one alone the second: the
# group of the three (whose longer member loses a page) ties with deleting the longer one alone
# and goes first on its ids — the groups' bound at a member that loses a token must list it
@example(points=[(0, 1, Level.NORMAL, 0.0, True, False)] * 2 + [(0, 2, Level.NORMAL, 0.0, True, False)],
         page_flags=[(True, False, False, False, 0)], host_pages=0, main_free=0,
         need_state=0, need_main=1, demote=False, protect=set())
def test_the_lazy_choice_is_the_exhaustive_minimum(points, page_flags, host_pages, main_free, need_state,
                                                   need_main, demote, protect):
    """``protect``: points this plan may not touch (a request's sources): a group of holders
    with one of them among its members is not an option. Each quote is planned twice: whole, and
    scoped (``Facts.partial``, as a live quote with a Host window: the points the records know
    are live, and the loss floors are read off ``RecordTable.lone``)."""
    facts, table = _quote(points, page_flags, host_pages, main_free)
    for quote in (facts, msgspec.structs.replace(facts, partial=True)):
        pl = Checked(quote, table, set(protect), lambda o: False, demote=demote)
        pl.plan({P.STATE: need_state, P.MAIN: need_main})


def test_the_property_reaches_choices_of_every_kind():
    """The generator above is not vacuous: its quotes make plans choose deletions of one and of
    several points, demotions of images and of pages, with and without Host victims."""
    seen = set()
    Checked.choices = 0

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(points=st.lists(point, min_size=1, max_size=8),
           page_flags=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans(),
                                          st.integers(0, 2)), min_size=1,
                               max_size=6),
           host_pages=st.integers(0, 4), need_state=st.integers(0, 2), need_main=st.integers(0, 8))
    def run(points, page_flags, host_pages, need_state, need_main):
        facts, table = _quote(points, page_flags, host_pages, 0)
        pl = Checked(facts, table, set(), lambda o: False)
        pl.plan({P.STATE: need_state, P.MAIN: need_main})
        for step in pl.steps:
            kinds = {type(a).__name__ for a in step}
            dels = sum(1 for a in step if isinstance(a, P.Delete))
            seen.add(("multi" if dels > 1 else "one") if dels and not kinds - {"Delete"} else
                     "demote+victims" if kinds & {"DemoteState", "DemoteBlocks"} and dels else
                     "demote_state" if "DemoteState" in kinds else "demote_blocks" if "DemoteBlocks" in kinds
                     else "other")
    run()
    assert {"one", "multi", "demote_state", "demote_blocks", "demote+victims"} <= seen, seen
    assert Checked.choices > 400
