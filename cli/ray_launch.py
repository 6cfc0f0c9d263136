"""Workers on a Ray cluster (``pdfabric serve --ray [ADDRESS]``, or ``[ray] address``).

The router runs where it is started. Each worker is a ``pdfabric worker`` process that a Ray actor
(``WorkerHost``) starts and waits on, on a node Ray picks by the actor's resource request
(``RayConfig.request``: CPUs, GPUs, a custom resource per pool). The worker joins the router over the
control socket as a local one does, and KV moves directly between the workers' processes (shared
memory when both are on one host, tcp across hosts); nothing goes through Ray's object store.

Supervision is ``supervisor.Workers``'s, as for local workers: an actor whose worker exits, or that
dies with its node, reports the exit; the router fails its requests over at once and a new actor is
started after the backoff, wherever Ray finds room for it. Actors are never restarted by Ray itself
(one restart policy, not two). Ray is an optional extra: ``pip install 'pdfabric[ray]'``.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import replace
from typing import Any

from pdfabric.cli.supervisor import Proc, Starter, StartupError, worker_argv
from pdfabric.cluster_secret import ClusterSecret
from pdfabric.config import ServeConfig
from pdfabric.worker_config import WorkerConfig, worker_config_from_json

log = logging.getLogger("pdfabric.serve")
LOST = -9  # the exit code reported for a worker whose actor (or node) died under it


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise StartupError("serving on Ray needs Ray installed: pip install 'pdfabric[ray]'") from None
    return ray


def connect(cfg: ServeConfig) -> None:
    """Joins the Ray cluster at ``[ray] address`` as a driver (the router's process)."""
    ray = _ray()
    try:
        ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise StartupError(f"cannot join the Ray cluster at {cfg.ray.address!r}: {exc}") from None
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    log.warning("joined Ray cluster %s: %d nodes alive", cfg.ray.address, len(nodes))


def join_address(bound: str) -> str:
    """The control address workers on other nodes join: ``bound``, with a wildcard host (0.0.0.0)
    replaced by this node's IP as Ray sees it."""
    head, _, port = bound.rpartition(":")
    if head.endswith("//0.0.0.0") or head.endswith("//*"):
        return f"tcp://{_ray().util.get_node_ip_address()}:{port}"
    return bound


def disconnect() -> None:
    """Leaves the cluster; the workers' actors (owned by this driver) end with it."""
    ray = _ray()
    if ray.is_initialized():
        ray.shutdown()


class WorkerHost:
    """A Ray actor that runs one worker process on its node and reports its exit code."""

    def __init__(self, worker_json: str, log_level: str, kv_on_node: bool) -> None:
        import ray

        worker = worker_config_from_json(worker_json)
        if kv_on_node:
            worker = replace(worker, kv_host=ray.util.get_node_ip_address())
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
        threads = worker.threads or max(1, int(cpus) or os.cpu_count() or 1)
        self.proc = subprocess.Popen(worker_argv(replace(worker, threads=threads), os.getpid(), log_level))

    def wait(self) -> int:
        return self.proc.wait()

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()

    def where(self) -> dict[str, Any]:
        """Where it runs: Ray's node id and IP, the worker process's pid."""
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": self.proc.pid}


class RayProc:
    """A worker started through a ``WorkerHost`` actor, seen as a process (``supervisor.Proc``)."""

    def __init__(self, actor: Any) -> None:
        self.ray = _ray()
        self.actor = actor
        self.exit_reason = ""
        self._exit = actor.wait.remote()  # resolves to the exit code, or raises when the actor died
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None and self.ray.wait([self._exit], timeout=0)[0]:
            self._settle()
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        if self._code is None:
            ready = self.ray.wait([self._exit], timeout=timeout)[0]
            if not ready:
                raise subprocess.TimeoutExpired("ray worker actor", timeout or 0)
            self._settle()
        assert self._code is not None
        return self._code

    def terminate(self) -> None:
        if self._code is None:
            self.actor.terminate.remote()

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)

    def _settle(self) -> None:
        try:
            self._code = self.ray.get(self._exit)
        except self.ray.exceptions.RayActorError as exc:
            self._code = LOST
            self.exit_reason = f"its Ray actor died ({type(exc).__name__}: the node or the actor was lost)"
        self.ray.kill(self.actor, no_restart=True)  # its resources go back to the cluster


def ray_starter(cfg: ServeConfig, log_level: str, secret: ClusterSecret) -> Starter:
    """Starts each worker through a ``WorkerHost`` actor placed by its kind's or pool's request; the
    cluster secret reaches the worker process through the actor's environment (Ray's runtime env)."""
    ray = _ray()
    host = ray.remote(WorkerHost)

    def start(worker_id: str, worker: WorkerConfig) -> Proc:
        request = cfg.ray.request(worker.kind, worker.pool)
        cpus, gpus = request.pop("CPU"), request.pop("GPU", 0)
        actor = host.options(
            num_cpus=cpus, num_gpus=gpus, resources=request, max_restarts=0, max_concurrency=4,
            runtime_env={"env_vars": secret.env()},
        ).remote(worker.to_json(), log_level, cfg.ray.kv_host == "node")  # fmt: skip
        log.info("worker %s: Ray actor asking for %s", worker_id, {"CPU": cpus, "GPU": gpus, **request})
        return RayProc(actor)

    return start
