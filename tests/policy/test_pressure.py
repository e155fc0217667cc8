"""Pressure's rules that need no reclaim planning, on fabricated needs and quotes (model-free):
when a cycle needs facts before it is sent (``quote-trigger``) and where each save's room comes
from (``save-room-order``). Milliseconds per test; no model, no worker."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer import protocol as P
from ninfer.policy.pressure import FRESH, ROW, Need, Pressure
from tests.policy.test_reclaim_planner import IMG, PAGE, Quote

INFO = SimpleNamespace(image_bytes=IMG)


def _pressure() -> Pressure:
    return Pressure(sched=None, rm=None, info=INFO)


def _pools(main: int, slots: int) -> dict[str, P.PoolState]:
    return {P.MAIN: P.PoolState(64, main), P.STATE: P.PoolState(8, slots)}


def _need(iid: int, main: int = 0, state: int = 0, known: bool = True) -> Need:
    return Need(iid, SimpleNamespace(rid=f"r{iid}"), ROW if state == 0 else FRESH,
                {P.MAIN: main, P.STATE: state} if known else None)


# ---- quote-trigger --------------------------------------------------------------------------
def test_a_cycle_that_fits_without_saves_is_sent_without_a_quote():
    p = _pressure()
    assert not p.needs_quote([_need(1, main=3), _need(2, main=5, state=1)], 0, _pools(8, 1), 0, False)


def test_a_take_back_an_unknown_demand_or_a_need_that_may_not_fit_asks_for_a_quote():
    p = _pressure()
    assert p.needs_quote([], 0, _pools(8, 1), 0, True)                             # a take-back
    assert p.needs_quote([_need(1, known=False)], 0, _pools(8, 1), 0, False)       # only a quote can tell
    assert p.needs_quote([_need(1, main=5), _need(2, main=4)], 0, _pools(8, 1), 0, False)   # 9 > 8 pages
    assert p.needs_quote([_need(1, state=2)], 0, _pools(8, 1), 0, False)


def test_saves_within_the_slots_the_needs_leave_need_no_quote():
    p = _pressure()
    # 3 slots, the needs take 1: two saves have a Device slot each
    assert not p.needs_quote([_need(1, state=1)], 2, _pools(8, 3), 0, False)
    # the needs' slots count: with 2 taken, the second save is beyond them
    assert p.needs_quote([_need(1, state=2)], 2, _pools(8, 3), 0, False)


def test_saves_beyond_the_slots_need_a_quote_only_when_the_host_holds_fewer_images():
    p = _pressure()
    needs = [_need(1, state=1)]
    assert not p.needs_quote(needs, 1, _pools(8, 1), 1, False)       # the Host takes it
    assert p.needs_quote(needs, 1, _pools(8, 1), 0, False)           # no extent holds an image
    # two saves past the slots: the Host must hold two images
    assert not p.needs_quote(needs, 2, _pools(8, 1), 2, False)
    assert p.needs_quote(needs, 2, _pools(8, 1), 1, False)
    assert not p.needs_quote(needs, 3, _pools(8, 2), 2, False)       # one slot left, two on the Host


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2)), max_size=5), st.integers(0, 6),
       st.integers(0, 12), st.integers(0, 4), st.integers(0, 4), st.booleans())
def test_the_quote_trigger_restated(demands, caps, main, slots, host_images, take_back):
    """The rule restated independently: a quote unless every need fits in order and the saves
    find a Device slot left by the needs or, past them, a Host image's room each."""
    needs = [_need(i + 1, m, s) for i, (m, s) in enumerate(demands)]
    fits = sum(m for m, _ in demands) <= main and sum(s for _, s in demands) <= slots
    left = slots - sum(s for _, s in demands)
    saves_fit = caps <= max(0, left) + host_images
    want = take_back or not fits or not saves_fit
    assert _pressure().needs_quote(needs, caps, _pools(main, slots), host_images, take_back) == want


# ---- save-room-order ------------------------------------------------------------------------
class _Table(Pressure):
    """Pressure whose admission-table step is fabricated: it records who asked."""

    def __init__(self, refuse: bool = False):
        super().__init__(None, None, INFO)
        self.asked: list[str] = []
        self.refuse = refuse

    def capture_room(self, req, sp, planner, facts, protect=frozenset(), rec=None, window_short=None):
        self.asked.append(req.rid)
        return (None, True, False) if self.refuse else ([P.Delete(99, 1, 1)], False, False)


