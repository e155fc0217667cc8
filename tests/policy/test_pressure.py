"""Pressure's rules that need no reclaim planning, on fabricated needs and quotes (model-free):
when a cycle needs facts before it is sent (``quote-trigger``) and where each save's room comes
from (``save-room-order``). Milliseconds per test; no model, no worker."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer import protocol as P
from ninfer.policy.pressure import FRESH, ROW, Need, Pressure
from tests.policy.test_reclaim_planner import IMG, Quote

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


def test_one_save_beyond_the_slots_needs_a_quote_only_when_no_host_extent_holds_its_image():
    p = _pressure()
    needs = [_need(1, state=1)]
    assert not p.needs_quote(needs, 1, _pools(8, 1), IMG, False)       # the Host takes it
    assert p.needs_quote(needs, 1, _pools(8, 1), IMG - 1, False)       # no extent large enough
    # two saves beyond the slots: the Host takes one image at most without a quote
    assert p.needs_quote(needs, 2, _pools(8, 1), 10 * IMG, False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2)), max_size=5), st.integers(0, 6),
       st.integers(0, 12), st.integers(0, 4), st.integers(0, 3 * IMG), st.booleans())
def test_the_quote_trigger_restated(demands, caps, main, slots, host_largest, take_back):
    """The rule restated independently: a quote unless every need fits in order and the saves
    find a Device slot left by the needs, or all but one do and a Host extent holds an image."""
    needs = [_need(i + 1, m, s) for i, (m, s) in enumerate(demands)]
    fits = sum(m for m, _ in demands) <= main and sum(s for _, s in demands) <= slots
    left = slots - sum(s for _, s in demands)
    saves_fit = caps <= max(0, left) or (caps == max(0, left) + 1 and host_largest >= IMG)
    want = take_back or not fits or not saves_fit
    assert _pressure().needs_quote(needs, caps, _pools(main, slots), host_largest, take_back) == want


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
    rooms = p.save_rooms(_saves(4), 1, q.facts(), None)
    # 2 slots left after the intents' 1, then one save on the Host; the 4th asks the table
    assert p.asked == ["s3"]
    assert rooms == [([], False, False), ([], False, False), ([], False, False), ([P.Delete(99, 1, 1)], False, False)]


def test_without_host_room_every_save_past_the_slots_asks_the_table_and_a_refusal_is_reported():
    q = Quote(main=8, slots=2, host=IMG - 1)         # no extent holds an image
    p = _Table(refuse=True)
    rooms = p.save_rooms(_saves(4), 0, q.facts(), None)
    assert p.asked == ["s2", "s3"]
    assert rooms[2:] == [([], True, False), ([], True, False)]


def test_intents_that_take_every_slot_leave_the_saves_the_host_and_the_table():
    q = Quote(main=8, slots=2, host=3 * IMG)
    p = _Table()
    p.save_rooms(_saves(3), 2, q.facts(), None)
    assert p.asked == ["s1", "s2"]                   # the Host took s0 (one image), then the table


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
