"""The admin API for models and versions: traffic weights, canary rollouts, adding and removing
versions, all without restarting the router or dropping a stream. Every call needs the admin key
and is audited (``admin.Audit``).

- ``GET /admin/models``: each model's versions (state, weight, checkpoint, workers, warm-up and
  cold-start seconds) and its rollout, if any.
- ``POST /admin/models/{model}/weights`` ``{"weights": {"v1": 90, "v2": 10}}``: sets traffic weights
  (409 while a rollout runs).
- ``POST /admin/models/{model}/rollout`` ``{"canary": "v2", "steps": [5, 25, 50, 100], "step_s": 60,
  "guardrails": {...}}``: starts a canary rollout (``rollout.Rollout``), ticked every
  ``TICK_S``; ``DELETE`` stops it (the incumbents get their weights back).
- ``POST /admin/models/{model}/versions`` with a ``[[models.versions]]`` table as JSON: starts the
  version's workers (through a ``Spawner``: the launcher's ``supervisor.Workers``), waits for them
  to register, sends one health-check request through them, then gives the version its ``weight``
  (default 0: pin it, set weights or roll it out). 202 at once; ``GET /admin/models`` shows
  ``warming``, then ``ready`` (or ``failed`` with the reason).
- ``DELETE /admin/models/{model}/versions/{version}``: the version takes no new requests and its
  workers drain: those in flight finish on it, then the workers exit.

Cold start per version: ``ready_s`` (added to warm-up passed) and ``cold_start_s`` (added to its
first client request routed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from pdfabric.config import ServeConfig
from pdfabric.control import PREFILL
from pdfabric.model_versions import ServedModel, check_name, parse_version, version_plan
from pdfabric.profile import WorkerProfile
from pdfabric.router.dispatch.dispatcher import Dispatcher
from pdfabric.router.errors import ApiError
from pdfabric.router.json_body import parse_json_body
from pdfabric.router.platform.admin import AUDIT, unauthorized
from pdfabric.router.platform.catalog import FAILED, READY, RETIRED, WARMING, Catalog, Version, load_tokenizer
from pdfabric.router.platform.rollout import Rollout, RolloutSpec, token_cost
from pdfabric.router.routing.registry import WorkerInfo
from pdfabric.router.routing.slo import resolve
from pdfabric.sampling_params import SamplingParams
from pdfabric.worker_config import WorkerConfig

log = logging.getLogger("pdfabric.router")
TICK_S = 0.5  # how often running rollouts are judged
WARM_TIMEOUT_S = 180.0  # a new version's workers must register and pass the health check in this long


class Spawner(Protocol):
    """Starts worker processes for a version added at run time (the launcher's)."""

    def start(self, plan: list[tuple[str, WorkerConfig]]) -> None: ...


class Models:
    """The router's model versions at run time: rollouts, warm-ups and their background tasks."""

    def __init__(
        self, cfg: ServeConfig, catalog: Catalog, dispatcher: Dispatcher, spawner: Spawner | None
    ) -> None:
        self.cfg, self.catalog, self.dispatcher, self.spawner = cfg, catalog, dispatcher, spawner
        self.rollouts: dict[str, Rollout] = {}
        self.on_event: Callable[[str, str, dict[str, Any]], None] = lambda action, target, details: None
        self._tasks: set[asyncio.Task[None]] = set()

    def observe(self, version: Version, ok: bool, ttft_s: float | None, itl_s: float | None) -> None:
        """A finished request: its model's rollout, if any, counts it."""
        rollout = self.rollouts.get(version.model)
        if rollout is not None:
            rollout.observe(version.name, ok, ttft_s, itl_s)

    # --- rollouts -------------------------------------------------------------------------------

    def no_rollout(self, model: str) -> None:
        """A 409 when the model has a rollout running (its weights are the rollout's to set)."""
        rollout = self.rollouts.get(model)
        if rollout is not None and not rollout.done:
            raise ApiError(409, f"model {model!r} has a rollout running; stop it first", kind="conflict")

    def start_rollout(self, spec: RolloutSpec) -> Rollout:
        model = self.catalog.models[spec.model]
        self.no_rollout(spec.model)
        canary = model.versions.get(spec.canary)
        if canary is None or canary.state != READY:
            raise ApiError(400, f"canary {spec.canary!r} is not a ready version of {spec.model!r}", "canary")
        incumbents = {v.name: v.weight for v in model.live() if v.name != spec.canary and v.state == READY}
        try:
            rollout = Rollout(spec, incumbents, time.monotonic())
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        self.rollouts[spec.model] = rollout
        self.catalog.set_weights(spec.model, rollout.weights())
        self._spawn(self._tick(rollout))
        return rollout

    async def _tick(self, rollout: Rollout) -> None:
        while not rollout.done:
            await asyncio.sleep(TICK_S)
            if self.rollouts.get(rollout.spec.model) is not rollout:
                return
            rollout.observe_cost(*self._costs(rollout))
            if rollout.tick(time.monotonic()):
                self.catalog.set_weights(rollout.spec.model, rollout.weights())
                label = f"{rollout.spec.model}@{rollout.spec.canary}"
                now_at = rollout.reason or f"{rollout.weights()[rollout.spec.canary]:g}%"
                log.warning("rollout of %s: %s %s", label, rollout.state, now_at)
                details = {"reason": rollout.reason, "weights": rollout.weights()}
                self.on_event(f"rollout_{rollout.state}", label, details)

    def _costs(self, rollout: Rollout) -> tuple[float | None, float | None]:
        """The canary's and the incumbents' cost per token (``rollout.token_cost``), both at the
        incumbents' mean decode batch and context per sequence now."""
        model = self.catalog.models[rollout.spec.model]
        routing = self.cfg.routing

        def decoders(names: list[str]) -> list[WorkerInfo]:
            keys = {model.versions[n].key for n in names if n in model.versions}
            return [w for k in keys for w in self.dispatcher.fleet.serving(k) if w.reg.kind != PREFILL]

        def priced(workers: list[WorkerInfo]) -> list[tuple[WorkerProfile, float]]:
            return [(w.load.profile, routing.pool(w.reg.kind, w.reg.pool).cost) for w in workers if w.load]

        incumbents = decoders(list(rollout.incumbents))
        busy = [w.load for w in incumbents if w.load is not None and w.load.running]
        batch = round(statistics.fmean(h.running for h in busy)) if busy else 1
        context = round(statistics.fmean(h.context_tokens / h.running for h in busy)) if busy else 1
        canary = token_cost(priced(decoders([rollout.spec.canary])), batch, context)
        return canary, token_cost(priced(incumbents), batch, context)

    def stop_rollout(self, model: str) -> Rollout:
        rollout = self.rollouts.get(model)
        if rollout is None or rollout.done:
            raise ApiError(404, f"model {model!r} has no rollout running", kind="not_found_error")
        rollout.stop(time.monotonic(), "stopped by the operator")
        self.catalog.set_weights(model, rollout.weights())
        return rollout

    # --- versions -------------------------------------------------------------------------------

    async def add_version(self, model: str, table: Any) -> Version:
        """Starts a version's workers and warms it up in the background (see the module docstring)."""
        if self.spawner is None:
            raise ApiError(409, "this router starts no workers (they join from elsewhere)", kind="conflict")
        try:
            check_name("a model", model)
            weight = table.pop("weight", 0.0) if isinstance(table, dict) else 0.0
            vcfg = parse_version(table, self.cfg.worker, "the version")
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        existing = self.catalog.models.get(model)
        if (
            existing is not None
            and vcfg.name in existing.versions
            and not existing.versions[vcfg.name].retired
        ):
            raise ApiError(409, f"{model}@{vcfg.name} exists already", kind="conflict")
        if existing is not None and any(
            w.reg.served == f"{model}@{vcfg.name}" for w in self.dispatcher.fleet.workers.values()
        ):
            raise ApiError(
                409, f"workers of a removed {model}@{vcfg.name} are still draining", kind="conflict"
            )
        try:
            _, tokenizer = await asyncio.to_thread(load_tokenizer, vcfg.model)
        except (OSError, ValueError) as exc:
            raise ApiError(400, f"cannot load model {vcfg.model!r}: {exc}", "model") from None
        version = Version(model, vcfg.name, vcfg.model, tokenizer, 0.0, time.monotonic(), state=WARMING)
        sticky = existing.sticky if existing is not None else True
        self.catalog.add(version, sticky)
        mcfg = ServedModel(model, (vcfg,), sticky)
        self.spawner.start(version_plan(mcfg, vcfg))
        self._spawn(self._warm(version, float(weight)))
        return version

    async def _warm(self, version: Version, weight: float) -> None:
        """Waits for the version's workers, then one greedy token through them; then it is ready."""
        deadline = time.monotonic() + WARM_TIMEOUT_S
        try:
            while not self.dispatcher.fleet.has_route(version.key):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"its workers did not register within {WARM_TIMEOUT_S:.0f}s")
                await asyncio.sleep(0.1)
            await asyncio.wait_for(self._health_check(version), max(1.0, deadline - time.monotonic()))
        except (TimeoutError, ApiError, RuntimeError) as exc:
            version.state, version.reason = FAILED, str(exc) or type(exc).__name__
            log.error("version %s failed its warm-up: %s", version.label, version.reason)
            self._drain(version)
            self.on_event("version_failed", version.label, {"reason": version.reason})
            return
        version.state, version.ready_at, version.weight = READY, time.monotonic(), weight
        log.warning("version %s is ready after %.1fs", version.label, version.ready_at - version.added_at)
        self.on_event(
            "version_ready", version.label, {"ready_s": round(version.ready_at - version.added_at, 3)}
        )

    async def _health_check(self, version: Version) -> None:
        prompt = tuple(version.tokenizer.encode("health check", add_special_tokens=True))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        request_id = f"warmup-{version.model}-{version.name}-{time.monotonic_ns()}"
        resolved = resolve(self.cfg.routing, None, "")
        stream = await self.dispatcher.submit(request_id, prompt, params, (), resolved, served=version.key)
        try:
            while True:
                delta = await stream.queue.get()
                if delta.finish_reason in ("error", "abort"):
                    raise RuntimeError(f"its health check failed: {delta.error or delta.finish_reason}")
                if delta.finish_reason is not None:
                    return
        finally:
            self.dispatcher.release(request_id, "health check done")

    def remove_version(self, model: str, name: str) -> Version:
        m = self.catalog.models.get(model)
        version = m.versions.get(name) if m is not None else None
        if version is None or version.retired:
            raise ApiError(404, f"no live version {model}@{name}", kind="not_found_error")
        self.no_rollout(model)
        others = [v for v in m.live() if v is not version and v.state == READY and v.weight > 0]
        if version.state == READY and version.weight > 0 and not others:
            raise ApiError(409, f"{model}@{name} is the only version with traffic; give another weight first",
                           kind="conflict")  # fmt: skip
        version.state, version.weight = RETIRED, 0.0
        self._drain(version)
        return version

    def _drain(self, version: Version) -> None:
        for w in self.dispatcher.fleet.serving(version.key):
            with contextlib.suppress(KeyError):
                self.dispatcher.drain_worker(w.worker_id, f"version {version.label} removed")

    def report(self) -> dict[str, Any]:
        models = []
        for m in self.catalog.models.values():
            versions = []
            for v in m.versions.values():
                workers = sorted(w.worker_id for w in self.dispatcher.fleet.serving(v.key))
                versions.append({
                    "id": v.label, "state": v.state, "weight": v.weight, "checkpoint": v.checkpoint,
                    "workers": workers, "reason": v.reason,
                    "ready_s": None if v.ready_at is None else round(v.ready_at - v.added_at, 3),
                    "cold_start_s": None if v.cold_start_s is None else round(v.cold_start_s, 3),
                })  # fmt: skip
            rollout = self.rollouts.get(m.name)
            models.append({"id": m.name, "sticky": m.sticky, "versions": versions,
                           "rollout": rollout.report() if rollout is not None else None})  # fmt: skip
        return {"models": models}

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