def _saves(n: int):
    return [(SimpleNamespace(rid=f"s{i}"), None, None) for i in range(n)]


def test_a_save_takes_a_slot_left_by_the_intents_then_the_host_then_the_admission_table():
    q = Quote(main=8, slots=3, host=2 * IMG)         # 3 free slots, a Host that holds two images
    p = _Table()
    rooms = p.save_rooms(_saves(5), 1, q.facts(), None)
    # 2 slots left after the intents' 1, then two saves on the Host; the 5th asks the table
    assert p.asked == ["s4"]
    assert rooms == [([], False, False)] * 4 + [([P.Delete(99, 1, 1)], False, False)]


def test_the_host_room_of_saves_is_what_the_intents_plan_leaves_first_fit():
    """The intents' demotions take their Host extents first: a Host of three images' room, one
    image and a page placed by the plan, leaves one whole image's room (first-fit)."""
    q = Quote(main=8, slots=1, host=3 * IMG)
    plan = SimpleNamespace(host_used=[(0, IMG), (IMG, PAGE)])
    p = _Table()
    p.save_rooms(_saves(3), 1, q.facts(), plan)
    assert p.asked == ["s1", "s2"]                   # s0 on the Host, the rest ask the table
    p = _Table()
    p.save_rooms(_saves(4), 1, q.facts(), SimpleNamespace(host_used=[]))
    assert p.asked == ["s3"]                         # nothing placed: three images' room


def test_without_host_room_every_save_past_the_slots_asks_the_table_and_a_refusal_is_reported():
    q = Quote(main=8, slots=2, host=IMG - 1)         # no extent holds an image
    p = _Table(refuse=True)
    rooms = p.save_rooms(_saves(4), 0, q.facts(), None)
    assert p.asked == ["s2", "s3"]
    assert rooms[2:] == [([], True, False), ([], True, False)]


def test_intents_that_take_every_slot_leave_the_saves_the_host_and_the_table():
    q = Quote(main=8, slots=2, host=3 * IMG)
    p = _Table()
    p.save_rooms(_saves(5), 2, q.facts(), None)
    assert p.asked == ["s3", "s4"]                   # the Host took s0-s2 (three images), then the table


# ---- take-back-second-pass ------------------------------------------------------------------
def test_a_take_back_that_frees_no_page_reclaims_the_cache_its_victim_shared_in_a_second_pass():
    """The only page the older request could get is one its younger victim shares with a
    cached point: pinned while the victim runs, so neither reclaim nor the take-back alone
    covers the page. Once the victim lets go, the cached point is reclaimable — the second pass
    plans it after the take-back (seed: 暂停较年轻者后其共享的可选缓存即可回收)."""
    q = Quote(main=1, slots=4, host=0)
    q.ckpt(1, 50)
    [bid] = q.cks[1].blocks
    victim_sid = 7
    b = q.blocks[bid]
    q.blocks[bid] = P.BlockFact(b.bid, b.version, b.kind, (1, -victim_sid), True, b.device, b.host, b.filled)
    old = SimpleNamespace(rid="old", ticket=1, live=True, sid=3, snapshot=None)
    young = SimpleNamespace(rid="young", ticket=2, live=True, sid=victim_sid, snapshot=None,
                            facts=SimpleNamespace(reserved=0))
    sched = SimpleNamespace(recovery=None, resident={"old": old, "young": young}, paused=[], fresh=[],
                            victims_for=lambda req: [young] if req is old else [])
    rm = SimpleNamespace(table=q.table, adopting=lambda: set())
    p = Pressure(sched, rm, INFO)
    need = Need(1, old, ROW, {P.MAIN: 1})
    verdicts, _ = p.settle([need], q.facts(), {}, tx_busy=False)
    v = verdicts[1]
    assert v.covered and v.contract is None, v
    assert v.remedies == [P.TakeBack(victim_sid, False, []), P.Reclaim([P.Delete(1, 1, 1)])]


