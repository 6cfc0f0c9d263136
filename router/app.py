"""The router's HTTP application: OpenAI-compatible endpoints over the dispatcher.

Each handler names the request's tenant and model version (``access``: 401 / 403 / a tenant's 429),
validates (400 naming the field), tokenizes off the event loop with its version's tokenizer, submits
the request to that version's workers,
then streams SSE chunks (or collects a JSON body) while detokenizing incrementally
(``router/responses.py``). Whatever ends the
handler (finish, stop string, error, timeout, client disconnect), its ``finally`` releases the request
so that every worker still holding it gets an ``Abort``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import asdict, replace
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdfabric.config import ServeConfig
from pdfabric.control import HandedOff
from pdfabric.engine.detokenizer import IncrementalDetokenizer
from pdfabric.router import access, responses
from pdfabric.router import idempotency as idem
from pdfabric.router import openai_api as api
from pdfabric.router import prompts as prompts_
from pdfabric.router.access import ACCESS
from pdfabric.router.admin import LIFECYCLE, Audit, add_admin
from pdfabric.router.admin_models import MODELS, Models, Spawner, add_model_admin
from pdfabric.router.breakdown import TokenTimes, breakdown
from pdfabric.router.catalog import VERSION_HEADER, Catalog
from pdfabric.router.dispatcher import Dispatcher, RequestStream
from pdfabric.router.metrics import RouterMetrics
from pdfabric.router.openapi import openapi_document
from pdfabric.router.registry import has_route
from pdfabric.router.routes import Budgets
from pdfabric.router.routing import Rejected
from pdfabric.router.scaler import Finished, Observations
from pdfabric.router.slo import BudgetError, resolve
from pdfabric.router.tenants import LimitError

CONFIG = web.AppKey("config", ServeConfig)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
CATALOG = web.AppKey("catalog", Catalog)
OBSERVED = web.AppKey("observed", Observations)  # recent requests: what the pool scaler reads
METRICS = web.AppKey("metrics", RouterMetrics)
IDEMPOTENCY = web.AppKey("idempotency", idem.IdempotencyStore)


def build_app(
    cfg: ServeConfig, dispatcher: Dispatcher, catalog: Catalog, spawner: Spawner | None = None
) -> web.Application:
    """The router's application over ``dispatcher``, serving ``catalog``'s models; ``spawner``
    starts the workers of versions added through the admin API (None: it cannot)."""
    app = web.Application(client_max_size=16 * 2**20)
    app[CONFIG], app[DISPATCHER], app[CATALOG] = cfg, dispatcher, catalog
    app[OBSERVED] = Observations(cfg.autoscale.window_s)
    app[IDEMPOTENCY] = idem.IdempotencyStore(cfg.idempotency_ttl_s, cfg.idempotency_max_entries)
    app[ACCESS] = platform = access.Access(cfg.routing, catalog)
    app[METRICS] = metrics_ = RouterMetrics(
        dispatcher.registry,
        lambda: len(dispatcher.routing.queue),
        lambda: dispatcher.restarts,
        lambda: dispatcher.down,
        platform.usage,
        catalog,
    )
    platform.on_unauthenticated = lambda: metrics_.rejections.labels("unauthenticated").inc()
    dispatcher.on_handed_off = lambda msg: _observe_transfer(metrics_, dispatcher, msg)
    dispatcher.on_failover = lambda moved: metrics_.failovers.labels(moved.cause).inc()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", access.list_models)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    audit = Audit(cfg.audit_log)
    add_admin(app, dispatcher, cfg.admin_key_sha256, platform.usage, audit)
    add_model_admin(app, Models(cfg, catalog, dispatcher, spawner))
    app.middlewares.append(access.authenticate)
    app.on_cleanup.append(lambda _: _close(audit))
    return app


async def _close(audit: Audit) -> None:
    audit.close()


def _observe_transfer(metrics_: RouterMetrics, dispatcher: Dispatcher, msg: HandedOff) -> None:
    info = dispatcher.registry.workers.get(msg.worker_id)
    pool = info.reg.pool if info is not None else "unknown"
    metrics_.kv_transfer_seconds.labels(pool).observe(msg.kv_seconds)
    metrics_.kv_transfer_bytes.labels(pool).observe(msg.kv_bytes)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _once(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _once(request, chat=True)


async def _once(request: web.Request, chat: bool) -> web.StreamResponse:
    """``_serve``, at most once per ``Idempotency-Key`` of a non-streaming request: a duplicate gets
    the first one's response with ``Idempotent-Replayed: true`` (router/idempotency.py)."""
    store, key = request.app[IDEMPOTENCY], request.headers.get(idem.HEADER)
    if key is None:
        return await _serve(request, chat)
    try:
        idem.check_key(key)  # a malformed key is refused whether or not it would be used
    except api.ApiError as err:
        request.app[METRICS].rejections.labels("invalid").inc()
        return responses.error_response(err)
    if not store.enabled:
        return await _serve(request, chat)
    try:
        body = api.parse_json_body(await request.read())
    except api.ApiError:
        return await _serve(request, chat)  # which answers the 400
    if isinstance(body, dict) and body.get("stream") is True:
        return await _serve(request, chat)  # a stream is never replayed: the header is ignored

    async def compute() -> idem.Reply:
        response = await _serve(request, chat)
        if not isinstance(response, web.Response) or not isinstance(response.body, bytes):
            raise TypeError("a non-streaming request was answered with a stream")
        return idem.Reply(response.status, response.body, tuple(response.headers.items()))

    scope = (request[access.TENANT], request.path, key)
    try:
        reply, replayed = await store.run(scope, idem.fingerprint(body), compute)
    except api.ApiError as err:
        request.app[METRICS].rejections.labels("invalid").inc()
        return responses.error_response(err)
    headers = list(reply.headers)
    if replayed:
        request.app[METRICS].idempotent_replays.inc()
        headers.append((idem.REPLAYED_HEADER, "true"))
    return web.Response(status=reply.status, body=reply.body, headers=headers)


