"""The reclaim planner on hand-built quotes: ranking, victim sets, Host placement by first-fit,
and the admission table's rows (seed: 回收与准入)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer import protocol as P
from ninfer.placement import align
from ninfer.policy.reclaim import Planner
from ninfer.policy.records import Level, RecordTable

IMG, PAGE = align(1000), align(500)


class Quote:
    """A tiny builder of Facts + the matching controller records."""

    def __init__(self, main=8, slots=4, host=4 * IMG):
        self.main, self.slots, self.host = main, slots, host
        self.cks: dict[int, P.CheckpointFact] = {}
        self.blocks: dict[int, P.BlockFact] = {}
        self.table = RecordTable()
        self.host_used: list[tuple[int, int]] = []
        self._next = 100

    def _host(self, size: int) -> tuple[int, int]:
        off = sum(s for _, s in self.host_used)
        self.host_used.append((off, size))
        return off, size

    def ckpt(self, cid, frontier, tokens=None, level=Level.NORMAL, demand=0.0, device=True, host_image=False,
             n_blocks=1, host_blocks=False, owner=None, ticket_owner=None):
        rec = self.table.new_record(None)
        rec.level, rec.evidence.demand_time = level, demand
        owner = ticket_owner or owner or rec.owner("E")
        bids = []
        for _ in range(n_blocks):
            bid = self._next = self._next + 1
            self.blocks[bid] = P.BlockFact(bid, 1, "main", (cid,), False, not host_blocks, host_blocks, 64,
                                           self._host(PAGE) if host_blocks else None)
            bids.append(bid)
        image_at = self._host(IMG) if host_image else None
        kind = P.CkptKind.SNAPSHOT if ticket_owner else P.CkptKind.CACHE
        self.cks[cid] = P.CheckpointFact(cid, 1, 1, kind, frontier, (owner,),
                                         device, host_image, False, tuple(bids), image_at)
        ref = P.CkptRef(cid, 1, frontier, P.CkptKind.CACHE, device, host_image)
        self.table.add_ckpt(ref, tuple(tokens or range(cid * 1000, cid * 1000 + frontier)), owner)
        if not ticket_owner:
            rec.e = cid
        return cid

    def facts(self) -> P.Facts:
        used_main = sum(1 for b in self.blocks.values() if b.device)
        used_slots = sum(1 for c in self.cks.values() if c.image_device)
        free, pos = [], 0
        for off, size in sorted(self.host_used):
            if off > pos:
                free.append((pos, off - pos))
            pos = off + size
        if pos < self.host:
            free.append((pos, self.host - pos))
        pools = {P.MAIN: P.PoolFact(P.MAIN, self.main, self.main - used_main, 0),
                 P.STATE: P.PoolFact(P.STATE, self.slots, self.slots - used_slots, 0)}
        return P.Facts(pools=pools, host_capacity=self.host, host_free=tuple(free), image_bytes=IMG, page_bytes=PAGE,
                       checkpoints=self.cks, blocks=self.blocks, tx_busy=False)

    def planner(self, revoke=lambda o: False, tickets=None) -> Planner:
        return Planner(self.facts(), self.table, set(), revoke, tickets)


def test_normal_before_reuse_and_lowest_loss_per_unit_first():
    q = Quote(host=0)
    q.ckpt(1, 100, level=Level.REUSE, demand=5.0)
    q.ckpt(2, 300)
    q.ckpt(3, 50)
    acts, covered = q.planner().plan({P.STATE: 1})
    assert covered and acts == [P.Delete(3, 1, 1)]                    # normal, least loss
    acts, _ = q.planner().plan({P.STATE: 3})
    assert [a.cid for a in acts] == [3, 2, 1]                          # reuse last


def test_shared_pages_go_only_with_all_their_holders():
    q = Quote(host=0)
    a, b = q.ckpt(1, 64), q.ckpt(2, 64)
    shared = q.cks[a].blocks[0]
    q.blocks[shared] = P.BlockFact(shared, 1, "main", (a, b), False, True, False, 64, None)
    q.cks[b] = P.CheckpointFact(b, 1, 1, P.CkptKind.CACHE, 64, q.cks[b].owners, True, False, False, (shared,), None)
    acts, covered = q.planner().plan({P.MAIN: 1})
    assert covered and sorted(x.cid for x in acts if isinstance(x, P.Delete)) == [1, 2]


def test_demotion_is_zero_loss_when_the_host_has_room():
    q = Quote(host=8 * IMG)
    q.ckpt(1, 500)
    acts, covered = q.planner().plan({P.STATE: 1})
    assert covered and acts == [P.DemoteState(1, 1, 1)]


def test_few_pages_short_moves_only_the_needed_group_and_halves_to_fit():
    q = Quote(host=2 * PAGE + 10)
    q.ckpt(1, 256, n_blocks=4)
    pl = q.planner()
    acts, covered = pl.plan({P.MAIN: 4})
    demoted = [a for a in acts if isinstance(a, P.DemoteBlocks)]
    assert demoted and len(demoted[0].bids) == 2                       # 4 did not fit: halved to 2


def test_row3_host_write_back_by_its_own_eligibility():
    """A normal record's demotion may not evict reuse content from the Host; reuse content may
    evict older reuse content, within the restore coverage it keeps."""
    q = Quote(host=IMG)
    hot = q.ckpt(1, 40, level=Level.REUSE, demand=10.0, device=False, host_image=True)
    q.ckpt(2, 500)                                                     # normal, on the Device
    acts, _ = q.planner().plan({P.STATE: 1})
    assert not any(isinstance(a, P.Delete) and a.cid == hot for a in acts)
    assert acts == [P.Delete(2, 1, 1)]                                 # it is deleted instead

    q2 = Quote(host=IMG)
    old = q2.ckpt(1, 40, level=Level.REUSE, demand=1.0, device=False, host_image=True)
    q2.ckpt(2, 500, level=Level.REUSE, demand=9.0)
    acts, _ = q2.planner().plan({P.STATE: 1})
    assert P.Delete(old, 1, 1) in acts and P.DemoteState(2, 1, 1) in acts


def test_row4_pause_snapshot_evicts_optional_cache_then_later_tickets_only():
    s7, s8, s9 = P.SnapshotOwner(7), P.SnapshotOwner(8), P.SnapshotOwner(9)
    tickets = {s7: 5, s8: 9, s9: 2}
    revoke_all = lambda owner: True                                   # noqa: E731
    q = Quote(host=IMG)
    q.ckpt(1, 200, ticket_owner=s7)                              # the snapshot to demote
    q.ckpt(2, 30, device=False, host_image=True, ticket_owner=s9)  # an older ticket's snapshot
    acts, _ = q.planner(revoke_all, tickets).plan({P.STATE: 1})
    assert P.Delete(2, 1, 1) not in acts                               # an older ticket is never evicted
    q = Quote(host=IMG)
    q.ckpt(1, 200, ticket_owner=s7)
    q.ckpt(2, 30, device=False, host_image=True, ticket_owner=s8)  # a later ticket's snapshot
    pl = q.planner(revoke_all, tickets)
    may, budget = pl.host_admission(pl.cands[1])
    assert may(pl.cands[2]) and budget is None
    q = Quote(host=IMG)
    q.ckpt(1, 200, ticket_owner=s7)
    q.ckpt(2, 30, device=False, host_image=True, ticket_owner=s9)
    pl = q.planner(revoke_all, tickets)
    may, _ = pl.host_admission(pl.cands[1])
    assert not may(pl.cands[2])


def test_capture_admission_rows_1_and_2():
    q = Quote(host=0)
    q.ckpt(1, 300)                                                     # loss 300 if deleted
    assert q.planner().plan_capture(benefit=60, own_demand=None, owner_reuse=False) is None
    assert q.planner().plan_capture(benefit=400, own_demand=None, owner_reuse=False) == [P.Delete(1, 1, 1)]
    assert q.planner().plan_capture(benefit=60, own_demand=5.0, owner_reuse=False) == [P.Delete(1, 1, 1)]
    q = Quote(host=0)
    q.ckpt(1, 300, level=Level.REUSE, demand=9.0)                      # newer reuse than the demand
    assert q.planner().plan_capture(benefit=60, own_demand=5.0, owner_reuse=False) is None


def test_a_captures_room_frees_a_device_slot_now_or_goes_to_the_host():
    """The capture runs at the end of its unit, in the same step: a Device slot it can use is
    one a deletion frees, or a demotion whose image already has a Host copy (the Device copy is
    released at once). A demotion that still has to copy frees its slot only once the copy
    publishes — no room for this capture (the worker skips it). With the Host full, the room is
    the capture itself on the Host, over an admissible Host victim (it was a demotion that never
    fit: a repeated chat turn missed its restore point every time)."""
    q = Quote(host=IMG)
    q.ckpt(1, 200, tokens=list(range(1, 201)))                          # Device image, no Host copy
    q.ckpt(2, 5, device=False, host_image=True, tokens=list(range(300, 305)))   # fills the Host
    q.slots = 1                                                        # every Device slot taken
    room = q.planner().plan_capture(benefit=60, own_demand=None, owner_reuse=False)
    assert room == [P.Delete(2, 1, 1)], room                           # the capture goes to the Host
    q = Quote(host=2 * IMG)
    q.ckpt(1, 200, tokens=list(range(1, 201)), host_image=True)         # Device image with a Host copy
    q.ckpt(2, 5, device=False, host_image=True, tokens=list(range(300, 305)))
    q.slots = 1
    room = q.planner().plan_capture(benefit=60, own_demand=None, owner_reuse=False)
    assert room == [P.DemoteState(1, 1, 1)], room                      # frees the slot at once, loses nothing


def test_placement_counts_contiguous_extents_not_bytes():
    """Two free half-size holes do not hold one StateImage."""
    q = Quote(host=3 * IMG)
    q.ckpt(1, 500)
    q.host_used = [(IMG // 2, IMG)]                                    # free: [0, IMG/2) and [1.5 IMG, 3 IMG)
    q.host = 2 * IMG
    acts, _ = q.planner().plan({P.STATE: 1})
    assert acts == [P.Delete(1, 1, 1)]


def test_nested_points_deleted_together_count_their_history_once():
    """Finding 5: deleting a nested E@100 with its input point @80 loses 100 restore tokens,
    not 180; with a surviving fallback @50 it loses 50. Identical aliases deleted together
    count their coverage once and are not each other's fallback."""
    q = Quote(host=0)
    toks = list(range(1, 101))
    e, inp = q.ckpt(1, 100, tokens=toks), q.ckpt(2, 80, tokens=toks[:80])
    pl = q.planner()
    assert pl.loss({e, inp}) == 100 and pl.loss({e}) == 20 and pl.loss({inp}) == 80
    q.ckpt(3, 50, tokens=toks[:50])
    assert q.planner().loss({e, inp}) == 50
    q2 = Quote(host=0)
    a, b = q2.ckpt(1, 60, tokens=toks[:60]), q2.ckpt(2, 60, tokens=toks[:60])
    pl = q2.planner()
    assert pl.loss({a}) == 0 and pl.loss({a, b}) == 60


