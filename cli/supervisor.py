"""The worker processes a launcher starts, watches and restarts, wherever they run.

``Workers`` owns them: it starts each planned worker through a ``Starter`` (``local_starter``: a
process on this host; ``pdfabric.cli.ray_launch``: a process that a Ray actor supervises on some node),
waits for them to register, reports one that exits to the dispatcher at once (so its requests fail
over instead of waiting for heartbeats to time out) and starts it again after a backoff
(``RestartPolicy``), unless it drained on purpose or keeps exiting (then it is listed as down). A
started worker is anything with ``Popen``'s ``poll`` / ``wait`` / ``terminate`` / ``kill``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from pdfabric.cluster_secret import ClusterSecret
from pdfabric.config import ServeConfig
from pdfabric.control import KINDS
from pdfabric.worker_config import WorkerConfig

log = logging.getLogger("pdfabric.serve")


class StartupError(RuntimeError):
    pass


class Proc(Protocol):
    """A started worker: the part of ``subprocess.Popen`` the supervisor uses."""

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


# Starts one worker (its whole config, the router's address in ``join``) and returns it running.
Starter = Callable[[str, WorkerConfig], Proc]


def worker_argv(whole: WorkerConfig, parent_pid: int, log_level: str) -> list[str]:
    """The command that starts a worker from its whole config (``pdfabric worker --worker-config``);
    it exits when ``parent_pid`` is gone."""
    return [sys.executable, "-m", "pdfabric.cli", "worker", "--worker-config", whole.to_json(),
            "--parent-pid", str(parent_pid), "--log-level", log_level]  # fmt: skip


def worker_command(cfg: ServeConfig, w: WorkerConfig, join: str, log_level: str) -> list[str]:
    """The command that starts one worker of the launch plan as a child of this process, with the
    router's address and its share of this host's cores."""
    # Workers on one host share its cores; each taking all of them oversubscribes the CPU badly.
    workers = sum(cfg.count(kind) for kind in KINDS)
    threads = w.threads or max(1, (os.cpu_count() or 1) // workers)
    return worker_argv(replace(w, join=join, threads=threads), os.getpid(), log_level)


def local_starter(cfg: ServeConfig, log_level: str, secret: ClusterSecret) -> Starter:
    """Starts each worker as a child process of this one, on this host, the cluster secret in its
    environment (not on its command line, which other users of the host can read)."""

    def start(worker_id: str, worker: WorkerConfig) -> Proc:
        env = {**os.environ, **secret.env()}
        return subprocess.Popen(worker_command(cfg, worker, worker.join, log_level), env=env)

    return start


@dataclass
class WorkerProcess:
    worker_id: str
    worker: WorkerConfig  # its whole config, the router's address in ``join``
    proc: Proc
    exited: bool = False  # its exit was reported
    restart_at: float | None = None  # when it starts again (monotonic seconds)

    @property
    def kind(self) -> str:
        return self.worker.kind


class RestartPolicy:
    """When to start an exited worker again: after ``base_s``, doubling with each exit still inside
    ``window_s`` up to ``max_s``; never again once it exited ``max_exits`` times inside the window
    (the circuit opens: something is wrong that a restart will not fix). No clock of its own."""

    def __init__(
        self, base_s: float = 0.5, max_s: float = 30.0, window_s: float = 300.0, max_exits: int = 5
    ) -> None:
        self.base_s, self.max_s, self.window_s, self.max_exits = base_s, max_s, window_s, max_exits
        self._exits: dict[str, deque[float]] = {}

    def exited(self, worker_id: str, now: float) -> float | None:
        """The worker exited at ``now``: when to start it again, or None to leave it down."""
        exits = self._exits.setdefault(worker_id, deque())
        exits.append(now)
        while exits and exits[0] < now - self.window_s:
            exits.popleft()
        if len(exits) >= self.max_exits:
            return None
        return now + min(self.max_s, self.base_s * 2 ** (len(exits) - 1))


class Workers:
    """The launcher's workers: started through ``starter``, joining the router at ``join``. Its
    ``start`` is also the admin API's ``Spawner`` (versions added at run time) and the scaler's."""

    def __init__(self, join: str, starter: Starter, policy: RestartPolicy | None = None) -> None:
        self.join, self.starter = join, starter
        self.policy = policy or RestartPolicy()
        self.procs: list[WorkerProcess] = []
        self.retiring: set[str] = set()  # drained on purpose (scaled in): gone for good once they exit

    def start(self, plan: list[tuple[str, WorkerConfig]]) -> None:
        """Starts each (worker id, config) of ``plan``; they are watched from now on."""
        for worker_id, worker in plan:
            whole = replace(worker, join=self.join)
            self.procs.append(WorkerProcess(worker_id, whole, self.starter(worker_id, whole)))
            log.info("started worker %s%s", worker_id, f" for {worker.served}" if worker.served else "")

    def ids(self) -> set[str]:
        return {w.worker_id for w in self.procs}

    def retire(self, worker_id: str) -> None:
        """The worker was told to drain and leave: once it exits it is forgotten, not restarted nor
        listed as down."""
        self.retiring.add(worker_id)

    def live(self, kind: str, pool: str = "default") -> list[WorkerProcess]:
        """The workers of ``kind`` in ``pool`` of the deployment's own model that are running or due
        to restart, retiring ones not counted."""
        return [
            w for w in self.procs
            if w.kind == kind and w.worker.pool == pool and not w.worker.served
            and w.worker_id not in self.retiring and (not w.exited or w.restart_at is not None)
        ]  # fmt: skip

    async def wait_ready(self, dispatcher, timeout: float) -> None:  # noqa: ANN001
        """Until every worker has registered; ``StartupError`` when one exits or time runs out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not all(w.worker_id in dispatcher.fleet for w in self.procs):
            for w in self.procs:
                code = w.proc.poll()
                if code is not None:
                    raise StartupError(
                        f"worker {w.worker_id} exited with code {code} during start-up (see its log above)"
                    )
            if loop.time() > deadline:
                missing = [w.worker_id for w in self.procs if w.worker_id not in dispatcher.fleet]
                raise StartupError(f"workers did not register within {timeout:.0f}s: {', '.join(missing)}")
            await asyncio.sleep(0.05)

    async def monitor(self, dispatcher) -> None:  # noqa: ANN001
        """Reports exited workers to the dispatcher at once and starts them again as the policy
        says; runs until cancelled."""
        while True:
            self.check(dispatcher, time.monotonic())
            await asyncio.sleep(0.1)

    def check(self, dispatcher, now: float) -> None:  # noqa: ANN001
        """One pass of ``monitor``."""
        policy = self.policy
        for w in list(self.procs):
            code = w.proc.poll()
            if code is not None and not w.exited:
                w.exited = True
                why = getattr(w.proc, "exit_reason", "") or f"process exited with code {code}"
                dispatcher.worker_gone(w.worker_id, why)
                if w.worker_id in self.retiring:
                    log.warning("worker %s retired (%s)", w.worker_id, why)
                    self.procs.remove(w)
                    self.retiring.discard(w.worker_id)
                    continue
                if code == 0:  # it drained and left on purpose (SIGTERM or Drain): not restarted
                    dispatcher.down[w.worker_id] = "drained: it exited on its own (SIGTERM or an admin drain)"
                    log.warning("worker %s drained and exited", w.worker_id)
                    continue
                w.restart_at = policy.exited(w.worker_id, now)
                if w.restart_at is None:
                    dispatcher.down[w.worker_id] = (
                        f"{why}; it exited {policy.max_exits} times in {policy.window_s:.0f}s and is not "
                        "restarted again"
                    )
                    log.error("worker %s is down: %s", w.worker_id, dispatcher.down[w.worker_id])
                else:
                    log.warning("worker %s %s; restarting in %.1fs", w.worker_id, why, w.restart_at - now)
            if w.exited and w.restart_at is not None and now >= w.restart_at:
                w.proc, w.exited, w.restart_at = self.starter(w.worker_id, w.worker), False, None
                dispatcher.restarts[w.worker_id] = dispatcher.restarts.get(w.worker_id, 0) + 1

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Workers got ``Shutdown`` from the dispatcher; terminate, then kill, those still running."""
        for w in self.procs:
            try:
                w.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                w.proc.terminate()
        for w in self.procs:
            try:
                w.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
