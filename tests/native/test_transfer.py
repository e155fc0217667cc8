"""The copy path: a transaction joined while its copies run completes once, after the last; a
copy that raises is a failed completion (the copy thread survives); delivery faults delay,
reorder, duplicate or drop completions by count."""

from __future__ import annotations

import threading

import pytest
import torch

from ninfer.faults import Fault, FaultPlan
from ninfer.native.transfer import TransferEngine


@pytest.fixture(params=["thread", "inline"])
def engine(request):
    e = TransferEngine(torch.device("cpu"), request.param)
    yield e
    e.shutdown()


def _drain_until(e: TransferEngine, n: int) -> list:
    out = []
    for _ in range(200):
        out += e.drain()
        if len(out) >= n:
            return out
        e.wait(0.05)
    return out


def test_joined_transaction_completes_once_after_its_last_copy():
    e = TransferEngine(torch.device("cpu"), "thread")
    gate = threading.Event()
    e.submit(1, 7, gate.wait)                  # a copy still running
    assert e.can_join(1, 7)
    done = []
    e.submit(1, 7, lambda: done.append(1))     # joins
    assert e.drain() == []
    gate.set()
    assert _drain_until(e, 1) == [(1, 7, "")] and done == [1]
    assert not e.can_join(1, 7) and e.finished(1, 7)
    e.shutdown()


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_a_parts_copies_complete_once_with_the_error_of_any(mode):
    """A part's copies are submitted together: one completion after the last, carrying the
    error of the one that failed. Inline copies once completed after the first copy of a part,
    and the second's failure came as another completion for a transaction already published
    (seed 8505 of the prompt-logprob sweep under inline copies: a corrupt Host image read back)."""
    e = TransferEngine(torch.device("cpu"), mode)
    ran = []

    def boom():
        ran.append(2)
        raise RuntimeError("DMA fault")
    e.submit(1, 3, lambda: ran.append(1), boom, lambda: ran.append(3))
    [(tid, gen, err)] = _drain_until(e, 1)
    assert (tid, gen) == (1, 3) and "DMA fault" in err and ran == [1, 2, 3]
    assert e.drain() == [] and e.error_of(1, 3) == err
    e.shutdown()


def test_a_failing_copy_is_a_failed_completion_and_the_thread_survives(engine):
    def boom():
        raise RuntimeError("DMA fault")
    engine.submit(1, 1, boom)
    [(tid, gen, err)] = _drain_until(engine, 1)
    assert (tid, gen) == (1, 1) and "DMA fault" in err
    engine.submit(2, 2, lambda: None)           # the copy path still works
    assert _drain_until(engine, 1) == [(2, 2, "")]


def test_injected_copy_error_fires_by_count():
    e = TransferEngine(torch.device("cpu"), "inline", FaultPlan([Fault(kind="copy_error", skip=1)]))
    for tid in (1, 2, 3):
        e.submit(tid, tid, lambda: None)
    out = e.drain()
    assert [c[0] for c in out] == [1, 2, 3] and [bool(c[2]) for c in out] == [False, True, False]


@pytest.mark.parametrize("kind,expect", [("completion_drop", []), ("completion_duplicate", [1, 1])])
def test_delivery_faults(kind, expect):
    e = TransferEngine(torch.device("cpu"), "inline", FaultPlan([Fault(kind=kind)]))
    e.submit(1, 1, lambda: None)
    assert [c[0] for c in e.drain()] == expect
    assert e.finished(1, 1)                    # a dropped completion's copy did finish


def test_delayed_and_reordered_completions():
    e = TransferEngine(torch.device("cpu"), "inline",
                       FaultPlan([Fault(kind="completion_reorder", steps=5)]))
    e.submit(1, 1, lambda: None)
    assert e.drain() == []                     # held back ...
    e.submit(2, 2, lambda: None)
    assert [c[0] for c in e.drain()] == [2, 1]   # ... and delivered after the newer one
    d = TransferEngine(torch.device("cpu"), "inline", FaultPlan([Fault(kind="completion_delay", steps=3)]))
    d.submit(1, 1, lambda: None)
    assert d.drain() == [] and d.drain() == [] and [c[0] for c in d.drain()] == [1]