@settings(max_examples=300, deadline=None, derandomize=True)
@given(points=st.lists(st.tuples(st.integers(10, 200), st.booleans(), st.booleans(), st.sampled_from([0, 1])),
                       min_size=1, max_size=6),
       benefit=st.integers(1, 250))
def test_a_capture_without_own_demand_loses_less_than_its_benefit_in_all(points, benefit):
    """Finding 6: the fixed new-coverage budget is cumulative — the Device step and the Host
    step of one admitted save together delete less restore coverage than the save adds
    (Device slots and the Host are full: every way to make room deletes something)."""
    points = [(f, dev or not on_host, on_host, nested) for f, dev, on_host, nested in points]
    q = Quote(slots=sum(1 for _, dev, _, _ in points if dev), host=sum(1 for p in points if p[2]) * IMG)
    base = list(range(1, 201))
    for i, (f, dev, on_host, nested) in enumerate(points):
        toks = base[:f] if nested else None              # nested points share one history
        q.ckpt(i + 1, f, tokens=toks, device=dev, host_image=on_host)
    pl = q.planner()
    acts = pl.plan_capture(benefit=benefit, own_demand=None, owner_reuse=False)
    if not acts:
        return
    deleted = {a.cid for a in acts if isinstance(a, P.Delete)}
    if deleted:
        assert q.planner().loss(deleted) < benefit, (acts, benefit)


