"""The reclaim planner's rules, each stated on a hand-built quote (model-free, milliseconds):
the classes of reclaim candidates, the revocation order, hot protection, the soft target,
loss, useful release, the State-before-KV order, the ranking, page groups, Host admission and
Host placement (seed: 回收与准入; docs/structures.md "Who decides what"). Each test names the
rule it states; tests/mutations.py breaks each rule in several ways and names these tests."""

from __future__ import annotations

from ninfer import protocol as P
from ninfer.policy.reclaim import Cls, Planner
from ninfer.policy.records import Level
from tests.policy.test_reclaim_planner import IMG, PAGE, Quote, _add_point, _host_point


def _with_owners(q: Quote, cid: int, owners: tuple) -> None:
    """Replace a checkpoint's holders (facts and records' mirror alike)."""
    c = q.cks[cid]
    q.cks[cid] = P.CheckpointFact(c.cid, c.generation, c.version, c.kind, c.frontier, owners,
                                  c.image_device, c.image_host, c.leased, c.blocks, c.image_at)
    q.table.ckpts[cid].owners = set(owners)


# ---- reclaim-classes --------------------------------------------------------------------------
def test_reclaim_classes_normal_reuse_revocable_waiter_and_snapshot_and_necessary_holds_never():
    """reclaim-classes: optional cache is normal or reuse; a waiting reference or a pause
    snapshot is a candidate only when the requester may revoke it, and ranks after optional
    cache; any necessary hold keeps the checkpoint out of reclaim altogether. A point held by
    several takes the highest class of its holders, whatever their order."""
    w_ok, w_no = P.WaiterOwner("young"), P.WaiterOwner("old")
    s_ok, s_no = P.SnapshotOwner(8), P.SnapshotOwner(2)
    q = Quote(main=64, slots=16, host=0)
    q.ckpt(1, 10)                                          # normal optional cache
    q.ckpt(2, 10, level=Level.REUSE, demand=1.0)           # reuse
    q.ckpt(3, 10, owner=w_ok)                              # a revocable waiting reference
    q.ckpt(4, 10, ticket_owner=s_ok)                       # a revocable pause snapshot
    q.ckpt(5, 10, owner=w_no)                              # a waiter it may not revoke: necessary
    q.ckpt(6, 10, ticket_owner=s_no)                       # a snapshot it may not revoke: necessary
    q.ckpt(7, 10)
    _with_owners(q, 7, (w_ok,) + q.cks[7].owners)          # a record's point a waiter also holds
    q.ckpt(8, 10, level=Level.REUSE, demand=1.0)
    _with_owners(q, 8, q.cks[8].owners + (w_no,))          # ... and one a necessary waiter holds
    pl = Planner(q.facts(), q.table, set(), lambda o: o in (w_ok, s_ok), {w_ok: 9, w_no: 1, s_ok: 8, s_no: 2})
    assert {cid: c.cls for cid, c in pl.cands.items()} == {
        1: Cls.NORMAL, 2: Cls.REUSE, 3: Cls.WAITER, 4: Cls.SNAPSHOT, 7: Cls.WAITER}


# ---- revocation-order -------------------------------------------------------------------------
def test_revocable_pause_snapshots_go_youngest_ticket_first():
    """revocation-order for pause snapshots: among later-ticket snapshots the youngest request's
    goes first, whatever demand their records saw."""
    young, old = P.SnapshotOwner(9), P.SnapshotOwner(5)
    q = Quote(host=0)
    q.ckpt(1, 80, ticket_owner=old)
    q.ckpt(2, 80, ticket_owner=young)
    pl = Planner(q.facts(), q.table, set(), lambda o: True, {old: 3, young: 8})
    assert pl.cands[1].cls == pl.cands[2].cls == Cls.SNAPSHOT
    acts, covered = pl.plan({P.STATE: 1})
    assert covered and acts == [P.Delete(2, 1, 1)]


# ---- hot-protection ---------------------------------------------------------------------------
def test_hot_protection_needs_a_proven_position_and_an_own_point_at_it_covers_it():
    """hot-protection: a reuse record with no proven position keeps its deeper point protected
    although it has a shallower point of its own; once the proven position is 100, its own
    point exactly at 100 covers it (the deeper E is then normal content), and the point at the
    proven position itself stays protected."""
    q = Quote(main=8, slots=4, host=0)
    toks = list(range(1, 400))
    q.ckpt(1, 150, tokens=toks[:150], level=Level.REUSE, demand=5.0)
    rid = next(iter(q.table.records))
    _add_point(q, rid, P.Role.INPUT, 3, 100, toks[:100])
    pl = q.planner()
    assert pl.cands[1].cls == Cls.REUSE and pl.cands[3].cls == Cls.REUSE
    q.table.records[rid].evidence.proven_frontier = 100
    pl = q.planner()
    assert pl.cands[1].cls == Cls.NORMAL and pl.cands[3].cls == Cls.REUSE


