"""The rules decided while a reply is interpreted (engine/outcomes.py), each stated on a fabricated
plan item and a fabricated ``StepReply`` driven through ``Outcomes.apply`` — the controller's
one writer of its books — with a real Scheduler, ResourceManager and books, no model and no
worker (milliseconds). tests/mutations.py breaks each rule in several ways and names these tests.

    unfit-source-reselect    a lone request short on restoring its source gives the source up
                             and reselects (it would fit computing from a shallower point); with
                             no source it fails with the capacity contract
    chunk-short-gives-turn   a resident's chunk that could not get its permit goes to the back
                             of the prefill rotation
    chunk-rotation           a resident whose prefill/replay chunk ran goes to the back of the
                             rotation; a decode row or a unit that did not run keeps its place
    wait-for-release         a unit (or a fresh bind) whose permit came back WAIT is not
                             planned again until the transaction of its committed reclaim settles
"""

from __future__ import annotations

from ninfer import protocol as P
from ninfer.engine.books import CommandQueue, EngineStats, RequestBook, TxBook
from ninfer.engine.outcomes import Outcomes
from ninfer.engine.planning import Item, Plan
from ninfer.engine.request import Request
from ninfer.engine.telemetry import Telemetry
from ninfer.engine.units import Unit
from ninfer.errors import ErrorKind
from ninfer.policy.pressure import CHUNK, FRESH, ROW, Contract, Need
from ninfer.policy.scheduler import Scheduler
from ninfer.protocol import FinishReason, Outcome, Phase, RequestSpec
from ninfer.sampling_params import SamplingParams
from tests.policy.fakes import INFO, resource_manager

PROMPT = list(range(1, 201))


class World:
    """The controller's books around one Outcomes, as EngineCore wires them."""

    def __init__(self):
        self.events: list[P.Event] = []
        self.sched = Scheduler(INFO.max_concurrency)
        self.rm = resource_manager(divergence_min=None)
        self.books = RequestBook(self.events.append)
        self.cmdq = CommandQueue()
        self.stats = EngineStats()
        self.out = Outcomes(self.sched, self.rm, self.books, TxBook(), self.cmdq, self.stats, Telemetry(),
                            INFO.image_bytes)
        self._tickets = iter(range(1, 1000))

    def request(self, rid: str, prompt=PROMPT) -> Request:
        req = Request(spec=RequestSpec(prompt=list(prompt), params=SamplingParams(max_tokens=4)), rid=rid,
                      ticket=next(self._tickets))
        self.books.requests[rid] = req
        self.sched.enqueue(req)
        return req

    def host_point(self, cid: int, tokens) -> None:
        """A complete cache point of ``tokens`` on the Host only, a record's E."""
        rec = self.rm.table.new_record(None)
        rec.e = cid
        self.rm.table.add_ckpt(P.CkptRef(cid, 1, len(tokens), P.CkptKind.CACHE, False, True), tuple(tokens),
                               rec.owner(P.Role.E))

    def resident(self, req: Request, sid: int) -> None:
        """``req`` bound and running as sequence ``sid`` (what a fresh bind's OK reply books)."""
        self.books.bind(req, sid, materializing=False)
        req.facts = P.SeqFacts(frontier=0, ledger_len=len(req.prompt), blocks=0, tail_ok=True, reserved=0)
        self.sched.admit(req)


def _fresh_item(w: World, req: Request, iid: int = 1) -> Item:
    adm = w.rm.plan_admission(req, w.sched.fresh)
    source = adm.source.ref if adm.source is not None else None
    intent = P.BindIntent(iid, source=source, first_tokens=64)
    need = Need(iid, req, FRESH, None, source.cid if source is not None else None)
    item = Item(iid, req, FRESH, intent, None, need, adm=adm)
    item.contract = Contract(req.rid, {P.MAIN: 3}, "needs 3 more KV pages than the device has")
    return item


def _short(iid: int) -> P.StepReply:
    return P.StepReply(1, intents=[P.IntentOut(iid, Outcome.SHORT, shortfall={P.MAIN: 3})])


# ---- unfit-source-reselect ---------------------------------------------------------------------
def test_a_lone_request_short_on_restoring_its_source_reselects_without_it():
    """unfit-source-reselect: the sole request, short after all legal reclaim while restoring a
    Host point (its KV pages plus the first unit exceed Main), is not failed: it gives the source
    up and the scan is woken to plan it again; its next admission computes from the root. With
    the source given up once, the same shortfall is the capacity contract."""
    w = World()
    w.host_point(7, PROMPT[:160])
    req = w.request("a")
    item = _fresh_item(w, req)
    assert item.need.source == 7, "the Host point is the admission's source"
    epoch = w.sched.epoch
    assert w.out.apply(_short(1), Plan(items=[item]), []) is True
    assert req.finish_reason is None and req.error is None and w.stats.capacity_errors == 0
    assert w.sched.epoch > epoch, "the scan is woken to plan the request again"
    again = _fresh_item(w, req, iid=2)
    assert again.need.source is None and again.adm.cached == 0, "reselected without the unfit source"
    w.out.apply(_short(2), Plan(items=[again]), [])
    assert req.finish_reason is FinishReason.ERROR and req.error.kind is ErrorKind.CAPACITY_CONTRACT
    assert w.stats.capacity_errors == 1