def test_revocable_waiters_go_youngest_first():
    """Finding 7: when waiting references must be revoked, the youngest waiter's goes first —
    not the one whose record saw the oldest demand."""
    young, old = P.WaiterOwner("young"), P.WaiterOwner("old")
    q = Quote(host=0)
    q.ckpt(1, 80, demand=1.0)                             # the old waiter's point: older demand
    q.ckpt(2, 80, demand=9.0)
    for cid, w in ((1, old), (2, young)):                 # each also held by a waiter
        c = q.cks[cid]
        q.cks[cid] = P.CheckpointFact(c.cid, c.generation, c.version, c.kind, c.frontier, c.owners + (w,),
                                      c.image_device, c.image_host, c.leased, c.blocks, c.image_at)
        q.table.ckpts[cid].owners.add(w)
    pl = Planner(q.facts(), q.table, set(), lambda o: True, {old: 3, young: 8})
    assert pl.cands[1].cls == pl.cands[2].cls == 2
    acts, covered = pl.plan({P.STATE: 1})
    assert covered and acts == [P.Delete(2, 1, 1)]


def _add_point(q: Quote, rec_id: int, role, cid: int, frontier: int, tokens, n_blocks=1):
    """A second point of an existing record (its input point or an anchor)."""
    owner = P.RecordOwner(rec_id, role)
    q.ckpt(cid, frontier, tokens=tokens, owner=owner, n_blocks=n_blocks)
    rec = q.table.records[rec_id]
    if role == P.Role.INPUT:
        rec.input_point = cid
    else:
        rec.anchors.append(cid)
    del q.table.records[max(q.table.records)]            # the helper's own empty record
    return cid


