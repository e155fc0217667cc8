"""``RecordTable.prefixes_of``: the live cache points that are exact prefixes of a point, deepest
first — kept across new points and brought up to date over the last ``RECENT_ADDS`` adds only;
``may_lose_nothing``: whether the deepest of them is as deep as the point (an identical alias;
on the whole table read off ``lone``, kept as points come and go);
``is_prefix``: one point's membership in that list.
Model-free: fabricated points, any order of adds, deletes and queries, against a brute force."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer import protocol as P
from ninfer.policy.records import RECENT_ADDS, RecordTable

# a few token histories with shared prefixes: points are their prefixes (and identical aliases)
HISTORIES = [(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 9, 9, 9), (1, 2, 7, 7), (5, 5, 5, 5, 5)]


def _brute(table: RecordTable, cid: int) -> list[tuple[int, int]]:
    toks = table.ckpts[cid].tokens
    return sorted(((o.frontier, other) for other, o in table.ckpts.items()
                   if other != cid and o.ref.kind is P.CkptKind.CACHE and o.frontier <= len(toks)
                   and o.tokens == toks[:o.frontier]), reverse=True)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(HISTORIES) - 1), st.integers(1, 8)),
    st.tuples(st.just("snap"), st.integers(0, len(HISTORIES) - 1), st.integers(1, 8)),
    st.tuples(st.just("drop"), st.integers(0, 200), st.just(0)),
    st.tuples(st.just("forget"), st.integers(0, 200), st.just(0)),
    st.tuples(st.just("ask"), st.integers(0, 200), st.just(0)),
    st.tuples(st.just("burst"), st.integers(0, len(HISTORIES) - 1), st.integers(RECENT_ADDS - 2, RECENT_ADDS + 2)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_prefixes_stay_exact_across_adds_and_deletes(steps):
    table, cids, owner = RecordTable(), [], P.EntryOwner(1)
    for op, a, b in steps:
        if op in ("add", "burst", "snap"):
            hist = HISTORIES[a]
            kind = P.CkptKind.SNAPSHOT if op == "snap" else P.CkptKind.CACHE     # a snapshot is never a prefix
            for k in range(b if op == "burst" else 1):
                n = min(1 + k % len(hist) if op == "burst" else b, len(hist))
                cid = len(cids) + 1
                table.add_ckpt(P.CkptRef(cid, 1, n, kind, True, False), hist[:n], owner)
                cids.append(cid)
        elif cids:
            cid = cids[a % len(cids)]
            if cid not in table.ckpts:
                continue
            if op == "drop":
                table.drop_owner(cid, owner)
            elif op == "forget":
                table.forget_ckpt(cid)
                assert table.lone == _brute_lone(table)
            else:
                assert table.prefixes_of(cid) == _brute(table, cid)
                _check_may_lose_nothing(table, cid)
                _check_is_prefix(table, cid)
    for cid in table.ckpts:
        assert table.prefixes_of(cid) == _brute(table, cid)
        _check_may_lose_nothing(table, cid)
        _check_is_prefix(table, cid)
    assert table.lone == _brute_lone(table)
    assert table.index.check() == ""


def test_a_list_is_derived_only_from_an_exact_prefix():
    """A new point's list is taken from a recent point below it whose list is kept — one whose
    tokens are its prefix, not one that merely ends on the same token: (5, 5, 5, 5, 5) ends as
    (1, 2, 3, 4, 5) does and is no prefix of (1, 2, 3, 4, 5, 6)."""
    table, owner = RecordTable(), P.EntryOwner(1)
    table.add_ckpt(P.CkptRef(1, 1, 5, P.CkptKind.CACHE, True, False), HISTORIES[3], owner)
    assert table.prefixes_of(1) == []                 # its list is kept now
    table.add_ckpt(P.CkptRef(2, 1, 6, P.CkptKind.CACHE, True, False), HISTORIES[0][:6], owner)
    assert table.prefixes_of(2) == _brute(table, 2) == []
    table.add_ckpt(P.CkptRef(3, 1, 3, P.CkptKind.CACHE, True, False), HISTORIES[0][:3], owner)
    table.prefixes_of(3)
    table.add_ckpt(P.CkptRef(4, 1, 8, P.CkptKind.CACHE, True, False), HISTORIES[0], owner)
    assert table.prefixes_of(4) == _brute(table, 4) == [(6, 2), (3, 3)]


def test_lists_and_lone_points_step_by_step():
    """Fixed steps through what the property above samples: a list derived from a kept one below
    (that point, the points just above it, never the new point itself), identical aliases
    joining and leaving a key (``lone``), a forget, and the index's frontiers after it."""
    table, owner, hist = RecordTable(), P.EntryOwner(1), HISTORIES[0]

    def add(cid: int, n: int) -> None:
        table.add_ckpt(P.CkptRef(cid, 1, n, P.CkptKind.CACHE, True, False), hist[:n], owner)
    add(1, 3)
    assert table.prefixes_of(1) == []                      # its list is kept now
    add(2, 4)                                              # never asked: no list kept
    add(3, 6)
    assert table.prefixes_of(3) == [(4, 2), (3, 1)]        # from 1's: 1 itself, and 2 just above it
    assert table.lone == {1: 3, 2: 4, 3: 6}
    add(4, 6)                                              # 3's identical alias
    assert table.prefixes_of(4) == [(6, 3), (4, 2), (3, 1)]    # from 3's, which now lists 4 itself
    assert table.lone == {1: 3, 2: 4}
    assert not table.may_lose_nothing(1, 3, table.ckpts) and table.may_lose_nothing(3, 6, table.ckpts)
    assert table.may_lose_nothing(1, 4, table.ckpts)       # asked at another position than its own
    table.drop_owner(4, owner)
    assert table.lone == {1: 3, 2: 4, 3: 6}                # its alias gone: 3 is alone again
    table.forget_ckpt(2)
    assert table.lone == {1: 3, 3: 6} and table.index.check() == ""
    for cid in table.ckpts:
        assert table.prefixes_of(cid) == _brute(table, cid)


