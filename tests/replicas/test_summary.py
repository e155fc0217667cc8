"""A replica's restore summary: bounded, published as deltas, and the router's copy always equals
the replica's after the deltas are applied in order (model-free; hypothesis drives the changes)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer import protocol as P
from ninfer.policy.index import PrefixIndex, digest
from ninfer.replicas.summary import PromptHashes, RestoreSummary, SummaryTable, bucket_digest


def _tokens(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 2000) for _ in range(n))


def _router_copy(table: SummaryTable, replica: int) -> set:
    view = table.views.get(replica)
    return set(view.entries) if view else set()


def test_prompt_hashes_agree_with_the_prefix_index_digest():
    toks = _tokens(1, 300)
    ph = PromptHashes(toks, block=64)
    for d in (0, 1, 63, 64, 65, 128, 200, 299, 300):
        assert ph.exact(d) == digest(toks[:d])
    assert ph.exacts([130, 140, 191]) == {d: digest(toks[:d]) for d in (130, 140, 191)}
    assert [b for b, _ in ph.buckets()] == [0, 64, 128, 192, 256]
    assert ph.buckets()[2][1] == bucket_digest(toks, 150, 64) == digest(toks[:128])


def test_the_index_publishes_keys_once_and_retracts_them_with_the_last_checkpoint():
    idx, summary = PrefixIndex(), RestoreSummary(cap=100, block=16)
    idx.observer = summary.observe
    a = _tokens(2, 40)
    idx.add(1, a)
    idx.add(2, a)                  # an alias at the same key: published once
    ev = summary.take()
    assert ev.reset and len(ev.added) == 1 and ev.added[0][:2] == (40, digest(a)) and ev.size == 1
    idx.remove(1)
    assert summary.take() is None  # the alias still holds the key
    idx.remove(2)
    ev = summary.take()
    assert not ev.reset and ev.removed == [(40, digest(a))] and ev.size == 0


def test_added_then_removed_within_one_delta_publishes_nothing():
    s = RestoreSummary(cap=10, block=16)
    s.take()                                         # the initial reset
    t = _tokens(3, 20)
    s.observe(True, (20, digest(t)), t)
    s.observe(False, (20, digest(t)))
    assert s.take() is None


def test_the_cap_drops_the_oldest_and_the_router_follows():
    s, table = RestoreSummary(cap=3, block=16), SummaryTable(block=16)
    keys = []
    for i in range(5):
        t = _tokens(10 + i, 20 + i)
        keys.append((len(t), digest(t)))
        s.observe(True, keys[-1], t)
        assert len(s) <= 3
        assert table.apply(0, s.take())
    assert _router_copy(table, 0) == set(keys[2:]) == set(s.entries())
    assert s.dropped == 2


def test_a_gap_or_another_epoch_asks_for_a_snapshot():
    s, table = RestoreSummary(cap=10, block=16), SummaryTable(block=16)
    t1, t2 = _tokens(20, 30), _tokens(21, 30)
    s.observe(True, (30, digest(t1)), t1)
    assert table.apply(0, s.take())
    s.observe(True, (30, digest(t2)), t2)
    lost = s.take()                                  # never delivered
    s.observe(False, (30, digest(t1)))
    assert not table.apply(0, s.take())              # seq gap
    assert table.apply(0, s.snapshot())              # a reset with everything
    assert _router_copy(table, 0) == {(30, digest(t2))}
    assert lost.seq < s.seq


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 11)), max_size=80),
       cap=st.integers(1, 8), every=st.integers(1, 5))
def test_the_router_copy_equals_the_summary_after_any_changes(ops, cap, every):
    """Random appear / disappear sequences, deltas taken every few changes, a reset in the
    middle: the router's copy always equals the replica's summary, which never exceeds its cap,
    and the bucket index holds exactly the router's entries."""
    s, table = RestoreSummary(cap=cap, block=8), SummaryTable(block=8)
    pool = [_tokens(100 + i, 5 + 3 * i) for i in range(12)]
    for n, (add, i) in enumerate(ops):
        key = (len(pool[i]), digest(pool[i]))
        s.observe(add, key, pool[i] if add else None)
        assert len(s) <= cap
        if n == len(ops) // 2:
            s.reset()
        if n % every == 0 and (ev := s.take()) is not None:
            assert table.apply(7, ev)
            assert _router_copy(table, 7) == set(s.entries())
    if (ev := s.take()) is not None:
        assert table.apply(7, ev)
    assert _router_copy(table, 7) == set(s.entries())
    indexed = {k for at in table._buckets.values() for k, holders in at.by_key.items() if 7 in holders}
    assert indexed == set(s.entries())
    table.drop(7)
    assert not table._buckets


def test_match_finds_each_replicas_deepest_exact_prefix():
    table = SummaryTable(block=16)
    doc = _tokens(40, 200)
    other = doc[:100] + _tokens(41, 50)

    def publish(replica, *depths, toks=doc):
        ev = P.SummaryEvent("e", 0, True, [(d, digest(toks[:d]), bucket_digest(toks, d, 16)) for d in depths], [],
                            len(depths))
        assert table.apply(replica, ev)
    publish(0, 50, 130)
    publish(1, 90)
    publish(2, 120, toks=other)               # parts from the prompt at 100: no prefix beyond
    ph = PromptHashes(doc[:180], block=16)
    assert table.match(ph) == {0: 130, 1: 90}
    assert table.match(PromptHashes(doc[:129], 16)) == {0: 50, 1: 90}   # 130 is deeper than the prompt
    assert table.match(PromptHashes(other, 16)) == {0: 50, 1: 90, 2: 120}
    assert table.match(ph, replicas={1}) == {1: 90}
