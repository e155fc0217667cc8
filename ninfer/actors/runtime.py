"""The in-process deployment: worker + EngineCore in one process, the same messages as Ray.

The EngineCore runs on one control thread. Clients hand it work through a queue (requests,
cancellations, engine-wide calls) and are woken by events; the worker's copy thread wakes the
control thread when a transfer completes, so it never spins while waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ninfer import protocol as P
from ninfer.actors.transport import InprocClient
from ninfer.actors.worker import Worker
from ninfer.config import EngineConfig
from ninfer.engine.core import EngineCore
from ninfer.engine.request import RequestSpec
from ninfer.engine.validate import validate_spec
from ninfer.errors import RequestError

log = logging.getLogger("ninfer.runtime")


class InprocRuntime:
    def __init__(self, model_dir: str, config: EngineConfig, sink: Callable[[P.Event], None], hook=None):
        self._wake = threading.Event()
        self._intake: queue.Queue = queue.Queue()
        self._stop = False
        worker = Worker(model_dir, config, hook=hook, notify=self._wake.set)
        self.client = InprocClient(worker)
        self.core = EngineCore(self.client, config, sink)
        self.info = self.core.info
        self._thread = threading.Thread(target=self._loop, name="ninfer-control", daemon=True)
        self._thread.start()

    # ---- client side (any thread) -----------------------------------------------------------
    def submit(self, spec: RequestSpec) -> None:
        validate_spec(spec, self.info)              # bad input fails here, for this request only
        self._put(("submit", spec, None))

    def cancel(self, rid: str) -> None:
        self._put(("cancel", rid, None))

    def call(self, what: str, timeout: float = 120.0):
        fut: Future = Future()
        self._put(("call", what, fut))
        return fut.result(timeout)

    def shutdown(self) -> None:
        if self._stop:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.client.shutdown()

    def _put(self, item) -> None:
        if self._stop:
            raise RequestError("the engine is shut down")
        self._intake.put(item)
        self._wake.set()

    # ---- the control thread -----------------------------------------------------------------
    def _loop(self) -> None:
        import torch
        torch.set_num_threads(1)
        core = self.core
        while not self._stop:
            self._wake.clear()
            self._drain()
            try:
                worked = core.busy() and core.cycle()
            except Exception:                       # never let the control thread die silently
                log.exception("engine cycle failed")
                worked = False
                self._fail_all("internal error in the engine cycle")
            if not worked and not self._stop:
                self._wake.wait(0.05 if core.tx_busy else None)

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
                    self.core.sink(P.FinalEvent(arg.rid, "error", [], {}, {}, [],
                                                {"type": "RequestError", "message": str(exc)}))
            elif kind == "cancel":
                self.core.cancel(arg)
            else:
                self._run_call(arg, fut)

    def _run_call(self, what: str, fut: Future) -> None:
        core = self.core
        try:
            if what == "stats":
                fut.set_result(core.stats_dict())
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
        except Exception as exc:
            fut.set_exception(exc)

    def _settle_idle(self) -> None:
        """Run cycles until nothing is pending (used before leak checks)."""
        core = self.core
        for _ in range(10000):
            if not core.busy():
                return
            if not core.cycle():
                self._wake.wait(0.01)
                self._wake.clear()

    def _fail_all(self, message: str) -> None:
        for req in list(self.core.requests.values()):
            self.core.fail(req, RuntimeError(message))