def _brute_lone(table: RecordTable) -> dict[int, int]:
    """The cache points no other live cache point has the very tokens of, with their token counts."""
    cache = {cid: o.tokens for cid, o in table.ckpts.items() if o.ref.kind is P.CkptKind.CACHE}
    return {cid: len(toks) for cid, toks in cache.items()
            if toks and not any(other != cid and t == toks for other, t in cache.items())}


def _check_may_lose_nothing(table: RecordTable, cid: int) -> None:
    """The reclaim planner's cheap floor of a least loss (``Planner._loss_floor``): the point may
    lose nothing exactly when a live point has its very tokens (its deepest prefix is as deep
    as itself) — on every live set, the whole table's and a part of it."""
    info = table.ckpts[cid]
    if info.ref.kind is not P.CkptKind.CACHE:        # not keyed by the index: the floor is 0
        assert table.may_lose_nothing(cid, info.frontier, table.ckpts)
        return
    for live in (table.ckpts, {c for c in table.ckpts if c % 2}):
        alias = table.deepest_prefix(cid, live) == info.frontier
        assert table.may_lose_nothing(cid, info.frontier, live) == alias, (cid, sorted(live))
        # asked at another position than the point's own, nothing is known: it may lose nothing
        assert table.may_lose_nothing(cid, info.frontier + 1, live) and table.may_lose_nothing(cid, 0, live)


def _check_is_prefix(table: RecordTable, cid: int) -> None:
    """``is_prefix`` (hot protection asks it of a record's own points): exactly membership in
    ``prefixes_of`` — itself, a deleted point and a snapshot never."""
    listed = {o for _, o in table.prefixes_of(cid)}
    for other in (*table.ckpts, cid, -1):
        assert table.is_prefix(other, cid) == (other in listed), (other, cid)
