"""Public fault injection (API.md: ``EngineConfig(faults=...)``): faults by name and count, at
the actor boundary and in the copy and compute paths, usable with both transports.

    EngineConfig(faults=[{"kind": "copy_error"},                       # the first copy fails
                         {"kind": "completion_delay", "steps": 4, "count": 0},   # every one
                         {"kind": "worker_death", "point": "mid_transaction"}])

Each fault lets ``skip`` opportunities pass, then fires ``count`` times (0 = every time).

    kind                   opportunity              effect
    copy_error             a copy job runs          the job raises: its transaction aborts
    forward_error          a forward call           the call raises: its rows' requests fail
    completion_delay       a completion             delivered ``steps`` progress points late
    completion_drop        a completion             never delivered (the controller's
                                                    overdue timeout settles the transaction)
    completion_duplicate   a completion             delivered twice
    completion_reorder     a completion             held back and delivered after the next
                                                    one (or ``steps`` points late)
    worker_death           a step at ``point``      the worker process dies (before_execute |
                                                    mid_transaction | after_execute)
    worker_hang            a step at ``point``      the worker stops answering for ``seconds``
                                                    (over Ray, past ``step_timeout_s`` the
                                                    controller treats it as lost and replaces it)
    controller_restart     a controller cycle       the controller restarts (once)

Faults fire where they are configured: the worker owns the copy, compute, completion and
death faults; the controller owns its restart. A recreated worker gets the faults still left.
"""

from __future__ import annotations

import threading

import msgspec

KINDS = ("copy_error", "forward_error", "completion_delay", "completion_drop", "completion_duplicate",
         "completion_reorder", "worker_death", "worker_hang", "controller_restart")
POINTS = ("before_execute", "mid_transaction", "after_execute")


class FaultInjected(RuntimeError):
    """Raised where an injected copy or forward fault fires."""


class Fault(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    kind: str
    count: int = 1
    skip: int = 0
    point: str | None = None
    steps: int = 3
    seconds: float = 30.0            # worker_hang: how long the worker stops answering

    def __post_init__(self) -> None:
        from ninfer.errors import ConfigError
        if self.kind not in KINDS:
            raise ConfigError(f"faults: kind={self.kind!r} is not one of {', '.join(KINDS)}")
        if self.count < 0 or self.skip < 0 or self.steps < 1:
            raise ConfigError(f"faults: {self.kind}: count >= 0, skip >= 0 and steps >= 1 are required")
        if self.kind in ("worker_death", "worker_hang") and self.point not in POINTS:
            raise ConfigError(f"faults: {self.kind} needs point= one of {', '.join(POINTS)}")
        if self.seconds < 0:
            raise ConfigError(f"faults: {self.kind}: seconds >= 0 is required")


class FaultPlan:
    """The live counters of a list of faults (thread-safe: the copy thread consults it)."""

    def __init__(self, faults: list[Fault] | tuple[Fault, ...] = ()):
        self.faults = list(faults)
        self._seen = [0] * len(self.faults)
        self._fired = [0] * len(self.faults)
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.faults)

    def fire(self, kind: str, point: str | None = None) -> Fault | None:
        """One opportunity for ``kind`` (at ``point``): the fault that fires, or None."""
        if not self.faults:
            return None
        with self._lock:
            for i, f in enumerate(self.faults):
                if f.kind != kind or (point is not None and f.point != point):
                    continue
                self._seen[i] += 1
                if self._seen[i] <= f.skip or (f.count and self._fired[i] >= f.count):
                    continue
                self._fired[i] += 1
                return f
        return None

    def fired(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for f, n in zip(self.faults, self._fired):
                if n:
                    out[f.kind] = out.get(f.kind, 0) + n
            return out

    def remaining(self, consumed: dict[str, int] | None = None) -> list[Fault]:
        """The faults still to fire, after ``consumed`` more firings by kind (a worker that died
        could not report its last ones)."""
        extra = dict(consumed or {})
        out = []
        with self._lock:
            for f, seen, fired in zip(self.faults, self._seen, self._fired):
                take = min(extra.get(f.kind, 0), f.count - fired) if f.count else 0
                extra[f.kind] = extra.get(f.kind, 0) - take
                fired += take
                if f.count and fired >= f.count:
                    continue
                out.append(msgspec.structs.replace(
                    f, count=f.count - fired if f.count else 0, skip=max(0, f.skip - seen)))
        return out