def test_soft_target_keeps_whole_records_and_the_newest_may_exceed():
    """Finding 12: the reuse segment is kept per record — the newest record's E and input
    point stay reuse together even past 3/4 of Main (the single newest record may exceed the
    target); an older record beyond the target is normal content."""
    q = Quote(main=8, slots=4, host=0)
    toks = list(range(1, 400))
    q.ckpt(1, 300, tokens=toks[:300], level=Level.REUSE, demand=9.0, n_blocks=5)
    new_rec = next(iter(q.table.records))
    _add_point(q, new_rec, P.Role.INPUT, 2, 100, toks[:100], n_blocks=2)
    q.ckpt(3, 64, level=Level.REUSE, demand=1.0)
    pl = q.planner()
    assert pl.cands[1].cls == 1 and pl.cands[2].cls == 1        # 7 pages > 6, one record
    assert pl.cands[3].cls == 0                                  # older, beyond the target


def test_hot_protection_is_covered_only_by_the_records_own_points():
    """Finding 12: a reuse record's deeper unproven E stays protected unless one of the
    record's own surviving points covers its proven position — another history's point at a
    deeper position does not count."""
    q = Quote(main=8, slots=4, host=0)
    toks = list(range(1, 400))
    q.ckpt(1, 150, tokens=toks[:150], level=Level.REUSE, demand=5.0)
    rid = next(iter(q.table.records))
    q.table.records[rid].evidence.proven_frontier = 100
    q.ckpt(2, 120, tokens=toks[:120])                            # another record's point
    pl = q.planner()
    assert pl.cands[1].cls == 1
    _add_point(q, rid, P.Role.INPUT, 3, 110, toks[:110])       # its own point covers 100
    assert q.planner().cands[1].cls == 0


