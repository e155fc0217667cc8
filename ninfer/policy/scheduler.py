"""Scheduler: who runs when (seed: Scheduler 行 — 执行成员、fresh 扫描与有限越过、prefill/replay
轮转、抢占和恢复门控).

    fresh queue    FIFO by ticket. A scan checks the head and up to C followers; a blocked
                   request may be overtaken by at most C younger successes; failed checks do
                   not consume the quota; a request that failed under the same event is not
                   re-quoted; scans re-open on queue change, real capacity release, transfer
                   completion or reference revocation — never on ordinary decode.
    paused queue   by original ticket; the oldest tries a full resume on a capacity event.
    residents      at most C lanes; rows are permitted recovery first, then by ticket; one
                   prefill/replay chunk per cycle rotates among residents (recovery first).
"""

from __future__ import annotations

from collections import deque

from ninfer.engine.request import Phase, Request


class Scheduler:
    def __init__(self, max_concurrency: int):
        self.C = max_concurrency
        self.fresh: list[Request] = []          # ticket order (tickets are monotonic)
        self.paused: list[Request] = []         # ticket order
        self.resident: dict[str, Request] = {}
        self.turn: deque[str] = deque()         # prefill/replay rotation
        self.recovery: Request | None = None    # the one full-recovery-permit holder
        self.epoch = 0                          # bumps on every event that re-opens a scan
        self.scan_open = True

    # ---- events ---------------------------------------------------------------------------
    def event(self, causes: frozenset[str] | set[str] = frozenset()) -> None:
        """Queue change, real capacity release, transfer completion or reference revocation.

        ``causes`` are requests whose own content was released: for them it is not a resume
        opportunity (seed: 刚暂停的请求不因自身释放立刻恢复)."""
        self.epoch += 1
        self.scan_open = True
        for req in self.paused:
            if req.rid not in causes:
                req.wake = True

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

    def pause(self, req: Request) -> None:
        self.resident.pop(req.rid, None)
        if req.rid in self.turn:
            self.turn.remove(req.rid)
        if self.recovery is req:
            self.recovery = None
        self.paused.append(req)
        self.paused.sort(key=lambda r: r.ticket)
        self.event(causes={req.rid})           # its own release is not an event for itself
        req.wake = False

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
        self.event()          # a queue change or a real capacity release

    # ---- queries --------------------------------------------------------------------------
    @property
    def lanes_free(self) -> int:
        return self.C - len(self.resident)

    def rows(self) -> list[Request]:
        """Resident requests whose next unit is a Decode/Control row, in permit order."""
        out = [r for r in self.resident.values() if r.phase is Phase.RUNNING and not r.in_prefill]
        return sorted(out, key=lambda r: (r is not self.recovery, r.ticket))

    def chunk_order(self) -> list[Request]:
        """Residents needing a prefill/replay chunk: recovery first, then the rotation."""
        need = {rid for rid, r in self.resident.items() if r.phase is Phase.RUNNING and r.in_prefill}
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

    def fresh_candidates(self) -> list[tuple[Request, int]]:
        """(request, overtaking budget) for this scan: the head and up to C followers, skipping
        requests that already failed under the current event."""
        if not self.scan_open or not self.fresh:
            return []
        out = []
        for req in self.fresh[: 1 + self.C]:
            budget = max(0, self.C - req.overtaken)
            if req.failed_epoch != self.epoch:
                out.append((req, budget))
            if budget == 0:
                break          # it may not be overtaken again: nobody younger is looked at
        return out

    def after_scan(self, tried: list[Request], admitted: set[str]) -> None:
        """Overtaking bookkeeping: a failed request is overtaken by every younger success of
        the same scan; the scan closes until the next event."""
        for i, req in enumerate(tried):
            if req.rid in admitted:
                continue
            req.failed_epoch = self.epoch
            req.overtaken += sum(1 for later in tried[i + 1:] if later.rid in admitted)
        self.scan_open = False

    def older_resident_than(self, req: Request) -> bool:
        return any(r.ticket < req.ticket for r in self.resident.values())

    def oldest_paused(self) -> Request | None:
        return self.paused[0] if self.paused else None

    def victims_for(self, req: Request) -> list[Request]:
        """Residents that may be paused for ``req``'s necessary work: younger, not
        materializing, not terminal, not the recovery holder — youngest first."""
        out = [r for r in self.resident.values()
               if r.ticket > req.ticket and r.phase is Phase.RUNNING and r is not self.recovery
               and r.finish_reason is None and not r.cancel_requested]
        return sorted(out, key=lambda r: -r.ticket)
