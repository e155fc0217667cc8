"""Scheduler rules that have no direct outside effect of their own, on plain request views."""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.policy.scheduler import Scheduler
from ninfer.protocol import Guard, Phase, RequestSpec, SeqFacts


@dataclass(eq=False)
class R:
    rid: str
    ticket: int
    phase: Phase = Phase.RUNNING
    sid: int | None = None
    facts: SeqFacts | None = field(default_factory=lambda: SeqFacts(10, 11, 1, True, 0))
    spec: RequestSpec = field(default_factory=lambda: RequestSpec(prompt=[1]))
    outputs: list = field(default_factory=list)
    snapshot: object = None
    replay_target: int | None = None
    recovery_pending: bool = False
    awaiting_release: set = field(default_factory=set)
    finish_reason: object = None
    cancel_requested: bool = False

    @property
    def live(self) -> bool:
        return self.finish_reason is None and not self.cancel_requested


def _sched(*reqs) -> Scheduler:
    s = Scheduler(4)
    for r in reqs:
        s.admit(r)
    return s


def test_materializing_finished_and_permit_holder_are_never_victims():
    old, binding, holder, done, young = R("o", 0), R("b", 1, Phase.MATERIALIZING), R("h", 2), R("d", 3), R("y", 4)
    done.finish_reason = "stop"
    s = _sched(old, binding, holder, done, young)
    s.begin_recovery(holder)
    assert s.victims_for(old) == [young]


def test_victims_are_younger_and_youngest_first():
    a, b, c = R("a", 0), R("b", 1), R("c", 2)
    s = _sched(a, b, c)
    assert s.victims_for(a) == [c, b] and s.victims_for(c) == []


def test_a_just_paused_request_is_not_woken_by_its_own_release():
    a, b = R("a", 0), R("b", 1)
    s = _sched(a, b)
    s.pause(b)
    assert not s.st(b).wake and s.resume_candidate() is None
    s.event(causes={"b"})                         # its own snapshot copy publishing
    assert s.resume_candidate() is None
    s.remove(a)                                   # a real capacity event
    assert s.resume_candidate() is b


def test_returned_recovery_balance_is_a_capacity_event():
    a, b = R("a", 0), R("b", 1)
    s = _sched(a, b)
    s.pause(b)
    s.begin_recovery(a)
    s.end_recovery(a)
    assert s.st(b).wake and s.recovery is None


def test_oldest_paused_takes_back_only_without_an_older_resident():
    a, b, c = R("a", 0), R("b", 1), R("c", 2)
    s = _sched(a, b, c)
    s.pause(b)
    assert not s.may_take_back(b)                 # a is older and resident
    s.remove(a)
    assert s.may_take_back(b)


def test_fresh_guards_state_the_lane_and_overtaking_bounds():
    g = Scheduler.fresh_guards([1, 2, 3], [4, 0, 4], lanes=2)
    assert g[0] == [Guard((), (), 2)]
    assert g[2] == [Guard((), (1, 2), 2), Guard((1,), (2,), 4), Guard((2,), (), 0)]


def test_rows_are_permitted_recovery_holder_first_then_by_ticket():
    """Permit order. (From outside its effect is masked: an older row short of a page takes it
    back from a younger one in the same step — so the order itself is pinned here.)"""
    a, b, c = R("a", 0), R("b", 1), R("c", 2)
    s = _sched(c, a, b)
    assert s.rows() == [a, b, c]
    s.begin_recovery(c)
    assert s.rows() == [c, a, b]


def _prefill(rid: str, ticket: int) -> R:
    """A resident with input left to compute (it needs prefill/replay chunks)."""
    return R(rid, ticket, facts=SeqFacts(2, 11, 1, True, 0))