def test_hot_protection_counts_an_own_point_only_as_a_live_exact_prefix():
    """hot-protection: the record's own point past the proven position covers it only when it
    is an exact prefix of the candidate (an anchor on an edited history is not) and live in the
    quote (a point the records still know but the facts no longer hold is not)."""
    q = Quote(main=8, slots=4, host=0)
    toks = list(range(1, 400))
    q.ckpt(1, 150, tokens=toks[:150], level=Level.REUSE, demand=5.0)
    rid = next(iter(q.table.records))
    q.table.records[rid].evidence.proven_frontier = 100
    _add_point(q, rid, P.Role.ANCHOR, 3, 110, [*toks[:109], 999])   # its own, not a prefix
    assert q.planner().cands[1].cls == 1
    _add_point(q, rid, P.Role.INPUT, 4, 120, toks[:120])            # a prefix, but gone from the quote
    del q.cks[4]
    assert q.planner().cands[1].cls == 1


def _host_point(q: Quote, cid: int, frontier: int, extent: tuple[int, int], demand: float = 0.0) -> int:
    """A checkpoint whose StateImage lives only on the Host, at ``extent``."""
    q.ckpt(cid, frontier, device=False, demand=demand)
    c = q.cks[cid]
    q.cks[cid] = P.CheckpointFact(c.cid, c.generation, c.version, c.kind, c.frontier, c.owners,
                                  False, True, False, c.blocks, extent)
    q.host_used.append(extent)
    return cid


def test_host_placement_prefers_an_action_that_lets_it_fit():
    """Finding 11: a victim that lets the allocation fit comes before victims that only add
    free bytes (seed: 能让申请放下的动作优先于只增加空闲字节的动作), and what is no longer needed is
    pruned: one image-sized victim (loss 50) instead of two adjacent half-size ones (loss 10
    each) that together would also make room."""
    half = IMG // 2
    q = Quote(host=2 * IMG)
    a = _host_point(q, 1, 10, (0, half))
    c = _host_point(q, 2, 10, (half, half))
    b = _host_point(q, 3, 50, (IMG, IMG))
    pl = q.planner()
    got = pl.place_host([IMG], lambda v: True)
    assert got == ([b], 50), got
    assert a not in got[0] and c not in got[0]


def test_host_placement_prunes_victims_it_no_longer_needs():
    """Finding 11: when no single victim makes room, victims are added in reclaim order and
    those the final set does not need are dropped again: the cheapest, isolated one is not
    deleted for nothing."""
    half = IMG // 2
    q = Quote(host=3 * IMG)
    l1 = _host_point(q, 1, 5, (0, half))
    l2 = _host_point(q, 2, 6, (half, half))
    q.host_used.append((IMG, IMG))                           # content nobody may delete
    lone = _host_point(q, 3, 1, (2 * IMG, half))             # the cheapest, but isolated
    q.host_used.append((2 * IMG + half, half))
    got = q.planner().place_host([IMG], lambda v: True)
    assert got is not None and sorted(got[0]) == [l1, l2] and lone not in got[0], got