def test_a_hot_public_entry_protects_its_point_on_its_own():
    """hot-protection: a point a reuse public entry serves stays reuse even when the private
    record that also holds it has its proven position covered by another of its points."""
    q = Quote(main=8, slots=4, host=0)
    toks = list(range(1, 400))
    q.ckpt(1, 150, tokens=toks[:150], level=Level.REUSE, demand=5.0)
    rid = next(iter(q.table.records))
    q.table.records[rid].evidence.proven_frontier = 100
    _add_point(q, rid, P.Role.INPUT, 3, 110, toks[:110])
    assert q.planner().cands[1].cls == Cls.NORMAL           # the record alone: covered by its point @110
    ent = q.table.new_entry(1, 150)
    ent.level, ent.evidence.demand_time = Level.REUSE, 5.0
    _with_owners(q, 1, q.cks[1].owners + (ent.owner,))
    assert q.planner().cands[1].cls == Cls.REUSE


# ---- soft-target ------------------------------------------------------------------------------
def test_the_soft_target_counts_state_slots_too_and_keeps_records_up_to_three_quarters():
    """soft-target by Device slots: 4 slots, so 3 reuse records' images are kept, newest demand
    first; the 4th (the oldest demand) is past 3/4 and ranks as normal."""
    q = Quote(main=64, slots=4, host=0)
    for cid, demand in ((1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)):
        q.ckpt(cid, 10, level=Level.REUSE, demand=demand)
    pl = q.planner()
    assert [pl.cands[c].cls for c in (1, 2, 3, 4)] == [Cls.REUSE, Cls.REUSE, Cls.REUSE, Cls.NORMAL]


def test_the_soft_target_counts_host_bytes_once_per_extent():
    """soft-target by Host bytes: three reuse records' Host images and one Host page they all
    list fit 3/4 of the Host when the page counts once (3 images + 1 page; counted per record it
    would be 3 images + 3 pages, past the target); the 4th record's image is past it."""
    from ninfer.policy.reclaim import SOFT_TARGET
    cap = int((3 * IMG + 2 * PAGE) / SOFT_TARGET)
    q = Quote(main=64, slots=64, host=cap)
    for cid, demand in ((1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)):
        q.ckpt(cid, 10, level=Level.REUSE, demand=demand, device=False, host_image=True)
    page = 999
    q.blocks[page] = P.BlockFact(page, 1, "main", (1, 2, 3), False, False, True, 64, q._host(PAGE))
    for cid in (1, 2, 3):
        c = q.cks[cid]
        q.cks[cid] = P.CheckpointFact(cid, 1, 1, c.kind, c.frontier, c.owners, False, True, False,
                                      (*c.blocks, page), c.image_at)
    pl = q.planner()
    assert [pl.cands[c].cls for c in (1, 2, 3, 4)] == [Cls.REUSE, Cls.REUSE, Cls.REUSE, Cls.NORMAL]


# ---- nested-loss ------------------------------------------------------------------------------
def test_a_point_already_chosen_as_a_victim_is_no_fallback():
    """nested-loss: loss counts down to the deepest fallback that survives the whole plan — a
    shallower point the plan already deletes is no fallback."""
    q = Quote(host=0)
    toks = list(range(1, 101))
    e, inp = q.ckpt(1, 100, tokens=toks), q.ckpt(2, 80, tokens=toks[:80])
    pl = q.planner()
    assert pl.loss({e}) == 20
    pl.victims.add(inp)
    assert pl.loss({e}) == 100


# ---- useful-release ---------------------------------------------------------------------------
def test_a_deletion_counts_only_what_it_frees_beyond_the_plan_so_far():
    """useful-release: a State slot a chosen demotion already frees is not freed again by a
    deletion, nor a page an earlier victim already freed."""
    q = Quote(main=8, slots=4, host=8 * IMG)
    q.ckpt(1, 64)
    q.ckpt(2, 64)
    q.ckpt(3, 64)
    pl = q.planner()
    assert pl.freed_by_delete(frozenset({1}), P.STATE) == 1
    pl.demoted_images.add(1)
    assert pl.freed_by_delete(frozenset({1}), P.STATE) == 0
    assert pl.freed_by_delete(frozenset({1, 2}), P.STATE) == 1
    pl.victims.add(3)                                        # its page is freed already
    assert pl.freed_by_delete(frozenset({2}), P.MAIN) == 1
    assert pl.freed_by_delete(frozenset({2, 3}), P.MAIN) == 1    # naming the victim again adds nothing


