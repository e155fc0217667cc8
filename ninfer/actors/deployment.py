"""A named NInfer deployment on a Ray cluster, as a client process sees it: which cluster to
join, what already runs under a name, and how to clear what a failed start left behind.

    init_ray(address)          an explicit address joins that cluster; None joins the cluster
                               a plain ray.init() would (RAY_ADDRESS, the latest live `ray
                               start`), else starts a private Ray; "local": always private
    find_deployment(name)      None | Found(frontend, info or error, model_dir, config)
    remove_deployment(name)    kills the three named actors, waits until the names are free
    wait_for_free_gpu()        a new worker needs a free GPU on a cluster that has GPUs

The deployment's names are ``<deployment>-frontend``, ``-controller`` and ``-worker``
(``ray_actors.names``); the frontend owns the controller, which owns the worker.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, NamedTuple

import ray
from ray.exceptions import RayError

from ninfer.actors.ray_actors import NAMESPACE, names
from ninfer.actors.startup import last_error_line, startup_error
from ninfer.errors import DeploymentError, NInferError

log = logging.getLogger("ninfer.deployment")


# ---- joining a cluster -------------------------------------------------------------------------

def init_ray(address: str | None) -> None:
    """Connect this process to Ray (once; a second call must not silently mean another cluster).

    A private Ray is started with ``num_gpus`` (one when torch sees a GPU: a CPU-only machine
    can then still place the GPU worker); an existing cluster brings its own resources, and
    Ray refuses ``num_gpus`` when joining one, so that is only passed for a private start.
    """
    if ray.is_initialized():
        _check_same_cluster(address)
        return
    kw = dict(namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING,
              ignore_reinit_error=True)
    private = address == "local" or (address is None and not _cluster_running())
    if not private:
        _check_reachable(address)
    try:
        if private:
            import torch
            ray.init(address="local", num_gpus=1 if torch.cuda.is_available() else 0, **kw)
        else:
            ray.init(address=address, **kw)
    except ConnectionError:
        raise DeploymentError(
            f"no Ray cluster is running at address {address or os.environ.get('RAY_ADDRESS')!r}: start one "
            "with `ray start --head` (or deploy/start.sh), or leave the address out for a private Ray") from None
    except (RuntimeError, RayError) as exc:
        found = last_error_line(str(exc))
        detail = f"{found[0]}: {found[1]}" if found else str(exc).splitlines()[0]
        raise DeploymentError(f"cannot join the Ray cluster at {address or 'RAY_ADDRESS'!r}: {detail}") from None


def _check_reachable(address: str | None, timeout_s: float = 15.0) -> None:
    """A cluster address where nothing answers is one DeploymentError within ``timeout_s``:
    ray.init itself retries such an address for minutes (measured: > 8 min for ``auto`` with
    the address file of a stopped cluster; 80 s and counting for a closed port). Only the GCS
    port's TCP answer is checked here; joining is still ray.init's. Ray Client addresses
    (``ray://``) are left to Ray."""
    if address is not None and address.startswith("ray://"):
        return
    try:
        from ray._private import services
        resolved = services.canonicalize_bootstrap_address(address)
    except Exception as exc:                    # no address file, a malformed address: ray.init says so
        log.debug("cannot resolve the Ray address %r before joining: %s", address, exc)
        return
    if resolved is None:
        return
    host, _, port = resolved.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)).close()
            return
        except OSError as exc:
            if time.monotonic() + 1.0 > deadline:
                named = f" (address {address!r})" if address not in (None, resolved) else ""
                raise DeploymentError(
                    f"no Ray cluster answers at {resolved}{named}: {exc.strerror or type(exc).__name__}; start "
                    "one with `ray start --head` (or deploy/start.sh), or leave the address out for a private "
                    "Ray") from None
            time.sleep(1.0)


