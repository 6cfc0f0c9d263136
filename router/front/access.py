"""Who a request comes from, which model version serves it, and what its tenant used: the HTTP side
of ``tenants`` (keys, limits, usage) and ``catalog`` (models and versions).

- ``authenticate`` (middleware) names the tenant of every ``/v1/`` request (``request[TENANT]``);
- ``version_of`` resolves the request's ``model`` to a version;
- the handler checks the tenant's limits (``Access.limits.admit``) and, once the request ends,
  ``settle`` lets it go there and counts its usage.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from pdfabric.router.dispatch.stream import RequestStream
from pdfabric.router.errors import ApiError, bad
from pdfabric.router.front import openai_api as api
from pdfabric.router.front.keys import BATCH_CLASS, BATCH_TOKEN
from pdfabric.router.platform.batch_runner import TOKEN_HEADER
from pdfabric.router.platform.catalog import SESSION_HEADER, Catalog, Version
from pdfabric.router.platform.tenants import Keys, Limits, UsageBook
from pdfabric.routing_config import AdmissionConfig

TENANT = "tenant"  # the request's tenant, set by ``authenticate``
SLO_CLASS = "slo_class"  # the class it is admitted in, when not its tenant's (a batch's line)


class Access:
    """The router's tenants (keys, limits, usage) and the models it serves."""

    def __init__(
        self, config: AdmissionConfig, catalog: Catalog, usage: UsageBook | None = None,
        unauthenticated: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        """``usage``: the usage book to count into (a new one when None); ``unauthenticated`` is
        called for each request refused a 401 (e.g. a rejection metric)."""
        self.keys, self.limits = Keys(config), Limits(config)
        self.usage = usage if usage is not None else UsageBook(config)
        self.catalog = catalog
        self.unauthenticated = unauthenticated


ACCESS = web.AppKey("access", Access)


@web.middleware
async def authenticate(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Names the tenant of every ``/v1/`` request: from its API key when the deployment has keys (401
    without a valid one), else from ``X-Tenant`` (``default`` when absent). The router's own batch
    runner's requests (which carry its in-memory token) run as ``X-Tenant``, the batch's owner, in the
    batch class."""
    if request.path.startswith("/v1/"):
        platform = request.app[ACCESS]
        if _batch_runner(request):
            request[TENANT] = request.headers.get("X-Tenant", "default")
            request[SLO_CLASS] = request.app[BATCH_CLASS]
        elif platform.keys.required:
            tenant = platform.keys.tenant_of(request.headers.get("Authorization", ""))
            if tenant is None:
                platform.unauthenticated()
                err = ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                                   kind="authentication_error")  # fmt: skip
                return web.json_response(err.body(), status=401)
            request[TENANT] = tenant
        else:
            request[TENANT] = request.headers.get("X-Tenant", "default")
    return await handler(request)


def _batch_runner(request: web.Request) -> bool:
    token, given = request.app.get(BATCH_TOKEN), request.headers.get(TOKEN_HEADER)
    return bool(token) and given is not None and hmac.compare_digest(given.encode(), token.encode())


def version_of(request: web.Request, body: object, chat: bool) -> Version:
    """The model version a request runs on, from its ``model`` (sticky by its ``user`` or the
    session header); a 400 naming ``model`` when it names none served here."""
    catalog = request.app[ACCESS].catalog
    requested = body.get("model") if isinstance(body, dict) else None
    if not isinstance(requested, str):  # the parser's 400 says what is wrong
        api.parse_request(body, chat, catalog.names(), 0)
        raise bad("'model' must be a string", "model")
    user = body.get("user")
    sticky = user if isinstance(user, str) else request.headers.get(SESSION_HEADER, "")
    return catalog.resolve(requested, sticky)


def settle(platform: Access, tenant: str, streams: list[RequestStream], model: str, failed: bool) -> None:
    """A request its tenant's limits admitted has ended: its generated tokens go into the tenant's
    window, and what its started requests (``streams``) used into its usage."""
    generated = sum(s.generated for s in streams)
    platform.limits.finish(tenant, generated, time.monotonic())
    if not streams:  # refused before any of its prompts started: nothing was computed
        return
    prompt = sum(s.prompt_len for s in streams)
    cached = sum(s.cached_tokens for s in streams)
    platform.usage.add(tenant, model, prompt, cached, generated, failed)


async def list_models(request: web.Request) -> web.Response:
    """Every model and, pinned, each of its live versions (with its traffic weight and checkpoint)."""
    data = []
    for m in request.app[ACCESS].catalog.models.values():
        entry = {"id": m.name, "object": "model", "created": 0, "owned_by": "pdfabric"}
        versions = [v for v in m.live() if v.name]
        if versions:
            entry["versions"] = [{"id": v.label, "weight": v.weight} for v in versions]
        data.append(entry)
        for v in versions:
            data.append({"id": v.label, "object": "model", "created": 0, "owned_by": "pdfabric",
                         "parent": m.name, "root": v.checkpoint})  # fmt: skip
    return web.json_response({"object": "list", "data": data})
