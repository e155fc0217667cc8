"""Divergence positions, model-free (issue 30): the history trie against a brute-force longest
common prefix, and the ResourceManager's choice of positions on fabricated requests and cache
points (milliseconds, no model, no worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer import protocol as P
from ninfer.policy.history import BLOCK, HistoryTrie
from ninfer.policy.resources import HISTORY_OBSERVER, MAX_DIVERGENCE, ResourceManager
from ninfer.protocol import RequestSpec
from tests.policy.fakes import resource_manager


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


histories = st.lists(st.tuples(st.integers(0, 70), st.lists(st.integers(0, 2), max_size=40), st.booleans()),
                     min_size=1, max_size=10)


@settings(max_examples=200, deadline=None)
@given(histories, st.lists(st.integers(0, 9), max_size=4), st.integers(0, 70),
       st.lists(st.integers(0, 2), max_size=40), st.integers(0, 2 ** 31))
def test_the_trie_finds_the_longest_shared_prefix_and_who_shares_it(hist, drop, cut, tail, seed):
    import random
    base = [random.Random(seed).randrange(3) for _ in range(70)]
    trie, held = HistoryTrie(), {}
    for i, (c, t, live) in enumerate(hist):
        key = f"r{i}" if live else ("ck", i)
        toks = tuple(base[:c] + t)
        trie.insert(key, toks, live)
        held[key] = (toks, live)
    for i in drop:
        key = next((k for k in held if k in (f"r{i}", ("ck", i))), None)
        if key is not None:
            trie.remove(key)
            del held[key]
    assert trie.check() is None
    q = base[:cut] + tail
    m = trie.match(q)
    best = max((_lcp(t, q) for t, _ in held.values()), default=0)
    sharing = [(k, live) for k, (t, live) in held.items() if best and _lcp(t, q) >= best]
    assert m.length == best
    assert set(m.live) == {k for k, live in sharing if live}
    assert m.cached == any(not live for _, live in sharing)
    through = [key for key, (t, _) in held.items() if _lcp(t, q) >= best]
    for k in (1, 3):
        got = trie.sample(q, best, k)
        assert len(got) == min(k, len(through)) and len(set(got)) == len(got)
        assert all(_lcp(held[key][0], q) >= best for key in got)
        assert got == _sample_by_scan(trie, q, best, k)      # which ones: the tails learned depend on it
    for k in list(held):
        trie.remove(k)
    assert len(trie) == 0 and trie.root.refs == 0 and not trie.root.children and not trie.root.tails


def _sample_by_scan(trie: HistoryTrie, tokens, length: int, k: int) -> list:
    """``sample`` as it was written first, scanning the node: its tails in insertion order, then
    depth first below it, the newest branch first."""
    node = trie.root
    for node, depth in trie._walk(tokens[:length]):
        pass
    if depth != length // BLOCK:
        return []
    part = tuple(tokens[depth * BLOCK:length])
    out = [key for key, t in node.tails.items() if t[:len(part)] == part and len(t) >= len(part)][:k]
    stack = [ch for ch in node.children.values() if ch.block[:len(part)] == part]
    while stack and len(out) < k:
        n = stack.pop()
        out += list(n.tails)[: k - len(out)]
        stack.extend(n.children.values())
    return out


def test_a_query_walks_only_its_own_blocks():
    """Cost per query does not grow with the number of histories: 5,000 histories under one
    shared prefix, and a query touches one node per block of its own, the branches next to it in
    token order where it parts, and those that share the most with it."""
    trie = HistoryTrie()
    shared = list(range(1000, 1000 + 10 * BLOCK))
    for i in range(5000):
        trie.insert(("ck", i), shared + [i % 97] * BLOCK + [i])
    m = trie.match(shared + [5000] * 3)
    assert m.length == 10 * BLOCK and m.cached and not m.live
    assert m.steps == 10 + 1                   # its 10 blocks, then the one branch it sorts beside
    deep = trie.match(shared + [5] * BLOCK + [5])
    assert deep.length == 11 * BLOCK + 1 and deep.steps <= 11 + 2 + 1


def test_a_query_does_not_scan_a_wide_node():
    """A cache of many distinct prompts gives the root one branch per distinct first block
    (cache-scale's 10k records: 10k): a query compares the branches beside it in token order and
    sums those sharing the most with it, never all of them — nor does ``sample``."""
    trie = HistoryTrie()
    for i in range(5000):
        trie.insert(("ck", i), [i % 50, i // 50] + [7] * (2 * BLOCK))
    m = trie.match([3, 17] + [7] * (2 * BLOCK) + [1])
    assert m.length == 2 + 2 * BLOCK and m.cached
    assert m.steps <= 2 + 2 + 1 + 1           # 2 blocks walked, 2 neighbours, 1 sharing, 1 spare
    near = trie.match([3, 1000, 5])            # parts after 1 token: 100 branches share [3]
    assert near.length == 1 and near.cached and near.steps <= 2 + 100
    assert len(trie.sample([3, 17], 1, 3)) == 3


@dataclass(eq=False)
class _Req:
    rid: str
    ticket: int
    prompt: list[int]
    outputs: list = field(default_factory=list)
    facts: object = None
    live: bool = True

    def __post_init__(self):
        self.spec = RequestSpec(prompt=self.prompt)

    @property
    def ledger(self) -> list[int]:
        return self.prompt + self.outputs


@dataclass
class _Facts:
    frontier: int


def _rm(**kw) -> ResourceManager:
    return resource_manager(**kw)


def _point(rm: ResourceManager, cid: int, tokens: list[int]) -> None:
    rec = rm.table.new_record(None)
    rm.table.add_ckpt(P.CkptRef(cid, 1, len(tokens), P.CkptKind.CACHE, True, False), tuple(tokens), rec.owner(P.Role.E))
    rec.e = cid


S = list(range(1, 201))


def _enqueue(rm, live, req):
    live[req.rid] = req
    rm.on_enqueued(req, live)


def test_the_position_where_a_prompt_parts_from_a_cached_history_is_offered():
    rm, live = _rm(), {}
    _point(rm, 1, S[:150] + [7] * 30)
    r = _Req("r", 1, S)
    _enqueue(rm, live, r)
    assert rm.book(r).divergence == [150] and 150 in rm.book(r).diverged_from
    assert 150 in rm.candidate_positions(r)
    [sp] = [sp for sp in rm.save_plan(r, 0, rm.table.new_record(None, insert=False)) if sp.frontier == 150]
    assert sp.kinds == ["d"] and len(sp.entries) == 1
    past = rm.save_plan(r, 150, rm.table.new_record(None, insert=False))        # past it: none
    assert [sp.frontier for sp in past if "d" in sp.kinds] == [] and past[-1].frontier == 200


def test_no_position_at_the_prompt_end_or_close_to_the_point_below():
    rm, live = _rm(divergence_min=16), {}
    _point(rm, 1, S[:100])                                   # a restore point at 100
    _point(rm, 2, S[:110] + [7] * 30)                        # a history parting at 110
    r = _Req("r", 1, S)
    _enqueue(rm, live, r)
    assert rm.book(r).divergence == []                       # 110 - 100 < 16
    _point(rm, 3, S + [9] * 10)                              # a history extending the whole prompt
    r2 = _Req("r2", 2, S)
    _enqueue(rm, live, r2)
    assert rm.book(r2).divergence == []                      # X = P: the input point is there
    off = _rm(divergence_min=None)
    _point(off, 2, S[:150] + [7] * 30)
    r3 = _Req("r3", 3, S)
    _enqueue(off, {}, r3)
    assert off.book(r3).divergence == []


def test_an_earlier_live_request_still_to_compute_the_position_is_offered_it_too():
    """Q (queued, earlier) shares [0, 150) with R: both offer the save; a bound Q before 150 gets
    the save point in its books at once; a later request is never the producer, nor one past X."""
    rm, live = _rm(), {}
    q = _Req("q", 1, S[:150] + [7] * 60)
    _enqueue(rm, live, q)
    r = _Req("r", 2, S)
    _enqueue(rm, live, r)
    assert rm.book(q).divergence == [150] and rm.book(r).divergence == [150]
    # bound and before the position: its pending save points get it (the pending-point rule sees it)
    rm2, live2 = _rm(), {}
    qb = _Req("q", 1, S[:150] + [7] * 60, facts=_Facts(64))
    _enqueue(rm2, live2, qb)
    rm2.book(qb).record = rm2.table.new_record(None)
    late = _Req("r", 2, S)
    _enqueue(rm2, live2, late)
    assert [sp.frontier for sp in rm2.book(qb).save_points] == [150]
    assert rm2.pending_source(late, 0, [(qb, 64, rm2.book(qb).save_points)]) == ("q", 150)
    # past the position: nothing offered to it
    rm3, live3 = _rm(), {}
    qp = _Req("q", 1, S[:150] + [7] * 60, facts=_Facts(160))
    _enqueue(rm3, live3, qp)
    rm3.book(qp).record = rm3.table.new_record(None)
    _enqueue(rm3, live3, _Req("r", 2, S))
    assert rm3.book(qp).save_points == []
    # a younger live request is no producer
    rm4, live4 = _rm(), {}
    young = _Req("y", 9, S[:150] + [7] * 60)
    _enqueue(rm4, live4, young)
    _enqueue(rm4, live4, _Req("r", 2, S))
    assert rm4.book(young).divergence == []


def test_a_request_offers_at_most_max_divergence_positions():
    rm, live = _rm(), {}
    q = _Req("q", 0, S)
    _enqueue(rm, live, q)
    for i in range(MAX_DIVERGENCE + 2):
        x = 40 + 20 * i
        _enqueue(rm, live, _Req(f"r{i}", i + 1, S[:x] + [7] * 20))
    assert rm.book(q).divergence == [40 + 20 * i for i in range(MAX_DIVERGENCE)]


def test_crossing_a_divergence_position_is_two_requests_computing_it():
    """The history's earlier computation and this commit: repeat demand (seed: 两个不同请求的真实
    计算也能证明重复需求), observed once per request and position; a position from no history is
    this request's observation alone."""
    rm, live = _rm(), {}
    _point(rm, 1, S[:150] + [7] * 30)
    r = _Req("r", 1, S)
    _enqueue(rm, live, r)
    from ninfer.policy.index import digest
    rm.observe_prefill(r, 0, 149)
    assert rm.summary.get(digest(S[:150]), 150) is None
    rm.observe_prefill(r, 149, 200)
    obs = rm.summary.get(digest(S[:150]), 150)
    assert obs.repeated and obs.requests == [HISTORY_OBSERVER, "r"]
    solo = _Req("s", 2, [5] * 200)
    _enqueue(rm, live, solo)
    rm.observe_prefill(solo, 0, 200)
    assert not rm.summary.get(digest([5] * 200), 200).repeated


