"""Tenants at the router's door: who a request comes from (API keys), whether it may start now (its
tenant's limits) and what it used (usage counters).

A request's life here:
1. ``Keys.tenant_of`` names its tenant from ``Authorization: Bearer KEY``: the tenant one of whose
   ``api_keys_sha256`` the key hashes to (only hashes are kept). When no tenant has keys, the
   ``X-Tenant`` header names it, as before (unauthenticated deployments).
2. ``Limits.admit`` checks the tenant's limits before the request reaches admission control: its
   context length (400: it could never pass), requests in flight, requests and tokens in the last
   60 s (429 with the seconds until it would pass). An admitted request is counted at once.
3. ``Limits.finish`` lets it go, adding the tokens it generated to the tenant's window, and
   ``UsageBook.add`` counts its prompt, cached and generated tokens (a failed request's partial output
   included) per tenant and model.

Nothing here reads a clock: times are the caller's (seconds).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections import deque
from dataclasses import asdict, dataclass, field

from pdfabric.router.errors import ApiError
from pdfabric.routing_config import AdmissionConfig, Tenant

WINDOW_S = 60.0  # the span of requests_per_min and tokens_per_min
OTHER = "_other"  # usage of tenants past MAX_TENANTS undeclared names is counted under this one
MAX_TENANTS = 1000


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_token(authorization: str) -> str:
    """The key in an ``Authorization: Bearer KEY`` header ("" when there is none)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class Keys:
    """API key -> tenant name, from the hashes in the config."""

    def __init__(self, config: AdmissionConfig) -> None:
        self._by_hash = {d.lower(): t.name for t in config.tenants for d in t.api_keys_sha256}

    @property
    def required(self) -> bool:
        """Whether requests must carry a key (some tenant has one)."""
        return bool(self._by_hash)

    def tenant_of(self, authorization: str) -> str | None:
        """The tenant whose key the ``Authorization`` header carries, or None (absent or unknown)."""
        token = bearer_token(authorization)
        if not token:
            return None
        digest = sha256_hex(token)
        for known, tenant in self._by_hash.items():  # compared in constant time, every one
            if hmac.compare_digest(known, digest):
                return tenant
        return None


class LimitError(ApiError):
    """A tenant's limit refused the request: 429 with Retry-After, or 400 when it could never pass.
    ``limit`` names it (the metrics label)."""

    def __init__(self, status: int, limit: str, message: str, retry_after_s: float | None = None) -> None:
        kind = "rate_limit_exceeded" if status == 429 else "invalid_request_error"
        super().__init__(status, message, kind=kind, retry_after_s=retry_after_s)
        self.limit = limit


@dataclass
class _Window:
    """One tenant's recent requests and tokens (time, amount), and its requests in flight."""

    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    in_flight: int = 0

    def expire(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]

    def add_tokens(self, now: float, n: int) -> None:
        if n > 0:
            self.tokens.append((now, n))
            self.token_sum += n


class Limits:
    """Per-tenant requests and tokens per minute, concurrency and context length (0: no limit)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._windows: dict[str, _Window] = {}

    def admit(self, tenant: Tenant, prompt_tokens: int, context_tokens: int, now: float) -> None:
        """Counts a request of ``prompt_tokens`` (all its prompts) whose longest sequence may reach
        ``context_tokens`` (prompt plus max_tokens); raises ``LimitError`` when a limit refuses it."""
        t = tenant
        if t.max_context and context_tokens > t.max_context:
            raise LimitError(
                400, "max_context",
                f"the prompt plus max_tokens is {context_tokens} tokens; tenant {t.name!r} may use "
                f"at most {t.max_context} per request",
            )  # fmt: skip
        if t.tokens_per_min and prompt_tokens > t.tokens_per_min:
            raise LimitError(
                400, "tokens_per_min",
                f"the prompt alone is {prompt_tokens} tokens, over tenant {t.name!r}'s "
                f"{t.tokens_per_min} tokens per minute",
            )  # fmt: skip
        w = self._windows.setdefault(t.name, _Window())
        w.expire(now)
        if t.max_concurrency and w.in_flight >= t.max_concurrency:
            raise LimitError(
                429, "max_concurrency",
                f"tenant {t.name!r} has {w.in_flight} requests in flight, its limit", retry_after_s=1.0,
            )  # fmt: skip
        if t.requests_per_min and len(w.requests) >= t.requests_per_min:
            wait = w.requests[0] + WINDOW_S - now
            raise LimitError(
                429, "requests_per_min",
                f"tenant {t.name!r} made {len(w.requests)} requests in the last minute, its limit",
                retry_after_s=_seconds(wait),
            )  # fmt: skip
        if t.tokens_per_min and w.token_sum + prompt_tokens > t.tokens_per_min:
            raise LimitError(
                429, "tokens_per_min",
                f"tenant {t.name!r} used {w.token_sum} of its {t.tokens_per_min} tokens per minute; "
                f"this request's prompt has {prompt_tokens}",
                retry_after_s=_seconds(self._token_wait(w, t.tokens_per_min - prompt_tokens, now)),
            )  # fmt: skip
        w.requests.append(now)
        w.add_tokens(now, prompt_tokens)
        w.in_flight += 1

    def finish(self, tenant: str, generated_tokens: int, now: float) -> None:
        """An admitted request ended, having generated ``generated_tokens`` (all its outputs)."""
        w = self._windows.get(tenant)
        if w is None:
            return
        w.in_flight = max(0, w.in_flight - 1)
        w.add_tokens(now, generated_tokens)
        if not w.in_flight and not w.requests and not w.tokens:
            del self._windows[tenant]

    def in_flight(self, tenant: str) -> int:
        w = self._windows.get(tenant)
        return w.in_flight if w is not None else 0

    @staticmethod
    def _token_wait(w: _Window, allowed: int, now: float) -> float:
        """Seconds until the window holds at most ``allowed`` tokens."""
        left = w.token_sum
        for at, n in w.tokens:
            left -= n
            if left <= allowed:
                return at + WINDOW_S - now
        return 0.0


def _seconds(wait: float) -> float:
    return max(1.0, math.ceil(wait))


@dataclass
class Usage:
    """What one tenant used of one model (served version)."""

    requests: int = 0
    failed: int = 0  # ended with an error (their partial output is counted below all the same)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those whose KV came from a prefix cache
    completion_tokens: int = 0  # every token generated, every output, before any stop string cut it


class UsageBook:
    """Usage per (tenant, model). Tenants not declared in the config count under their own name for
    the first ``MAX_TENANTS`` names, then under ``_other`` (the header is the client's to choose)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.declared = {t.name for t in config.tenants}
        self.usage: dict[tuple[str, str], Usage] = {}

    def label(self, tenant: str) -> str:
        if tenant in self.declared or any(t == tenant for t, _ in self.usage):
            return tenant
        return tenant if len({t for t, _ in self.usage}) < MAX_TENANTS else OTHER

    def add(self, tenant: str, model: str, prompt: int, cached: int, completion: int, failed: bool) -> None:
        u = self.usage.setdefault((self.label(tenant), model), Usage())
        u.requests += 1
        u.failed += int(failed)
        u.prompt_tokens += prompt
        u.cached_tokens += cached
        u.completion_tokens += completion

    def report(self) -> dict[str, dict[str, dict[str, int]]]:
        """{tenant: {model: usage}} (the admin endpoint's body)."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (tenant, model), u in sorted(self.usage.items()):
            out.setdefault(tenant, {})[model] = asdict(u)
        return out
