"""The router's operator endpoints and its own shutdown drain.

- ``POST /admin/workers/{worker_id}/drain``: the worker takes no new requests, finishes those it
  holds (what is left after its ``drain_timeout_s`` moves to other workers), then exits; a worker
  started by ``pdfabric serve`` is not restarted. 202 when sent, 404 for an unknown worker.
- When ``[serve] admin_key_sha256`` is set, admin endpoints need ``Authorization: Bearer KEY`` whose
  SHA-256 it is (401 otherwise); only the hash is kept in the config.
- ``Lifecycle.shutting_down``: set when the server stops; from then on new requests get 503 with
  ``Retry-After`` (the middleware below) and ``/health`` says ``draining``, while those in flight
  finish (``pdfabric serve`` waits up to ``shutdown_drain_s`` for them).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from pdfabric.router.dispatcher import Dispatcher
from pdfabric.router.openai_api import ApiError


class Lifecycle:
    """Whether the server is stopping (shared by the middleware, ``/health`` and the launcher)."""

    def __init__(self) -> None:
        self.shutting_down = False


LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
_ADMIN_KEY = web.AppKey("admin_key_sha256", str)
_ADMIN_DISPATCHER = web.AppKey("admin_dispatcher", Dispatcher)


def add_admin(app: web.Application, dispatcher: Dispatcher, admin_key_sha256: str) -> Lifecycle:
    """Adds the admin routes and the shutdown middleware to ``app``; returns its ``Lifecycle``."""
    app[_ADMIN_KEY], app[_ADMIN_DISPATCHER] = admin_key_sha256.lower(), dispatcher
    app[LIFECYCLE] = lifecycle = Lifecycle()
    app.middlewares.append(_refuse_when_stopping)
    app.router.add_post("/admin/workers/{worker_id}/drain", drain_worker)
    return lifecycle


def authorized(request: web.Request) -> bool:
    """True when no admin key is configured, or the request's bearer token hashes to it."""
    want = request.app[_ADMIN_KEY]
    if not want:
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).hexdigest(), want)


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(ApiError(status, message, kind=kind).body(), status=status, headers=headers)


async def drain_worker(request: web.Request) -> web.Response:
    if not authorized(request):
        return _error(401, "admin endpoints need Authorization: Bearer ADMIN_KEY", "authentication_error")
    worker_id = request.match_info["worker_id"]
    try:
        request.app[_ADMIN_DISPATCHER].drain_worker(worker_id, "asked by the admin endpoint")
    except KeyError:
        return _error(404, f"no worker {worker_id!r} is registered", "not_found_error")
    return web.json_response({"worker": worker_id, "draining": True}, status=202)


@web.middleware
async def _refuse_when_stopping(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    if request.app[LIFECYCLE].shutting_down and request.path.startswith("/v1/") and request.method == "POST":
        return _error(503, "the server is shutting down", "server_error", {"Retry-After": "1"})
    return await handler(request)