def test_a_page_shared_with_a_victim_goes_with_its_last_other_holder():
    """useful-release: a page two points share frees only when both go — the second one's
    deletion frees it once the first is a victim, and not before."""
    q = Quote(main=8, slots=4, host=8 * IMG)
    q.ckpt(4, 64)
    q.ckpt(5, 64, n_blocks=0)
    [bid] = q.cks[4].blocks
    b, c = q.blocks[bid], q.cks[5]
    q.blocks[bid] = P.BlockFact(bid, b.version, b.kind, (4, 5), False, True, False, b.filled, None)
    q.cks[5] = P.CheckpointFact(c.cid, c.generation, c.version, c.kind, c.frontier, c.owners, c.image_device,
                                c.image_host, c.leased, (bid,), c.image_at)
    pl = q.planner()
    assert pl.freed_by_delete(frozenset({5}), P.MAIN) == 0
    assert pl.freed_by_delete(frozenset({4, 5}), P.MAIN) == 1
    pl.victims.add(4)
    assert pl.freed_by_delete(frozenset({5}), P.MAIN) == 1
    assert pl.freed_so_far(P.MAIN) == 0


def test_a_page_only_a_victim_lists_goes_with_its_last_holder():
    """useful-release: a page one point holds and only another lists (the holder's directory no
    longer does) goes once its holder is deleted and a deleted point lists it — the lister being
    a victim already counts; without that victim the page stays listed."""
    q = Quote(main=8, slots=4, host=8 * IMG)
    q.ckpt(4, 64)
    q.ckpt(5, 64, n_blocks=0)
    [bid] = q.cks[4].blocks
    for cid, blocks in ((4, ()), (5, (bid,))):          # 4 holds it, 5 lists it
        c = q.cks[cid]
        q.cks[cid] = P.CheckpointFact(c.cid, c.generation, c.version, c.kind, c.frontier, c.owners, c.image_device,
                                      c.image_host, c.leased, blocks, c.image_at)
    pl = q.planner()
    assert pl.freed_by_delete(frozenset({4}), P.MAIN) == 0
    pl.victims.add(5)
    assert pl.freed_by_delete(frozenset({4}), P.MAIN) == 1


# ---- state-before-kv --------------------------------------------------------------------------
def test_a_state_gap_is_planned_before_a_kv_gap_and_what_it_frees_counts_for_the_kv_gap():
    """state-before-kv: short one slot and one page, the slot is planned first — the only point
    with a Device image goes, and its page covers the KV gap too; planning the page first would
    delete the cheaper page-only point as well."""
    q = Quote(main=2, slots=1, host=0)
    q.ckpt(1, 100)                                         # a Device image and a page
    q.ckpt(2, 10, device=False)                            # a page only (its image on no medium)
    acts, covered = q.planner().plan({P.STATE: 1, P.MAIN: 1})
    assert covered and acts == [P.Delete(1, 1, 1)]


def test_a_gap_no_candidate_covers_is_reported_short():
    """state-before-kv: the plan says whether it covers each pool's gap."""
    q = Quote(main=8, slots=2, host=0)
    q.ckpt(1, 10)
    acts, covered = q.planner().plan({P.STATE: 2})
    assert acts == [P.Delete(1, 1, 1)] and not covered
    acts, covered = q.planner().plan({P.STATE: 1, P.MAIN: 5})
    assert not covered


# ---- reclaim-ranking --------------------------------------------------------------------------
def test_normal_content_goes_by_loss_per_freed_unit():
    """reclaim-ranking: normal content by marginal loss ÷ useful release — a point that loses
    100 for two pages goes before two that lose 60 and 70 for one page each."""
    q = Quote(main=8, slots=8, host=0)
    q.ckpt(1, 100, n_blocks=2)
    q.ckpt(2, 60)
    q.ckpt(3, 70)
    acts, covered = q.planner().plan({P.MAIN: 2})
    assert covered and acts == [P.Delete(1, 1, 1)]


def test_reuse_content_goes_oldest_demand_first_whatever_it_loses():
    """reclaim-ranking: reuse content goes after normal content, the oldest real demand first
    (not the least loss)."""
    q = Quote(main=8, slots=8, host=0)
    q.ckpt(1, 300, level=Level.REUSE, demand=1.0)          # oldest demand, largest loss
    q.ckpt(2, 20, level=Level.REUSE, demand=5.0)
    q.ckpt(3, 400)                                         # normal
    acts, covered = q.planner().plan({P.STATE: 2})
    assert covered and acts == [P.Delete(3, 1, 1), P.Delete(1, 1, 1)]