def test_the_trie_follows_the_cache_and_the_queue():
    rm, live = _rm(), {}
    _point(rm, 1, S[:150])
    r = _Req("r", 1, S)
    _enqueue(rm, live, r)
    assert rm.check({"r"}) is None
    rm.forget(r)
    rm.table.forget_ckpt(1)
    assert rm.check(set()) is None and len(rm.table.histories) == 0


def test_anticipated_positions_are_a_doubling_ladder_of_tails_and_the_longer_tails_seen_most_often():
    """A prompt's end less divergence_min x 1, 2, 4, 8, 16 (16 ... 256 tokens), and less each of
    the 3 tails longer than the ladder seen at two real divergences or more (a tail seen once is
    no pattern; a tail inside the ladder adds nothing); none closer than divergence_min to the
    start; the counts stay bounded; nothing with divergence positions off."""
    from ninfer.policy.resources import ANTICIPATE, LADDER, TAIL_KINDS
    long = list(range(1, 1001))
    rm = _rm()
    assert LADDER == 5 and ANTICIPATE == 3
    assert rm.anticipated(_Req("a", 0, S)) == [200 - 128, 200 - 64, 200 - 32, 200 - 16]   # 200 - 256 < 16
    assert rm.anticipated(_Req("a", 0, long)) == [1000 - d for d in (256, 128, 64, 32, 16)]
    ladder = [1000 - d for d in (256, 128, 64, 32, 16)]
    for d, n in ((300, 3), (800, 1), (48, 5)):
        for _ in range(n):
            rm._note_tail(d)
    # 800 seen once is no pattern, 48 lies inside the ladder
    assert rm.anticipated(_Req("a", 0, long)) == sorted([1000 - 300, *ladder])
    for d, n in ((600, 2), (400, 2), (900, 2)):
        for _ in range(n):
            rm._note_tail(d)
    # the ladder, then 300 (seen 3 times), 400 and 600 (twice; shorter first); 900 is the 4th
    # (twice, longest), 800 is seen once and 48 lies inside the ladder
    assert rm.anticipated(_Req("a", 0, long)) == sorted(1000 - d for d in (600, 400, 300, 256, 128, 64, 32, 16))
    assert rm.anticipated(_Req("b", 0, S[:40])) == [40 - 16]                             # past the start: none
    for d in range(1000, 1000 + 2 * TAIL_KINDS):
        rm._note_tail(d)
    assert len(rm.tails) <= TAIL_KINDS and rm.tails[300] == 3
    off = _rm(divergence_min=None)
    off._note_tail(300), off._note_tail(300)
    assert off.anticipated(_Req("a", 0, long)) == []
    wide = _rm(divergence_min=64)                                      # the ladder scales with it
    assert wide.anticipated(_Req("a", 0, long)) == [1000 - d for d in (1024, 512, 256, 128, 64) if 1000 - d >= 64]