def test_host_gain_is_capped_at_the_shortfall():
    """Finding 11: a victim's freed bytes rank only up to the byte shortfall — or, when the
    free bytes suffice but do not fit, up to the largest single allocation."""
    q = Quote(host=4 * IMG)
    pl = q.planner()
    assert pl.host_gain_cap([(0, IMG // 2)], [IMG]) == IMG - IMG // 2          # short of bytes
    assert pl.host_gain_cap([(0, IMG // 2), (IMG, IMG)], [IMG, PAGE]) == IMG   # bytes suffice


def test_host_placement_releases_safe_duplicates_before_any_victim():
    """Finding 10: a Host replica of content the Device also holds is released first (nothing
    is lost), before any checkpoint is deleted for the room (seed: Host 先释放安全的重复副本)."""
    q = Quote(host=2 * IMG)
    dup = q.ckpt(1, 200, device=True, host_image=True)          # on both: its Host copy is spare
    victim = _host_point(q, 2, 5, (IMG, IMG))                   # the cheapest victim otherwise
    pl = q.planner()
    got = pl.place_host([IMG], lambda v: True)
    assert got == ([("dup", dup)], 0), got
    acts = pl.commit_host([IMG], got[0])
    assert acts == [P.DropHostCopy(dup, 1, 1)] and victim not in pl.victims


def test_host_copies_of_device_pages_are_released_before_any_victim_but_not_for_their_own_demotion():
    """Finding 10: the Host copies of KV pages the Device also holds (a restore read them back)
    are safe duplicates: released before any victim is deleted; a demotion of those very pages
    does not release their copies (it would write them again), and once released in a plan a
    later demotion of them counts their bytes."""
    q = Quote(host=2 * PAGE + IMG)
    dup = q.ckpt(1, 128, n_blocks=2)                            # pages on the Device ...
    for bid in q.cks[dup].blocks:                               # ... and on the Host
        b = q.blocks[bid]
        q.blocks[bid] = P.BlockFact(b.bid, b.version, b.kind, b.holders, False, True, True, b.filled, q._host(PAGE))
    victim = _host_point(q, 2, 5, (2 * PAGE, IMG))              # the cheapest victim otherwise
    pl = q.planner()
    got = pl.place_host([PAGE], lambda v: True)
    assert got == ([("dup", dup)], 0), got
    assert pl.place_host([PAGE], lambda v: True, keep=frozenset(q.cks[dup].blocks)) == ([victim], 5)
    acts = pl.commit_host([PAGE], got[0])
    assert acts == [P.DropHostCopy(dup, 1, 1)] and victim not in pl.victims
    assert all(not pl._page_on_host(b) for b in q.cks[dup].blocks)


def test_a_deletion_counts_nothing_for_pages_a_chosen_demotion_already_frees():
    """Finding 10: pages judged by physical identity — once a demotion in the plan frees two
    shared pages, deleting their other holder frees no more Main for them."""
    q = Quote(main=4, slots=4, host=8 * IMG)
    a = q.ckpt(1, 128, n_blocks=2)
    shared = q.cks[a].blocks
    for bid in shared:
        b = q.blocks[bid]
        q.blocks[bid] = P.BlockFact(b.bid, b.version, b.kind, (1, 2), False, True, False, b.filled, None)
    q.ckpt(2, 128, n_blocks=0)
    c = q.cks[2]
    q.cks[2] = P.CheckpointFact(c.cid, c.generation, c.version, c.kind, c.frontier, c.owners,
                                c.image_device, c.image_host, c.leased, shared, c.image_at)
    pl = q.planner()
    assert pl.freed_by_delete(frozenset({1, 2}), P.MAIN) == 2
    pl.demoted_blocks.update(shared)                        # a chosen demotion moves them
    assert pl.freed_by_delete(frozenset({2}), P.MAIN) == 0
    assert pl.freed_by_delete(frozenset({1, 2}), P.MAIN) == 0


def test_host_placement_cost_is_bounded_with_a_full_fragmented_host(monkeypatch):
    """Bounded policy cost (issue 30): with the Host full of small images, every demotion option
    of a State gap places its image by ranking Host victims. The rankings of one planner state
    repeat across those options (the same candidates against the same victims chosen so far)
    and are computed once: a 128:256 trace replay spent 93 % of its time re-ranking them, each
    option ranking every candidate for every victim it added (options × candidates × victims)."""
    n = 24
    half = IMG // 2
    q = Quote(main=64, slots=n, host=n * IMG)
    for i in range(n):                               # Device images that may demote
        q.ckpt(1 + i, 100)
    for j in range(2 * n):                           # a full Host of half-size images
        _host_point(q, 100 + j, 1 + j % 5, (j * half, half))
    calls = []
    rank = Planner._host_rank
    monkeypatch.setattr(Planner, "_host_rank", lambda self, c, *a: calls.append(c.cid) or rank(self, c, *a))
    pl = q.planner()
    actions, covered = pl.plan({P.STATE: 1})
    assert covered and any(isinstance(a, P.DemoteState) for a in actions), actions
    assert sum(isinstance(a, P.Delete) for a in actions) == 2, actions     # two adjacent halves make room
    host_cands = 2 * n
    assert len(calls) <= 3 * host_cands, len(calls)                        # not n options × 2n × victims