# ---- capacity-contract: one typed verdict --------------------------------------------------
def test_a_stalled_engine_fails_the_oldest_live_request_with_the_contract():
    reqs = [SimpleNamespace(rid="young", ticket=7, live=True), SimpleNamespace(rid="dead", ticket=1, live=False),
            SimpleNamespace(rid="old", ticket=3, live=True)]
    c = Pressure.stalled(reqs)
    assert (c.rid, c.short) == ("old", {}) and "cannot progress" in c.message
    assert Pressure.stalled([r for r in reqs if not r.live]) is None


# ---- rights, revocation, protection, the alternative plan, the contract, the pause route ------
from ninfer.policy.pressure import CHUNK, RESUME, Rights, Waiters  # noqa: E402
from ninfer.policy.reclaim import Planner  # noqa: E402
from ninfer.policy.records import Level  # noqa: E402
from ninfer.policy.scheduler import Scheduler  # noqa: E402
from tests.policy.test_reclaim_planner import _host_point  # noqa: E402
from tests.policy.test_scheduler import R  # noqa: E402


def _real(*resident: R, paused: tuple[R, ...] = (), fresh: tuple[R, ...] = (), table=None, adopting=()) -> Pressure:
    """Pressure over a real Scheduler (``resident`` admitted in order, ``paused`` paused) and a
    fabricated ResourceManager (its record table and the sources being adopted)."""
    s = Scheduler(8)
    for r in (*resident, *paused):
        s.admit(r)
    for r in paused:
        s.pause(r)
    s.fresh.extend(fresh)
    rm = SimpleNamespace(table=table, adopting=lambda: set(adopting))
    return Pressure(s, rm, INFO)


def test_the_rights_of_each_requester():
    """preemption-rights: a fresh admission may revoke younger waiters only; a resume behind an
    older resident may only reclaim optional cache; the oldest paused with no older resident
    may do everything a row may; a row may revoke and take back, and a young one that still
    cannot progress pauses itself — never the full-recovery holder."""
    a, b, c, d = R("a", 0, sid=1), R("b", 1, sid=2), R("c", 2, sid=3), R("d", 3, sid=4)
    p = _real(a, c, d, paused=(b,))
    assert p.rights(Need(1, R("f", 9), FRESH, None)) == Rights(waiters=Waiters.YOUNGER)
    assert p.rights(Need(1, b, RESUME, None)) == Rights()                       # a is older and resident
    assert p.rights(Need(1, a, ROW, None)) == Rights(Waiters.ALL, True, True, False)
    assert p.rights(Need(1, c, CHUNK, None)) == Rights(Waiters.ALL, True, True, True)
    p.sched.begin_recovery(d)
    assert p.rights(Need(1, d, ROW, None)).pause_self is False                  # the holder never pauses itself
    p.sched.remove(a)
    assert p.rights(Need(1, b, RESUME, None)) == Rights(Waiters.ALL, True, True, False)


def test_which_waiting_references_and_pause_snapshots_a_requester_may_revoke():
    """revocation-rights: a fresh admission revokes younger requests' waiting references only
    and no pause snapshot; a row any waiting reference and later tickets' snapshots, never an
    earlier one's; a resume behind an older resident nothing. The waiters carry their tickets
    for the revocation order."""
    me = R("me", 5, sid=50)
    w_old, w_young = R("w_old", 2, phase=P.Phase.QUEUED), R("w_young", 8, phase=P.Phase.QUEUED)
    p_old, p_young = R("p_old", 3, sid=30), R("p_young", 9, sid=90)
    p = _real(me, paused=(p_old, p_young), fresh=(w_old, w_young))
    W, S = P.WaiterOwner, P.SnapshotOwner
    may, snaps = p._revoker(me, Rights(waiters=Waiters.YOUNGER))
    assert [may(o) for o in (W("w_young"), W("w_old"), S(90), S(30))] == [True, False, False, False]
    assert snaps[W("w_young")] == 8 and snaps[W("w_old")] == 2 and snaps[S(90)] == 9
    may, _ = p._revoker(me, Rights(Waiters.ALL, True, True, True))
    assert [may(o) for o in (W("w_young"), W("w_old"), S(90), S(30))] == [True, True, True, False]
    may, _ = p._revoker(me, Rights())
    assert not any(may(o) for o in (W("w_young"), W("w_old"), S(90), S(30)))


