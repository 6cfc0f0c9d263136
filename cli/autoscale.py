"""The pool scaler at work (``[autoscale] enabled``): every ``interval_s`` it reads the router's
signals, asks ``router.scaler.Scaler`` for pool sizes and acts on its decisions.

Up: new workers of the kind's default pool start through the launcher's ``supervisor.Workers``
(local processes or Ray actors alike), named ``KIND-N`` with the next free ``N``. Down: the worker
holding the fewest requests (the newest among equals) is told to drain, so its requests finish
where they are; once it exits it is forgotten, not restarted. Each decision is logged, written to
the audit log (``scale_up`` / ``scale_down``, with its reason) and counted in
``pdfabric_scale_decisions_total{kind,direction}``; ``pdfabric_pool_target_workers{kind}`` is the
size each pool was last set to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdfabric.cli.supervisor import Workers
from pdfabric.config import ServeConfig
from pdfabric.control import KINDS
from pdfabric.router.platform.scaler import Decision, Observations, Pool, Scaler, Signals
from pdfabric.router.routing.registry import WorkerInfo

log = logging.getLogger("pdfabric.cli.autoscale")


class Autoscaler:
    def __init__(
        self,
        cfg: ServeConfig,
        dispatcher: Any,  # pdfabric.router.dispatch.dispatcher.Dispatcher
        workers: Workers,
        observed: Observations,
        registry: CollectorRegistry,
        on_event: Callable[[str, str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg, self.dispatcher, self.workers, self.observed = cfg, dispatcher, workers, observed
        self.scaler = Scaler(cfg.autoscale, {k: cfg.own_count(k) for k in KINDS})
        self.on_event = on_event or (lambda action, target, details: None)
        self.decisions = Counter(
            "pdfabric_scale_decisions",
            "Pool size changes by the scaler",
            ["kind", "direction"],
            registry=registry,
        )
        self.target = Gauge(
            "pdfabric_pool_target_workers",
            "Workers the scaler last set each pool to",
            ["kind"],
            registry=registry,
        )
        for kind in self.scaler.bounds:
            self.target.labels(kind).set(len(workers.live(kind)))

    async def run(self) -> None:
        """Decides and acts every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.cfg.autoscale.interval_s)
            for decision in self.scaler.decide(self.signals(time.monotonic())):
                self.apply(decision)

    def signals(self, now: float) -> Signals:
        pools = {kind: self._pool(kind) for kind in self.scaler.bounds}
        recent = self.observed.recent(now)
        waiting = self.dispatcher.fleet.waiting
        return Signals(now, recent, self.observed.window_s, waiting, pools, self.dispatcher.fleet.in_flight)

    def _pool(self, kind: str) -> Pool:
        live = {w.worker_id for w in self.workers.live(kind)}
        infos: list[WorkerInfo] = [
            i for i in self.dispatcher.fleet.workers.values() if i.worker_id in live
        ]
        total = sum(i.reg.num_blocks for i in infos)
        used = total - sum(i.free_blocks for i in infos)
        if not infos:
            return Pool(len(live))
        # The profile fitted from the most steps: a worker just added may have profiled on a busy CPU.
        profiles = [i.load.profile if i.load is not None else i.reg.profile for i in infos]
        profile = max(profiles, key=lambda p: p.prefill_samples + p.decode_samples)
        info = infos[0]
        return Pool(
            len(live),
            used / total if total else 0.0,
            profile,
            info.reg.max_running,
            info.reg.max_batch_tokens,
        )

    def apply(self, d: Decision) -> None:
        """Starts or drains workers until ``d.kind``'s pool has ``d.target``."""
        live = self.workers.live(d.kind)
        if d.target > len(live):
            taken = self.workers.ids()
            new = []
            n = 0
            while len(new) < d.target - len(live):
                worker_id = f"{d.kind}-{n}"
                if worker_id not in taken:
                    new.append((worker_id, self.cfg.pool_worker(d.kind, worker_id)))
                n += 1
            self.workers.start(new)
            changed = [w for w, _ in new]
        else:
            fleet = self.dispatcher.fleet
            order = sorted(live, key=lambda w: (fleet.held_by(w.worker_id), -_index(w.worker_id)))
            changed = []
            for w in order[: len(live) - d.target]:
                self.workers.retire(w.worker_id)
                if w.worker_id in fleet:
                    self.dispatcher.drain_worker(w.worker_id, "scaled in")
                else:  # not registered yet: nothing to drain
                    w.proc.terminate()
                changed.append(w.worker_id)
        self.decisions.labels(d.kind, d.direction).inc()
        self.target.labels(d.kind).set(d.target)
        log.warning("scale %s %s: %d -> %d workers (%s): %s", d.direction, d.kind, d.current, d.target,
                    d.reason, ", ".join(changed))  # fmt: skip
        details = {"from": d.current, "to": d.target, "reason": d.reason, "workers": changed}
        self.on_event(f"scale_{d.direction}", d.kind, details)


def _index(worker_id: str) -> int:
    tail = worker_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0
