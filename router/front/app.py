"""The router's HTTP application: its routes and state (``build_app``), the completions endpoints
(each call through ``serve``'s pipeline, at most once per idempotency key), ``/health`` and
``/metrics`` over the fleet's read-only view."""

from __future__ import annotations

from dataclasses import asdict

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdfabric.config import ServeConfig
from pdfabric.router.dispatch.dispatcher import Dispatcher
from pdfabric.router.errors import ApiError
from pdfabric.router.front import access, embeddings, responses
from pdfabric.router.front import idempotency as idem
from pdfabric.router.front.access import ACCESS
from pdfabric.router.front.batch_api import add_batch_api, batch_class
from pdfabric.router.front.keys import (
    BATCH_CLASS,
    BATCH_TOKEN,
    CATALOG,
    CONFIG,
    DISPATCHER,
    IDEMPOTENCY,
    METRICS,
    OBSERVED,
)
from pdfabric.router.front.metrics import RouterMetrics
from pdfabric.router.front.openapi import openapi_document
from pdfabric.router.front.serve import serve
from pdfabric.router.json_body import parse_json_body
from pdfabric.router.platform.admin import LIFECYCLE, Audit, add_admin
from pdfabric.router.platform.admin_models import Models, Spawner, add_model_admin
from pdfabric.router.platform.catalog import Catalog
from pdfabric.router.platform.scaler import Observations
from pdfabric.router.platform.tenants import UsageBook


def build_app(
    cfg: ServeConfig, dispatcher: Dispatcher, catalog: Catalog, spawner: Spawner | None = None
) -> web.Application:
    """The router's application over ``dispatcher``, serving ``catalog``'s models; ``spawner``
    starts the workers of versions added through the admin API (None: it cannot)."""
    app = web.Application(client_max_size=16 * 2**20)
    app[CONFIG], app[DISPATCHER], app[CATALOG] = cfg, dispatcher, catalog
    app[OBSERVED] = Observations(cfg.autoscale.window_s)
    app[IDEMPOTENCY] = idem.IdempotencyStore(cfg.idempotency_ttl_s, cfg.idempotency_max_entries)
    usage = UsageBook(cfg.routing)
    app[METRICS] = metrics_ = RouterMetrics(dispatcher.fleet, usage, catalog)
    app[ACCESS] = platform = access.Access(cfg.routing, catalog, usage, metrics_.unauthenticated)
    dispatcher.listen(metrics_)
    runner = add_batch_api(app, cfg, lambda: dispatcher.fleet.waiting)
    app[BATCH_TOKEN], app[BATCH_CLASS] = runner.token, batch_class(cfg.routing, cfg.batches.slo_class)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings.embeddings)
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


async def completions(request: web.Request) -> web.StreamResponse:
    return await _once(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _once(request, chat=True)


async def _once(request: web.Request, chat: bool) -> web.StreamResponse:
    """``_serve``, at most once per ``Idempotency-Key`` of a non-streaming request: a duplicate gets
    the first one's response with ``Idempotent-Replayed: true`` (router/front/idempotency.py)."""
    store, key = request.app[IDEMPOTENCY], request.headers.get(idem.HEADER)
    if key is None:
        return await serve(request, chat)
    try:
        idem.check_key(key)  # a malformed key is refused whether or not it would be used
    except ApiError as err:
        request.app[METRICS].rejections.labels("invalid").inc()
        return responses.error_response(err)
    if not store.enabled:
        return await serve(request, chat)
    try:
        body = parse_json_body(await request.read())
    except ApiError:
        return await serve(request, chat)  # which answers the 400
    if isinstance(body, dict) and body.get("stream") is True:
        return await serve(request, chat)  # a stream is never replayed: the header is ignored

    async def compute() -> idem.Reply:
        response = await serve(request, chat)
        if not isinstance(response, web.Response) or not isinstance(response.body, bytes):
            raise TypeError("a non-streaming request was answered with a stream")
        return idem.Reply(response.status, response.body, tuple(response.headers.items()))

    scope = (request[access.TENANT], request.path, key)
    try:
        reply, replayed = await store.run(scope, idem.fingerprint(body), compute)
    except ApiError as err:
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
    fleet = request.app[DISPATCHER].fleet
    workers = [
        {
            "id": w.worker_id,
            "kind": w.reg.kind,
            "pool": w.reg.pool,
            "pid": w.reg.pid,
            "host": w.reg.host,
            "kv_endpoint": w.reg.kv_endpoint,
            "requests": fleet.held_by(w.worker_id),
            "draining": w.draining,
            "free_blocks": w.free_blocks,
            "total_blocks": w.reg.num_blocks,
            "model": w.reg.model,
            "weights": w.reg.weights,
            "weight_bytes": w.reg.weight_bytes,
            "kv_cache_dtype": w.reg.kv_cache_dtype,
            "block_size": w.reg.block_size,
            "max_model_len": w.reg.max_model_len,
            "max_running": w.reg.max_running,
            "max_batch_tokens": w.reg.max_batch_tokens,
            "kv_bytes_per_token": w.reg.kv_bytes_per_token,
            "kv_bytes_per_s": w.load.kv_bytes_per_s if w.load is not None else 0.0,
            "kv_rates": dict(w.load.kv_rates) if w.load is not None else {},
            "profile": asdict(w.load.profile if w.load is not None else w.reg.profile),
            "restarts": fleet.restarts.get(w.worker_id, 0),
        }
        for w in fleet.workers.values()
    ]
    ok = fleet.has_route()
    stopping = request.app[LIFECYCLE].shutting_down
    down = [
        {"id": wid, "reason": why, "restarts": fleet.restarts.get(wid, 0)}
        for wid, why in sorted(fleet.down.items())
    ]
    status = "draining" if stopping else "ok" if ok else "unavailable"
    return web.json_response(
        {"status": status, "workers": workers, "down": down}, status=200 if status == "ok" else 503
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