def test_a_divergence_records_both_tails_and_the_save_plan_offers_the_anticipated_positions():
    rm, live = _rm(), {}
    _point(rm, 1, S[:150] + [7] * 30)
    for i in range(2):
        _enqueue(rm, live, _Req(f"r{i}", i, S[:150] + [9 + i] * 50))   # tail 50 each
    assert rm.tails == {50: 3}          # r0 and r1 from the cached history, r0 again as r1's live sharer
    h = _Req("h", 5, list(range(500, 800)))
    _enqueue(rm, live, h)
    sps = rm.save_plan(h, 0, rm.table.new_record(None, insert=False))
    assert [(sp.frontier, sp.kinds) for sp in sps] == [(300 - d, ["t"]) for d in (256, 128, 64, 32, 16)] + [(300, ["in"])]
    # none closer than divergence_min to where the request starts (its restore point)
    assert [sp.frontier for sp in rm.save_plan(h, 240, rm.table.new_record(None, insert=False))] == [268, 284, 300]


def test_a_prompt_inside_an_earlier_one_records_the_earlier_ones_tail():
    """A shorter copy of a cached prompt (it ends inside it) parts from it at its own end: the
    earlier prompt's tail (its input point less that end) is recorded — where the next shorter
    copy will need a restore point — and the new prompt has no tail of its own."""
    rm, live = _rm(), {}
    rec = rm.table.new_record(None)
    rm.table.add_ckpt(P.CkptRef(1, 1, 180, P.CkptKind.CACHE, True, False), tuple(S[:180]), rec.owner(P.Role.INPUT))
    rec.input_point = 1
    _enqueue(rm, live, _Req("r", 1, S[:150]))
    assert rm.tails == {30: 1}


def test_a_divergence_records_the_tail_of_the_cached_prompt_it_parts_from():
    """The earlier side's tail comes from its record's input point: H's prompt ends at 180, the
    new prompt parts from it at 150 — tails 30 (H) and 50 (the new one)."""
    rm, live = _rm(), {}
    rec = rm.table.new_record(None)
    rm.table.add_ckpt(P.CkptRef(1, 1, 180, P.CkptKind.CACHE, True, False), tuple(S[:180]), rec.owner(P.Role.INPUT))
    rec.input_point = 1
    _enqueue(rm, live, _Req("r", 1, S[:150] + [7] * 50))
    assert rm.tails == {30: 1, 50: 1}


def test_a_later_prompt_ending_where_an_earlier_live_one_goes_on_offers_it_no_save_there():
    """divergence-points: X must lie before the later prompt's end — where it ends, its own input
    point is the save; an earlier live request that goes on past X is offered nothing there."""
    rm, live = _rm(), {}
    q = _Req("q", 1, S + [7] * 30)
    _enqueue(rm, live, q)
    r = _Req("r", 2, S)
    _enqueue(rm, live, r)
    assert rm.book(q).divergence == [] and rm.book(r).divergence == []
    assert rm.book(r).diverged_from == set()
