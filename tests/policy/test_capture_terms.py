"""A save's admission terms (seed: 新捕获区分候选精确位置自身的重复需求), model-free: the fixed
new-coverage benefit, and the candidate's own repeat demand — which the second request to
compute a position has when its save rides on that very computation (milliseconds, no model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.policy.index import digest
from ninfer.policy.resources import ResourceManager, SavePoint
from tests.policy.fakes import resource_manager


@dataclass
class _Spec:
    session_id: str | None = None
    anchors: list[int] = field(default_factory=list)
    markers: list[int] = field(default_factory=list)
    recovery_frontier: int | None = None


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    spec: _Spec = field(default_factory=_Spec)
    replay_target: int | None = None
    outputs: list = field(default_factory=list)

    @property
    def ledger(self) -> list[int]:
        return self.prompt + self.outputs


def _rm() -> ResourceManager:
    return resource_manager(divergence_min=None)


PROMPT = list(range(1, 41))
END = SavePoint(40, [], [])


def test_a_first_computation_has_no_own_demand():
    rm = _rm()
    benefit, own, _ = rm.capture_terms(_Req("a", PROMPT), END)
    assert benefit == 40 and own is None


def test_the_second_request_computing_a_position_saves_it_with_own_demand():
    """The first request computed the prompt (its save was refused: the cache was full of
    larger cold points); the second computes it again: its save is made only if that unit
    commits, and then two different requests have computed the position — own demand, now."""
    rm = _rm()
    a, b = _Req("a", PROMPT), _Req("b", list(PROMPT))
    rm.observe_prefill(a, 0, 40)
    _, own, _ = rm.capture_terms(b, END)
    assert own is not None
    assert rm.stats.summary_hits == 0          # a query: the settlement that uses it counts it


def test_no_own_demand_from_ones_own_computation_a_replay_or_a_position_already_observed():
    rm = _rm()
    a = _Req("a", PROMPT)
    rm.observe_prefill(a, 0, 40)
    assert rm.capture_terms(a, END)[1] is None                 # the same request again
    rm.books.pop("a")                                          # (its book rebuilt: still itself)
    assert rm.capture_terms(a, END)[1] is None
    b = _Req("b", list(PROMPT), replay_target=45)
    assert rm.capture_terms(b, END)[1] is None                 # a Replay observes nothing
    c = _Req("c", list(PROMPT))
    rm.book(c).observed.add(40)                                # its commit there was counted
    assert rm.capture_terms(c, END)[1] is None
    d = _Req("d", PROMPT[:30] + [99] * 10)                     # another prompt
    assert rm.capture_terms(d, END)[1] is None
    assert rm.summary.get(digest(PROMPT), 40) is not None


def test_the_benefit_is_new_coverage_and_own_demand_is_the_positions_own_time():
    """capture-terms: the benefit is what the save adds over the deepest point below it; a
    position two requests already computed gives the save own repeat demand dated at that
    computation (not at the save); its owner is reuse only when the record is."""
    from ninfer import protocol as P
    from ninfer.policy.records import Level

    rm = _rm()
    below = rm.table.new_record(None)
    rm.table.add_ckpt(P.CkptRef(1, 1, 30, P.CkptKind.CACHE, True, False), tuple(PROMPT[:30]), below.owner(P.Role.E))
    below.e = 1
    d = digest(PROMPT)
    rm.summary.observe(d, 40, "x", 10.0)
    rm.summary.observe(d, 40, "y", 20.0)
    a = _Req("a", PROMPT)
    mine = rm.table.new_record(None)
    rm.book(a).record = mine
    assert rm.capture_terms(a, END) == (10, 20.0, False)
    mine.level = Level.REUSE
    assert rm.capture_terms(a, END)[2] is True