def test_the_chunk_turn_goes_to_the_recovery_holder_first_then_by_rotation():
    """chunk-order: the rotation is the order residents were admitted and ran their chunks (not
    the ticket); the full-recovery holder jumps to the front of it."""
    a, b, c, d = _prefill("a", 0), _prefill("b", 1), _prefill("c", 2), R("d", 3)
    s = _sched(b, a, c, d)                        # d decodes: it needs no chunk
    assert s.chunk_order() == [b, a, c]
    s.rotate(b)
    assert s.chunk_order() == [a, c, b]
    s.begin_recovery(c)
    assert s.chunk_order() == [c, a, b]
    s.rotate(a)
    assert s.chunk_order() == [c, b, a]


def test_only_younger_successes_overtake_and_the_count_accumulates_across_scans():
    """overtaking-count / fresh-scan / no-requote-same-event: a blocked request counts every
    younger success of every scan it failed in; overtaken C times it ends the scan, and a request
    failed under the current event is not quoted again."""
    s = Scheduler(3)
    a, b, c, d, e, f, g = (R(x, i, phase=Phase.QUEUED) for i, x in enumerate("abcdefg"))
    for r in (a, b, c, d, e, f, g):
        s.enqueue(r)

    def scan(admit: set[str]) -> list[tuple[str, int]]:
        cands = s.fresh_candidates()
        for r, _ in cands:
            if r.rid in admit:
                s.admit(r)
        s.after_scan([r for r, _ in cands], admit)
        return [(r.rid, budget) for r, budget in cands]

    def candidates() -> list[tuple[str, int]]:
        return [(r.rid, budget) for r, budget in s.fresh_candidates()]

    assert scan({"b", "d"}) == [("a", 3), ("b", 3), ("c", 3), ("d", 3)]
    assert (s.st(a).overtaken, s.st(c).overtaken) == (2, 1)     # two younger successes for a, one for c
    # a and c failed under this event: not quoted again (e and f moved up into the window)
    assert candidates() == [("e", 3), ("f", 3)]
    s.event()
    assert scan({"e"}) == [("a", 1), ("c", 2), ("e", 3), ("f", 3)]
    assert (s.st(a).overtaken, s.st(c).overtaken, s.st(f).overtaken) == (3, 2, 0)
    assert candidates() == []                     # a failed now and may not be overtaken again
    s.event()
    assert candidates() == [("a", 0)]             # its budget is spent: nobody behind it is looked at


def test_the_oldest_paused_resumes_only_after_a_real_event_while_live_and_nobody_holds_the_permit():
    """resume-candidate: the oldest paused, woken by an event it did not cause, live, and only
    while no request holds the full recovery permit."""
    a, b, c = R("a", 0), R("b", 1), R("c", 2)
    s = _sched(a, b, c)
    s.pause(c)
    s.pause(b)                                    # b's release is an event for c, not for b
    assert s.resume_candidate() is None           # b is the oldest paused and saw no event
    s.event()
    assert s.resume_candidate() is b
    s.begin_recovery(a)
    assert s.resume_candidate() is None           # a holds the full recovery permit
    s.end_recovery(a)
    assert s.resume_candidate() is b
    b.cancel_requested = True
    assert s.resume_candidate() is None           # not c: c is not the oldest paused


def test_only_the_oldest_paused_may_take_back():
    """take-back-gate with two paused requests and no older resident."""
    a, b, c, d = R("a", 0), R("b", 1), R("c", 2), R("d", 3)
    s = _sched(a, b, c, d)
    s.pause(c)
    s.pause(b)
    s.remove(a)
    assert s.may_take_back(b) and not s.may_take_back(c) and not s.may_take_back(d)


def test_a_cancelled_request_is_not_scanned():
    """fresh-scan: a request cancelled while queued is no candidate (it leaves at the next
    lifecycle step); the live ones around it are."""
    s = Scheduler(2)
    a, b, c = (R(x, i, phase=Phase.QUEUED) for i, x in enumerate("abc"))
    for r in (a, b, c):
        s.enqueue(r)
    a.cancel_requested = True
    assert [r.rid for r, _ in s.fresh_candidates()] == ["b", "c"]
