"""The client side of a Ray deployment: what ``Engine.start(transport="ray")`` and
``ninfer.connect`` hold. One poller thread per client long-polls the frontend for this client's
events (its heartbeat, too: a client that stops polling is considered gone and its requests
are cancelled)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from ninfer import protocol as P
from ninfer.actors.ray_actors import NAMESPACE, FrontendActor, names
from ninfer.config import EngineConfig
from ninfer.protocol import RequestSpec
from ninfer.errors import RequestError

log = logging.getLogger("ninfer.client")


def init_ray(address: str | None) -> None:
    if ray.is_initialized():
        return
    kw = dict(namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING,
              ignore_reinit_error=True)
    if address:
        ray.init(address=address, **kw)
    else:
        import torch
        ray.init(num_gpus=1 if torch.cuda.is_available() else 0, **kw)


def _startup_error(exc: Exception) -> Exception:
    """The deepest NInfer error behind a failed actor start, as one line."""
    from ninfer.errors import ConfigError, ModelLoadError, NInferError
    text = str(exc)
    for line in reversed(text.splitlines()):
        for kind, cls in (("ModelLoadError", ModelLoadError), ("ConfigError", ConfigError)):
            if f"{kind}:" in line:
                return cls(line.split(f"{kind}:", 1)[1].strip())
    return NInferError(f"the deployment failed to start: {text.splitlines()[0] if text else type(exc).__name__}")


class RayClientRuntime:
    def __init__(self, frontend, owns: bool, model_dir: str):
        self.frontend = frontend
        self.owns = owns
        self.model_dir = model_dir
        try:
            self.info = P.decode_info(ray.get(frontend.ready.remote()))
        except ray.exceptions.RayError as exc:
            if owns:
                ray.kill(frontend)
            raise _startup_error(exc) from None
        self.client_id = ray.get(frontend.register_client.remote())
        self._target: Callable[[P.Event], None] = lambda ev: None
        self._on_lost: Callable[[str], None] = lambda msg: None
        self._stop = False
        self._thread = threading.Thread(target=self._poll, name="ninfer-client-poll", daemon=True)

    @classmethod
    def start(cls, model_dir: str, config: EngineConfig, address: str | None, deployment: str,
              detached: bool = False, client_timeout: float = 10.0) -> "RayClientRuntime":
        init_ray(address)
        opts = dict(name=names(deployment)["frontend"], namespace=NAMESPACE)
        if detached:
            opts["lifetime"] = "detached"
        frontend = FrontendActor.options(**opts).remote(model_dir, P.encode(config), deployment, client_timeout)
        return cls(frontend, owns=not detached, model_dir=model_dir)

    @classmethod
    def connect(cls, address: str, deployment: str) -> "RayClientRuntime":
        init_ray(address)
        try:
            frontend = ray.get_actor(names(deployment)["frontend"], namespace=NAMESPACE)
        except ValueError:
            raise RequestError(f"no NInfer deployment named {deployment!r} is serving on this Ray cluster") from None
        return cls(frontend, owns=False, model_dir=ray.get(frontend.model_dir.remote()))

    def attach(self, sink: Callable[[P.Event], None], on_lost: Callable[[str], None] | None = None) -> None:
        self._target = sink
        if on_lost is not None:
            self._on_lost = on_lost
        if not self._thread.is_alive():
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop:
            try:
                batch = ray.get(self.frontend.poll.remote(self.client_id, 1.0))
            except (RayActorError, RequestError, Exception) as exc:   # frontend restarted or gone
                if self._stop:
                    return
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

    def _check(self, err) -> None:
        if err:
            raise RequestError(err)

    def submit(self, spec: RequestSpec) -> None:
        self._check(ray.get(self.frontend.submit.remote(self.client_id, P.encode(spec))))

    def submit_chat(self, chat: P.ChatSpec) -> None:
        err, _ = ray.get(self.frontend.submit_chat.remote(self.client_id, P.encode(chat)))
        self._check(err)

    def cancel(self, rid: str) -> None:
        self.frontend.cancel.remote(rid)

    def call(self, what: str):
        return ray.get(self.frontend.call.remote(what))

    def shutdown(self) -> None:
        if self._stop:
            return
        self._stop = True
        try:
            ray.get(self.frontend.close_client.remote(self.client_id), timeout=10)
        except Exception:
            pass
        self._thread.join(timeout=5)
        if self.owns:
            try:
                ray.kill(self.frontend)          # the controller and worker go with their owner
            except Exception:
                pass
