"""Transports carrying protocol bytes to the worker. Policy never knows which one it is on.

``InprocClient`` calls a Worker in the same process but still encodes and decodes every
message, so the in-process path exercises exactly the bytes that cross Ray.
"""

from __future__ import annotations

from ninfer import protocol as P


class InprocClient:
    def __init__(self, worker):
        self.worker = worker

    def info(self) -> P.WorkerInfo:
        return P.decode_info(P.encode(self.worker.info()))

    def step(self, plan: P.StepPlan) -> P.StepReply:
        return P.decode_reply(self.worker.handle(P.encode(plan)))

    def wait(self, timeout: float) -> bool:
        return self.worker.wait(timeout)

    def shutdown(self) -> None:
        self.worker.shutdown()