def test_sources_being_adopted_and_the_requesters_own_snapshot_are_protected_nothing_else():
    """protected-sources: the sources binds are adopting and the requester's own snapshot are
    never victims; another paused request's snapshot is not protected by it."""
    me, other = R("me", 1, sid=1), R("o", 2, sid=2)
    me.snapshot, other.snapshot = SimpleNamespace(cid=20), SimpleNamespace(cid=30)
    p = _real(paused=(me, other), adopting=(11, 12))
    assert p.protected(me) == {11, 12, 20}
    assert p.protected(R("f", 3)) == {11, 12}


def _lone_row(q: Quote, demand: dict[str, int], tx_busy: bool = False, others: tuple[R, ...] = ()):
    a = R("a", 0, sid=1)
    p = _real(a, *others, table=q.table)
    verdicts, _ = p.settle([Need(1, a, ROW, demand)], q.facts(), {}, tx_busy=tx_busy)
    return verdicts[1]


def test_deletions_alone_when_the_demotion_first_plan_cannot_cover_and_a_demotion_when_it_can():
    """deletions-only-alternative: short a slot and a page with one point (an image and a page)
    and Host room for one image: demoting its image first leaves its page neither movable nor
    deletable (the Host is then full, the point migrating), so that plan cannot cover — deleting
    the point alone covers both. Short a slot only, the zero-loss demotion is kept."""
    q = Quote(main=1, slots=1, host=IMG)
    q.ckpt(1, 100)
    v = _lone_row(q, {P.MAIN: 1, P.STATE: 1})
    assert v.covered and v.contract is None and v.remedies == [P.Reclaim([P.Delete(1, 1, 1)])], v
    q = Quote(main=1, slots=1, host=IMG)
    q.ckpt(1, 100)
    v = _lone_row(q, {P.STATE: 1})
    assert v.covered and v.remedies == [P.Reclaim([P.DemoteState(1, 1, 1)])], v


def _shared_prefix(q: Quote) -> tuple[int, int, int]:
    """A prefix point (two pages) a bind adopts, a sibling that lists both pages plus one of its
    own, and an older point below them on the same pages: (source, sibling, own page)."""
    src = q.ckpt(1, 32, n_blocks=2, host_image=True)
    pre = q.cks[src].blocks
    sib = q.ckpt(2, 40, demand=1.0, host_image=True)
    own = q.cks[sib].blocks[0]
    old = q.ckpt(3, 16, host_image=True)
    for bid in pre:
        q.blocks[bid] = P.BlockFact(bid, 1, "main", (src, sib, old), False, True, False, 64, None)
    del q.blocks[q.cks[old].blocks[0]]
    for cid, blocks in ((sib, (*pre, own)), (old, pre[:1])):
        c = q.cks[cid]
        q.cks[cid] = P.CheckpointFact(cid, 1, 1, c.kind, c.frontier, c.owners, True, True, False, blocks, c.image_at)
    return src, sib, own


def test_a_needs_remedy_moves_no_page_a_bind_of_this_step_reads():
    """sources-stay-put: a fresh bind short one page, its source's pages listed by older and
    sibling points too: no demotion moves a page the bind reads (it would be copied back at
    once — the freed page is the one the copy back takes) — the sibling's own page goes; nor a
    page an earlier need's source lists. The same pages are fair game for a need whose bind
    reads something else."""
    q = Quote(main=3, slots=4, host=16 * IMG)      # full: the two shared pages and the sibling's own
    src, sib, own = _shared_prefix(q)
    f = R("f", 3)
    p = _real(R("a", 0, sid=1), fresh=(f,), table=q.table)
    verdicts, _ = p.settle([Need(1, f, FRESH, {P.MAIN: 1}, src)], q.facts(), {}, tx_busy=False)
    v = verdicts[1]
    moved = [b for r in v.remedies for a in r.actions if isinstance(a, P.DemoteBlocks) for b in a.bids]
    assert v.covered and moved == [own], v
    # an earlier need adopts the source: a later need's remedy does not move its pages either
    g = R("g", 4)
    verdicts, _ = p.settle([Need(1, f, FRESH, {}, src), Need(2, g, FRESH, {P.MAIN: 1}, None)], q.facts(), {},
                           tx_busy=False)
    moved = [b for r in verdicts[2].remedies for a in r.actions if isinstance(a, P.DemoteBlocks) for b in a.bids]
    assert verdicts[2].covered and moved == [own], verdicts[2]
    # a bind adopting it right now (a transaction in flight) reads it too
    busy = _real(R("a", 0, sid=1), fresh=(g,), table=q.table, adopting=(src,))
    verdicts, _ = busy.settle([Need(1, g, FRESH, {P.MAIN: 1}, None)], q.facts(), {}, tx_busy=False)
    moved = [b for r in verdicts[1].remedies for a in r.actions if isinstance(a, P.DemoteBlocks) for b in a.bids]
    assert moved == [own], verdicts[1]
    # no bind reads the source: its pages may move (the older point's, oldest demand first)
    verdicts, _ = p.settle([Need(1, g, FRESH, {P.MAIN: 1}, None)], q.facts(), {}, tx_busy=False)
    moved = [b for r in verdicts[1].remedies for a in r.actions if isinstance(a, P.DemoteBlocks) for b in a.bids]
    assert moved and own not in moved, verdicts[1]