async def openapi(request: web.Request) -> web.Response:
    catalog = request.app[CATALOG]
    vocab = max(v.tokenizer.vocab_size for m in catalog.models.values() for v in m.live())
    return web.json_response(openapi_document(catalog.names(), vocab))


async def health(request: web.Request) -> web.Response:
    registry, holders = request.app[DISPATCHER].registry, request.app[DISPATCHER].holders
    workers = [
        {
            "id": w.worker_id,
            "kind": w.reg.kind,
            "pool": w.reg.pool,
            "pid": w.reg.pid,
            "host": w.reg.host,
            "requests": holders.count(w.worker_id),
            "draining": w.draining,
            "free_blocks": w.free_blocks,
            "total_blocks": w.reg.num_blocks,
            "model": w.reg.model,
            "block_size": w.reg.block_size,
            "max_model_len": w.reg.max_model_len,
            "max_running": w.reg.max_running,
            "max_batch_tokens": w.reg.max_batch_tokens,
            "kv_bytes_per_token": w.reg.kv_bytes_per_token,
            "kv_bytes_per_s": w.load.kv_bytes_per_s if w.load is not None else 0.0,
            "kv_rates": dict(w.load.kv_rates) if w.load is not None else {},
            "profile": asdict(w.load.profile if w.load is not None else w.reg.profile),
        }
        for w in registry.workers.values()
    ]
    ok = has_route(registry)
    stopping = request.app[LIFECYCLE].shutting_down
    dispatcher = request.app[DISPATCHER]
    for w in workers:
        w["restarts"] = dispatcher.restarts.get(w["id"], 0)
    down = [
        {"id": wid, "reason": why, "restarts": dispatcher.restarts.get(wid, 0)}
        for wid, why in sorted(dispatcher.down.items())
    ]
    status = "draining" if stopping else "ok" if ok else "unavailable"
    return web.json_response(
        {"status": status, "workers": workers, "down": down}, status=200 if status == "ok" else 503
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    arrival = time.monotonic()
    metrics_ = app[METRICS]
    try:
        body = api.parse_json_body(await request.read())
    except api.ApiError as err:
        metrics_.rejections.labels("invalid").inc()
        return responses.error_response(err)
    submitted: list[str] = []  # the response's requests in the router (one per prompt)
    streams: list[RequestStream] = []
    tenant, admitted, model = request[access.TENANT], False, ""  # admitted: counted by the tenant's limits
    try:
        version = access.version_of(request, body, chat)
        tok = version.tokenizer
        parsed = api.parse_request(body, chat, (body["model"],), tok.vocab_size)
        parsed = replace(parsed, model=version.label)  # responses name the version that serves
        model = version.label
        try:
            resolved = resolve(app[CONFIG].routing, body.get("slo"), tenant)
        except BudgetError as exc:
            raise api.bad(str(exc), exc.param) from None
        if resolved.tenant.models and version.model not in resolved.tenant.models:
            why = f"tenant {tenant!r} may not use model {version.model!r}"
            raise api.ApiError(403, why, "model", kind="permission_error")
        prompts = await asyncio.to_thread(prompts_.tokenize, tok, parsed)
        max_model_len = app[DISPATCHER].registry.max_model_len(version.key)
        max_tokens = [prompts_.max_tokens(parsed, len(p), max_model_len) for p in prompts]
        context = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
        app[ACCESS].limits.admit(resolved.tenant, sum(map(len, prompts)), context, time.monotonic())
        admitted = True
        seed = parsed.seed if parsed.seed is not None else secrets.randbelow(2**63)
        request_id = api.new_id(chat)
        header_timeout = api.timeout_seconds(request.headers.get("X-Request-Timeout"), "X-Request-Timeout")
        timeouts = [t for t in (parsed.timeout_s, header_timeout) if t is not None]
        deadline = arrival + min(timeouts) if timeouts else None
        eos = tuple(sorted(tok.eos_token_ids))
        for i, (prompt_ids, limit) in enumerate(zip(prompts, max_tokens, strict=True)):
            sub_id = request_id if i == 0 else f"{request_id}-{i}"  # each prompt of a batch is a request
            params = parsed.sampling_params(limit, seed)
            submitted.append(sub_id)
            streams.append(
                await app[DISPATCHER].submit(
                    sub_id, prompt_ids, params, eos, resolved, deadline, parsed.best_of, version.key
                )
            )
            if version.first_routed_at is None:
                version.first_routed_at = time.monotonic()
    except Rejected as err:
        _release(app, submitted, tenant, admitted, streams, model, failed=True)
        metrics_.rejections.labels(err.reason).inc()
        app[OBSERVED].add(Finished(time.monotonic(), sum(map(len, prompts)), 0, False, None))
        return responses.error_response(err)
    except LimitError as err:
        metrics_.rejections.labels(f"tenant_{err.limit}").inc()
        return responses.error_response(err)
    except api.ApiError as err:
        _release(app, submitted, tenant, admitted, streams, model, failed=True)
        metrics_.rejections.labels("invalid" if err.status < 500 else "no_capacity").inc()
        if err.status >= 500 and model:  # its version could not serve it: a rollout counts that
            app[MODELS].observe(version, False, None, None)
        return responses.error_response(err)
    except BaseException:  # the client left while a later prompt of its batch waited to start
        _release(app, submitted, tenant, admitted, streams, model, failed=True)
        raise
    dispatched = time.monotonic()
    metrics_.queue_wait.labels(model).observe(dispatched - arrival)
    metrics_.prompt_tokens.labels(model).inc(sum(len(p) for p in prompts))
    outcome = "abort"  # unless the loop below reaches a finish: the client went away
    try:
        times = TokenTimes()
        timeout_s = app[CONFIG].request_timeout_s
        sources = []
        for p, (stream, prompt_ids) in enumerate(zip(streams, prompts, strict=True)):
            for c in range(parsed.best_of):
                detok = IncrementalDetokenizer(tok, list(prompt_ids), stop=list(parsed.stop))
                primary = times if p == 0 and c == 0 else None  # the output the latency metrics follow
                events = responses.events(
                    stream.queues[c], detok, timeout_s, deadline, metrics_, model, arrival, primary
                )
                logprobs = responses.logprobs_out(tok, parsed)
                index = p * parsed.best_of + c
                echo = prompts_.prompt_text(tok, parsed, p, prompt_ids) if parsed.echo else None
                sources.append(responses.Source(index, events, stream, logprobs, echo, prompt_ids))
        first = streams[0]

        def report() -> dict[str, Any]:
            choice, transfer_s = first.choice, first.transfer_s
            return breakdown(first.route, resolved, choice, arrival, dispatched, times, transfer_s)

        # Clients that speak the ``slo`` extension also get the latency breakdown in their usage.
        reporting = report if "slo" in body else None
        headers = {VERSION_HEADER: version.label}
        if parsed.stream:
            response, outcome = await responses.stream_sse(
                request, parsed, request_id, sources, reporting, headers
            )
        else:
            response, outcome = await responses.collect(parsed, request_id, sources, reporting)
            response.headers.update(headers)
        return response
    finally:
        failed = outcome in ("error", "abort")
        _release(app, submitted, tenant, admitted, streams, model, failed)
        ttft, itl = times.latencies(arrival)
        app[MODELS].observe(version, outcome != "error", ttft, itl)
        app[OBSERVED].add(_finished(resolved.budgets, prompts, streams, ttft, itl, dispatched - arrival))
        metrics_.requests.labels(model, outcome).inc()
        metrics_.e2e.labels(model).observe(time.monotonic() - arrival)


def _finished(
    budgets: Budgets,
    prompts: list[list[int]],
    streams: list[RequestStream],
    ttft: float | None,
    itl: float | None,
    wait_s: float,
) -> Finished:
    """An answered request as the pool scaler counts it: its sizes and whether it met its budgets."""
    ttft_ok = None if ttft is None else ttft * 1e3 <= budgets.ttft_ms
    itl_ok = None if itl is None else itl * 1e3 <= budgets.itl_ms
    generated = sum(st.generated for st in streams)
    return Finished(time.monotonic(), sum(map(len, prompts)), generated, ttft_ok, itl_ok, wait_s)


def _release(
    app: web.Application,
    request_ids: list[str],
    tenant: str,
    admitted: bool,
    streams: list[RequestStream],
    model: str,
    failed: bool,
) -> None:
    """Ends the response's requests (every worker still holding one gets an ``Abort``); when its
    tenant's limits had admitted it, settles what it used (``access.settle``)."""
    for request_id in request_ids:
        app[DISPATCHER].release(request_id, "request ended")
    if admitted:
        access.settle(app[ACCESS], tenant, streams, model, failed)
