"""Asynchronous copies (D2H, H2D) whose completions arrive later as events.

On CUDA a copy runs on a dedicated stream after the compute stream's current work and
completes when its event fires. On the CPU a worker thread performs the copies, so completion
handling is really asynchronous there too. Completions are drained as ``(tid, generation)``
pairs; the Program (and, across the process boundary, the controller) settles them.

A test hook (``FaultHook``) sits between "the copy finished" and "the completion is delivered":
it can delay, reorder, duplicate or drop completions, which the settling side must survive
(generation checks; timeouts).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Completion = tuple[int, int]   # (transaction id, generation)


@dataclass
class FaultHook:
    """Scripted delivery faults for tests (all off by default).

    delay:      hold every completion for this many drains before delivering it
    drop:       transaction ids whose completion is never delivered (drop_all: every one)
    duplicate:  deliver every completion twice
    reverse:    deliver each drained batch in reverse order
    """

    delay: int = 0
    drop: set[int] = field(default_factory=set)
    drop_all: bool = False
    duplicate: bool = False
    reverse: bool = False
    _held: list[list] = field(default_factory=list)

    def apply(self, fresh: list[Completion]) -> list[Completion]:
        self._held.extend([c, self.delay] for c in fresh if not self.drop_all and c[0] not in self.drop)
        out = [c for c, wait in self._held if wait <= 0]
        self._held = [[c, wait - 1] for c, wait in self._held if wait > 0]
        if self.reverse:
            out.reverse()
        if self.duplicate:
            out = [c for c in out for _ in range(2)]
        return out


class TransferEngine:
    """Runs copy jobs off the compute path and reports their completion."""

    def __init__(self, device: torch.device, hook: FaultHook | None = None):
        self.device = device
        self.hook = hook or FaultHook()
        self._done: deque[Completion] = deque()
        self._finished: set[Completion] = set()     # copies really done, delivered or not
        self.on_done: Callable[[], None] | None = None   # wakes an idle controller
        self._signal = threading.Event()
        self._inflight = 0
        self._lock = threading.Lock()
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._pending: list[tuple[Completion, torch.cuda.Event]] = []
        else:
            self._jobs: queue.Queue = queue.Queue()
            self._thread = threading.Thread(target=self._worker, name="ninfer-copies", daemon=True)
            self._thread.start()

    # -- submission ---------------------------------------------------------------------
    def submit(self, tid: int, generation: int, job: Callable[[], None]) -> None:
        with self._lock:
            self._inflight += 1
        if self.device.type == "cuda":
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                job()
                ev = torch.cuda.Event()
                ev.record(self._stream)
            self._pending.append(((tid, generation), ev))
        else:
            self._jobs.put(((tid, generation), job))

    def _worker(self) -> None:
        torch.set_num_threads(1)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            done, job = item
            job()
            self._finish(done)

    def _finish(self, done: Completion) -> None:
        with self._lock:
            self._inflight -= 1
            self._done.append(done)
            self._finished.add(done)
        self._signal.set()
        if self.on_done is not None:
            self.on_done()

    # -- completion ---------------------------------------------------------------------
    def drain(self) -> list[Completion]:
        """Completions ready now (after the fault hook); never blocks."""
        if self.device.type == "cuda":
            still = []
            for done, ev in self._pending:
                if ev.query():
                    self._finish(done)
                else:
                    still.append((done, ev))
            self._pending = still
        with self._lock:
            fresh = list(self._done)
            self._done.clear()
            self._signal.clear()
        return self.hook.apply(fresh)

    def wait(self, timeout: float) -> bool:
        """Block until a copy finishes or ``timeout`` passes (no spinning)."""
        if self.device.type == "cuda":
            deadline_ev = [ev for _, ev in self._pending]
            if deadline_ev:
                deadline_ev[0].synchronize()
            return bool(deadline_ev)
        return self._signal.wait(timeout)

    def finished(self, done: Completion) -> bool:
        """Did this copy really finish (whether or not its completion was delivered)? Lets the
        settling side recover from a dropped completion after a timeout."""
        with self._lock:
            return done in self._finished

    def forget(self, done: Completion) -> None:
        with self._lock:
            self._finished.discard(done)

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def shutdown(self) -> None:
        if self.device.type != "cuda":
            self._jobs.put(None)
            self._thread.join(timeout=5)
