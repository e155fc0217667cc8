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
