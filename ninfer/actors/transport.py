"""Transports carrying protocol bytes to the worker. Policy never knows which one it is on.

``InprocClient`` calls a Worker in the same process but still encodes and decodes every
message, so the in-process path exercises exactly the bytes that cross Ray. An injected worker
death ends this worker for good, as a killed actor would: every later call reports it lost.
"""

from __future__ import annotations

from ninfer import protocol as P
from ninfer.actors.worker import WorkerDeath
from ninfer.errors import NInferError


class WorkerLost(NInferError):
    """The GPU worker is gone (killed, crashed, restarting)."""


class WorkerTimeout(WorkerLost):
    """The GPU worker did not answer a step within ``step_timeout_s`` (hung): lost as well."""


class InprocClient:
    def __init__(self, worker):
        self.worker = worker
        self.dead: str | None = None
        self.bytes_out = self.bytes_in = 0     # protocol bytes (the periodic engine summary)

    def info(self) -> P.WorkerInfo:
        return P.decode_info(P.encode(self.worker.info()))

    def step(self, plan: P.StepPlan) -> P.StepReply:
        if self.dead is not None:
            raise WorkerLost(self.dead)
        try:
            data = P.encode(plan)
            self.bytes_out += len(data)
            reply = self.worker.handle(data)
            self.bytes_in += len(reply)
            return P.decode_reply(reply)
        except WorkerDeath as exc:
            self.dead = str(exc)
            self.worker.shutdown()
            raise WorkerLost(self.dead) from None

    def wait(self, timeout: float) -> bool:
        return self.worker.wait(timeout)

    def shutdown(self) -> None:
        self.worker.shutdown()