def test_a_lone_request_short_with_no_source_meets_the_capacity_contract():
    """unfit-source-reselect: nothing to give up — the verdict's contract fails the request with
    its message (no wait for a releaser that does not exist)."""
    w = World()
    req = w.request("a")
    item = _fresh_item(w, req)
    assert item.need.source is None
    w.out.apply(_short(1), Plan(items=[item]), [])
    assert req.error is not None and req.error.kind is ErrorKind.CAPACITY_CONTRACT
    assert "3 more KV pages" in req.error.message and w.stats.capacity_errors == 1


def test_a_short_request_with_no_contract_waits():
    """A shortfall without the contract's verdict (someone else holds or needs capacity) fails
    nobody and gives no source up: the request keeps its source and waits."""
    w = World()
    w.host_point(7, PROMPT[:160])
    req = w.request("a")
    item = _fresh_item(w, req)
    item.contract = None
    w.out.apply(_short(1), Plan(items=[item]), [])
    assert req.finish_reason is None and not w.rm.book(req).unfit
    assert _fresh_item(w, req, iid=2).need.source == 7


# ---- chunk-short-gives-turn ------------------------------------------------------------------
def _chunk_item(req: Request, iid: int) -> Item:
    intent = P.RowIntent(iid, req.sid, P.UnitSpec(32, P.UnitKind.PREFILL))
    return Item(iid, req, CHUNK, intent, None, Need(iid, req, CHUNK, {P.MAIN: 2}))


def test_a_chunk_that_cannot_get_its_permit_gives_up_its_turn():
    """chunk-short-gives-turn: the resident first in the prefill rotation whose chunk is short
    goes to the back; the next one prefills next cycle. A chunk that ran not at all because a
    guard skipped it keeps its place."""
    w = World()
    a, b = w.request("a"), w.request("b")
    w.resident(a, 1)
    w.resident(b, 2)
    assert w.sched.chunk_order()[0] is a
    w.out.apply(P.StepReply(1, intents=[P.IntentOut(1, Outcome.SKIPPED)]), Plan(items=[_chunk_item(a, 1)]), [])
    assert w.sched.chunk_order()[0] is a, "a skipped chunk keeps its turn"
    w.out.apply(_short(1), Plan(items=[_chunk_item(a, 1)]), [])
    assert [r.rid for r in w.sched.chunk_order()] == ["b", "a"]
    assert a.phase is Phase.RUNNING and a.finish_reason is None


# ---- wait-for-release ----------------------------------------------------------------------
def _waited(w: World, req: Request, n: int, iid: int, tid: int, ran: bool = False) -> None:
    """``req``'s unit of ``n`` tokens came back WAIT: a demotion committed for it, its copies in
    transaction ``tid`` (and the unit ran after the Control/Decode batch when ``ran``)."""
    demote = P.Reclaim([P.DemoteBlocks(40 + iid, 1, (400 + iid,), (1,))])
    intent = P.RowIntent(iid, req.sid, P.UnitSpec(n, P.UnitKind.PREFILL if n > 1 else P.UnitKind.DECODE),
                         remedies=[demote])
    item = Item(iid, req, CHUNK if n > 1 else ROW, intent, Unit(n, intent.unit.kind), Need(iid, req, CHUNK, {}))
    out = P.IntentOut(iid, Outcome.WAIT, shortfall={P.MAIN: 1},
                      applied=[P.Applied(0, commit=P.CommitResult(True, tid=tid))])
    f = req.facts
    units = [P.UnitOut(req.sid, True, facts=P.SeqFacts(f.frontier + n, f.ledger_len, 0, True, 0))] if ran else []
    w.out.apply(P.StepReply(1, intents=[out], units=units), Plan(items=[item]), [])


def _settle(w: World, tid: int, ok: bool = True) -> None:
    w.out.apply(P.StepReply(2, settled=[P.Settled(tid, 1, ok, point=1)]), Plan(), [])