def _cluster_running() -> bool:
    """Whether a plain ray.init() would join a running cluster: RAY_ADDRESS is set, or the
    latest `ray start` on this machine still runs (the address file a stopped cluster leaves
    behind does not count: that would fail to connect instead of starting a private Ray)."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    try:
        from ray._private import services     # Ray's own lookup, so the answer matches ray.init
        latest = services.find_bootstrap_address(None)
        return latest is not None and latest in services.find_gcs_addresses()
    except Exception:                          # the private lookup moved: start a private Ray
        return False


def _check_same_cluster(address: str | None) -> None:
    """A process holds one Ray connection; asking for another cluster is an error, not a
    quiet deployment on the wrong one."""
    if address in (None, "auto", "local"):
        return
    current = ray.get_runtime_context().gcs_address
    if _canonical(address) != _canonical(current):
        raise DeploymentError(
            f"this process is already connected to the Ray cluster at {current}, not {address}: "
            "use a separate process for the other cluster (or ray.shutdown() first)")


def _canonical(address: str) -> str:
    try:
        from ray._private.services import canonicalize_bootstrap_address
        return canonicalize_bootstrap_address(address) or address
    except Exception:
        return address


# ---- what runs under a name ----------------------------------------------------------------------

class Found(NamedTuple):
    """A deployment already on the cluster: healthy (``info`` set) or failed (``error`` set)."""

    frontend: Any
    info: bytes | None
    error: NInferError | None
    model_dir: str
    config: bytes

    def serves(self, model_dir: str, config: bytes) -> bool:
        return os.path.realpath(self.model_dir) == os.path.realpath(model_dir) and self.config == config

    def conflict(self, deployment: str, model_dir: str, detached: bool) -> DeploymentError:
        """What to do when a healthy deployment holds the name a start wants."""
        if not detached:
            return DeploymentError(
                f"a deployment named {deployment!r} is already serving {self.model_dir} on this Ray cluster: "
                f"attach to it with ninfer.connect(deployment={deployment!r}) or `ninfer serve --address auto`, "
                "or start this one under another name (deployment= / --deployment)")
        what = ("another model" if os.path.realpath(self.model_dir) != os.path.realpath(model_dir)
                else "another engine config")
        return DeploymentError(
            f"the deployment {deployment!r} on this Ray cluster serves {self.model_dir} with {what}: stop it "
            f"first (deploy/stop.sh {deployment}) or serve this one under another name (--deployment NAME)")


def find_deployment(deployment: str) -> Found | None:
    """The deployment named ``deployment``, once it has finished starting or failed.

    A start still under way is waited for (loading a large model takes minutes, and killing it
    would throw that away); a failed one answers ready() with its startup error.
    """
    try:
        frontend = ray.get_actor(names(deployment)["frontend"], namespace=NAMESPACE)
    except ValueError:
        return None
    except Exception as exc:                   # noqa: BLE001 — named, but its class went with its dead starter
        return Found(None, None, DeploymentError(f"its frontend cannot be reached ({type(exc).__name__})"), "", b"")
    try:
        info, error = ray.get(frontend.ready.remote()), None
    except RayError as exc:
        info, error = None, startup_error(exc)
    return Found(frontend, info, error, *_describe(frontend))


def _describe(frontend) -> tuple[str, bytes]:
    """(model_dir, encoded config) of a deployment; empty when it cannot say (it died, or an
    older frontend has no ``config`` method): such a one is never attached to."""
    try:
        return tuple(ray.get([frontend.model_dir.remote(), frontend.config.remote()]))
    except (RayError, AttributeError):
        return "", b""


def _replica_names(deployment: str) -> list[str]:
    """The controllers and workers of a replicated deployment's replicas (``<name>-r<slot>.<gen>-...``)."""
    import re
    pattern = re.compile(rf"^{re.escape(deployment)}-r\d+\.\d+-(controller|worker)$")
    try:
        found = ray.util.list_named_actors(all_namespaces=True)
    except Exception:                          # noqa: BLE001 — an older Ray: only the three names
        return []
    return [a["name"] for a in found if a.get("namespace") == NAMESPACE and pattern.match(a["name"])]


def remove_replica_groups(deployment: str) -> None:
    """The placement groups of a replicated deployment's replicas (they hold its GPUs)."""
    import re

    from ray.util.placement_group import get_placement_group, remove_placement_group
    try:
        table = ray.util.placement_group_table()
    except Exception:                          # noqa: BLE001
        return
    pattern = re.compile(rf"^{re.escape(deployment)}-r\d+\.\d+$")
    for row in table.values():
        if pattern.match(row.get("name") or "") and row.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(row["name"]))
            except Exception:                  # noqa: BLE001 — gone meanwhile
                pass


def remove_deployment(deployment: str, timeout: float = 10.0) -> None:
    """Kill the deployment's named actors and wait until the names are free, so that a start
    right after does not collide with them."""
    for name in list(names(deployment).values()) + _replica_names(deployment):
        _kill_named(name)
    remove_replica_groups(deployment)
    deadline = time.monotonic() + timeout
    while any(_exists(name) for name in names(deployment).values()):
        if time.monotonic() > deadline:
            raise DeploymentError(f"the actors of deployment {deployment!r} were killed but still hold their "
                                  f"names after {timeout:g} s; try again, or stop Ray (deploy/stop.sh)")
        time.sleep(0.05)


def _kill_named(name: str) -> None:
    """Kill one named actor of ours. A handle by name needs the actor's class from GCS's
    function table, and that entry goes with the job that created it: an actor a dead starter
    left (its driver gone) can be named but not handled (Ray raises an AssertionError deep in
    ``get_actor``). Such an actor is killed by its id from the GCS actor table instead."""
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:                         # not there (never created, or already gone)
        return
    except Exception:                          # noqa: BLE001 — named, but no handle can be made
        _kill_by_id(name)
        return
    ray.kill(handle, no_restart=True)


def _kill_by_id(name: str) -> None:
    from ray._private import state
    from ray._private.worker import global_worker
    for info in state.actors().values():
        if info.get("Name") == name and info.get("State") != "DEAD":
            global_worker.core_worker.kill_actor(ray.ActorID.from_hex(info["ActorID"]), True)


def find_named(deployment: str) -> bool:
    """Whether any of the deployment's three named actors exists (even one a failed start left)."""
    return any(_exists(name) for name in names(deployment).values())


def wait_for_free_gpu(count: int = 1, timeout: float = 10.0) -> None:
    """On a cluster with GPUs, wait until ``count`` are free for the new workers (one per
    replica; a deployment just removed releases its GPU a moment later); too few free is an
    error, not a start that would wait forever for the GPU another deployment holds."""
    total = ray.cluster_resources().get("GPU", 0)
    if total < 1:
        return                                 # the workers ask for no GPU here
    if total < count:
        raise DeploymentError(f"{count} replicas need {count} GPUs, and this Ray cluster has {total:g}: add GPU "
                              "nodes (ray start --address HEAD) or serve fewer replicas (--replicas)")
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("GPU", 0) < count:
        if time.monotonic() > deadline:
            raise DeploymentError(
                f"no {'GPU is' if count == 1 else f'{count} GPUs are'} free on this Ray cluster for the new "
                "deployment's workers: stop the deployment that holds them (deploy/stop.sh NAME) or attach to it "
                "(ninfer serve --address auto --deployment NAME)")
        time.sleep(0.1)


def _exists(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
        return True
    except ValueError:
        return False
    except Exception:                          # noqa: BLE001 — named, though no handle can be made
        return True

