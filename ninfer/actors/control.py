"""The controller's control thread, shared by the in-process runtime and the Ray controller
actor: one thread owns the EngineCore; everything else hands it work through a queue.

Supervision of the worker lives here: when a worker call fails because the worker is gone,
every in-flight request ends with a clear error naming the cause, the worker is recreated with
a fresh Program, the now-invalid cache records are dropped, requests that were only queued are
kept, and new requests succeed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ninfer import protocol as P
from ninfer.config import EngineConfig
from ninfer.engine.core import EngineCore
from ninfer.engine.request import Phase
from ninfer.protocol import RequestSpec
from ninfer.errors import NInferError, RequestError

log = logging.getLogger("ninfer.control")


class WorkerLost(NInferError):
    """The GPU worker is gone (killed, crashed, restarting)."""


class ControlLoop:
    def __init__(self, make_client: Callable[[], object], config: EngineConfig,
                 sink: Callable[[P.Event], None], flush: Callable[[], None] | None = None):
        self._make_client = make_client
        self.config = config
        self._sink = sink
        self._flush = flush or (lambda: None)
        self.wake = threading.Event()
        self._intake: queue.Queue = queue.Queue()
        self._stop = False
        self.client = make_client()
        self.core = EngineCore(self.client, config, sink)
        self.info = self.core.info
        self.recoveries = 0
        self._thread = threading.Thread(target=self._loop, name="ninfer-control", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------
    def submit(self, spec: RequestSpec) -> None:
        self._put(("submit", spec, None))

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

    def _put(self, item) -> None:
        if self._stop:
            raise RequestError("the engine is shut down")
        self._intake.put(item)
        self.wake.set()

    # ---- the control thread -------------------------------------------------------------------
    def _loop(self) -> None:
        import torch
        torch.set_num_threads(1)
        while not self._stop:
            self.wake.clear()
            try:
                self._drain()
                worked = self.core.busy() and self.core.cycle()
            except WorkerLost as exc:
                self._recover(str(exc))
                worked = True
            except Exception:                       # never let the control thread die silently
                log.exception("engine cycle failed")
                self._fail_all("internal error in the engine cycle")
                worked = True
            self._flush()
            if not worked and not self._stop:
                self.wake.wait(0.05 if self.core.tx_busy else 1.0)

    def _drain(self) -> None:
        while True:
            try:
                kind, arg, fut = self._intake.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                try:
                    self.core.add(arg)
                except RequestError as exc:
                    self._sink(P.FinalEvent(arg.rid, "error", [], {}, {}, [],
                                            {"type": "RequestError", "message": str(exc)}))
            elif kind == "cancel":
                self.core.cancel(arg)
            else:
                self._run_call(arg, fut)

    def _run_call(self, what: str, fut: Future) -> None:
        core = self.core
        try:
            if what == "stats":
                fut.set_result({**core.stats_dict(), "worker_recoveries": self.recoveries})
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
            self._recover(str(exc))
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
            self.core.fail(req, RuntimeError(message))

    # ---- supervision ------------------------------------------------------------------------
    def _recover(self, cause: str) -> None:
        """The worker is gone: in-flight requests fail clearly, a fresh worker (fresh Program)
        replaces it, cache records die with the old Program, queued requests are kept."""
        self.recoveries += 1
        old = self.core
        log.warning("GPU worker lost (%s); recreating it", cause)
        message = f"the GPU worker failed and was restarted ({cause}); this request was in flight"
        keep = []
        for req in list(old.requests.values()):
            if req.phase is Phase.QUEUED and req.finish_reason is None and not req.cancel_requested:
                keep.append(req.spec)
                continue
            if req.finish_reason is None:
                req.error = {"type": "worker_lost", "message": message}
                req.finish_reason = "error"
            if req.finished_at is None:
                old._finish(req)
        self.client = self._make_client()
        self.core = EngineCore(self.client, self.config, self._sink)
        for spec in keep:
            self.core.add(spec)
