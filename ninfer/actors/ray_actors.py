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

An error while starting (a config the node cannot serve, a bad model directory) does not kill
the actor in its constructor: the actor keeps it and raises it from ``info``/``ready``, so the
client gets the typed error and its message (``actors/startup.py``) instead of a creation-task
death that Ray reports only as text, with a native stack dump in the logs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import msgspec
import ray
from ray.exceptions import RayActorError, RayError

from ninfer import protocol as P
from ninfer.actors import collector
from ninfer.config import decode_config
from ninfer.actors.startup import last_error_line, startup_error
from ninfer.errors import ErrorKind, NInferError, RequestError, lost_error
from ninfer.faults import Fault
from ninfer.logs import configure as configure_logging
from ninfer.protocol import FinishReason, RequestSpec

log = logging.getLogger("ninfer.ray")
NAMESPACE = "ninfer"


def names(deployment: str, replica: str | None = None) -> dict[str, str]:
    """The actors' names; a replica's controller and worker carry its key (``ninfer/replicas``)."""
    out = {k: f"{deployment}-{k}" for k in ("frontend", "controller", "worker")}
    if replica is not None:
        out.update(controller=f"{deployment}-r{replica}-controller", worker=f"{deployment}-r{replica}-worker")
    return out


def _gpus() -> int:
    return 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0


def _kept_startup_failure(exc: Exception, what: str) -> Exception:
    """An exception a constructor keeps for its ``info`` to raise. A NInfer error is expected
    (its message says it all); anything else is a bug, so its traceback goes to the log."""
    if not isinstance(exc, NInferError):
        log.error("the %s failed to start", what, exc_info=exc)
    return exc


def ask_normal_priority(what: str) -> None:
    """Ray starts worker processes at niceness 15 so that its own daemons stay responsive; the
    three actors are the service itself (the worker's step and the controller's cycle are on
    every token's path), so they ask for normal priority back. Measured on 2 busy cores: at
    niceness 15 the worker's decode step was ~20% slower than the same step in-process. Lowering
    niceness needs the privilege to do so; without it the actor runs as Ray started it. On Linux
    niceness is per thread (a new thread inherits its creator's): call it on each thread that
    does the service's work (``actors/channel.py`` does for the step thread)."""
    from ninfer.actors.channel import normal_priority
    why = normal_priority()
    if why:
        log.info("the %s keeps Ray's process priority (%s)", what, why)


