"""The router's operator endpoints and its own shutdown drain.

- ``POST /admin/workers/{worker_id}/drain``: the worker takes no new requests, finishes those it
  holds (what is left after its ``drain_timeout_s`` moves to other workers), then exits; a worker
  started by ``pdfabric serve`` is not restarted. 202 when sent, 404 for an unknown worker.
- When ``[serve] admin_key_sha256`` is set, admin endpoints need ``Authorization: Bearer KEY`` whose
  SHA-256 it is (401 otherwise); only the hash is kept in the config. Without it they answer only
  callers on this host's loopback (127.0.0.0/8, ::1): anyone else gets 403, whatever the bind address,
  so a router bound to a public address never hands its admin API to the network by default.
- ``GET /admin/usage``: every tenant's usage per model (``tenants.UsageBook``): requests, failed
  requests, prompt, cached and generated tokens.
- Every admin request is written to the audit log (``Audit``): one JSON line with the time, the
  action, its target, the caller's address and the first 12 hex digits of its key's hash, and the
  status answered. Prompts and outputs are never logged anywhere.
- ``Lifecycle.shutting_down``: set when the server stops; from then on new requests get 503 with
  ``Retry-After`` (the middleware below) and ``/health`` says ``draining``, while those in flight
  finish (``pdfabric serve`` waits up to ``shutdown_drain_s`` for them).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

from aiohttp import web

from pdfabric.router.dispatch.dispatcher import Dispatcher
from pdfabric.router.errors import ApiError
from pdfabric.router.platform.tenants import UsageBook, bearer_token, sha256_hex


class Lifecycle:
    """Whether the server is stopping (shared by the middleware, ``/health`` and the launcher)."""

    def __init__(self) -> None:
        self.shutting_down = False


class Audit:
    """The audit log of admin actions: one JSON object per line, to a file (appended) or stderr."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self._out: TextIO = open(path, "a", encoding="utf-8") if path else sys.stderr  # noqa: SIM115

    def record(self, request: web.Request, action: str, target: str, status: int) -> None:
        """An admin request: who (address, and the first 12 hex digits of its key's SHA-256), what."""
        _, _, token = request.headers.get("Authorization", "").partition(" ")
        caller = hashlib.sha256(token.strip().encode()).hexdigest()[:12] if token.strip() else ""
        self.write(request.remote or "", action, target, status, {"key_sha256_prefix": caller})

    def write(self, remote: str, action: str, target: str, status: int, details: dict[str, Any]) -> None:
        """One entry; ``remote`` is ``router`` for what the router did on its own (a rollback)."""
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "audit": action, "target": target, "status": status, "remote": remote, **details,
        }  # fmt: skip
        self._out.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self._out.flush()

    def close(self) -> None:
        if self.path:
            self._out.close()


LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
AUDIT = web.AppKey("audit", Audit)
_ADMIN_KEY = web.AppKey("admin_key_sha256", str)
_ADMIN_DISPATCHER = web.AppKey("admin_dispatcher", Dispatcher)
_USAGE = web.AppKey("usage", UsageBook)


def add_admin(
    app: web.Application, dispatcher: Dispatcher, admin_key_sha256: str, usage: UsageBook, audit: Audit
) -> Lifecycle:
    """Adds the admin routes and the shutdown middleware to ``app``; returns its ``Lifecycle``."""
    app[_ADMIN_KEY], app[_ADMIN_DISPATCHER] = admin_key_sha256.lower(), dispatcher
    app[_USAGE], app[AUDIT] = usage, audit
    app[LIFECYCLE] = lifecycle = Lifecycle()
    app.middlewares.append(_refuse_when_stopping)
    app.router.add_post("/admin/workers/{worker_id}/drain", drain_worker)
    app.router.add_get("/admin/usage", usage_report)
    return lifecycle


def authorized(request: web.Request) -> bool:
    """True when the request's bearer token hashes to the admin key, or, with no admin key configured,
    when it comes from this host's loopback."""
    want = request.app[_ADMIN_KEY]
    if not want:
        return from_loopback(request)
    token = bearer_token(request.headers.get("Authorization", ""))
    return bool(token) and hmac.compare_digest(sha256_hex(token), want)


def from_loopback(request: web.Request) -> bool:
    """Whether the request's peer (the connection's, never a forwarding header) is a loopback address."""
    try:
        address = ipaddress.ip_address(request.remote or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # an IPv4 peer of a dual-stack socket
    return (mapped or address).is_loopback


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(ApiError(status, message, kind=kind).body(), status=status, headers=headers)


def unauthorized(request: web.Request, action: str, target: str) -> web.Response | None:
    """The refusal (audited) of a request that may not use the admin API, or None when it may: 401
    without the admin key when one is set; 403 from another host when none is."""
    if authorized(request):
        return None
    if not request.app[_ADMIN_KEY]:
        request.app[AUDIT].record(request, action, target, 403)
        why = "with no admin key set ([serve] admin_key_sha256), admin endpoints answer only on loopback"
        return _error(403, why, "permission_error")
    request.app[AUDIT].record(request, action, target, 401)
    return _error(401, "admin endpoints need Authorization: Bearer ADMIN_KEY", "authentication_error")


async def drain_worker(request: web.Request) -> web.Response:
    worker_id = request.match_info["worker_id"]
    if (refused := unauthorized(request, "drain_worker", worker_id)) is not None:
        return refused
    try:
        request.app[_ADMIN_DISPATCHER].drain_worker(worker_id, "asked by the admin endpoint")
    except KeyError:
        request.app[AUDIT].record(request, "drain_worker", worker_id, 404)
        return _error(404, f"no worker {worker_id!r} is registered", "not_found_error")
    request.app[AUDIT].record(request, "drain_worker", worker_id, 202)
    return web.json_response({"worker": worker_id, "draining": True}, status=202)


async def usage_report(request: web.Request) -> web.Response:
    if (refused := unauthorized(request, "usage", "")) is not None:
        return refused
    request.app[AUDIT].record(request, "usage", "", 200)
    return web.json_response({"tenants": request.app[_USAGE].report()})


@web.middleware
async def _refuse_when_stopping(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    if request.app[LIFECYCLE].shutting_down and request.path.startswith("/v1/") and request.method == "POST":
        return _error(503, "the server is shutting down", "server_error", {"Retry-After": "1"})
    return await handler(request)
