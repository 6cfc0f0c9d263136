"""Idempotency keys: a non-streaming request sent again with the same key is answered, not run again.

A key lives in one scope, (tenant, endpoint path, key), and goes through these states:

1. absent: the first request with it claims it and computes its response;
2. in flight: a duplicate (same scope, same body) waits for that response; a different body under
   the key is a 422 at once;
3. kept: a 2xx response is kept for ``ttl_s`` after it was completed and every duplicate gets it
   (replayed). Any other response (4xx, 429, 5xx) goes to the duplicates that waited for it and the
   key returns to absent, so that the next retry computes again. A first request that ends without
   a response (its client went away) also returns the key to absent; one of its waiting duplicates
   then claims it and computes.

At most ``max_entries`` responses are kept; past that the oldest is forgotten. Keys in flight are not
counted: they are as many as the requests in flight and hold no response yet. There is no aiohttp
here (the HTTP layer turns its responses into ``Reply`` values) and the clock is injected.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pdfabric.router.errors import ApiError, bad

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_LEN = 255

Scope = tuple[str, str, str]  # (tenant, endpoint path, key)


@dataclass(frozen=True)
class Reply:
    """A complete HTTP response as the store keeps and replays it."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(eq=False)
class _Entry:
    fingerprint: str
    reply: Reply | None = None  # the first request's response, once it has one
    expires: float = 0.0  # clock time at which a kept reply is forgotten
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set when the first request ended


def check_key(key: str) -> None:
    """A 400 naming the header unless ``key`` has 1 to ``MAX_KEY_LEN`` characters."""
    if not 0 < len(key) <= MAX_KEY_LEN:
        raise bad(f"the {HEADER} header must have 1 to {MAX_KEY_LEN} characters, got {len(key)}", HEADER)


def fingerprint(body: Any) -> str:
    """The identity of a JSON request body: the same whatever its key order or spacing."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class IdempotencyStore:
    """Responses by scope, in flight or kept; ``ttl_s == 0`` turns the store off (``enabled``)."""

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s >= 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.ttl_s, self.max_entries, self.clock = ttl_s, max_entries, clock
        self._running: dict[Scope, _Entry] = {}
        self._kept: OrderedDict[Scope, _Entry] = OrderedDict()  # completion order, hence expiry order

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def kept(self) -> int:
        return len(self._kept)

    async def run(
        self, scope: Scope, fingerprint: str, compute: Callable[[], Awaitable[Reply]]
    ) -> tuple[Reply, bool]:
        """``(reply, replayed)``: ``compute()``'s reply (False), or that of the request that held
        ``scope`` first (True). A held scope with another ``fingerprint`` is a 422 ``ApiError``."""
        while True:
            entry = self._lookup(scope)
            if entry is None:
                return await self._compute(scope, fingerprint, compute), False
            if entry.fingerprint != fingerprint:
                raise ApiError(422, f"this {HEADER} was already used with a different request body", HEADER)
            await entry.done.wait()
            if entry.reply is not None:
                return entry.reply, True
            # The first request ended without a response: claim the key again.

    def _lookup(self, scope: Scope) -> _Entry | None:
        now = self.clock()
        while self._kept and next(iter(self._kept.values())).expires <= now:
            self._kept.popitem(last=False)
        return self._running.get(scope) or self._kept.get(scope)

    async def _compute(
        self, scope: Scope, fingerprint: str, compute: Callable[[], Awaitable[Reply]]
    ) -> Reply:
        entry = self._running[scope] = _Entry(fingerprint)
        try:
            entry.reply = await compute()
        finally:
            del self._running[scope]
            if entry.reply is not None and entry.reply.ok:
                entry.expires = self.clock() + self.ttl_s
                self._kept[scope] = entry
                while len(self._kept) > self.max_entries:
                    self._kept.popitem(last=False)
            entry.done.set()
        return entry.reply