def _was_restarted() -> bool:
    """Whether Ray restarted the calling actor. Ray's property reads a deprecated attribute
    internally, and its warning would be forwarded to every client's terminal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


# ---- GPU worker --------------------------------------------------------------------------------

@ray.remote(num_cpus=0, max_concurrency=2)
class GpuWorkerActor:
    """Holds the Worker. ``handle`` runs one StepPlan; copy completions call ``notify``.
    A Worker that could not be built leaves its exception for ``info`` to raise."""

    def __init__(self, model_dir: str, config: bytes, controller_name: str, faults: bytes):
        from ninfer.actors.worker import Worker, WorkerDeath
        ask_normal_priority("GPU worker")
        cfg = decode_config(config)
        if cfg.log_format:
            configure_logging(cfg.log_format)
        self._controller_name = controller_name
        self._controller = None
        self._death = WorkerDeath
        self._failed: Exception | None = None
        self._channel = None
        try:
            self.worker = Worker(model_dir, cfg, notify=self._notify,
                                 faults=msgspec.msgpack.decode(faults, type=list[Fault]))
            collector.settle_startup()      # the model is loaded and calibrated: set it aside
        except Exception as exc:
            self.worker, self._failed = None, _kept_startup_failure(exc, "GPU worker")

    def _notify(self) -> None:
        try:
            if self._controller is None:
                self._controller = ray.get_actor(self._controller_name, namespace=NAMESPACE)
            self._controller.notify.remote()
        except Exception:                    # the controller may be restarting: it polls anyway
            self._controller = None

    def info(self) -> bytes:
        if self._failed is not None:
            raise self._failed
        return P.encode(self.worker.info())

    def handle(self, plan: bytes) -> bytes:
        try:
            return self.worker.handle(plan)
        except self._death:                  # an injected worker death: this process dies here
            os._exit(1)

    def channel_address(self) -> tuple[str | None, str]:
        """Where the per-cycle step channel listens (``actors/channel.py``), and this node."""
        if self._channel is None and self.worker is not None:
            from ninfer.actors.channel import ChannelServer
            self._channel = ChannelServer(self.handle)
        address = self._channel.address if self._channel is not None else None
        return address, ray.get_runtime_context().get_node_id()

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()


class RayWorkerClient:
    """The controller's view of the worker actor: bytes in, bytes out; a dead actor is
    reported as WorkerLost so the control loop can supervise. Steps travel on the direct step
    channel (``actors/channel.py``) once the worker is up; everything else is a plain call."""

    def __init__(self, actor, step_timeout_s: float | None = None):
        self.actor = actor
        self.step_timeout_s = step_timeout_s
        self.channel = None
        self.bytes_out = self.bytes_in = 0     # protocol bytes (the periodic engine summary)

    def _get(self, ref):
        from ninfer.actors.transport import WorkerLost
        try:
            return ray.get(ref)
        except RayActorError as exc:
            if exc.actor_init_failed:          # died in its constructor: the cause is deep in the text
                found = last_error_line(str(exc))
                if found is not None:
                    raise WorkerLost(f"the GPU worker failed to start: {found[0]}: {found[1]}") from None
            raise WorkerLost(f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None

    def info(self) -> P.WorkerInfo:
        return P.decode_info(self._get(self.actor.info.remote()))

    def open_channel(self) -> None:
        """The per-cycle channel, built once the worker answered ``info``."""
        from ninfer.actors.channel import StepChannel
        from ninfer.actors.transport import WorkerLost, WorkerTimeout
        self.channel = StepChannel(self.actor, WorkerLost, self.step_timeout_s, WorkerTimeout)

    @property
    def channel_kind(self) -> str:
        """What the steps travel on: "socket" (the direct channel) or "call"."""
        return "socket" if self.channel is not None and self.channel.direct else "call"

    def step(self, plan: P.StepPlan) -> P.StepReply:
        data = P.encode(plan)
        self.bytes_out += len(data)
        if self.channel is None:             # before the channel opened (StepChannel covers both after)
            reply = self._get(self.actor.handle.remote(data))
        else:
            reply = self.channel.call(data)
        self.bytes_in += len(reply)
        return P.decode_reply(reply)

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
        try:
            ray.kill(self.actor)
        except Exception:
            pass


# ---- engine controller ---------------------------------------------------------------------------

@ray.remote(num_cpus=0, max_concurrency=16, max_restarts=3)
class EngineControllerActor:
    """Holds the ControlLoop. A start that failed (here or in the worker) leaves its error, as
    one line, for ``info`` to raise; a worker that failed is killed at once (it holds the GPU),
    the client that started the deployment removes the rest."""

    def __init__(self, model_dir: str, config: bytes, deployment: str, replica: str | None = None,
                 summary: tuple[int, int] | None = None):
        """``replica``: this engine is one replica of a replicated deployment (its key, e.g.
        ``"0.1"``): it publishes its restore summary (``summary``: (cap, block)) with its events
        and names itself as their source."""
        from ninfer.actors.control import ControlLoop
        ask_normal_priority("engine controller")
        self.names = names(deployment, replica)
        self._source = () if replica is None else (replica,)
        restore_summary = None
        if replica is not None:
            from ninfer.replicas.summary import RestoreSummary
            restore_summary = RestoreSummary(*(summary or ()))
        self._config = config
        self._model_dir = model_dir
        self._events: list[P.Event] = []
        self._lock = threading.Lock()
        self._events_out = None                           # FrameSender to the frontend, when local
        self._events_retry_at = 0.0
        self._frontend = ray.get_actor(self.names["frontend"], namespace=NAMESPACE)
        self._failed: Exception | None = None
        self.loop = None
        cfg = decode_config(config)
        self._step_timeout_s = cfg.step_timeout_s
        if cfg.log_format:                     # its summaries go to this actor's stderr (Ray's log)
            configure_logging(cfg.log_format)
        try:
            self.loop = ControlLoop(self._make_client, cfg, self._sink, self._flush,
                                    on_restart=lambda: os._exit(1), restarted=_was_restarted(),
                                    summary=restore_summary)
        except Exception as exc:              # RayTaskError(ConfigError) from the worker, too
            failure = exc if isinstance(exc, RayError) else _kept_startup_failure(exc, "engine controller")
            self._failed = startup_error(failure)
        self.started = time.time()

    def _make_client(self, faults: list[Fault] | None = None) -> RayWorkerClient:
        name = self.names["worker"]
        try:                                   # a previous worker under this name is gone or goes now
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except Exception:
            pass
        opts = dict(name=name, namespace=NAMESPACE, num_gpus=_gpus(), max_restarts=0)
        group = ray.util.get_current_placement_group()
        if group is not None:                  # a replica: its worker in its bundle (its GPU, its node)
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        for _ in range(100):
            try:
                actor = GpuWorkerActor.options(**opts).remote(
                    self._model_dir, self._config, self.names["controller"], P.encode(faults or []))
                break
            except ValueError:                 # the old name is still being released
                time.sleep(0.05)
        client = RayWorkerClient(actor, self._step_timeout_s)
        try:
            client.info()                      # wait until it is up
            client.open_channel()
        except Exception:
            client.shutdown()                  # a worker that failed to start still holds its GPU
            raise
        return client

    def _sink(self, ev: P.Event) -> None:
        with self._lock:
            self._events.append(ev)

    def _flush(self) -> None:
        """The cycle's events in one message: over the frontend's event socket when it is on
        this node (no actor call per cycle), else a deliver call."""
        with self._lock:
            events, self._events = self._events, []
        if not events:
            return
        data = P.encode(events)
        out = self._events_out or self._connect_events()
        if out is not None and out.send(data):
            return
        self._events_out = None
        self._frontend.deliver.remote(data, *self._source)

    def _connect_events(self):
        now = time.monotonic()
        if now < self._events_retry_at:
            return None
        self._events_retry_at = now + 1.0                  # a frontend that restarts: try again later
        try:
            from ninfer.actors.channel import FrameSender
            address, node = ray.get(self._frontend.event_address.remote(*self._source), timeout=10)
            if address is not None and node == ray.get_runtime_context().get_node_id():
                self._events_out = FrameSender(address)
        except Exception as exc:
            log.info("events go by actor call (%s)", exc)
        return self._events_out

    # remote methods (run on Ray's threads; the control thread owns the core)
    def info(self) -> bytes:
        if self._failed is not None:
            raise self._failed
        return P.encode(self.loop.info)

    def submit(self, spec: bytes) -> None:
        self.loop.submit(P.decode_spec(spec))

    def cancel(self, rid: str) -> None:
        self.loop.cancel(rid)

    def call(self, what: str):
        return self.loop.call(what)

    def notify(self) -> None:
        self.loop.wake.set()

    def summary_snapshot(self) -> bytes:
        """A replica's whole restore summary as one reset event (the router resynchronises)."""
        return P.encode(self.loop.summary.snapshot())

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def ping(self) -> float:
        return self.started