# ---- page-groups ------------------------------------------------------------------------------
def _pages_with_host_copies(q: Quote, cid: int) -> None:
    for bid in q.cks[cid].blocks:
        b = q.blocks[bid]
        q.blocks[bid] = P.BlockFact(b.bid, b.version, b.kind, b.holders, False, True, True, b.filled, q._host(PAGE))


def test_a_page_group_is_halved_down_to_a_single_page_to_fit_the_host():
    """page-groups: 4 pages short, the Host holds one page: the group is halved 4 -> 2 -> 1 and
    one page is demoted (nothing is deleted)."""
    q = Quote(main=8, host=PAGE + 10)
    q.ckpt(1, 256, n_blocks=4)
    acts, covered = q.planner().plan({P.MAIN: 4})
    demoted = [a for a in acts if isinstance(a, P.DemoteBlocks)]
    assert demoted and len(demoted[0].bids) == 1, acts


def test_a_page_group_halves_rather_than_shrinking_by_one():
    """page-groups: 4 pages short, the Host holds three: the group halves to 2 (not 3)."""
    q = Quote(main=8, host=3 * PAGE + 10)
    q.ckpt(1, 256, n_blocks=4)
    acts, _ = q.planner().plan({P.MAIN: 4})
    demoted = [a for a in acts if isinstance(a, P.DemoteBlocks)]
    assert demoted and len(demoted[0].bids) == 2, acts


def test_pages_with_a_host_copy_demote_without_host_room():
    """page-groups: a page whose complete copy is already on the Host needs no Host room — with
    the Host full, the whole group still demotes (its Device copies go) instead of a deletion."""
    q = Quote(main=8, host=4 * PAGE)
    q.ckpt(1, 256, n_blocks=4)
    _pages_with_host_copies(q, 1)                          # fills the Host exactly
    acts, covered = q.planner().plan({P.MAIN: 4})
    assert covered and [type(a) for a in acts] == [P.DemoteBlocks] and len(acts[0].bids) == 4, acts


# ---- host-admission ---------------------------------------------------------------------------
def test_a_pause_snapshot_may_replace_reuse_cache_on_the_host():
    """host-admission: a pause snapshot's demotion may replace optional cache of either level
    (normal and reuse), and only later tickets' snapshots."""
    s7 = P.SnapshotOwner(7)
    q = Quote(host=IMG)
    q.ckpt(1, 200, ticket_owner=s7)
    q.ckpt(2, 30, device=False, host_image=True, level=Level.REUSE, demand=9.0)
    pl = q.planner(lambda o: True, {s7: 5})
    may, budget = pl.host_admission(pl.cands[1])
    assert may(pl.cands[2]) and budget is None


def test_a_write_back_replaces_by_its_own_eligibility():
    """host-admission for a Host write-back of existing content: normal content replaces
    normal content only; reuse content also older reuse content, never newer."""
    q = Quote(main=64, slots=16, host=8 * IMG)
    n_dev = q.ckpt(1, 100)
    r_dev = q.ckpt(2, 100, level=Level.REUSE, demand=5.0)
    r_old = _host_point(q, 3, 30, (0, IMG), demand=1.0)
    r_new = _host_point(q, 4, 30, (IMG, IMG), demand=9.0)
    n_host = _host_point(q, 5, 30, (2 * IMG, IMG))
    for cid in (r_old, r_new):
        q.table.records[next(rid for rid, rec in q.table.records.items() if rec.e == cid)].level = Level.REUSE
    pl = q.planner()
    assert [pl.cands[c].cls for c in (r_dev, r_old, r_new, n_host)] == [Cls.REUSE, Cls.REUSE, Cls.REUSE, Cls.NORMAL]
    may, _ = pl.host_admission(pl.cands[r_dev])
    assert may(pl.cands[r_old]) and may(pl.cands[n_host]) and not may(pl.cands[r_new])
    may, _ = pl.host_admission(pl.cands[n_dev])
    assert may(pl.cands[n_host]) and not may(pl.cands[r_old])


