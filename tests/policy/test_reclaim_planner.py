"""The reclaim planner on hand-built quotes: ranking, victim sets, Host placement by first-fit,
and the admission table's rows (seed: 回收与准入)."""

from __future__ import annotations

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


def test_placement_counts_contiguous_extents_not_bytes():
    """Two free half-size holes do not hold one StateImage."""
    q = Quote(host=3 * IMG)
    q.ckpt(1, 500)
    q.host_used = [(IMG // 2, IMG)]                                    # free: [0, IMG/2) and [1.5 IMG, 3 IMG)
    q.host = 2 * IMG
    acts, _ = q.planner().plan({P.STATE: 1})
    assert acts == [P.Delete(1, 1, 1)]