# ---- frontend ----------------------------------------------------------------------------------

class _ClientState:
    def __init__(self):
        self.events: list[bytes] = []
        self.ready = asyncio.Event()
        self.last_seen = time.monotonic()
        self.live: set[str] = set()
        self.writer = None              # a client on this node streams events over a socket


class Frontend:
    """Request intake and output streams for many clients; watches the controller. The actor
    is ``FrontendActor``; ``ninfer/replicas/frontend.py`` serves N engines behind the same
    client methods."""

    def __init__(self, model_dir: str, config: bytes, deployment: str, client_timeout: float = 10.0):
        ask_normal_priority("frontend")
        from ninfer.frontend.intake import Intake
        fmt = decode_config(config).log_format
        if fmt:
            configure_logging(fmt)
        self.names = names(deployment)
        self._model_dir, self._config, self._deployment = model_dir, config, deployment
        self.client_timeout = client_timeout
        self.clients: dict[str, _ClientState] = {}
        self.owner: dict[str, str] = {}            # rid -> client id
        self.controller = self._create_engine()
        self.controller_epoch = None
        self.info_bytes: bytes | None = None
        self.intake = None
        self._intake_cls = Intake
        self._watch = None
        self._events_server = None
        self._clients_server = None
        self._touched: set[str] = set()
        self._intake_threads = ThreadPoolExecutor(4, thread_name_prefix="ninfer-intake")
        self._controller_seen = time.monotonic()
        self.unstarted: dict[str, bytes] = {}      # rid -> its encoded spec, until its first token
        self._recovering: asyncio.Task | None = None
        self._resubmitted: set[str] = set()
        self.counters: Counter = Counter()           # controller restarts, resubmissions, failures

    def _create_engine(self):
        """The engine behind this frontend: one controller (which creates its worker)."""
        return EngineControllerActor.options(name=self.names["controller"], namespace=NAMESPACE).remote(
            self._model_dir, self._config, self._deployment)

    async def ready(self) -> bytes:
        if self.info_bytes is None:
            ask_normal_priority("frontend's event loop")
            self.info_bytes = await self.controller.info.remote()
            self.controller_epoch = await self.controller.ping.remote()
            self.intake = self._intake_cls(self._model_dir, P.decode_info(self.info_bytes),
                                           decode_config(self._config).media_budget_bytes)
            self._watch = asyncio.get_running_loop().create_task(self._watchdog())
            from ninfer.frontend import offload
            offload.shared().warm()            # large chat inputs are planned there (frontend/offload.py)
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
        """Rendering and tokenising run on the intake threads (a large input in the helper
        process, ``frontend/offload.py``), never on this loop: it delivers every client's events."""
        try:
            req = await asyncio.get_running_loop().run_in_executor(self._intake_threads, self._chat, chat)
        except NInferError as exc:
            return str(exc), []
        return await self._forward(cid, req), req.prompt

    def _chat(self, chat: bytes) -> RequestSpec:
        return self.intake.validate(self.intake.chat(P.decode_chat(chat)))

    async def _forward(self, cid: str, req: RequestSpec) -> str | None:
        """Hand the request to the controller; the frontend keeps its spec until its first token,
        so a controller lost before then costs it nothing (``_controller_lost`` resubmits it)."""
        state = self.clients.get(cid)
        if state is None:
            return f"unknown client {cid!r}"
        self.owner[req.rid] = cid
        state.live.add(req.rid)
        data = P.encode(req)
        self.unstarted[req.rid] = data
        if self._recovering is not None:           # the controller is being replaced: it goes after
            return None
        try:
            await self.controller.submit.remote(data)
        except RayActorError:                       # it goes with the recovery's resubmissions
            self._start_recovery("the engine controller is unavailable")
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
        if self._recovering is not None and self.unstarted.pop(rid, None) is not None:
            self._fail(rid, None)                    # cancelled, never resubmitted: it ends here
            return
        try:
            await self.controller.cancel.remote(rid)
        except RayActorError:
            self._start_recovery("the engine controller is unavailable")

    async def close_client(self, cid: str) -> None:
        state = self.clients.pop(cid, None)
        if state is not None:
            for rid in state.live:
                await self.cancel(rid)

    async def call(self, what: str):
        """``stats`` and friends, with this frontend's own counters in ``stats``; while the
        controller is being replaced the call waits for the new one (up to a minute)."""
        for attempt in range(2):
            if self._recovering is not None:
                await asyncio.wait_for(asyncio.shield(self._recovering), 60.0)
            try:
                out = await self.controller.call.remote(what)
                break
            except RayActorError:
                if attempt:
                    raise
                self._start_recovery("the engine controller is unavailable")
        if what == "stats":
            out["requests"] = self.intake.stats.snapshot()
            out["frontend"] = dict(self.counters)
            out["controller_restarts"] = self.counters.get("controller_restarts", 0)
            out["requests_resubmitted"] = out.get("requests_resubmitted", 0) + self.counters.get("resubmitted", 0)
        return out

    # ---- from the controller ----------------------------------------------------------------
    async def event_address(self) -> tuple[str | None, str]:
        """Where the controller sends its events (a local socket, ``actors/channel.py``)."""
        if self._events_server is None:
            from ninfer.actors.channel import new_address, serve_frames
            address = new_address()
            self._events_server = (await serve_frames(address, self._deliver), address)
        return self._events_server[1], ray.get_runtime_context().get_node_id()

    async def deliver(self, data: bytes) -> None:
        self._deliver(data)

    def _deliver(self, data: bytes) -> None:
        for ev in P.decode_events(data):
            if self.intake is not None:
                self.intake.observe(ev)
            self._route(ev)
        self._push()

    def _route(self, ev: P.Event) -> None:
        cid = self.owner.get(ev.rid)
        state = self.clients.get(cid) if cid else None
        if isinstance(ev, (P.TokensEvent, P.FinalEvent)):
            self.unstarted.pop(ev.rid, None)         # started (or ended): no resubmission any more
        if isinstance(ev, P.FinalEvent):
            self.owner.pop(ev.rid, None)
            if state is not None:
                state.live.discard(ev.rid)
        if state is not None:
            state.events.append(P.encode(ev))
            if state.writer is not None:
                self._touched.add(cid)
            else:
                state.ready.set()

    def _push(self) -> None:
        """Events routed to streaming clients go out, one frame per client per batch."""
        from ninfer.actors.channel import HEADER, OK
        touched, self._touched = self._touched, set()
        for cid in touched:
            state = self.clients.get(cid)
            if state is None or state.writer is None or not state.events:
                continue
            out, state.events = state.events, []
            data = msgspec.msgpack.encode(out)
            try:
                state.writer.write(HEADER.pack(OK, len(data)) + data)
            except Exception:                 # the client went away: its reader ends it
                state.writer = None

    async def client_stream_address(self) -> tuple[str | None, str]:
        """Where a client on this node reads its events (instead of polling)."""
        if self._clients_server is None:
            from ninfer.actors.channel import new_address, serve_connections
            address = new_address()
            self._clients_server = (await serve_connections(address, self._client_stream), address)
        return self._clients_server[1], ray.get_runtime_context().get_node_id()

    async def _client_stream(self, reader, writer) -> None:
        """One client's event stream: it names itself, then reads; its end is the client
        leaving (its requests are cancelled, as a client that stops polling)."""
        from ninfer.actors.channel import HEADER
        cid = None
        try:
            _, n = HEADER.unpack(await reader.readexactly(HEADER.size))
            cid = (await reader.readexactly(n)).decode()
            state = self.clients.get(cid)
            if state is None:
                return
            state.writer = writer
            self._touched.add(cid)
            self._push()                       # what arrived before it connected
            await reader.read()                # until the client closes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            state = self.clients.get(cid) if cid else None
            if state is not None and state.writer is writer:
                state.writer = None
                await self.close_client(cid)

    # ---- supervision --------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        """Cancels the requests of clients that stopped polling, and fails outstanding requests
        clearly when the controller restarts (then keeps serving through the new one)."""
        while True:
            await asyncio.sleep(0.5)
            await self._watch_clients()
            await self._watch_engine()

    async def _watch_clients(self) -> None:
        now = time.monotonic()
        for cid, state in list(self.clients.items()):
            if state.live and state.writer is None and now - state.last_seen > self.client_timeout:
                log.info("client %s disconnected: cancelling %d requests", cid, len(state.live))
                await self.close_client(cid)

    async def _watch_engine(self) -> None:
        if self._recovering is not None:
            return
        try:
            epoch = await asyncio.wait_for(self.controller.ping.remote(), 5.0)
        except (RayActorError, asyncio.TimeoutError):
            self._start_recovery("the engine controller stopped responding")
            return
        self._controller_seen = time.monotonic()
        if epoch != self.controller_epoch:
            self._start_recovery("the engine controller was restarted", epoch)

    # ---- a lost controller ---------------------------------------------------------------------
    def _start_recovery(self, message: str, epoch: float | None = None) -> None:
        if self._recovering is None:
            self._recovering = asyncio.get_running_loop().create_task(self._controller_lost(message, epoch))

    async def _controller_lost(self, message: str, epoch: float | None = None) -> None:
        """The controller was lost (its process died; Ray restarts it with an empty engine).
        Requests that had produced tokens fail with ``controller_lost`` and a retry hint; the
        ones that had not are resubmitted to the new controller once it answers, and complete."""
        self.counters["controller_restarts"] += 1
        log.warning("%s: failing the requests that had produced tokens, resubmitting the others", message)
        try:
            for rid in [r for r in self.owner if r not in self.unstarted]:
                self._fail(rid, ErrorKind.CONTROLLER_LOST, f"{message} while this request was generating")
            self._push()
            await self._await_controller(epoch)
            while True:                              # new arrivals while it came back go too
                pending = [(rid, data) for rid, data in self.unstarted.items() if rid not in self._resubmitted]
                if not pending:
                    break
                for rid, data in pending:
                    self._resubmitted.add(rid)
                    await self.controller.submit.remote(data)
                    self.counters["resubmitted"] += 1
        except Exception as exc:                     # it failed again: the next watchdog tick retries
            log.warning("the engine controller is not back yet (%s: %s)", type(exc).__name__, exc)
        finally:
            self._resubmitted.clear()
            self._recovering = None

    async def _await_controller(self, epoch: float | None) -> None:
        """The restarted controller's epoch once it answers; one that does not come back within
        a minute (Ray's restarts used up) is replaced under the same name, once that is free."""
        if epoch is None:
            deadline = time.monotonic() + 60.0
            while True:
                try:
                    epoch = await asyncio.wait_for(self.controller.ping.remote(), 10.0)
                    break
                except (RayActorError, asyncio.TimeoutError):
                    if time.monotonic() > deadline:
                        epoch = await self._new_controller()
                        break
                    await asyncio.sleep(0.2)
        self.controller_epoch = epoch
        self._controller_seen = time.monotonic()

    async def _new_controller(self) -> float:
        name = self.names["controller"]
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass
        for _ in range(200):                         # the dead one's name is released a moment later
            try:
                self.controller = EngineControllerActor.options(name=name, namespace=NAMESPACE).remote(
                    self._model_dir, self._config, self._deployment)
                break
            except ValueError:
                await asyncio.sleep(0.1)
        return await self.controller.ping.remote()

    def _fail(self, rid: str, kind: ErrorKind | None, message: str = "") -> None:
        """End one request here (the controller that had it is gone): failed with a lost
        ``kind``, or cancelled (None)."""
        if kind is None:
            ev = P.FinalEvent(rid, FinishReason.CANCELLED, [], None, None, [], None)
        else:
            ev = P.FinalEvent(rid, FinishReason.ERROR, [], None, None, [], lost_error(kind, message))
        self.intake.observe(ev)                      # counted with the engine's own failures
        self._route(ev)

    async def health(self) -> bool:
        """Cheap liveness for /health: the controller answered the watchdog's last pings (no
        round trip through a busy control cycle, as ``call("stats")`` would be)."""
        return self.info_bytes is not None and time.monotonic() - self._controller_seen < 10.0

    async def model_dir(self) -> str:
        return self._model_dir

    async def config(self) -> bytes:
        """The engine config it was started with: a later start attaches only to the same one."""
        return self._config


FrontendActor = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=1)(Frontend)
