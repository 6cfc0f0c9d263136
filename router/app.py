"""The router's HTTP application: OpenAI-compatible endpoints over the dispatcher.

Each handler validates (400 naming the field), tokenizes off the event loop, submits the request,
then streams SSE chunks (or collects a JSON body) while detokenizing incrementally
(``router/responses.py``). Whatever ends the
handler (finish, stop string, error, timeout, client disconnect), its ``finally`` releases the request
so that every worker still holding it gets an ``Abort``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import asdict
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdfabric.config import ServeConfig
from pdfabric.control import HandedOff
from pdfabric.engine.detokenizer import IncrementalDetokenizer
from pdfabric.engine.tokenizer import Tokenizer
from pdfabric.router import idempotency as idem
from pdfabric.router import openai_api as api
from pdfabric.router import responses
from pdfabric.router.admin import LIFECYCLE, add_admin
from pdfabric.router.breakdown import TokenTimes, breakdown
from pdfabric.router.dispatcher import Dispatcher
from pdfabric.router.metrics import RouterMetrics
from pdfabric.router.openapi import openapi_document
from pdfabric.router.registry import has_route
from pdfabric.router.routing import Rejected
from pdfabric.router.slo import BudgetError, resolve

CONFIG = web.AppKey("config", ServeConfig)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
METRICS = web.AppKey("metrics", RouterMetrics)
IDEMPOTENCY = web.AppKey("idempotency", idem.IdempotencyStore)


def build_app(cfg: ServeConfig, dispatcher: Dispatcher, tokenizer: Tokenizer) -> web.Application:
    app = web.Application(client_max_size=16 * 2**20)
    app[CONFIG], app[DISPATCHER], app[TOKENIZER] = cfg, dispatcher, tokenizer
    app[IDEMPOTENCY] = idem.IdempotencyStore(cfg.idempotency_ttl_s, cfg.idempotency_max_entries)
    app[METRICS] = metrics_ = RouterMetrics(
        dispatcher.registry,
        lambda: len(dispatcher.routing.queue),
        lambda: dispatcher.restarts,
        lambda: dispatcher.down,
    )
    dispatcher.on_handed_off = lambda msg: _observe_transfer(metrics_, dispatcher, msg)
    dispatcher.on_failover = lambda moved: metrics_.failovers.labels(moved.cause).inc()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_admin(app, dispatcher, cfg.admin_key_sha256)
    return app


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
    if key is None or not store.enabled:
        return await _serve(request, chat)
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return await _serve(request, chat)  # which answers the 400
    if isinstance(body, dict) and body.get("stream") is True:
        return await _serve(request, chat)  # a stream is never replayed: the header is ignored

    async def compute() -> idem.Reply:
        response = await _serve(request, chat)
        if not isinstance(response, web.Response) or not isinstance(response.body, bytes):
            raise TypeError("a non-streaming request was answered with a stream")
        return idem.Reply(response.status, response.body, tuple(response.headers.items()))

    scope = (request.headers.get("X-Tenant", "default"), request.path, key)
    try:
        idem.check_key(key)
        reply, replayed = await store.run(scope, idem.fingerprint(body), compute)
    except api.ApiError as err:
        request.app[METRICS].rejections.labels("invalid").inc()
        return responses.error_response(err)
    headers = list(reply.headers)
    if replayed:
        request.app[METRICS].idempotent_replays.inc()
        headers.append((idem.REPLAYED_HEADER, "true"))
    return web.Response(status=reply.status, body=reply.body, headers=headers)


async def models(request: web.Request) -> web.Response:
    name = request.app[CONFIG].model_name
    return web.json_response(
        {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pdfabric"}]}
    )


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app[CONFIG].model_name))


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
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        metrics_.rejections.labels("invalid").inc()
        return responses.error_response(api.bad("the request body is not valid JSON"))
    submitted: list[str] = []  # the response's requests in the router (one per prompt)
    try:
        parsed = api.parse_request(body, chat, (app[CONFIG].model_name,), app[TOKENIZER].vocab_size)
        try:
            tenant = request.headers.get("X-Tenant", "default")
            resolved = resolve(app[CONFIG].routing, body.get("slo"), tenant)
        except BudgetError as exc:
            raise api.bad(str(exc), exc.param) from None
        prompts = await asyncio.to_thread(_tokenize, app[TOKENIZER], parsed)
        max_model_len = app[DISPATCHER].registry.max_model_len
        max_tokens = [_max_tokens(parsed, len(p), max_model_len) for p in prompts]
        seed = parsed.seed if parsed.seed is not None else secrets.randbelow(2**63)
        request_id = api.new_id(chat)
        header_timeout = api.timeout_seconds(request.headers.get("X-Request-Timeout"), "X-Request-Timeout")
        timeouts = [t for t in (parsed.timeout_s, header_timeout) if t is not None]
        deadline = arrival + min(timeouts) if timeouts else None
        eos = tuple(sorted(app[TOKENIZER].eos_token_ids))
        streams = []
        for i, (prompt_ids, limit) in enumerate(zip(prompts, max_tokens, strict=True)):
            sub_id = request_id if i == 0 else f"{request_id}-{i}"  # each prompt of a batch is a request
            params = parsed.sampling_params(limit, seed)
            submitted.append(sub_id)
            streams.append(
                await app[DISPATCHER].submit(
                    sub_id, prompt_ids, params, eos, resolved, deadline, parsed.best_of
                )
            )
    except Rejected as err:
        _release(app, submitted)
        metrics_.rejections.labels(err.reason).inc()
        return responses.error_response(err)
    except api.ApiError as err:
        _release(app, submitted)
        metrics_.rejections.labels("invalid" if err.status < 500 else "no_capacity").inc()
        return responses.error_response(err)
    except BaseException:  # the client left while a later prompt of its batch waited to start
        _release(app, submitted)
        raise
    model = parsed.model
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
                detok = IncrementalDetokenizer(app[TOKENIZER], list(prompt_ids), stop=list(parsed.stop))
                primary = times if p == 0 and c == 0 else None  # the output the latency metrics follow
                events = responses.events(
                    stream.queues[c], detok, timeout_s, deadline, metrics_, model, arrival, primary
                )
                logprobs = responses.logprobs_out(app[TOKENIZER], parsed)
                index = p * parsed.best_of + c
                echo = _prompt_text(app[TOKENIZER], parsed, p, prompt_ids) if parsed.echo else None
                sources.append(responses.Source(index, events, stream, logprobs, echo, prompt_ids))
        first = streams[0]

        def report() -> dict[str, Any]:
            choice, transfer_s = first.choice, first.transfer_s
            return breakdown(first.route, resolved, choice, arrival, dispatched, times, transfer_s)

        # Clients that speak the ``slo`` extension also get the latency breakdown in their usage.
        reporting = report if "slo" in body else None
        if parsed.stream:
            response, outcome = await responses.stream_sse(request, parsed, request_id, sources, reporting)
        else:
            response, outcome = await responses.collect(parsed, request_id, sources, reporting)
        return response
    finally:
        _release(app, submitted)
        metrics_.requests.labels(model, outcome).inc()
        metrics_.e2e.labels(model).observe(time.monotonic() - arrival)


def _release(app: web.Application, request_ids: list[str]) -> None:
    """Ends the response's requests; every worker still holding one gets an ``Abort``."""
    for request_id in request_ids:
        app[DISPATCHER].release(request_id, "request ended")


