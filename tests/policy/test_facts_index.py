"""``reclaim.FactsIndex.derived``: a quote's facts index brought forward from the quote before it.
Consecutive quotes of a full Device share nearly all of their messages, so the index re-indexes
only the checkpoints and blocks whose messages differ. On random edits — points added and
deleted, their page lists changed, pages gaining and losing holders (sequences among them),
pinned, leaving the Device — every part the derivation brought forward must equal, as sets, the
part an index built anew computes, and so must every answer the planner asks of it."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ninfer import protocol as P
from ninfer.policy import reclaim as R

CIDS = list(range(1, 9))
BIDS = list(range(100, 112))


def _facts(cks: dict[int, tuple[int, ...]], blocks: dict[int, tuple[tuple[int, ...], bool, bool]]) -> P.Facts:
    ck = {cid: P.CheckpointFact(cid, 1, 1, P.CkptKind.CACHE, 64 * len(bl), (), True, False, False, bl, None)
          for cid, bl in sorted(cks.items())}
    bk = {bid: P.BlockFact(bid, 1, "main", holders, pinned, device, False, 64, None)
          for bid, (holders, pinned, device) in sorted(blocks.items())}
    return P.Facts({}, 0, (), 1, 1, ck, bk, False)


page_lists = st.lists(st.sampled_from(BIDS), max_size=5, unique=True).map(tuple)
holder_sets = st.lists(st.sampled_from(CIDS[:4] + [-1, -2]), max_size=4, unique=True).map(lambda h: tuple(sorted(h)))
block = st.tuples(holder_sets, st.sampled_from([False, False, True]), st.sampled_from([True, True, False]))  # pinned, device
state = st.tuples(st.dictionaries(st.sampled_from(CIDS), page_lists, max_size=8),
                  st.dictionaries(st.sampled_from(BIDS), block, max_size=12))
page_edit = st.tuples(st.just("page"), st.sampled_from(BIDS), st.none() | block)
edit = st.one_of(st.tuples(st.just("point"), st.sampled_from(CIDS), st.none() | page_lists), page_edit, page_edit)


def _answers(ix: R.FactsIndex) -> tuple:
    cids = list(ix.facts.checkpoints)
    victims = frozenset(cids[:2])
    return ({m: sorted((b, tuple(sorted(h)), tuple(sorted(lst))) for b, h, lst in ix.entries(m, victims))
             for m in cids + [-1, -2]},
            {m: ix.touches(m) for m in cids},
            {cid: ix.movable(cid) for cid in cids},
            {g: sorted(b) for g, b in ix.groups(victims).items()},
            sorted(ix.unheld), len(ix.releasable))


@settings(max_examples=400, deadline=None)
@given(state, st.lists(edit, min_size=1, max_size=5), st.integers(0, 3))
@example(({1: (100,)}, {100: ((1,), False, True)}), [("page", 100, ((-1, 1), False, True))], 1)   # a sequence takes a page
@example(({1: (100,), 2: (100,)}, {100: ((1, 2), False, True)}), [("page", 100, ((1,), False, True))], 3)   # a holder goes
def test_a_derived_index_answers_as_one_built_anew(start, edits, computed):
    cks, blocks = dict(start[0]), dict(start[1])
    base = R.FactsIndex(_facts(cks, blocks))
    # the base has computed some of its parts (each settlement asks for what it needs)
    for part in (lambda: base.listers, lambda: base.unheld, lambda: base.touches(0), lambda: base.shared)[:computed + 1]:
        part()
    for kind, key, value in edits:
        target = cks if kind == "point" else blocks
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    facts = _facts(cks, blocks)
    ix = base.derived(facts)
    if ix is None:       # more than half of the messages changed: built anew
        return
    ix.check_against_fresh()
    assert _answers(ix) == _answers(R.FactsIndex(facts))


def test_a_quote_that_changed_one_page_is_derived_not_rebuilt():
    """Told by a facts delta what changed (``index_from_delta``), the next quote's index is
    brought forward; a quote nobody said anything about is indexed anew (``facts_index`` never
    compares messages with an index whose facts' dicts may have changed in place since)."""
    cks = {cid: (100 + cid, 101 + cid) for cid in CIDS}
    blocks = {bid: ((bid - 100, bid - 99), False, True) for bid in BIDS}
    before = _facts(cks, blocks)
    first = R.facts_index(before)
    first.touches(0), first.shared
    blocks[103] = ((3,), False, True)                 # one page lost a holder
    assert R.facts_index(_facts(cks, blocks)).computed() == {}      # not told: built anew, lazily
    after = _facts(cks, blocks)
    R.index_from_delta(before, after, [], [103])
    ix = R.facts_index(after)
    assert {"listers", "touch", "shared"} <= set(ix.computed())      # brought forward, not left lazy
    assert frozenset({3, 4}) not in ix.shared or 103 not in ix.shared[frozenset({3, 4})]
    ix.check_against_fresh()