MODELS = web.AppKey("models", Models)


def add_model_admin(app: web.Application, models: Models) -> None:
    app[MODELS] = models
    audit = app[AUDIT]
    models.on_event = lambda action, target, details: audit.write("router", action, target, 0, details)
    app.router.add_get("/admin/models", _handler("models", _list))
    app.router.add_post("/admin/models/{model}/weights", _handler("set_weights", _weights))
    app.router.add_post("/admin/models/{model}/rollout", _handler("start_rollout", _rollout))
    app.router.add_delete("/admin/models/{model}/rollout", _handler("stop_rollout", _stop))
    app.router.add_post("/admin/models/{model}/versions", _handler("add_version", _add))
    app.router.add_delete("/admin/models/{model}/versions/{version}", _handler("remove_version", _remove))
    app.on_cleanup.append(lambda _: models.close())


Handler = Callable[[web.Request, Models], Awaitable[tuple[int, dict[str, Any]]]]


def _handler(action: str, fn: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
    """Checks the admin key, runs ``fn``, answers its JSON (or the error) and audits the call."""

    async def handle(request: web.Request) -> web.Response:
        target = "@".join(request.match_info.get(k, "") for k in ("model", "version")).strip("@")
        if (refused := unauthorized(request, action, target)) is not None:
            return refused
        try:
            status, body = await fn(request, request.app[MODELS])
        except ApiError as err:
            status, body = err.status, err.body()
        request.app[AUDIT].record(request, action, target, status)
        return web.json_response(body, status=status)

    return handle


async def _json(request: web.Request) -> Any:
    return parse_json_body(await request.read())


def _model(request: web.Request, models: Models) -> str:
    name = request.match_info["model"]
    if name not in models.catalog.models:
        raise ApiError(404, f"no model {name!r}", kind="not_found_error")
    return name


async def _list(request: web.Request, models: Models) -> tuple[int, dict[str, Any]]:
    return 200, models.report()


async def _weights(request: web.Request, models: Models) -> tuple[int, dict[str, Any]]:
    model, body = _model(request, models), await _json(request)
    models.no_rollout(model)
    if not isinstance(body, dict) or not isinstance(body.get("weights"), dict):
        raise ApiError(400, 'the body must be {"weights": {"VERSION": WEIGHT, ...}}', "weights")
    try:
        models.catalog.set_weights(model, body["weights"])
    except ValueError as exc:
        raise ApiError(400, str(exc), "weights") from None
    return 200, {"model": model, "weights": {v.name: v.weight for v in models.catalog.models[model].live()}}


async def _rollout(request: web.Request, models: Models) -> tuple[int, dict[str, Any]]:
    model, body = _model(request, models), await _json(request)
    try:
        spec = RolloutSpec.from_body(model, body)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc)) from None
    return 202, models.start_rollout(spec).report()


async def _stop(request: web.Request, models: Models) -> tuple[int, dict[str, Any]]:
    return 200, models.stop_rollout(_model(request, models)).report()


async def _add(request: web.Request, models: Models) -> tuple[int, dict[str, Any]]:
    version = await models.add_version(request.match_info["model"], await _json(request))
    return 202, {"version": version.label, "state": version.state}


async def _remove(request: web.Request, models: Models) -> tuple[int, dict[str, Any]]:
    version = models.remove_version(_model(request, models), request.match_info["version"])
    return 202, {"version": version.label, "state": version.state}
