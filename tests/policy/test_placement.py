"""``ninfer.placement``: the first-fit arithmetic the Host arena and the reclaim planner share.
``merge_into`` (the planner's hole list: the quote's merged free extents, with the few a plan
frees put in their places) equals merging everything again wherever it answers — extents
adjacent to one or both neighbours, in any order — and declines (None) only for an extent that
overlaps or repeats one (the caller then merges everything again)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.placement import merge_extents, merge_into

extent = st.tuples(st.integers(0, 40), st.integers(1, 6)).map(lambda t: (t[0] * 4, t[1] * 4))


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


@settings(max_examples=400, deadline=None)
@given(st.lists(extent, max_size=12), st.lists(extent, max_size=5))
def test_merge_into_equals_merging_everything_again(free, extra):
    got = merge_into(merge_extents(sorted(set(free))), extra)
    want = merge_extents(sorted(set(free) | set(extra)))
    if got is None:     # only for an extent that shares a byte with another one
        merged, ext = merge_extents(sorted(set(free))), sorted(set(extra))
        assert any(_overlap(e, m) for e in ext for m in merged) or any(
            _overlap(a, b) for i, a in enumerate(ext) for b in ext[i + 1:])
    else:
        assert got == want


def test_merge_into_joins_both_neighbours_and_keeps_the_rest():
    base = [(0, 4), (8, 4), (20, 4)]
    assert merge_into(base, [(4, 4)]) == [(0, 12), (20, 4)]
    assert merge_into(base, [(12, 4), (16, 4)]) == [(0, 4), (8, 16)]
    assert merge_into(base, []) == base and merge_into([], [(4, 4), (0, 4)]) == [(0, 8)]
    assert merge_into(base, [(2, 4)]) is None and merge_into(base, [(8, 4)]) is None   # overlap, repeat
