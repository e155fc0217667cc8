"""The client side of a Ray deployment: what ``Engine.start(transport="ray")`` and
``ninfer.connect`` hold. One poller thread per client long-polls the frontend for this client's
events (its heartbeat, too: a client that stops polling is considered gone and its requests
are cancelled)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import ray
from ray.exceptions import ActorAlreadyExistsError, RayActorError, RayError

from ninfer import protocol as P
from ninfer.actors.channel import OK, recv_frame, send_frame
from ninfer.actors.deployment import find_deployment, init_ray, remove_deployment, wait_for_free_gpu
from ninfer.actors.ray_actors import NAMESPACE, FrontendActor, names
from ninfer.actors.startup import startup_error
from ninfer.config import EngineConfig
from ninfer.errors import DeploymentError, RequestError
from ninfer.protocol import RequestSpec

log = logging.getLogger("ninfer.client")

__all__ = ["RayClientRuntime", "init_ray"]


class RayClientRuntime:
    """One client of a deployment's frontend (``attached``: a deployment this process found
    running rather than started)."""

    def __init__(self, frontend, info: bytes, owns: bool, model_dir: str, attached: bool = False,
                 deployment: str | None = None):
        self.frontend = frontend
        self.deployment = deployment
        self.owns = owns
        self.attached = attached
        self.model_dir = model_dir
        self.info = P.decode_info(info)
        self.client_id = ray.get(frontend.register_client.remote())
        self._target: Callable[[P.Event], None] = lambda ev: None
        self._on_lost: Callable[[str], None] = lambda msg: None
        self._stop = False
        self._stream: socket.socket | None = None      # events from a frontend on this node
        self._no_stream = False
        self._thread = threading.Thread(target=self._poll, name="ninfer-client-poll", daemon=True)

    @classmethod
    def start(cls, model_dir: str, config: EngineConfig, address: str | None, deployment: str,
              detached: bool = False, client_timeout: float = 10.0, replicas: int = 1,
              router=None) -> "RayClientRuntime":
        """A new deployment named ``deployment`` (detached: it outlives this process).

        What already runs under the name decides: a deployment that failed to start (or whose
        starter died mid-start and it failed since) is removed and replaced; a healthy detached
        one with the same model and config is attached to, so running ``ninfer serve --address
        auto`` twice serves the same engine; any other healthy one is an error that says what
        to do. A start that fails removes what it created and raises the cause in one line.
        """
        init_ray(address)
        model_dir = os.path.abspath(model_dir)        # the actors may run in another directory
        encoded = P.encode(config)
        routing = None
        if replicas > 1:                              # N engines behind one frontend (ninfer/replicas)
            from ninfer.replicas.frontend import identity
            from ninfer.replicas.router import RouterConfig
            routing = msgspec.msgpack.encode(RouterConfig.coerce(router))
            wanted = identity(encoded, replicas, routing)
        else:
            wanted = encoded
        found = find_deployment(deployment)
        if found is not None and found.error is None:
            if detached and found.serves(model_dir, wanted):
                log.info("attached to the running deployment %r (same model and engine config)", deployment)
                return cls(found.frontend, found.info, owns=False, model_dir=model_dir, attached=True)
            raise found.conflict(deployment, model_dir, detached)
        if found is not None:
            log.warning("replacing the deployment %r that a failed start left on this Ray cluster (%s)",
                        deployment, found.error)
            remove_deployment(deployment)
        wait_for_free_gpu(max(1, replicas))
        frontend = cls._create_frontend(model_dir, encoded, deployment, detached, client_timeout, replicas, routing)
        try:
            info = ray.get(frontend.ready.remote())
        except RayError as exc:
            remove_deployment(deployment)
            raise startup_error(exc) from None
        return cls(frontend, info, owns=not detached, model_dir=model_dir, deployment=deployment)

    @staticmethod
    def _create_frontend(model_dir: str, config: bytes, deployment: str, detached: bool, client_timeout: float,
                         replicas: int = 1, routing: bytes | None = None):
        opts = dict(name=names(deployment)["frontend"], namespace=NAMESPACE)
        if detached:
            opts["lifetime"] = "detached"
        if os.environ.get("NINFER_RAY_STEP_CHANNEL"):       # the actors it creates inherit it
            opts["runtime_env"] = {"env_vars": {"NINFER_RAY_STEP_CHANNEL": os.environ["NINFER_RAY_STEP_CHANNEL"]}}
        try:
            if replicas > 1:
                from ninfer.replicas.frontend import ReplicatedFrontendActor
                return ReplicatedFrontendActor.options(**opts).remote(model_dir, config, deployment, client_timeout,
                                                                      replicas, routing)
            return FrontendActor.options(**opts).remote(model_dir, config, deployment, client_timeout)
        except ActorAlreadyExistsError:
            raise DeploymentError(f"another start of deployment {deployment!r} is under way on this Ray cluster: "
                                  "wait for it and attach (ninfer serve --address auto), or use another name") from None

    @classmethod
    def connect(cls, address: str, deployment: str) -> "RayClientRuntime":
        init_ray(address)
        found = find_deployment(deployment)
        if found is None:
            raise RequestError(f"no NInfer deployment named {deployment!r} is serving on this Ray cluster")
        if found.error is not None:
            raise DeploymentError(f"the deployment {deployment!r} on this Ray cluster failed to start: {found.error} "
                                  "(a new start under that name replaces it)")
        return cls(found.frontend, found.info, owns=False, model_dir=found.model_dir, attached=True)

    def attach(self, sink: Callable[[P.Event], None], on_lost: Callable[[str], None] | None = None) -> None:
        self._target = sink
        if on_lost is not None:
            self._on_lost = on_lost
        if not self._thread.is_alive():
            self._thread.start()

    def _poll(self) -> None:
        """Events of this client: streamed over a local socket when the frontend is on this
        node (no actor call per batch), else long polls; a lost frontend fails what is in
        flight and the client registers again."""
        while not self._stop:
            try:
                sock = self._stream or self._open_stream()
                if sock is not None:
                    frame = recv_frame(sock)
                    if frame is None:
                        raise ConnectionError("the frontend closed the event stream")
                    batch = msgspec.msgpack.decode(frame[1], type=list[bytes])
                else:
                    batch = ray.get(self.frontend.poll.remote(self.client_id, 1.0))
            except (RayActorError, RequestError, Exception) as exc:   # frontend restarted or gone
                if self._stop:
                    return
                self._close_stream()
                log.warning("lost the frontend: %s", exc)
                self._on_lost(f"the frontend was lost ({type(exc).__name__}); requests in flight failed")
                time.sleep(0.5)
                try:
                    self.client_id = ray.get(self.frontend.register_client.remote())
                except Exception:
                    pass
                continue
            for raw in batch:
                self._target(P.decode_event(raw))

    @property
    def streaming(self) -> bool:
        """Whether this client's events arrive on a socket from the frontend (else polls)."""
        return self._stream is not None

    def _open_stream(self):
        if self._no_stream:
            return None
        self._no_stream = True                      # one try per registration
        try:
            address, node = ray.get(self.frontend.client_stream_address.remote())
            if address is None or node != ray.get_runtime_context().get_node_id():
                return None
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(address)
            send_frame(sock, OK, self.client_id.encode())
        except Exception as exc:
            log.info("events by polling (%s)", exc)
            return None
        self._stream = sock
        return sock

    def _close_stream(self) -> None:
        sock, self._stream = self._stream, None
        self._no_stream = False
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except OSError:
                pass

    def _check(self, err) -> None:
        if err:
            raise RequestError(err)

    def submit(self, spec: RequestSpec) -> None:
        self._check(ray.get(self.frontend.submit.remote(self.client_id, _encode(spec))))

    def submit_chat(self, chat: P.ChatSpec) -> list[int]:
        """Rendered and submitted by the frontend actor; returns the prompt's token ids."""
        err, prompt = ray.get(self.frontend.submit_chat.remote(self.client_id, _encode(chat)))
        self._check(err)
        return prompt

    def cancel(self, rid: str) -> None:
        self.frontend.cancel.remote(rid)

    def alive(self) -> bool:
        """The frontend answers and its controller answered lately (what /health reports)."""
        try:
            return bool(ray.get(self.frontend.health.remote(), timeout=5))
        except Exception:
            return False

    def call(self, what: str):
        return ray.get(self.frontend.call.remote(what))

    def drain(self, slot: int, replace: bool) -> dict:
        """A replicated deployment's ``ReplicatedFrontend.drain``."""
        try:
            method = self.frontend.drain
        except AttributeError:
            raise RequestError("this deployment serves one engine: there is no replica to drain") from None
        try:
            return ray.get(method.remote(slot, replace))
        except RayError as exc:
            from ninfer.actors.startup import original_cause
            cause = original_cause(exc)
            raise (cause if isinstance(cause, RequestError) else RequestError(str(exc).splitlines()[0])) from None

    def shutdown(self) -> None:
        if self._stop:
            return
        self._stop = True
        try:
            ray.get(self.frontend.close_client.remote(self.client_id), timeout=10)
        except Exception:
            pass
        self._close_stream()
        self._thread.join(timeout=5)
        if self.owns:
            try:
                ray.kill(self.frontend)          # the controller and worker go with their owner
            except Exception:
                pass
            if self.deployment is not None:      # replicas' placement groups outlive their creator
                from ninfer.actors.deployment import remove_replica_groups
                remove_replica_groups(self.deployment)


INT64 = (-(2 ** 63), 2 ** 63 - 1)


def _encode(msg) -> bytes:
    """The request's bytes for the frontend; a value msgpack cannot carry (an integer beyond 64
    bits: ``max_tokens`` with 400 digits) is this request's RequestError naming the field, as
    in-process, never an OverflowError from the encoder."""
    params = getattr(msg, "params", None)
    for name in getattr(type(params), "__struct_fields__", ()):
        value = getattr(params, name)
        if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
            shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}...({len(str(value))} digits)"
            raise RequestError(f"{name}={shown} is out of range: at most {INT64[1]}")
    try:
        return P.encode(msg)
    except (OverflowError, msgspec.EncodeError, TypeError, ValueError) as exc:
        raise RequestError(f"the request cannot be sent to the engine: {exc}") from None
