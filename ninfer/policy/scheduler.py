"""Scheduler: who runs when (seed: Scheduler 行 — 执行成员、fresh 扫描与有限越过、prefill/replay
轮转、抢占和恢复门控). It owns these rules and nothing else does:

    permit order   rows are permitted recovery holder first, then by original ticket
    fresh queue    FIFO by ticket. A scan checks the head and up to C followers; a blocked
                   request may be overtaken by at most C younger successes; failed checks do
                   not consume the quota; a request that failed under the same event is not
                   re-quoted, nor one whose bind waits for its reclaim's copies (until they
                   settle: wait-for-release); scans re-open on queue change, real capacity
                   release, transfer completion or reference revocation — never on ordinary
                   decode. The lane and
                   overtaking bounds travel to the worker as guards (``fresh_guards``).
    paused queue   by original ticket; the oldest tries a full resume on a real capacity event
                   that it did not cause itself; with an older resident present it may only use
                   free and optional-cache space; with none it takes back the lane and capacity
                   of the youngest preemptable resident
    residents      at most C lanes; one prefill/replay chunk per cycle rotates among residents
                   (recovery first)
    victims        younger residents that are running (not materializing, not terminal, not
                   the full-recovery-permit holder), youngest first
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from ninfer.policy.view import RequestView as Request
from ninfer.protocol import Guard, Phase


@dataclass
class SchedState:
    """What the Scheduler keeps per request (its own table)."""

    overtaken: int = 0          # younger successes that overtook it while it was blocked
    failed_epoch: int = -1      # the event under which its last admission check failed
    wake: bool = False          # a paused request saw a capacity event not caused by itself
    pending: bool = False       # a fresh request waiting for another's pending save: not scanned


class Scheduler:
    def __init__(self, max_concurrency: int):
        self.C = max_concurrency
        self.fresh: list[Request] = []          # ticket order (tickets are monotonic)
        self.paused: list[Request] = []         # ticket order
        self.resident: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}   # fresh requests waiting for a pending save
        self.turn: deque[str] = deque()         # prefill/replay rotation
        self.recovery: Request | None = None    # the one full-recovery-permit holder
        self.state: dict[str, SchedState] = {}
        self.epoch = 0                          # bumps on every event that re-opens a scan
        # the last scan as it was decided (the rule monitor restates the scan rule over it):
        # (the fresh queue as seen — request, waiting, failed epoch, overtaken —, the epoch, the result)
        self.last_scan: tuple[list[tuple[Request, bool, int, int]], int, list[Request]] | None = None

    def st(self, req: Request) -> SchedState:
        s = self.state.get(req.rid)
        if s is None:
            s = self.state[req.rid] = SchedState()
        return s

    # ---- events ---------------------------------------------------------------------------
    def event(self, causes: frozenset[str] | set[str] = frozenset()) -> None:
        """Queue change, real capacity release, transfer completion or reference revocation.

        ``causes`` are requests whose own content was released: for them it is not a resume
        opportunity (seed: 刚暂停的请求不因自身释放立刻恢复)."""
        self.epoch += 1
        for req in self.paused:
            # rule: own-release-no-wake
            if req.rid not in causes:
                self.st(req).wake = True

    # ---- membership -----------------------------------------------------------------------
    def enqueue(self, req: Request) -> None:
        self.fresh.append(req)
        self.event()

    def admit(self, req: Request) -> None:
        """A bind succeeded: the request holds a lane."""
        if req in self.fresh:
            self.fresh.remove(req)
        if req in self.paused:
            self.paused.remove(req)
        self.resident[req.rid] = req
        if req.rid not in self.turn:
            self.turn.append(req.rid)

    def begin_recovery(self, req: Request) -> None:
        self.recovery = req

    def end_recovery(self, req: Request) -> None:
        """Its permit balance returns: a capacity event for everyone else."""
        if self.recovery is req:
            self.recovery = None
        self.event(causes={req.rid})

    def pause(self, req: Request) -> None:
        self.resident.pop(req.rid, None)
        if req.rid in self.turn:
            self.turn.remove(req.rid)
        if self.recovery is req:
            self.recovery = None
        self.paused.append(req)
        self.paused.sort(key=lambda r: r.ticket)
        self.event(causes={req.rid})           # its own release is not an event for itself
        self.st(req).wake = False

    def remove(self, req: Request) -> None:
        """Terminal (finished, cancelled, failed): leaves every queue."""
        for q in (self.fresh, self.paused):
            if req in q:
                q.remove(req)
        self.resident.pop(req.rid, None)
        if req.rid in self.turn:
            self.turn.remove(req.rid)
        if self.recovery is req:
            self.recovery = None
        self.state.pop(req.rid, None)
        self.waiting.pop(req.rid, None)
        self.event()          # a queue change or a real capacity release

    # ---- queries --------------------------------------------------------------------------
    @property
    def lanes_free(self) -> int:
        return self.C - len(self.resident)

    def rows(self) -> list[Request]:
        """Running residents whose next unit is a Decode/Control row, in permit order."""
        out = [r for r in self.resident.values()
               if r.phase is Phase.RUNNING and r.live and not _in_prefill(r) and not _awaits_release(r)]
        # rule: permit-order
        return sorted(out, key=lambda r: (r is not self.recovery, r.ticket))

    def chunk_order(self) -> list[Request]:
        """Residents needing a prefill/replay chunk: recovery first, then the rotation."""
        need = {rid for rid, r in self.resident.items()
                if r.phase is Phase.RUNNING and r.live and _in_prefill(r) and not _awaits_release(r)}
        # rule: chunk-order
        order = [self.resident[rid] for rid in self.turn if rid in need]
        if self.recovery is not None and self.recovery in order:
            order.remove(self.recovery)
            order.insert(0, self.recovery)
        return order

    def rotate(self, req: Request) -> None:
        """The chunk ran: its owner goes to the back of the rotation."""
        if req.rid in self.turn:
            self.turn.remove(req.rid)
            self.turn.append(req.rid)

    def wait_pending(self, req: Request, on: bool) -> None:
        """A fresh request starts (or stops) waiting for another's pending save: while it waits
        it is not scanned; when it stops it is tried at once."""
        self.st(req).pending = on
        if on:
            self.waiting[req.rid] = req
        else:
            self.waiting.pop(req.rid, None)
            self.st(req).failed_epoch = -1

    def fresh_candidates(self) -> list[tuple[Request, int]]:
        """(request, remaining overtaking budget) for this scan: the head and up to C
        followers, skipping requests that already failed under the current event. A request
        waiting for another's pending save is not looked at (it holds nothing and blocks
        nobody; its own place is kept)."""
        if not self.fresh:
            return []
        seen = [(r, self.st(r).pending, self.st(r).failed_epoch, self.st(r).overtaken) for r in self.fresh]
        out = []
        # rule: fresh-scan
        for req in itertools.islice((r for r in self.fresh if not self.st(r).pending), 1 + self.C):
            if not req.live:
                continue
            budget = max(0, self.C - self.st(req).overtaken)
            # rule: no-requote-same-event
            # (one whose bind came back WAIT is not quoted again until its copies settle:
            # wait-for-release — it keeps its place, like a failed check)
            if self.st(req).failed_epoch != self.epoch and not _awaits_release(req):
                out.append((req, budget))
            if budget == 0:
                break          # it may not be overtaken again: nobody younger is looked at
        self.last_scan = (seen, self.epoch, [r for r, _ in out])
        return out

    @staticmethod
    def fresh_guards(iids: list[int], budgets: list[int], lanes: int) -> list[list[Guard]]:
        """The scan's bounds as guards on each fresh bind: at most ``lanes`` successes in all,
        and a blocked candidate j is overtaken by at most its budget of younger successes."""
        out = []
        for k in range(len(iids)):
            # rule: lane-bound
            guards = [Guard((), tuple(iids[:k]), lanes)]
            for j in range(k):
                between = tuple(iids[j + 1:k])
                # rule: overtaking-bound
                guards.append(Guard((iids[j],), between, budgets[j]))
            out.append(guards)
        return out

    def after_scan(self, tried: list[Request], admitted: set[str]) -> None:
        """Overtaking bookkeeping: a failed request is overtaken by every younger success of
        the same scan; a failed one is not quoted again until the next event."""
        for i, req in enumerate(tried):
            if req.rid in admitted:
                continue
            st = self.st(req)
            st.failed_epoch = self.epoch
            # rule: overtaking-count
            st.overtaken += sum(1 for later in tried[i + 1:] if later.rid in admitted)

    def older_resident_than(self, req: Request) -> bool:
        return any(r.ticket < req.ticket for r in self.resident.values())

    def resume_candidate(self) -> Request | None:
        """The oldest paused request, when it saw a real capacity event not caused by itself
        and nobody holds the full recovery permit."""
        # rule: resume-candidate
        if not self.paused or self.recovery is not None:
            return None
        req = self.paused[0]
        return req if self.st(req).wake and req.live else None

    def may_take_back(self, req: Request) -> bool:
        """The oldest paused request with no older resident takes back lanes and capacity from
        younger residents; with an older resident present it only uses free and optional space
        (it never pauses young borrowers just to probe)."""
        # rule: take-back-gate
        return bool(self.paused) and self.paused[0] is req and not self.older_resident_than(req)

    def victims_for(self, req: Request) -> list[Request]:
        """Residents that may be paused for ``req``'s necessary work: younger, running (not
        materializing), not terminal, not the recovery holder — youngest first."""
        # rule: victims
        out = [r for r in self.resident.values()
               if r.ticket > req.ticket and r.phase is Phase.RUNNING and r is not self.recovery and r.live]
        return sorted(out, key=lambda r: -r.ticket)


def _in_prefill(req: Request) -> bool:
    """Input remains to compute (initial prefill or Replay)."""
    f = req.facts
    return f is not None and f.frontier < f.ledger_len - 1


# rule: wait-for-release
def _awaits_release(req: Request) -> bool:
    """Its unit's permit came back WAIT: the reclaim committed for it frees the capacity once
    its copies publish. Until that transaction settles the unit is not planned again — the
    real gap is asked once the copies complete (seed: 完成后重新查询真实缺口), never by quoting
    and reclaiming for the same gap every cycle meanwhile (未完成的异步事件不自旋等待)."""
    return bool(req.awaiting_release)
