"""The controller's control thread, shared by the in-process runtime and the Ray controller
actor: one thread owns the EngineCore; everything else hands it work through a queue.

Supervision of the worker lives here: when a worker call fails because the worker is gone,
every request that had produced tokens ends with a typed error naming the cause and saying
that a retry is served (``lost_error``), the worker is recreated with a fresh Program (and the
injected faults still left), the now-invalid cache records are dropped, every request that had
produced no token yet is kept and starts again, and new requests succeed.

The ``controller_restart`` fault fires here, once per configured count: ``on_restart`` decides
what a restart is (the Ray actor exits and Ray restarts it; in process, the loop fails every
request with ``controller_lost`` and starts over with a fresh worker and core).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ninfer import protocol as P
from ninfer.actors import collector
from ninfer.actors.transport import WorkerLost, WorkerTimeout
from ninfer.config import EngineConfig
from ninfer.engine.core import EngineCore
from ninfer.errors import ErrorKind, RequestError, lost_error
from ninfer.faults import FaultPlan
from ninfer.frontend.request_stats import Histogram
from ninfer.protocol import FinishReason, RequestSpec

log = logging.getLogger("ninfer.control")

__all__ = ["ControlLoop", "WorkerLost"]


ITERATION_BUCKETS = tuple(2 ** k for k in range(15))     # 1 .. 16384 tokens per step


class ControlLoop:
    def __init__(self, make_client: Callable[..., object], config: EngineConfig,
                 sink: Callable[[P.Event], None], flush: Callable[[], None] | None = None,
                 on_restart: Callable[[], None] | None = None, restarted: bool = False, summary=None):
        self._make_client = make_client
        self.summary = summary           # a replica's RestoreSummary (ninfer/replicas): published per cycle
        self.config = config
        self._sink = sink
        self._flush = flush or (lambda: None)
        self._on_restart = on_restart or self._restart_in_process
        faults = [f for f in config.faults if not (restarted and f.kind == "controller_restart")]
        self.faults = FaultPlan([f for f in faults if f.kind == "controller_restart"])
        self._worker_faults = FaultPlan([f for f in faults if f.kind != "controller_restart"])
        self.wake = threading.Event()
        self._intake: queue.Queue = queue.Queue()
        self._stop = False
        self.client = make_client(self._worker_faults.remaining())
        self.core = EngineCore(self.client, config, sink)
        self._watch_index()
        self.info = self.core.info
        self.recoveries = 0
        self.restarts = 0
        self.resubmitted = 0             # requests without a token kept across a loss
        self.iteration_tokens = Histogram(ITERATION_BUCKETS)
        self._iteration_core, self._iteration_base = None, (0, 0)
        collector.settle_startup()       # the worker (in-process: this one) and the core are built
        self._thread = threading.Thread(target=self._loop, name="ninfer-control", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------
    def submit(self, spec: RequestSpec) -> None:
        self._put(("submit", spec, time.monotonic()))     # the request's ``queued`` moment

    def cancel(self, rid: str) -> None:
        self._put(("cancel", rid, None))

    def call(self, what: str, timeout: float = 300.0):
        fut: Future = Future()
        self._put(("call", what, fut))
        return fut.result(timeout)

    def stop(self) -> None:
        self._stop = True
        self.wake.set()
        self._thread.join(timeout=30)
        collector.release()

    @property
    def stopped(self) -> bool:
        """stop() was called."""
        return self._stop

    def running(self) -> bool:
        """Not stopped, and the control thread is alive."""
        return not self._stop and self._thread.is_alive()

    def _put(self, item) -> None:
        if self._stop:
            raise RequestError("the engine is shut down")
        self._intake.put(item)
        self.wake.set()

    # ---- the control thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            self.wake.clear()
            try:
                self._drain()
                if self.core.busy() and self.faults.fire("controller_restart"):
                    self._on_restart()
                    continue
                worked = self.core.busy() and self.core.cycle()
                if worked:
                    self._count_iteration()
            except WorkerLost as exc:
                self._recover(str(exc), isinstance(exc, WorkerTimeout))
                worked = True
            except Exception:                       # never let the control thread die silently
                log.exception("engine cycle failed")
                self._fail_all("internal error in the engine cycle")
                worked = True
            self._publish()
            self._flush()
            if not worked and not self._stop:
                if not self.wake.is_set():
                    self._idle()
                self.wake.wait(0.05 if self.core.tx_busy else 1.0)

    def _idle(self) -> None:
        """Nothing to do until the next event: the core's idle bookkeeping (``EngineCore.idle``)."""
        try:
            self.core.idle()
        except Exception:
            log.exception("engine idle bookkeeping failed")
            self._fail_all("internal error in the engine's idle bookkeeping")

    def _drain(self) -> None:
        while True:
            try:
                kind, arg, fut = self._intake.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                if arg.rid and arg.rid in self.core.requests:
                    log.info("request %s was submitted again (a resubmission after a loss): kept once", arg.rid)
                    continue
                try:
                    self.core.add(arg, queued_at=fut)
                except RequestError as exc:
                    self._sink(P.FinalEvent(arg.rid, FinishReason.ERROR, [], None, None, [],
                                            P.Failure(ErrorKind.REQUEST_ERROR, str(exc))))
            elif kind == "cancel":
                self.core.cancel(arg)
            else:
                self._run_call(arg, fut)

    def _count_iteration(self) -> None:
        """Tokens the cycle's step computed (prefill, Replay and decode): vLLM's
        ``iteration_tokens_total`` histogram."""
        s = self.core.stats
        now = (s.steps, s.tokens_prefilled + s.tokens_replayed + s.tokens_generated)
        last = self._iteration_base if self._iteration_core is self.core else (0, 0)
        if now[0] > last[0] and now[1] > last[1]:
            self.iteration_tokens.observe(now[1] - last[1])
        self._iteration_core, self._iteration_base = self.core, now

    def _run_call(self, what: str, fut: Future) -> None:
        core = self.core
        try:
            if what == "stats":
                fut.set_result({**core.stats_dict(), "worker_recoveries": self.recoveries,
                                "controller_restarts": self.restarts, "requests_resubmitted": self.resubmitted,
                                "iteration_tokens": self.iteration_tokens.snapshot(),
                                "step_channel": getattr(self.client, "channel_kind", "inproc")})
            elif what == "check_integrity":
                self._settle_idle()
                core.check_integrity()
                fut.set_result(None)
            elif what == "drop_caches":
                self._settle_idle()
                core.drop_caches()
                fut.set_result(None)
            else:
                fut.set_exception(ValueError(f"unknown call {what!r}"))
        except WorkerLost as exc:
            self._recover(str(exc), isinstance(exc, WorkerTimeout))
            fut.set_exception(RequestError(f"the GPU worker was lost: {exc}"))
        except Exception as exc:
            fut.set_exception(exc)

    def _settle_idle(self) -> None:
        """Run cycles until nothing is pending (used before leak checks)."""
        core = self.core
        for _ in range(100000):
            if not core.busy():
                return
            if not core.cycle():
                self.wake.wait(0.01)
                self.wake.clear()

    def _fail_all(self, message: str) -> None:
        for req in list(self.core.requests.values()):
            self.core.fail(req, ErrorKind.RUNTIME_ERROR, message)

    # ---- supervision ------------------------------------------------------------------------
    def _recover(self, cause: str, hung: bool = False) -> None:
        """The worker is gone: requests that had produced tokens fail with ``worker_lost`` (a
        retry hint in the error), a fresh worker (fresh Program, the faults still left) replaces
        it, cache records die with the old Program, and every request that had produced no token
        yet — queued, waiting, or mid-prefill — is kept and starts again on the fresh worker: its
        client has seen nothing, so nothing it saw changes."""
        self.recoveries += 1
        log.warning("GPU worker lost (%s); recreating it", cause)
        message = f"the GPU worker failed and was restarted ({cause}) while this request was generating"
        keep = self._end_all(ErrorKind.WORKER_LOST, message, keep_unstarted=True)
        consumed = dict(self.core.faults_fired)
        kind = "worker_hang" if hung else "worker_death"
        if any(f.kind == kind for f in self._worker_faults.faults):
            consumed[kind] = consumed.get(kind, 0) + 1   # it fired and never reported it
        self._renew(self._worker_faults.remaining(consumed))
        self._carry(keep)

    def _restart_in_process(self) -> None:
        """The in-process twin of a restarted controller actor: requests that had produced
        tokens fail with ``controller_lost`` (as the frontend reports them over Ray), the ones
        that had not start again on a fresh worker and core (as the frontend resubmits them)."""
        self.restarts += 1
        keep = self._end_all(ErrorKind.CONTROLLER_LOST, "the engine controller was restarted while this request "
                                                        "was generating", keep_unstarted=True)
        self._renew(self._worker_faults.remaining(self.core.faults_fired))
        self._carry(keep)

    def _carry(self, keep: list) -> None:
        for req in keep:                 # its arrival and published moments carry over
            self.core.add(req.spec, carry=req)
        self.resubmitted += len(keep)

    def _end_all(self, kind: ErrorKind, message: str, keep_unstarted: bool) -> list:
        old, keep = self.core, []
        for req in list(old.requests.values()):
            if keep_unstarted and req.live and not req.outputs:
                keep.append(req)
                continue
            if req.finish_reason is None:
                req.error = lost_error(kind, message)
                req.finish_reason = FinishReason.ERROR
            if req.finished_at is None:
                old._finish(req)
        return keep

    def _renew(self, faults) -> None:
        try:
            self.client.shutdown()
        except Exception:
            pass
        self._worker_faults = FaultPlan(faults)
        self.client = self._make_client(faults)
        self.core = EngineCore(self.client, self.config, self._sink)
        self._watch_index()

    # ---- a replica's restore summary ----------------------------------------------------------
    def _watch_index(self) -> None:
        """A new core starts with empty caches: so does the summary the router sees."""
        if self.summary is not None:
            self.summary.reset()
            self.core.rm.table.index.observer = self.summary.observe

    def _publish(self) -> None:
        """What changed in the summary this cycle goes out with the cycle's events."""
        if self.summary is not None and (ev := self.summary.take()) is not None:
            self._sink(ev)
