"""``POST /v1/embeddings`` in OpenAI's shape: one vector per input, computed by prefill and colocated
workers from the model's last hidden states, pooled as the checkpoint declares (``engine/pooling.py``).

1. ``parse``: the body (``input`` as a string, token ids, or an array of either; ``encoding_format``
   float or base64; ``dimensions`` where the model declares Matryoshka sizes): a 400 naming the field;
2. the model version, the budget (the request's ``slo`` ``ttft_ms``, its tenant's or class's, or
   ``[embeddings] budget_ms``), the tenant's permission (403) and limits (429);
3. the inputs as tokens (off the event loop), each within the workers' context (400);
4. the dispatcher batches them with other requests' inputs (``dispatch/embedder.py``) and waits for
   every vector, at most until the request's timeout (``timeout``, ``X-Request-Timeout``: then a 429,
   as for a generation that no route fits before its deadline; else ``request_timeout_s``: a 504);
   a vector that cannot be computed (no worker, failovers spent) is a 503;
5. the vectors, cut to ``dimensions`` (and scaled to unit length again when the model normalizes),
   with ``usage``; metrics and the tenant's usage count the request.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from pdfabric.engine.pooling import Pooling, declared_pooling
from pdfabric.router.errors import ApiError, bad
from pdfabric.router.front import access, fields, inputs, responses
from pdfabric.router.front import openai_api as api
from pdfabric.router.front.keys import CONFIG, DISPATCHER, METRICS
from pdfabric.router.json_body import parse_json_body
from pdfabric.router.platform.catalog import VERSION_HEADER, Version
from pdfabric.router.platform.tenants import LimitError
from pdfabric.router.routing.slo import BudgetError, resolve
from pdfabric.routing_config import SloClass

MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows
FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "slo", "timeout"})


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool
    dimensions: int | None
    timeout_s: float | None


def parse(body: Any, vocab_size: int) -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise bad(f"'{name}' is not supported by this server", name)
    fields.typed(body, "user", str, None)
    found = inputs.prompts(body, vocab_size, "input", MAX_INPUTS)
    encoding = fields.typed(body, "encoding_format", str, "float")
    if encoding not in ("float", "base64"):
        raise bad(f"'encoding_format' must be 'float' or 'base64', got {encoding!r}", "encoding_format")
    dimensions = fields.typed(body, "dimensions", int, None)
    if dimensions is not None and dimensions < 1:
        raise bad(f"'dimensions' must be at least 1, got {dimensions}", "dimensions")
    timeout_s = api.timeout_seconds(fields.typed(body, "timeout", (int, float), None), "timeout")
    return EmbeddingRequest(found, encoding == "base64", dimensions, timeout_s)


@functools.cache
def _declared(checkpoint: str) -> Pooling:
    from pdfabric.engine.default_model import resolve_model

    return declared_pooling(resolve_model(checkpoint))


async def pooling_of(version: Version) -> Pooling:
    """The pooling the version's checkpoint declares (read once); a 400 when it declares one that is
    not computed here."""
    try:
        return await asyncio.to_thread(_declared, version.checkpoint)
    except ValueError as exc:
        raise ApiError(400, f"model {version.label!r} cannot serve embeddings: {exc}", "model") from None


async def embeddings(request: web.Request) -> web.Response:
    app, arrival, tenant = request.app, time.monotonic(), request.get(access.TENANT, "")
    metrics, model, admitted, outcome, tokens = app[METRICS], "", False, "error", 0
    try:
        body = parse_json_body(await request.read())
        version = access.version_of(request, body, False)
        model = version.label
        req = parse(body, version.tokenizer.vocab_size)
        try:
            resolved = resolve(
                app[CONFIG].routing, body.get("slo"), tenant, request.get(access.SLO_CLASS, "")
            )
        except BudgetError as exc:
            raise bad(str(exc), exc.param) from None
        if resolved.tenant.models and version.model not in resolved.tenant.models:
            why = f"tenant {tenant!r} may not use model {version.model!r}"
            raise ApiError(403, why, "model", kind="permission_error")
        pooling = await pooling_of(version)
        if req.dimensions is not None and req.dimensions not in pooling.dimensions:
            sizes = ", ".join(map(str, pooling.dimensions)) or "none: its vectors are served whole"
            raise bad(
                f"model {model!r} cannot cut its vectors to {req.dimensions} (its sizes: {sizes})",
                "dimensions",
            )
        ids = await asyncio.to_thread(_tokenize, version, req)
        tokens = sum(map(len, ids))
        app[access.ACCESS].limits.admit(resolved.tenant, tokens, max(map(len, ids)), time.monotonic())
        admitted = True
        slo = body.get("slo")
        own_budget = isinstance(slo, dict) and "ttft_ms" in slo
        budget_ms = app[CONFIG].embeddings.budget_ms
        budget_ms = resolved.budgets.ttft_ms if own_budget or not budget_ms else budget_ms
        done = await _compute(request, version, req, ids, pooling, budget_ms, resolved.slo_class, arrival)
        for d in done:
            metrics.embeddings.embedded(model, d)
        data = [_item(i, d.vector, req, pooling) for i, d in enumerate(done)]
        outcome = "stop"
    except LimitError as exc:
        metrics.rejections.labels(f"tenant_{exc.limit}").inc()
        return responses.error_response(exc)
    except ApiError as exc:
        metrics.rejections.labels("invalid" if exc.status < 500 else "no_capacity").inc()
        return responses.error_response(exc)
    except asyncio.CancelledError:  # the client left: its inputs were ended (``Dispatcher.embed``)
        outcome = "abort"
        raise
    finally:
        if admitted:
            app[access.ACCESS].limits.finish(tenant, 0, time.monotonic())
            app[access.ACCESS].usage.add(tenant, model, tokens, 0, 0, outcome != "stop")
        if model:
            metrics.requests.labels(model, outcome).inc()
    metrics.prompt_tokens.labels(model).inc(tokens)
    metrics.e2e.labels(model).observe(time.monotonic() - arrival)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    reply = {"object": "list", "data": data, "model": model, "usage": usage}
    return web.json_response(reply, headers={VERSION_HEADER: model})


def _tokenize(version: Version, req: EmbeddingRequest) -> list[tuple[int, ...]]:
    out = []
    for i, text in enumerate(req.inputs):
        ids = (
            text
            if isinstance(text, tuple)
            else tuple(version.tokenizer.encode(text, add_special_tokens=True))
        )
        if not ids:
            raise bad(f"'input[{i}]' encodes to no tokens", "input")
        out.append(ids)
    return out


async def _compute(
    request: web.Request, version: Version, req: EmbeddingRequest, ids: list[tuple[int, ...]],
    pooling: Pooling, budget_ms: float, slo_class: SloClass, arrival: float,
) -> list:  # fmt: skip
    """Every input's ``EmbedDone``, once each has its vector; an ``ApiError`` otherwise. ``budget_ms``:
    the inputs' latency budget; ``slo_class``: their class (its priority, and whether background)."""
    app = request.app
    dispatcher, cfg = app[DISPATCHER], app[CONFIG]
    limit = dispatcher.fleet.max_model_len(version.key)
    for i, one in enumerate(ids):
        if limit and len(one) > limit:
            raise bad(
                f"'input[{i}]' has {len(one)} tokens; this model's workers hold at most {limit}", "input"
            )
    header = api.timeout_seconds(request.headers.get("X-Request-Timeout"), "X-Request-Timeout")
    own = [t for t in (req.timeout_s, header) if t is not None]
    timeout_s = min([*own, cfg.request_timeout_s])
    job = dispatcher.embed(
        f"emb-{secrets.token_hex(12)}", ids, pooling.mode, pooling.normalize, version.key,
        arrival + budget_ms / 1e3, slo_class.priority, slo_class.background,
    )  # fmt: skip
    try:
        done = await asyncio.wait_for(job, max(0.0, arrival + timeout_s - time.monotonic()))
    except TimeoutError:
        why = f"the embeddings were not ready within {timeout_s:g}s"
        if own and min(own) <= cfg.request_timeout_s:  # its own deadline: refused as overload (deadline)
            raise ApiError(
                429, f"request rejected (deadline): {why}", kind="rate_limit_exceeded", retry_after_s=1.0
            ) from None
        raise ApiError(504, why, kind="timeout") from None
    failed = [d for d in done if d.error]
    if failed:
        raise ApiError(503, failed[0].error, kind="server_error", retry_after_s=1.0)
    return done


def _item(index: int, vector: bytes, req: EmbeddingRequest, pooling: Pooling) -> dict[str, Any]:
    v = np.frombuffer(vector, dtype="<f4")
    if req.dimensions is not None:
        v = v[: req.dimensions]
        if pooling.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
    v = v.astype("<f4")
    embedding: Any = base64.b64encode(v.tobytes()).decode() if req.base64 else v.tolist()
    return {"object": "embedding", "index": index, "embedding": embedding}