def test_a_unit_waiting_for_its_release_is_not_planned_again_until_the_copies_settle():
    """wait-for-release: a's chunk and c's decode row came back WAIT (a demotion committed for
    each, its copies in flight): neither is planned again — b prefills meanwhile, and no quote
    and reclaim for the same gaps is made — until their transaction settles (published, or
    aborted: either way the real gap is asked again); then a has its turn back and c its row."""
    w = World()
    a, b, c = w.request("a"), w.request("b"), w.request("c", prompt=PROMPT[:1])
    for sid, r in enumerate((a, b, c), 1):
        w.resident(r, sid)
    c.facts = P.SeqFacts(frontier=0, ledger_len=1, blocks=0, tail_ok=True, reserved=0)
    assert [r.rid for r in w.sched.chunk_order()] == ["a", "b"] and w.sched.rows() == [c]
    _waited(w, a, 32, 1, tid=5)
    _waited(w, c, 1, 2, tid=6)
    assert [r.rid for r in w.sched.chunk_order()] == ["b"], "a waits for its release"
    assert w.sched.rows() == [], "c waits for its release"
    _settle(w, 6, ok=False)
    assert w.sched.rows() == [c], "an aborted release is asked again too"
    assert [r.rid for r in w.sched.chunk_order()] == ["b"]
    _settle(w, 5)
    assert [r.rid for r in w.sched.chunk_order()] == ["a", "b"], "a keeps its turn"


def test_a_fresh_bind_waiting_for_its_release_is_not_quoted_again_until_the_copies_settle():
    """wait-for-release, for a fresh bind: it came back WAIT (a demotion committed for it, its
    copies in flight) and the commit's own partial release re-opened the scan — it is not
    looked at again (no second quote and reclaim for the same gap) while b behind it is; once
    the transaction settles it is the head of the scan again."""
    w = World()
    a, b = w.request("a"), w.request("b")
    item = _fresh_item(w, a)
    demote = P.Reclaim([P.DemoteState(41, 1, 1)])
    item.intent.remedies = [demote]
    out = P.IntentOut(1, Outcome.WAIT, shortfall={P.STATE: 1},
                      applied=[P.Applied(0, commit=P.CommitResult(True, tid=7))])
    w.out.apply(P.StepReply(1, intents=[out]), Plan(items=[item]), [])
    w.sched.event()                                   # the commit released part of the capacity
    assert [r.rid for r, _ in w.sched.fresh_candidates()] == ["b"]
    _settle(w, 7)
    assert [r.rid for r, _ in w.sched.fresh_candidates()] == ["a", "b"]


def test_a_waiting_chunk_that_ran_after_the_decode_batch_is_planned_next_cycle():
    """wait-for-release: a chunk whose permit came back WAIT but was refreshed after the
    Control/Decode batch and ran (its copies published in time) waits for nothing."""
    w = World()
    a = w.request("a")
    w.resident(a, 1)
    _waited(w, a, 32, 1, tid=5, ran=True)
    assert w.sched.chunk_order() == [a]


# ---- chunk-rotation ----------------------------------------------------------------------------
def _ran(w: World, req: Request, n: int, kind: P.UnitKind, iid: int, ran: bool = True) -> None:
    """``req``'s unit of ``n`` tokens came back (ran or not) with its frontier moved on."""
    unit = Unit(n, kind)
    item = Item(iid, req, CHUNK if n > 1 else ROW, P.RowIntent(iid, req.sid, P.UnitSpec(n, kind)), unit,
                Need(iid, req, CHUNK, {}))
    f = req.facts
    facts = P.SeqFacts(f.frontier + (n if ran else 0), f.ledger_len, 0, True, 0)
    w.out.apply(P.StepReply(1, intents=[P.IntentOut(iid, Outcome.OK)], units=[P.UnitOut(req.sid, ran, facts=facts)]),
                Plan(items=[item]), [])


def test_the_resident_whose_chunk_ran_goes_to_the_back_of_the_rotation():
    """chunk-rotation: three residents prefilling in turn a, b, c: a's chunk ran — b, c, a; a
    one-token unit (the last prompt token, a decode row) or a chunk that did not run moves
    nobody; a Replay chunk rotates as a prefill chunk does."""
    w = World()
    a, b, c = w.request("a"), w.request("b"), w.request("c")
    for sid, r in enumerate((a, b, c), 1):
        w.resident(r, sid)
    order = lambda: [r.rid for r in w.sched.chunk_order()]      # noqa: E731
    _ran(w, a, 32, P.UnitKind.PREFILL, 1)
    assert order() == ["b", "c", "a"]
    _ran(w, b, 1, P.UnitKind.DECODE, 2)
    assert order() == ["b", "c", "a"], "a one-token unit is no chunk turn"
    _ran(w, b, 32, P.UnitKind.PREFILL, 3, ran=False)
    assert order() == ["b", "c", "a"], "a chunk that did not run keeps its turn"
    _ran(w, b, 2, P.UnitKind.REPLAY, 4)
    assert order() == ["c", "a", "b"]
    _ran(w, c, 32, P.UnitKind.PREFILL, 5)
    assert order() == ["a", "b", "c"]
