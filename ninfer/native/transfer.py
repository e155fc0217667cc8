"""Asynchronous copies (D2H, H2D) whose completions arrive later as events.

On CUDA a copy runs on a dedicated stream after the compute stream's current work (the copy
stream waits for compute at submission: a capture reads an image compute has finished writing)
and completes when its event fires. Compute waits for the copy stream only where it reads what
a copy wrote: a restored slot or page is read only after its transaction settled, which happens
once every event of the transaction has fired (``drain`` queries them, then makes the compute
stream wait on them — free by then, but the order stands on the GPU as on the host); a D2H of a
slot that compute keeps writing copies a clone taken in compute order (``Memory.slot_to_host``).
On the CPU ``auto`` is ``inline``: each copy runs at submission and its completion is delivered
at the next progress point — Device and Host are the same memory there, a copy is a memcpy, and a
copy thread only competes with the forward's threads for the cores while every reclaim it
carries costs the waiting request a cycle (the admission retries on the spot once its copies
have landed: ``worker._StepRun._progress_in_admission``; the 300-request trace slice's TTFT mean
56 -> 50 ms against ``thread``). ``thread`` performs the copies on a worker thread, so completion
handling is really asynchronous on the CPU too (tests of the asynchronous paths ask for it).

A transaction may receive further copies while its earlier ones run (the Program's single
context transaction is joined by later captures, pauses and demotions); its completion is
reported once all of its copies have finished. A copy that raises never kills the copy path:
the transaction completes with the error, and the Program aborts it.

Completions are drained as ``(tid, generation, error)``; the Program settles them. Delivery
faults (``ninfer.faults``) sit between "the copies finished" and "the completion is
delivered": delay, reorder, duplicate or drop — the settling side must survive each.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from ninfer.faults import FaultInjected, FaultPlan
from ninfer.native.threads import pin as pin_threads

log = logging.getLogger("ninfer.transfer")

Key = tuple[int, int]                 # (transaction id, generation)
Completion = tuple[int, int, str]     # (transaction id, generation, error; "" = ok)


class _Open:
    __slots__ = ("outstanding", "error", "events")

    def __init__(self) -> None:
        self.outstanding = 0
        self.error = ""
        self.events: list = []


class TransferEngine:
    """Runs copy jobs off the compute path and reports each transaction's completion."""

    def __init__(self, device: torch.device, mode: str = "auto", faults: FaultPlan | None = None):
        self.device = device
        self.faults = faults or FaultPlan()
        if mode == "auto":
            mode = "stream" if device.type == "cuda" else "inline"
        self.mode = mode
        self._open: dict[Key, _Open] = {}
        self._done: list[Completion] = []
        self._finished: dict[Key, str] = {}      # copies really done (delivered or not) -> error
        self._held: list[list] = []             # [completion, points left] (delivery faults)
        self.on_done: Callable[[], None] | None = None   # wakes an idle controller
        self._signal = threading.Event()
        self._lock = threading.Lock()
        if mode == "stream":
            self._stream = torch.cuda.Stream(device)
        elif mode == "thread":
            self._jobs: queue.Queue = queue.Queue()
            self._thread = threading.Thread(target=self._worker, name="ninfer-copies", daemon=True)
            self._thread.start()

    # -- submission ---------------------------------------------------------------------
    def can_join(self, tid: int, generation: int) -> bool:
        """May another copy still join this transaction (its copies have not all finished)?"""
        with self._lock:
            o = self._open.get((tid, generation))
            return o is not None and (o.outstanding > 0 or bool(o.events))

    def submit(self, tid: int, generation: int, *jobs: Callable[[], None]) -> None:
        """Submit a part's copies together: all of them are counted before the first runs, so the
        transaction cannot complete — and publish what a later copy has not written, or lose that
        copy's error — between two of them (``inline`` ran each at submission, and a quick copy
        thread could finish the first before the second was queued: the completion came after
        the first copy, and the failure of the second named a transaction already published)."""
        if not jobs:
            return                             # a part without copies: nothing to complete
        key = (tid, generation)
        with self._lock:
            o = self._open.setdefault(key, _Open())
            o.outstanding += len(jobs)
        for job in jobs:
            if self.mode == "thread":
                self._jobs.put((key, job))
            elif self.mode == "inline":
                self._finish_job(key, self._run(job))
            else:
                error = ""
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    error = self._run(job)
                    ev = torch.cuda.Event()
                    ev.record(self._stream)
                with self._lock:
                    o.events.append(ev)
                self._finish_job(key, error)       # enqueued: done when its events fire (drain)

    def _run(self, job: Callable[[], None]) -> str:
        try:
            if self.faults.fire("copy_error"):
                raise FaultInjected("injected copy error")
            job()
            return ""
        except Exception as exc:      # a failed copy is a failed completion, never a dead thread
            log.warning("copy failed: %s", exc)
            return f"{type(exc).__name__}: {exc}"

    def _worker(self) -> None:
        pin_threads(1)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            key, job = item
            self._finish_job(key, self._run(job))

    def _finish_job(self, key: Key, error: str) -> None:
        with self._lock:
            o = self._open[key]
            o.outstanding -= 1
            o.error = o.error or error
            if o.outstanding or o.events:
                return
            del self._open[key]
            self._done.append((*key, o.error))
            self._finished[key] = o.error
        self._signal.set()
        if self.on_done is not None:
            self.on_done()

    # -- completion ---------------------------------------------------------------------
    def drain(self) -> list[Completion]:
        """Completions ready now (after the delivery faults); never blocks."""
        if self.mode == "stream":
            with self._lock:
                for key, o in list(self._open.items()):
                    if not o.outstanding and o.events and all(ev.query() for ev in o.events):
                        compute = torch.cuda.current_stream(self.device)
                        for ev in o.events:       # done already; the order is explicit on the GPU too
                            compute.wait_event(ev)
                        del self._open[key]
                        self._done.append((*key, o.error))
                        self._finished[key] = o.error
        with self._lock:
            fresh, self._done = self._done, []
            self._signal.clear()
        return self._deliver(fresh)

    def _deliver(self, fresh: list[Completion]) -> list[Completion]:
        out: list[Completion] = []
        for c in fresh:
            if self.faults.fire("completion_drop"):
                continue
            f = self.faults.fire("completion_delay") or self.faults.fire("completion_reorder")
            if f is not None:
                self._held.append([c, f.steps, f.kind == "completion_reorder"])
                continue
            out.append(c)
            if self.faults.fire("completion_duplicate"):
                out.append(c)
        due, held = [], []
        for c, left, reorder in self._held:
            if left <= 1 or (reorder and out):
                due.append(c)
            else:
                held.append([c, left - 1, reorder])
        self._held = held
        return out + due            # a reordered completion comes after the newer ones

    def wait(self, timeout: float) -> bool:
        """Block until a copy finishes or ``timeout`` passes (no spinning). With no copy running
        there is nothing to wait for: a completion held back by a delivery fault comes at a later
        progress point, not after a while (it returned after the whole timeout before — seconds
        per held completion in the fault tests)."""
        if self.mode == "stream":
            events = [ev for o in self._open.values() for ev in o.events]
            if events:
                events[-1].synchronize()
            return bool(events)
        with self._lock:
            if not self._open:
                return bool(self._done)
        return self._signal.wait(timeout)

    def finished(self, tid: int, generation: int) -> bool:
        """Did this transaction's copies really finish (whether or not its completion was
        delivered)? Lets the settling side recover from a dropped completion."""
        with self._lock:
            return (tid, generation) in self._finished

    def error_of(self, tid: int, generation: int) -> str:
        with self._lock:
            return self._finished.get((tid, generation), "")

    def forget(self, tid: int, generation: int) -> None:
        with self._lock:
            self._finished.pop((tid, generation), None)

    @property
    def busy(self) -> bool:
        """Copies still running."""
        with self._lock:
            return bool(self._open)

    @property
    def pending(self) -> bool:
        """Anything not yet delivered: copies running, completions waiting or held back."""
        with self._lock:
            return bool(self._open) or bool(self._done) or bool(self._held)

    def shutdown(self) -> None:
        if self.mode == "thread":
            self._jobs.put(None)
            self._thread.join(timeout=5)