def _tokenize(tokenizer: Tokenizer, parsed: api.ParsedRequest) -> list[tuple[int, ...]]:
    """Each prompt's token ids (a chat request's one prompt, rendered by the chat template)."""
    if parsed.chat:
        try:
            text = tokenizer.apply_chat_template(list(parsed.messages or ()), add_generation_prompt=True)
        except ValueError as exc:
            raise api.bad(str(exc), "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise api.bad("the prompt encodes to no tokens", "messages")
        return [tuple(ids)]
    out = []
    for prompt in parsed.prompts:
        if isinstance(prompt, tuple):
            out.append(prompt)
            continue
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise api.bad("the prompt encodes to no tokens", "prompt")
        out.append(tuple(ids))
    return out


def _prompt_text(tokenizer: Tokenizer, parsed: api.ParsedRequest, i: int, ids: tuple[int, ...]) -> str:
    """Prompt ``i`` as the client sent it (text), or decoded from its token ids (``echo``)."""
    prompt = parsed.prompts[i]
    return prompt if isinstance(prompt, str) else tokenizer.decode(list(ids), skip_special_tokens=False)


def _max_tokens(parsed: api.ParsedRequest, prompt_len: int, max_model_len: int) -> int:
    if max_model_len == 0:
        raise api.ApiError(503, "no worker is registered yet", kind="server_error", retry_after_s=1.0)
    field = "messages" if parsed.chat else "prompt"
    if prompt_len >= max_model_len:
        raise api.bad(f"the prompt has {prompt_len} tokens; the context window is {max_model_len}", field)
    room = max_model_len - prompt_len
    if parsed.max_tokens is None:
        return room
    if parsed.max_tokens > room:
        name = "max_completion_tokens" if parsed.chat else "max_tokens"
        raise api.bad(
            f"'{name}' is {parsed.max_tokens}, but the prompt ({prompt_len} tokens) leaves room for "
            f"{room} in the {max_model_len}-token context window",
            name,
        )
    return parsed.max_tokens
