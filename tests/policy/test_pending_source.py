"""The source cost of waiting for a pending point (issue: shared prefixes computed once): wait
while the producer's remaining prefill to the point is no more than computing the prefix from
one's best complete source; the deepest such point; never a producer waited for in vain."""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer import protocol as P
from ninfer.policy.resources import ResourceManager, SavePoint
from ninfer.sampling_params import SamplingParams
from tests.policy.fakes import resource_manager


@dataclass
class _Spec:
    session_id: str | None = None
    params: SamplingParams = SamplingParams()


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    live: bool = True
    spec: _Spec = field(default_factory=_Spec)
    outputs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)

    @property
    def ledger(self) -> list[int]:
        return self.prompt + self.outputs


def _rm() -> ResourceManager:
    return resource_manager()


def test_wait_only_while_the_producers_remaining_work_is_no_more_than_computing_it():
    rm = _rm()
    x = list(range(1, 601))
    producer = _Req("a", x)
    waiter = _Req("w", x[:500] + [7])
    pts = [SavePoint(300, [], []), SavePoint(600, [], [])]
    assert rm.pending_source(waiter, 0, [(producer, 0, pts)]) == ("a", 300)      # 300 <= 300
    assert rm.pending_source(waiter, 250, [(producer, 0, pts)]) is None          # 300 > 50: compute
    assert rm.pending_source(waiter, 250, [(producer, 260, pts)]) == ("a", 300)  # 40 <= 50
    deeper = _Req("b", x[:500])
    got = rm.pending_source(waiter, 0, [(producer, 0, pts), (deeper, 100, [SavePoint(500, [], [])])])
    assert got == ("b", 500)                                                     # the deepest
    rm.book(waiter).waited.add("b")
    assert rm.pending_source(waiter, 0, [(deeper, 100, [SavePoint(500, [], [])])]) is None
    other = _Req("c", [9] + x[1:])                                               # not its prefix
    assert rm.pending_source(waiter, 0, [(other, 0, pts)]) is None


@dataclass
class _Facts:
    frontier: int


def test_a_wait_ends_when_a_source_as_deep_appears_elsewhere():
    """While the producer is still before the awaited point, a complete point at least as deep
    appears from another request: the wait ends and the request adopts that one."""
    rm = _rm()
    x = list(range(1, 601))
    producer = _Req("a", x)
    producer.facts = _Facts(100)
    rm.book(producer).save_points = [SavePoint(300, [], [])]
    waiter = _Req("w", x[:400] + [7], spec=_Spec())
    rm.wait_pending(waiter, "a", 300, 0)
    assert rm.pending_holds(waiter, producer, resident=True)
    rec = rm.table.new_record(None)
    rm.table.add_ckpt(P.CkptRef(9, 1, 320, P.CkptKind.CACHE, True, False), tuple(x[:320]), rec.owner(P.Role.E))
    rec.e = 9
    assert not rm.pending_holds(waiter, producer, resident=True)
    assert rm.book(waiter).pending is None and rm.book(waiter).pending_base == 0
    assert rm.stats.pending_abandoned == 0


def test_a_request_asking_prompt_logprobs_restores_and_awaits_no_point_it_has_not_computed():
    """vLLM's prompt_logprobs need every prompt position's logits: a fresh request restores no
    point and waits for none; after a pause (a Replay) it may restore up to the positions whose
    entries it holds, anything once it holds them all."""
    rm = _rm()
    x = list(range(1, 601))
    pts = [SavePoint(300, [], [])]
    waiter = _Req("w", x[:500], spec=_Spec(params=SamplingParams(prompt_logprobs=0)))
    assert rm.restore_limit(waiter, 500) == 0
    assert rm.pending_source(waiter, 0, [(_Req("a", x), 0, pts)]) is None
    assert rm.restore_limit(_Req("plain", x[:500]), 500) == 500
    waiter.prompt_logprobs = [None] * 128                    # entries of prompt tokens 1..128
    assert rm.restore_limit(waiter, 200) == 128
    waiter.prompt_logprobs = [None] * 499                    # all of them
    assert rm.restore_limit(waiter, 500) == 500