# ---- host-fit-first / host-gain-cap / host-prune / host-dups-first ----------------------------
def test_host_victims_normal_before_reuse_even_when_the_reuse_one_would_fit():
    """host-fit-first: the class comes first — normal victims that only add free bytes go
    before a reuse victim that alone would let the image fit."""
    half = IMG // 2
    q = Quote(host=2 * IMG)
    a = _host_point(q, 1, 10, (0, half))
    b = _host_point(q, 2, 10, (half, half))
    r = _host_point(q, 3, 5, (IMG, IMG), demand=1.0)
    q.table.records[next(rid for rid, rec in q.table.records.items() if rec.e == r)].level = Level.REUSE
    pl = q.planner()
    assert pl.cands[r].cls == Cls.REUSE
    got = pl.place_host([IMG], lambda v: True)
    assert got is not None and sorted(got[0]) == [a, b], got


def test_normal_host_victims_go_by_loss_per_useful_byte():
    """host-fit-first: among normal victims none of which lets the image fit, loss per useful
    freed byte orders them — a half-image victim losing 30 (60 per image) before a quarter-image
    one losing 20 (80 per image)."""
    half, quarter = IMG // 2, IMG // 4
    q = Quote(host=2 * IMG)
    big = _host_point(q, 1, 30, (0, half))
    q.host_used.append((half, IMG))                        # nobody's: not deletable
    small = _host_point(q, 2, 20, (IMG + half, quarter))
    q.host_used.append((IMG + half + quarter, quarter))
    pl = q.planner()
    cap = pl.host_gain_cap(pl._holes(set()), [IMG])
    ranked = sorted((pl.cands[big], pl.cands[small]), key=lambda c: pl._host_rank(c, set(), [IMG], cap, 0))
    assert [c.cid for c in ranked] == [big, small]


def test_the_gain_cap_when_the_free_bytes_just_suffice_but_do_not_fit():
    """host-gain-cap: free bytes equal to the need but in two holes: the shortfall is 0 bytes,
    so a victim's gain counts up to the largest allocation."""
    q = Quote(host=4 * IMG)
    pl = q.planner()
    assert pl.host_gain_cap([(0, IMG // 2), (IMG, IMG // 2)], [IMG]) == IMG


def test_host_placement_prunes_each_victim_against_the_victims_still_kept():
    """host-prune: a victim is dropped only if the rest of the *current* set still fits — two
    victims that are each redundant given the other are not both dropped. Victims a and b
    (normal) come first in reclaim order, the reuse victim c last; then a is dropped (b and c
    fit), but b is kept (c alone does not fit)."""
    half = IMG // 2
    q = Quote(host=IMG + half)
    a = _host_point(q, 1, 5, (0, half))
    c = _host_point(q, 2, 5, (half, half), demand=1.0)
    b = _host_point(q, 3, 6, (IMG, half))
    q.table.records[next(rid for rid, rec in q.table.records.items() if rec.e == c)].level = Level.REUSE
    pl = q.planner()
    got = pl.place_host([IMG], lambda v: True)
    assert got is not None and sorted(got[0]) == sorted([b, c]), got


def test_host_placement_prunes_several_victims_it_no_longer_needs():
    """host-prune: every victim the final set does not need is dropped, not only the first. The
    two cheap normal victims come first in reclaim order (normal before reuse) but do not make
    room; the reuse one that does makes both unnecessary."""
    quarter = IMG // 4
    q = Quote(host=2 * IMG)
    l1 = _host_point(q, 1, 1, (0, quarter))
    q.host_used.append((quarter, quarter))                 # nobody's: not deletable
    l2 = _host_point(q, 2, 2, (2 * quarter, quarter))
    q.host_used.append((3 * quarter, quarter))
    big = _host_point(q, 3, 50, (IMG, IMG), demand=1.0)
    q.table.records[next(rid for rid, rec in q.table.records.items() if rec.e == big)].level = Level.REUSE
    pl = q.planner()
    assert pl.cands[big].cls == Cls.REUSE
    got = pl.place_host([IMG], lambda v: True)
    assert got == ([big], 50), (got, l1, l2)


def test_a_released_duplicate_the_victims_make_unnecessary_is_kept():
    """host-dups-first: safe duplicates are released first, but one the chosen victims make
    unnecessary is kept again (its content stays on both media)."""
    q = Quote(host=4 * IMG)
    dup = q.ckpt(1, 200, device=True, host_image=True)      # [0, IMG): on both media
    q.host_used.append((IMG, IMG))                          # nobody's: not deletable
    v1 = _host_point(q, 2, 5, (2 * IMG, IMG))
    v2 = _host_point(q, 3, 6, (3 * IMG, IMG))
    pl = q.planner()
    got = pl.place_host([2 * IMG], lambda v: v.cid != dup)
    assert got is not None and sorted(got[0]) == [v1, v2], (got, dup)
