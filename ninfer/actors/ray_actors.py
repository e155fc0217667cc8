"""The three Ray actors. Each is a thin shell over a plain class; only protocol bytes cross.

    FrontendActor          request intake (chat rendering, validation), per-client event
    (async)                streams, client liveness; supervises the controller
         | submit / cancel / call                ^ deliver(events)
    EngineControllerActor  the ControlLoop (EngineCore, Scheduler, ResourceManager, transaction
    (threaded)             state machine); supervises the worker
         | handle(StepPlan bytes) -> StepReply bytes     ^ notify() on copy completion
    GpuWorkerActor         the Worker: Program, stores, model, copies (num_gpus=1 on a GPU node)

Ownership follows supervision: the frontend creates the controller, the controller creates the
worker; a dead owner takes what it owns down with it, and the supervisor recreates it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid

import msgspec
import ray
from ray.exceptions import RayActorError

from ninfer import protocol as P
from ninfer.config import decode_config
from ninfer.errors import NInferError, RequestError
from ninfer.faults import Fault
from ninfer.logs import configure as configure_logging
from ninfer.protocol import FinishReason, RequestSpec

log = logging.getLogger("ninfer.ray")
NAMESPACE = "ninfer"


def names(deployment: str) -> dict[str, str]:
    return {k: f"{deployment}-{k}" for k in ("frontend", "controller", "worker")}


def _gpus() -> int:
    return 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0


# ---- GPU worker --------------------------------------------------------------------------------

@ray.remote(num_cpus=0, max_concurrency=2)
class GpuWorkerActor:
    """Holds the Worker. ``handle`` runs one StepPlan; copy completions call ``notify``."""

    def __init__(self, model_dir: str, config: bytes, controller_name: str, faults: bytes):
        import torch

        from ninfer.actors.worker import Worker, WorkerDeath
        torch.set_num_threads(1)
        cfg = decode_config(config)
        if cfg.log_format:
            configure_logging(cfg.log_format)
        self._controller_name = controller_name
        self._controller = None
        self._death = WorkerDeath
        self.worker = Worker(model_dir, cfg, notify=self._notify,
                             faults=msgspec.msgpack.decode(faults, type=list[Fault]))

    def _notify(self) -> None:
        try:
            if self._controller is None:
                self._controller = ray.get_actor(self._controller_name, namespace=NAMESPACE)
            self._controller.notify.remote()
        except Exception:                    # the controller may be restarting: it polls anyway
            self._controller = None

    def info(self) -> bytes:
        return P.encode(self.worker.info())

    def handle(self, plan: bytes) -> bytes:
        try:
            return self.worker.handle(plan)
        except self._death:                  # an injected worker death: this process dies here
            os._exit(1)

    def ping(self) -> bool:
        return True


class RayWorkerClient:
    """The controller's view of the worker actor: bytes in, bytes out; a dead actor is
    reported as WorkerLost so the control loop can supervise."""

    def __init__(self, actor):
        self.actor = actor
        self.bytes_out = self.bytes_in = 0     # protocol bytes (the periodic engine summary)

    def _get(self, ref):
        from ninfer.actors.transport import WorkerLost
        try:
            return ray.get(ref)
        except RayActorError as exc:
            raise WorkerLost(f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None

    def info(self) -> P.WorkerInfo:
        return P.decode_info(self._get(self.actor.info.remote()))

    def step(self, plan: P.StepPlan) -> P.StepReply:
        data = P.encode(plan)
        self.bytes_out += len(data)
        reply = self._get(self.actor.handle.remote(data))
        self.bytes_in += len(reply)
        return P.decode_reply(reply)

    def shutdown(self) -> None:
        try:
            ray.kill(self.actor)
        except Exception:
            pass


# ---- engine controller ---------------------------------------------------------------------------

@ray.remote(num_cpus=0, max_concurrency=16, max_restarts=3)
class EngineControllerActor:
    def __init__(self, model_dir: str, config: bytes, deployment: str):
        from ninfer.actors.control import ControlLoop
        self.names = names(deployment)
        self._config = config
        self._model_dir = model_dir
        self._events: list[P.Event] = []
        self._lock = threading.Lock()
        self._frontend = ray.get_actor(self.names["frontend"], namespace=NAMESPACE)
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        cfg = decode_config(config)
        if cfg.log_format:                     # its summaries go to this actor's stderr (Ray's log)
            configure_logging(cfg.log_format)
        self.loop = ControlLoop(self._make_client, cfg, self._sink, self._flush,
                                on_restart=lambda: os._exit(1), restarted=restarted)
        self.started = time.time()

    def _make_client(self, faults: list[Fault] | None = None) -> RayWorkerClient:
        name = self.names["worker"]
        try:                                   # a previous worker under this name is gone or goes now
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except Exception:
            pass
        for _ in range(100):
            try:
                actor = GpuWorkerActor.options(name=name, namespace=NAMESPACE, num_gpus=_gpus(),
                                               max_restarts=0).remote(
                    self._model_dir, self._config, self.names["controller"], P.encode(faults or []))
                break
            except ValueError:                 # the old name is still being released
                time.sleep(0.05)
        client = RayWorkerClient(actor)
        client.info()                          # wait until it is up
        return client

    def _sink(self, ev: P.Event) -> None:
        with self._lock:
            self._events.append(ev)

    def _flush(self) -> None:
        with self._lock:
            events, self._events = self._events, []
        if events:
            self._frontend.deliver.remote(P.encode(events))

    # remote methods (run on Ray's threads; the control thread owns the core)
    def info(self) -> bytes:
        return P.encode(self.loop.info)

    def submit(self, spec: bytes) -> None:
        self.loop.submit(P.decode_spec(spec))

    def cancel(self, rid: str) -> None:
        self.loop.cancel(rid)

    def call(self, what: str):
        return self.loop.call(what)

    def notify(self) -> None:
        self.loop.wake.set()

    def ping(self) -> float:
        return self.started


# ---- frontend ----------------------------------------------------------------------------------

class _ClientState:
    def __init__(self):
        self.events: list[bytes] = []
        self.ready = asyncio.Event()
        self.last_seen = time.monotonic()
        self.live: set[str] = set()


@ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=1)
class FrontendActor:
    """Request intake and output streams for many clients; watches the controller."""

    def __init__(self, model_dir: str, config: bytes, deployment: str, client_timeout: float = 10.0):
        from ninfer.frontend.intake import Intake
        fmt = decode_config(config).log_format
        if fmt:
            configure_logging(fmt)
        self.names = names(deployment)
        self._model_dir, self._config, self._deployment = model_dir, config, deployment
        self.client_timeout = client_timeout
        self.clients: dict[str, _ClientState] = {}
        self.owner: dict[str, str] = {}            # rid -> client id
        self.controller = EngineControllerActor.options(
            name=self.names["controller"], namespace=NAMESPACE).remote(model_dir, config, deployment)
        self.controller_epoch = None
        self.info_bytes: bytes | None = None
        self.intake = None
        self._intake_cls = Intake
        self._watch = None

    async def ready(self) -> bytes:
        if self.info_bytes is None:
            self.info_bytes = await self.controller.info.remote()
            self.controller_epoch = await self.controller.ping.remote()
            self.intake = self._intake_cls(self._model_dir, P.decode_info(self.info_bytes))
            self._watch = asyncio.get_running_loop().create_task(self._watchdog())
        return self.info_bytes

    # ---- clients --------------------------------------------------------------------------
    async def register_client(self) -> str:
        await self.ready()
        cid = uuid.uuid4().hex[:12]
        self.clients[cid] = _ClientState()
        return cid

    async def submit(self, cid: str, spec: bytes) -> str | None:
        """Returns an error message for bad input (that request alone), else None."""
        req = P.decode_spec(spec)
        try:
            self.intake.validate(req)
        except NInferError as exc:
            return str(exc)
        return await self._forward(cid, req)

    async def submit_chat(self, cid: str, chat: bytes) -> tuple[str | None, list[int]]:
        try:
            req = self.intake.chat(P.decode_chat(chat))
            self.intake.validate(req)
        except NInferError as exc:
            return str(exc), []
        return await self._forward(cid, req), req.prompt

    async def _forward(self, cid: str, req: RequestSpec) -> str | None:
        state = self.clients.get(cid)
        if state is None:
            return f"unknown client {cid!r}"
        self.owner[req.rid] = cid
        state.live.add(req.rid)
        try:
            await self.controller.submit.remote(P.encode(req))
        except RayActorError:
            await self._controller_lost("the engine controller is unavailable")
            return "the engine controller was restarted; resubmit"
        return None

    async def poll(self, cid: str, timeout: float = 2.0) -> list[bytes]:
        """Events of this client's requests since its last poll (each delivered once). Polling
        is also the client's heartbeat."""
        state = self.clients.get(cid)
        if state is None:
            raise RequestError(f"unknown client {cid!r}")
        state.last_seen = time.monotonic()
        if not state.events:
            state.ready.clear()
            try:
                await asyncio.wait_for(state.ready.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        state.last_seen = time.monotonic()
        out, state.events = state.events, []
        return out

    async def cancel(self, rid: str) -> None:
        try:
            await self.controller.cancel.remote(rid)
        except RayActorError:
            await self._controller_lost("the engine controller is unavailable")

    async def close_client(self, cid: str) -> None:
        state = self.clients.pop(cid, None)
        if state is not None:
            for rid in state.live:
                await self.cancel(rid)

    async def call(self, what: str):
        return await self.controller.call.remote(what)

    # ---- from the controller ----------------------------------------------------------------
    async def deliver(self, data: bytes) -> None:
        for ev in P.decode_events(data):
            if self.intake is not None:
                self.intake.observe(ev)
            self._route(ev)

    def _route(self, ev: P.Event) -> None:
        cid = self.owner.get(ev.rid)
        state = self.clients.get(cid) if cid else None
        if isinstance(ev, P.FinalEvent):
            self.owner.pop(ev.rid, None)
            if state is not None:
                state.live.discard(ev.rid)
        if state is not None:
            state.events.append(P.encode(ev))
            state.ready.set()

    # ---- supervision --------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        """Cancels the requests of clients that stopped polling, and fails outstanding requests
        clearly when the controller restarts (then keeps serving through the new one)."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for cid, state in list(self.clients.items()):
                if state.live and now - state.last_seen > self.client_timeout:
                    log.info("client %s disconnected: cancelling %d requests", cid, len(state.live))
                    await self.close_client(cid)
            try:
                epoch = await asyncio.wait_for(self.controller.ping.remote(), 5.0)
            except (RayActorError, asyncio.TimeoutError):
                await self._controller_lost("the engine controller stopped responding")
                continue
            if epoch != self.controller_epoch:
                self.controller_epoch = epoch
                await self._controller_lost("the engine controller was restarted")

    async def _controller_lost(self, message: str) -> None:
        for rid, cid in list(self.owner.items()):
            self._route(P.FinalEvent(rid, FinishReason.ERROR, [], {}, {}, [],
                                     {"type": "controller_lost", "message": message}))
        try:
            self.controller_epoch = await asyncio.wait_for(self.controller.ping.remote(), 60.0)
        except Exception:
            self.controller = EngineControllerActor.options(
                name=self.names["controller"], namespace=NAMESPACE).remote(
                self._model_dir, self._config, self._deployment)
            self.controller_epoch = await self.controller.ping.remote()

    async def model_dir(self) -> str:
        return self._model_dir
