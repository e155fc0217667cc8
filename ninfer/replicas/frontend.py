"""One frontend, N whole engines (issue 34): the replicated deployment's Ray actor.

    clients (Engine handle, ninfer.connect, ninfer serve) ── the same methods as FrontendActor
                                   │
    ReplicatedFrontendActor        intake (templates, tokens), per-client streams, the Router
        │ submit / cancel / call          ^ events + SummaryEvent, one socket per replica
        ├── replica 0: EngineControllerActor ── GpuWorkerActor    one placement group each:
        ├── replica 1: EngineControllerActor ── GpuWorkerActor    {"GPU": 1} on a GPU cluster,
        └── ...                                                    a token CPU share otherwise

Each replica is a whole engine, the seed unchanged inside it; the frontend decides only which
engine gets a request (``router.py``) and supervises them:

- A replica that dies (its controller, or its worker's process group) or stops answering its
  ping for 5 s is lost: requests it held that had produced no token yet are re-routed to the
  live replicas and complete there; those that had produced tokens end with ``replica_lost``
  (retryable: a retry is served). Its summary is dropped at once, so nothing is routed to it or
  waits on it; a replacement starts under a new key and joins with an empty summary.
- Requests that arrive while no replica is live wait for the first replacement.

Plain actors, not Ray Serve: the existing frontend already is the ingress (OpenAI server, client
streams over sockets, per-request cancellation and liveness), and routing needs the request's
tokens after the chat template ran — a Serve ingress would add a hop (≈ 1 ms a call here) in
front of a frontend that must still exist, and its request router sees requests, not the
replicas' restore points. One frontend in front of N controllers keeps one hop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import msgspec
import ray
from ray.exceptions import RayActorError, RayError

from ninfer import protocol as P
from ninfer.actors.ray_actors import NAMESPACE, EngineControllerActor, Frontend, ask_normal_priority, names
from ninfer.config import decode_config
from ninfer.errors import ErrorKind, NInferError, RequestError
from ninfer.replicas.router import NoReplica, Router, RouterConfig
from ninfer.replicas.stats import merge

log = logging.getLogger("ninfer.replicas")

STARTING, LIVE, DRAINING, LOST = "starting", "live", "draining", "lost"
PING_TIMEOUT_S = 5.0
CPU_SHARE = 0.001            # a CPU replica's bundle: placement only, no real reservation


def identity(config: bytes, replicas: int, router: bytes) -> bytes:
    """What a later start must match to attach to a running replicated deployment."""
    return msgspec.msgpack.encode([config, replicas, router])


class Replica:
    """One engine of the deployment: its key (slot.generation), controller, placement group."""

    def __init__(self, slot: int, gen: int, controller, group):
        self.slot, self.gen = slot, gen
        self.key = f"{slot}.{gen}"
        self.controller, self.group = controller, group
        self.state = STARTING
        self.node: str | None = None
        self.lanes = 0
        self.seen = time.monotonic()
        self.error: BaseException | None = None


class ReplicatedFrontend(Frontend):
    def __init__(self, model_dir: str, config: bytes, deployment: str, client_timeout: float = 10.0,
                 replicas: int = 2, router: bytes = b""):
        self.n_replicas = replicas
        self.router_config = msgspec.msgpack.decode(router, type=RouterConfig) if router else RouterConfig()
        self._router_bytes = router
        self.router = Router(self.router_config)
        self.replicas: dict[int, Replica] = {}
        self._sources: dict[str, int] = {}         # key of a live replica -> its slot
        self._event_servers: dict[str, tuple] = {}
        self._pending: deque[str] = deque()        # waiting for a live replica
        self._ready_lock = asyncio.Lock()
        super().__init__(model_dir, config, deployment, client_timeout)

    # ---- the replicas ------------------------------------------------------------------------
    def _create_engine(self):
        for slot in range(self.n_replicas):
            self.replicas[slot] = self._launch(slot, 0)
        return None                                # no single controller

    def _launch(self, slot: int, gen: int) -> Replica:
        """A replica's placement group and controller (which creates its worker inside the
        group): it is STARTING until its controller answers ``info``."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        gpu = ray.cluster_resources().get("GPU", 0) >= 1
        for _ in range(1000):      # a name still held (a restarted frontend's old replicas): the next generation
            key = f"{slot}.{gen}"
            try:
                group = placement_group([{"GPU": 1} if gpu else {"CPU": CPU_SHARE}], strategy="STRICT_PACK",
                                        name=f"{self._deployment}-r{key}")
            except RayError:
                gen += 1
                continue
            try:
                controller = EngineControllerActor.options(
                    name=names(self._deployment, key)["controller"], namespace=NAMESPACE, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
                ).remote(self._model_dir, self._config, self._deployment, key,
                         (self.router_config.summary_cap, self.router_config.block_tokens))
            except ValueError:
                remove_placement_group(group)
                gen += 1
                continue
            return Replica(slot, gen, controller, group)
        raise NInferError(f"no free name for replica {slot} of deployment {self._deployment!r}")

    async def _await_live(self, rep: Replica) -> bytes:
        """Wait until a starting replica serves; it then joins the router with an empty summary."""
        info = await rep.controller.info.remote()
        rep.epoch = await rep.controller.ping.remote()
        rep.node = await rep.controller.node.remote()
        rep.lanes = P.decode_info(info).max_concurrency
        if rep.state != STARTING:                 # lost while starting
            return info
        rep.state, rep.seen = LIVE, time.monotonic()
        self._sources[rep.key] = rep.slot
        self.router.add(rep.slot, rep.lanes)
        await self._resync(rep)
        log.info("replica %s is serving on node %s (%d lanes)", rep.key, rep.node, rep.lanes)
        while self._pending:                      # what waited for a live replica goes now
            asyncio.get_running_loop().create_task(self._redispatch(self._pending.popleft()))
        return info

    async def _resync(self, rep: Replica) -> None:
        """The whole summary of a replica (its delta thread had a gap, or it just joined)."""
        try:
            ev = P.decode_event(await rep.controller.summary_snapshot.remote())
        except RayActorError:
            self._lost(rep, "it died")
            return
        if rep.state == LIVE:
            self.router.apply(rep.slot, ev)

    def _lost(self, rep: Replica, why: str) -> None:
        """A replica is gone: it steers and takes nothing from now on; what it held that had no
        token yet is re-routed, the rest fails (retryable); a replacement starts."""
        if rep.state == LOST:
            return
        was_live, rep.state = rep.state in (LIVE, DRAINING), LOST
        self.counters["replicas_lost"] += 1
        self._sources.pop(rep.key, None)
        log.warning("replica %s was lost (%s): re-routing its queued requests, failing the generating ones",
                    rep.key, why)
        try:
            ray.kill(rep.controller, no_restart=True)
        except Exception:
            pass
        try:                                       # its worker goes with it (and the GPU is free)
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(rep.group)
        except Exception:
            pass
        loop = asyncio.get_running_loop()
        # rule: replica-loss
        for rid in self.router.remove(rep.slot):
            if rid in self.unstarted:
                loop.create_task(self._redispatch(rid))
            else:
                self.counters["failed_in_flight"] += 1
                self._fail(rid, ErrorKind.REPLICA_LOST, f"engine replica {rep.slot} was lost ({why}) while "
                                                        "this request was generating")
        self._push()
        if was_live:                               # one that failed to start is retried by its starter
            loop.create_task(self._replace(rep.slot, rep.gen + 1))

    async def _replace(self, slot: int, gen: int) -> None:
        """A new replica in the lost one's slot (retried while it fails to start)."""
        delay = 1.0
        while True:
            rep = self.replicas[slot] = self._launch(slot, gen)
            try:
                await self._await_live(rep)
                self.counters["replicas_replaced"] += 1
                return
            except Exception as exc:              # noqa: BLE001 — logged, and tried again
                log.warning("replacement replica %s failed to start (%s: %s); trying again in %.0f s",
                            rep.key, type(exc).__name__, exc, delay)
                rep.state = LOST
                try:
                    ray.kill(rep.controller, no_restart=True)
                    from ray.util.placement_group import remove_placement_group
                    remove_placement_group(rep.group)
                except Exception:
                    pass
                await asyncio.sleep(delay)
                delay, gen = min(delay * 2, 30.0), rep.gen + 1

    def live(self) -> list[Replica]:
        """The replicas serving (a draining one still finishes what it holds)."""
        return [r for r in self.replicas.values() if r.state in (LIVE, DRAINING)]

    async def drain(self, slot: int, replace: bool = True) -> dict:
        """Replica ``slot`` takes no new request; once what it holds has finished it stops, and
        (``replace``) a fresh replica takes its slot and joins with an empty summary — a rolling
        restart that fails nothing. New requests go to the other replicas meanwhile (with none
        left, they wait for the replacement). Returns the slot's replica as it is then."""
        rep = self.replicas.get(slot)
        if rep is None or rep.state != LIVE:
            raise RequestError(f"replica {slot} is not serving (replicas: {sorted(self.replicas)})")
        if not replace and not [r for r in self.live() if r.state == LIVE and r is not rep]:
            raise RequestError(f"replica {slot} is the last one serving: drain it with replace=True")
        rep.state = DRAINING
        self.router.drain(slot)
        log.info("draining replica %s (%d requests to finish)", rep.key, self.router.loads[slot].outstanding)
        while rep.state == DRAINING and self.router.loads[slot].outstanding > 0:
            await asyncio.sleep(0.05)
        if rep.state != DRAINING:                  # lost meanwhile: its loss handled it
            return self._describe(self.replicas[slot], None)
        rep.state = LOST
        self._sources.pop(rep.key, None)
        self.router.remove(slot)
        self.counters["replicas_drained"] += 1
        try:
            ray.kill(rep.controller, no_restart=True)
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(rep.group)
        except Exception:
            pass
        if replace:
            await self._replace(slot, rep.gen + 1)
        else:
            del self.replicas[slot]
            return self._describe(rep, None)
        return self._describe(self.replicas[slot], None)

    # ---- startup ----------------------------------------------------------------------------------
    async def ready(self) -> bytes:
        async with self._ready_lock:
            if self.info_bytes is None:
                ask_normal_priority("frontend's event loop")
                infos = await asyncio.gather(*(self._await_live(r) for r in list(self.replicas.values())))
                self.info_bytes = infos[0]
                self.intake = self._intake_cls(self._model_dir, P.decode_info(self.info_bytes),
                                               decode_config(self._config).media_budget_bytes)
                self._watch = asyncio.get_running_loop().create_task(self._watchdog())
                from ninfer.frontend import offload
                offload.shared().warm()
        return self.info_bytes

    async def config(self) -> bytes:
        return identity(self._config, self.n_replicas, self._router_bytes)

    # ---- requests ---------------------------------------------------------------------------------
    async def _forward(self, cid: str, req: P.RequestSpec) -> str | None:
        state = self.clients.get(cid)
        if state is None:
            return f"unknown client {cid!r}"
        self.owner[req.rid] = cid
        state.live.add(req.rid)
        data = P.encode(req)
        self.unstarted[req.rid] = data
        await self._dispatch(req.rid, req.prompt, req.session_id, data)
        return None

    async def _dispatch(self, rid: str, prompt, session: str | None, data: bytes, rerouted: bool = False) -> None:
        """Route and submit; a replica found dead on the way is lost and the request routed again."""
        while True:
            try:
                decision = self.router.route(rid, prompt, session, rerouted)
            except NoReplica:
                self._pending.append(rid)
                return
            rep = self.replicas[decision.replica]
            try:               # never wait on a replica that does not answer: it is lost (and killed)
                await asyncio.wait_for(rep.controller.submit.remote(data), PING_TIMEOUT_S)
                return
            except (RayActorError, asyncio.TimeoutError) as exc:
                self.router.finished(rid)
                self._lost(rep, "it died" if isinstance(exc, RayActorError) else "it stopped answering")
                rerouted = True

    async def _redispatch(self, rid: str) -> None:
        data = self.unstarted.get(rid)
        if data is None or self.router.replica_of(rid) is not None:    # cancelled meanwhile, or placed
            return
        spec = P.decode_spec(data)
        self.counters["rerouted"] += 1
        await self._dispatch(rid, spec.prompt, spec.session_id, data, rerouted=True)

    async def cancel(self, rid: str) -> None:
        slot = self.router.replica_of(rid)
        if slot is None:                           # waiting for a live replica: it ends here
            if self.unstarted.pop(rid, None) is not None:
                try:
                    self._pending.remove(rid)
                except ValueError:
                    pass
                self._fail(rid, None)                # cancelled
                self._push()
            return
        rep = self.replicas[slot]
        try:
            await asyncio.wait_for(rep.controller.cancel.remote(rid), PING_TIMEOUT_S)
        except (RayActorError, asyncio.TimeoutError) as exc:
            self._lost(rep, "it died" if isinstance(exc, RayActorError) else "it stopped answering")
            if self.unstarted.pop(rid, None) is not None:      # it would have been re-routed: it ends here
                self.router.finished(rid)
                self._fail(rid, None)                # cancelled
                self._push()

    # ---- events -------------------------------------------------------------------------------------
    async def event_address(self, source: str | None = None) -> tuple[str | None, str]:
        """A socket per replica, so every frame says which replica sent it."""
        if source not in self._event_servers:
            from ninfer.actors.channel import new_address, serve_frames
            address = new_address()
            server = await serve_frames(address, lambda data, s=source: self._deliver_from(s, data))
            self._event_servers[source] = (server, address)
        return self._event_servers[source][1], ray.get_runtime_context().get_node_id()

    async def deliver(self, data: bytes, source: str | None = None) -> None:
        self._deliver_from(source, data)

    def _deliver_from(self, source: str | None, data: bytes) -> None:
        """Events of one replica: summaries to the router; a request's events only from the
        replica that holds it (a lost replica's late frames are dropped)."""
        slot = self._sources.get(source)
        for ev in P.decode_events(data):
            if isinstance(ev, P.SummaryEvent):
                if slot is not None and not self.router.apply(slot, ev):
                    self.counters["summary_resyncs"] += 1
                    asyncio.get_running_loop().create_task(self._resync(self.replicas[slot]))
                continue
            if slot is None or self.router.replica_of(ev.rid) != slot:
                continue
            if isinstance(ev, P.LifecycleEvent) and ev.kind is P.Life.ADMITTED:
                self.router.admitted(ev.rid)
            elif isinstance(ev, P.FinalEvent):
                self.router.finished(ev.rid)
            if self.intake is not None:
                self.intake.observe(ev)
            self._route(ev)
        self._push()

    # ---- engine-wide calls --------------------------------------------------------------------------
    async def call(self, what: str):
        """``stats``: every live replica's, merged (``stats["replicas"]``: each one's own
        numbers, ``stats["router"]``: the router's); ``check_integrity`` / ``drop_caches``: on
        every live replica."""
        deadline = time.monotonic() + 60.0
        while not self.live():
            if time.monotonic() > deadline:
                raise NInferError("no engine replica is serving")
            await asyncio.sleep(0.1)
        live = self.live()
        outs = await asyncio.gather(*(r.controller.call.remote(what) for r in live), return_exceptions=True)
        for rep, out in zip(live, outs):
            if isinstance(out, RayActorError):
                self._lost(rep, "it died")
            elif isinstance(out, BaseException):
                raise out
        if what != "stats":
            return None
        good = [(rep, out) for rep, out in zip(live, outs) if not isinstance(out, BaseException)]
        merged = merge([out for _, out in good])
        merged["requests"] = self.intake.stats.snapshot()
        merged["frontend"] = dict(self.counters)
        merged["requests_resubmitted"] = merged.get("requests_resubmitted", 0) + self.counters.get("rerouted", 0)
        merged["router"] = self.router.snapshot()
        merged["replicas"] = [self._describe(rep, out) for rep, out in good] + \
            [self._describe(rep, None) for rep in self.replicas.values() if rep.state != LIVE]
        return merged

    def _describe(self, rep: Replica, stats: dict | None) -> dict:
        out = {"slot": rep.slot, "key": rep.key, "state": rep.state, "node": rep.node, "lanes": rep.lanes}
        if stats is not None:
            c = stats["cache"]
            out.update(prefill_tokens=stats["prefill_tokens"], replay_tokens=stats["replay_tokens"],
                       cache_hits=c["hits"], reused_tokens=c["reused_tokens"], running=stats["running"],
                       waiting=stats["waiting"], finished=stats["finished"])
        return out

    # ---- supervision --------------------------------------------------------------------------------
    async def _watch_engine(self) -> None:
        live = self.live()
        pings = await asyncio.gather(*(asyncio.wait_for(r.controller.ping.remote(), PING_TIMEOUT_S) for r in live),
                                     return_exceptions=True)
        now = time.monotonic()
        for rep, got in zip(live, pings):
            if isinstance(got, (RayActorError, asyncio.TimeoutError)):
                self._lost(rep, "it died" if isinstance(got, RayActorError) else "it stopped answering")
            elif not isinstance(got, BaseException):
                rep.seen = now
        self._controller_seen = max((r.seen for r in self.live()), default=self._controller_seen)

    async def health(self) -> bool:
        return self.info_bytes is not None and any(time.monotonic() - r.seen < 10.0 for r in self.live())

    async def replica_info(self) -> list[dict]:
        """Each replica's slot, key, state, node and lanes (tests, deploy checks)."""
        return [self._describe(r, None) for r in self.replicas.values()]


ReplicatedFrontendActor = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=1)(ReplicatedFrontend)
