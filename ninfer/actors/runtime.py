"""The in-process deployment: worker + EngineCore in one process, the same messages as Ray.

The worker's copy thread wakes the control thread when a transfer completes, so it never
spins while waiting.
"""

from __future__ import annotations

from collections.abc import Callable

from ninfer import protocol as P
from ninfer.actors.control import ControlLoop
from ninfer.actors.transport import InprocClient
from ninfer.actors.worker import Worker
from ninfer.config import EngineConfig
from ninfer.protocol import RequestSpec
from ninfer.frontend.intake import Intake


class InprocRuntime:
    client_id = "local"

    def __init__(self, model_dir: str, config: EngineConfig):
        self._workers: list[Worker] = []
        self._target: Callable[[P.Event], None] = lambda ev: None

        def make_client(faults=None) -> InprocClient:
            worker = Worker(model_dir, config, notify=lambda: self.loop.wake.set(), faults=faults)
            self._workers.append(worker)
            return InprocClient(worker)
        self.loop = None
        self.loop = ControlLoop(make_client, config, lambda ev: self._target(ev))
        self.info = self.loop.info
        self.model_dir = model_dir
        self.intake = Intake(model_dir, self.info, config.media_budget_bytes)

    @property
    def core(self):
        return self.loop.core

    def attach(self, sink: Callable[[P.Event], None]) -> None:
        self._target = sink

    def submit(self, spec: RequestSpec) -> None:
        self.loop.submit(self.intake.validate(spec))     # bad input fails here, for it alone

    def submit_chat(self, chat: P.ChatSpec) -> list[int]:
        """Render and submit; returns the prompt's token ids."""
        spec = self.intake.chat(chat)
        self.submit(spec)
        return spec.prompt

    def observe(self, ev: P.Event) -> None:
        self.intake.observe(ev)

    def cancel(self, rid: str) -> None:
        self.loop.cancel(rid)

    def alive(self) -> bool:
        return self.loop.running()

    def call(self, what: str, timeout: float = 300.0):
        out = self.loop.call(what, timeout)
        if what == "stats":
            out["requests"] = self.intake.stats.snapshot()
        return out

    def shutdown(self) -> None:
        if self.loop.stopped:
            return
        self.loop.stop()
        for w in self._workers:
            w.shutdown()
