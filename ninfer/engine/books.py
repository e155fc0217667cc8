"""The controller's books, each with one owner (issue 36, move 2):

    RequestBook    the open requests, their worker sequences and their publication
    TxBook         the context transactions: each one's parts, the running one and its first sight
    CommandQueue   commands decided between cycles, sent first in the next step, each with the
                   typed follow-up that says what its reply means (no closure carries meaning)
    EngineStats    the controller's counters

Planning and settling read these and change none of them (the rule monitor checks it every
cycle); Outcomes (outcomes.py) is their writer while a reply is interpreted, EngineCore at intake
and at a request's end.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from ninfer import protocol as P
from ninfer.engine.events import Lifecycle
from ninfer.engine.request import Request
from ninfer.errors import ErrorKind
from ninfer.protocol import FinishReason


@dataclass
class EngineStats:
    cycles: int = 0
    steps: int = 0
    preemptions: int = 0
    revocations: int = 0
    take_backs: int = 0
    wide_quotes: int = 0          # scoped quotes whose Host window did not suffice (quoted again wider)
    resumes_snapshot: int = 0
    resumes_replay: int = 0
    capacity_errors: int = 0
    copy_failures: int = 0
    device_errors: int = 0
    stalls: int = 0                 # progress guard fired (a policy gap: should stay 0)
    captures_skipped_with_room: int = 0
    cycle_s: float = 0.0            # wall time of cycles that made a round trip
    worker_s: float = 0.0           # of which the worker was busy
    prefill_tokens: int = 0         # of finished requests
    replay_tokens: int = 0
    finished: int = 0
    tokens_prefilled: int = 0       # as units run (the periodic summary's rates)
    tokens_replayed: int = 0
    tokens_generated: int = 0


# A request's phase transitions (controller side), the only ones RequestBook.move makes:
# admitted (bound, its read-back in flight or not), its read-back settled, paused (a lane given
# back), resumed (bound again), ended (from any phase: finished, cancelled, failed).
TRANSITIONS: dict[P.Phase, frozenset[P.Phase]] = {
    P.Phase.QUEUED: frozenset({P.Phase.MATERIALIZING, P.Phase.RUNNING, P.Phase.FINISHED}),
    P.Phase.MATERIALIZING: frozenset({P.Phase.RUNNING, P.Phase.PAUSED, P.Phase.FINISHED}),
    P.Phase.RUNNING: frozenset({P.Phase.PAUSED, P.Phase.FINISHED}),
    P.Phase.PAUSED: frozenset({P.Phase.MATERIALIZING, P.Phase.RUNNING, P.Phase.FINISHED}),
    P.Phase.FINISHED: frozenset(),
}


class PhaseError(RuntimeError):
    """A phase transition the controller's state machine does not have (a programming error)."""


class RequestBook:
    """Open requests by id and by worker sequence, and where their events go; the owner of a
    request's phase transitions (``move``: the only writer of ``req.phase``, checked against
    TRANSITIONS). Invariant: a request is in ``by_sid`` exactly while ``req.sid`` names its
    sequence."""

    def __init__(self, sink: Callable[[P.Event], None]):
        self.requests: dict[str, Request] = {}
        self.by_sid: dict[int, Request] = {}
        self.sink = sink
        self.life = Lifecycle(sink)

    def bind(self, req: Request, sid: int, materializing: bool) -> None:
        """The worker bound ``req`` as sequence ``sid`` (fresh or resumed); it runs at once or
        once its read-back settles."""
        self.move(req, P.Phase.MATERIALIZING if materializing else P.Phase.RUNNING)
        req.sid = sid
        self.by_sid[sid] = req

    @staticmethod
    def move(req: Request, phase: P.Phase) -> None:
        if phase not in TRANSITIONS[req.phase]:
            raise PhaseError(f"request {req.rid}: no transition {req.phase.name} -> {phase.name}")
        req.phase = phase

    def unbind(self, req: Request) -> None:
        """The worker released its sequence."""
        if req.sid is not None:
            self.by_sid.pop(req.sid, None)
        req.sid = None

    def of_sid(self, sid: int) -> Request | None:
        return self.by_sid.get(sid)

    def fail(self, req: Request, kind: ErrorKind, message: str) -> None:
        """Fail one request with a clear error (it alone); its books close next cycle."""
        if req.finish_reason is not None:
            return
        req.error = P.Failure(kind, message)
        req.finish_reason = FinishReason.ERROR

    def close(self, req: Request) -> None:
        self.requests.pop(req.rid, None)
        if req.sid is not None:
            self.by_sid.pop(req.sid, None)


class TxPart(enum.Enum):
    """A part of a context transaction the controller learned of."""

    BIND = "bind"            # a bind's read-back: the request may run once it settles
    PAUSE = "pause"          # a pause snapshot: on the Host once it settles
    CAPTURE = "capture"      # a save's copy
    DEMOTE = "demote"        # a committed demotion's copies
    RELEASE = "release"      # a unit waits for the capacity this transaction's demotions release


class TxBook:
    """Transactions by id: their parts, the running one (from the last reply) and when it was
    first seen running (a completion that never comes is settled after a timeout)."""

    def __init__(self):
        self.parts: dict[int, list[tuple[TxPart, Request | None]]] = {}
        self.running: P.TxRef | None = None
        self.since: float | None = None

    def book(self, tid: int | None, part: TxPart, req: Request | None) -> None:
        if tid is not None:
            self.parts.setdefault(tid, []).append((part, req))

    def settle(self, tid: int) -> list[tuple[TxPart, Request | None]]:
        return self.parts.pop(tid, [])

    def observe(self, tx: P.TxRef | None, now: float) -> None:
        self.running = tx
        if tx is None:
            self.since = None
        elif self.since is None:
            self.since = now

    def overdue(self, now: float, timeout: float) -> bool:
        if self.since is not None and now - self.since > timeout:
            self.since = now
            return True
        return False

    @property
    def busy(self) -> bool:
        return self.running is not None


@dataclass(frozen=True)
class PauseFollow:
    """A Pause command's reply pauses ``req`` (its snapshot's destination after deleting
    ``victims``); ``reason`` as Outcomes.paused says."""

    req: Request
    victims: tuple[P.Delete, ...] = ()
    reason: str = "taken_back"


@dataclass(frozen=True)
class FreezeFollow:
    """A Freeze command's reply: the finished request's generation end becomes its record's E."""

    req: Request


Follow = PauseFollow | FreezeFollow | None


@dataclass
class CommandQueue:
    """Commands decided outside a step (a request's end, a released wait, a capture's owners),
    sent first in the next one."""

    items: list[tuple[P.Command, Follow]] = field(default_factory=list)

    def put(self, cmd: P.Command, follow: Follow = None) -> None:
        self.items.append((cmd, follow))

    def extend(self, cmds) -> None:
        self.items += [(c, None) for c in cmds]

    def take(self) -> list[tuple[P.Command, Follow]]:
        out, self.items = self.items, []
        return out

    def __bool__(self) -> bool:
        return bool(self.items)
