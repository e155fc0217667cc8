"""The engine core's two guards, model-free: the progress guard (``progress-guard``) and the
ingress timeout (``ingress-timeout``), each run on a stand-in for the core that holds only what
the guard reads (no model, no worker, milliseconds). End to end: ``stats.stalls == 0`` in the
oracle sweeps, ``test_scheduling.py::test_ingress_timeout_is_not_restarted_by_a_pause``."""

from __future__ import annotations

import time
from types import SimpleNamespace

from ninfer.engine.core import STALL_CYCLES, EngineCore
from ninfer.errors import ErrorKind
from ninfer.policy.pressure import Pressure
from ninfer.protocol import FinishReason


def _core(*reqs, tx_busy: bool = False):
    core = SimpleNamespace(tx_busy=tx_busy, requests={r.rid: r for r in reqs}, _stuck=0, events=0, failed=[],
                           stats=SimpleNamespace(stalls=0, capacity_errors=0))
    core.sched = SimpleNamespace(event=lambda: setattr(core, "events", core.events + 1))
    core.fail = lambda req, kind, message: core.failed.append((req.rid, kind))
    core.pressure = SimpleNamespace(stalled=Pressure.stalled)        # who fails: the contract's verdict
    return core


def _req(rid: str, ticket: int, live: bool = True):
    return SimpleNamespace(rid=rid, ticket=ticket, live=live)


def guard(core, progressed: bool) -> bool:
    return EngineCore._guard_progress(core, progressed)


def test_a_stall_wakes_every_waiter_once_then_fails_the_oldest_live_request():
    """progress-guard: nothing ran and nothing is in flight — the first such cycle wakes every
    waiter (an event); only after STALL_CYCLES of them in a row the oldest live request fails
    with the capacity contract."""
    core = _core(_req("young", 5), _req("old", 2), _req("gone", 1, live=False))
    assert guard(core, False) is True and core.events == 1 and not core.failed
    for _ in range(STALL_CYCLES - 2):
        assert guard(core, False) is False
    assert not core.failed
    assert guard(core, False) is True
    assert core.failed == [("old", ErrorKind.CAPACITY_CONTRACT)] and core.stats.stalls == 1


def test_progress_or_a_transfer_in_flight_is_no_stall_and_restarts_the_count():
    """progress-guard: a cycle that progressed, or one with a transfer in flight, is no stall and
    starts the count again: stalls that are not consecutive fail nobody."""
    core = _core(_req("a", 1))
    for _ in range(3 * STALL_CYCLES):
        guard(core, False)
        guard(core, True)
    assert not core.failed and core.events == 3 * STALL_CYCLES
    busy = _core(_req("a", 1), tx_busy=True)
    for _ in range(3 * STALL_CYCLES):
        assert guard(busy, False) is False
    assert not busy.failed and busy.events == 0


def _lifecycle(*reqs, timeout: float = 0.3):
    ended = []
    core = SimpleNamespace(cmdq=SimpleNamespace(take=list), config=SimpleNamespace(request_timeout_s=timeout),
                           requests={r.rid: r for r in reqs},
                           _end=lambda req, reason, cmds: ended.append((req.rid, reason)))
    EngineCore._lifecycle(core)
    return ended


def _queued(rid: str, age: float, admitted: bool = False):
    now = time.monotonic()
    return SimpleNamespace(rid=rid, arrival=now - age, first_admitted=now - age / 2 if admitted else None,
                           finish_reason=None, finished_at=None, cancel_requested=False, error=None)


def test_the_ingress_timeout_runs_from_arrival_to_the_first_admission():
    """ingress-timeout: a request not admitted within the timeout of its arrival fails with
    ``timeout``; one admitted in time does not, however long ago it arrived (a later pause does
    not restart the count); one not yet past the timeout waits on."""
    late, admitted, young = _queued("late", 0.5), _queued("admitted", 5.0, admitted=True), _queued("young", 0.1)
    ended = _lifecycle(late, admitted, young)
    assert ended == [("late", FinishReason.ERROR)] and late.error.kind is ErrorKind.TIMEOUT
    assert admitted.finish_reason is None and young.finish_reason is None
    assert _lifecycle(_queued("no_timeout", 99.0), timeout=None) == []
    failed = _queued("failed", 5.0)                        # ended otherwise before its admission
    failed.finish_reason, failed.error = FinishReason.ERROR, "its own error"
    assert _lifecycle(failed) == [("failed", FinishReason.ERROR)] and failed.error == "its own error"