def test_the_capacity_contract_fires_only_for_a_lone_request_with_nothing_in_flight():
    """capacity-contract: the only request, short after all legal reclaim, fails with the
    contract error — not while a transfer may still release capacity, nor beside another
    resident (it is judged again once nobody is about to release anything)."""
    q = Quote(main=0, slots=4, host=0)
    v = _lone_row(q, {P.MAIN: 1})
    assert not v.covered and v.contract is not None and "cannot get a legal unit" in v.contract.message
    assert _lone_row(q, {P.MAIN: 1}, tx_busy=True).contract is None
    assert _lone_row(q, {P.MAIN: 1}, others=(R("b", 1, sid=2, phase=P.Phase.MATERIALIZING),)).contract is None


def _route(owner_kind: str) -> tuple[bool, list]:
    """pause_route of a young victim with no pages, the Host full of one other checkpoint."""
    q = Quote(host=IMG)
    if owner_kind == "snapshot_earlier":
        q.ckpt(2, 30, device=False, host_image=True, ticket_owner=P.SnapshotOwner(3))
    elif owner_kind == "snapshot_later":
        q.ckpt(2, 30, device=False, host_image=True, ticket_owner=P.SnapshotOwner(9))
    elif owner_kind == "waiter":
        q.ckpt(2, 30, device=False, host_image=True, owner=P.WaiterOwner("w"))
    else:
        _host_point(q, 2, 30, (0, IMG), demand=1.0)
        if owner_kind == "reuse":
            q.table.records[next(rid for rid, rec in q.table.records.items() if rec.e == 2)].level = Level.REUSE
    tickets = {P.SnapshotOwner(3): 3, P.SnapshotOwner(9): 9, P.WaiterOwner("w"): 8}
    pl = Planner(q.facts(), q.table, set(), lambda o: True, tickets)
    victim = R("y", 5, sid=7)
    return _real(victim, table=q.table).pause_route(victim, pl, q.facts())


def test_a_snapshot_pause_goes_to_the_host_over_optional_cache_and_later_snapshots_only():
    """pause-route: the victim's Snapshot goes to the Host when its content can be placed over
    optional cache (normal or reuse) or a later ticket's snapshot; over an earlier ticket's
    snapshot or a waiting reference's point it cannot, and the pause is destructive."""
    assert _route("normal") == (True, [P.Delete(2, 1, 1)])
    assert _route("reuse") == (True, [P.Delete(2, 1, 1)])
    assert _route("snapshot_later") == (True, [P.Delete(2, 1, 1)])
    assert _route("snapshot_earlier") == (False, [])
    assert _route("waiter") == (False, [])


def test_no_capacity_contract_while_a_take_back_publishes():
    """capacity-contract: the oldest row, short after reclaim, takes its younger neighbour back
    and is still short — the take-back releases what it frees only once its snapshot publishes,
    so the contract is not judged in this cycle (it is, once nobody is about to release)."""
    q = Quote(main=0, slots=4, host=0)
    v = _lone_row(q, {P.MAIN: 1}, others=(R("b", 1, sid=2),))
    assert not v.covered and v.contract is None and v.remedies == [P.TakeBack(2, False, [])], v
