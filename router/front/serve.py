"""One completions or chat-completions call, as a pipeline of named steps over a ``Call`` record:

1. ``parse``: the body as JSON (a 400 for one that is not);
2. ``authorize``: its model version (``access``), its fields (``openai_api``: a 400 naming the field),
   its budgets (``slo``) and whether its tenant may use that model (403);
3. ``admit``: its prompts as tokens (off the event loop), their room for output, and its tenant's
   limits (a tenant's 429);
4. ``submit``: each prompt to the dispatcher, which starts it on a route or refuses it; a refusal
   becomes an HTTP error here (``refusal_error``: 429 with the reason, or 503);
5. ``stream``: the deltas as server-sent events, or collected into one JSON body (``responses``);
6. ``settle``: whatever ended it, every worker still holding one of its requests gets an ``Abort``,
   its tenant's limits and usage, its version's rollout, the scaler's window and the metrics count it.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from pdfabric.engine.detokenizer import IncrementalDetokenizer
from pdfabric.router.dispatch.dispatcher import Refusal
from pdfabric.router.dispatch.effects import Refused
from pdfabric.router.dispatch.stream import RequestStream
from pdfabric.router.errors import ApiError, bad
from pdfabric.router.front import access, responses
from pdfabric.router.front import openai_api as api
from pdfabric.router.front import prompts as prompts_
from pdfabric.router.front.breakdown import TokenTimes, breakdown
from pdfabric.router.front.keys import CONFIG, DISPATCHER, METRICS, OBSERVED
from pdfabric.router.json_body import parse_json_body
from pdfabric.router.platform.admin_models import MODELS
from pdfabric.router.platform.catalog import VERSION_HEADER, Version
from pdfabric.router.platform.scaler import Finished
from pdfabric.router.platform.tenants import LimitError
from pdfabric.router.routing.slo import BudgetError, Resolved, resolve

# Why admission control turned a request away, by its outcome's reason (the 429's message).
_WHY = {
    "ttft": "the predicted time to first token is over its budget",
    "itl": "the predicted inter-token latency is over its budget",
    "batch_full": "every decode batch that meets its budgets is full",
    "kv_full": "no decode worker that meets its budgets has KV room for the prompt",
    "ttft_unreachable": "no worker could meet its time-to-first-token budget even when idle",
    "itl_unreachable": "no worker could meet its inter-token-latency budget even when idle",
    "no_workers": "no worker can take it",
    "queue_full": "the router's wait queue is full",
    "deadline": "no route fitted before its deadline",
    "behind_waiting": "requests that have waited longer go first",
}


def refusal_error(refused: Refused) -> ApiError:
    """The HTTP answer to a request that never started: 429 with the reason and ``Retry-After`` when
    admission control turned it away, else 503 (no worker could take it)."""
    outcome = refused.outcome
    if outcome is None:
        return ApiError(refused.status, refused.message, kind="server_error", retry_after_s=1.0)
    b = outcome.ticket.budgets
    why = _WHY.get(outcome.reason, outcome.reason)
    return ApiError(
        429,
        f"request rejected ({outcome.reason}): {why} (ttft_ms={b.ttft_ms:g}, itl_ms={b.itl_ms:g}); "
        f"retry after {outcome.retry_after_ms} ms",
        kind="rate_limit_exceeded",
        retry_after_s=outcome.retry_after_ms / 1e3,
    )


@dataclass
class Call:
    """One call on its way through the pipeline: what each step found, for the steps after it."""

    request: web.Request
    chat: bool
    arrival: float = field(default_factory=time.monotonic)
    tenant: str = ""
    body: Any = None
    version: Version | None = None
    parsed: api.ParsedRequest | None = None
    resolved: Resolved | None = None
    prompts: list[list[int]] = field(default_factory=list)
    max_tokens: list[int] = field(default_factory=list)
    admitted: bool = False  # counted by its tenant's limits, so ``settle`` must let it go there
    submitted: list[str] = field(default_factory=list)  # its requests in the router, one per prompt
    streams: list[RequestStream] = field(default_factory=list)
    deadline: float | None = None  # ``time.monotonic()`` seconds, from its timeouts (None: none)
    dispatched: float = 0.0
    times: TokenTimes = field(default_factory=TokenTimes)
    outcome: str = "abort"  # until ``stream`` reaches a finish: the client went away

    @property
    def model(self) -> str:
        """The version that serves it, as responses name it ("" before ``authorize``)."""
        return self.version.label if self.version is not None else ""


async def serve(request: web.Request, chat: bool) -> web.StreamResponse:
    """The whole pipeline: an HTTP error for a call refused on the way, else its stream or body."""
    call = Call(request, chat, tenant=request.get(access.TENANT, ""))
    try:
        await parse(call)
        authorize(call)
        await admit(call)
        await submit(call)
    except (ApiError, Refusal) as exc:
        return refuse(call, exc)
    except BaseException:  # the client left while a later prompt of its batch waited to start
        release(call, failed=True)
        raise
    try:
        return await stream(call)
    finally:
        settle(call)


async def parse(call: Call) -> None:
    call.body = parse_json_body(await call.request.read())


def authorize(call: Call) -> None:
    app, body = call.request.app, call.body
    call.version = access.version_of(call.request, body, call.chat)
    parsed = api.parse_request(body, call.chat, (body["model"],), call.version.tokenizer.vocab_size)
    call.parsed = replace(parsed, model=call.version.label)  # responses name the version that serves
    try:
        call.resolved = resolve(
            app[CONFIG].routing, body.get("slo"), call.tenant, call.request.get(access.SLO_CLASS, "")
        )
    except BudgetError as exc:
        raise bad(str(exc), exc.param) from None
    allowed = call.resolved.tenant.models
    if allowed and call.version.model not in allowed:
        why = f"tenant {call.tenant!r} may not use model {call.version.model!r}"
        raise ApiError(403, why, "model", kind="permission_error")


async def admit(call: Call) -> None:
    app, parsed, version = call.request.app, call.parsed, call.version
    assert parsed is not None and version is not None and call.resolved is not None  # authorize ran
    call.prompts = await asyncio.to_thread(prompts_.tokenize, version.tokenizer, parsed)
    max_model_len = app[DISPATCHER].fleet.max_model_len(version.key)
    call.max_tokens = [prompts_.max_tokens(parsed, len(p), max_model_len) for p in call.prompts]
    context = max(len(p) + m for p, m in zip(call.prompts, call.max_tokens, strict=True))
    tokens = sum(map(len, call.prompts))
    app[access.ACCESS].limits.admit(call.resolved.tenant, tokens, context, time.monotonic())
    call.admitted = True


async def submit(call: Call) -> None:
    app, parsed, version, resolved = call.request.app, call.parsed, call.version, call.resolved
    assert parsed is not None and version is not None and resolved is not None  # admit ran
    seed = parsed.seed if parsed.seed is not None else secrets.randbelow(2**63)
    request_id = api.new_id(call.chat)
    header_timeout = api.timeout_seconds(call.request.headers.get("X-Request-Timeout"), "X-Request-Timeout")
    timeouts = [t for t in (parsed.timeout_s, header_timeout) if t is not None]
    call.deadline = deadline = call.arrival + min(timeouts) if timeouts else None
    eos = tuple(sorted(version.tokenizer.eos_token_ids))
    priority = resolved.slo_class.priority  # a worker prefills higher classes' prompts first
    background = resolved.slo_class.background  # and a background class's prompts in short chunks
    for i, (prompt_ids, limit) in enumerate(zip(call.prompts, call.max_tokens, strict=True)):
        sub_id = request_id if i == 0 else f"{request_id}-{i}"  # each prompt of a batch is a request
        call.submitted.append(sub_id)
        params = replace(parsed.sampling_params(limit, seed), priority=priority, background=background)
        stream = await app[DISPATCHER].submit(
            sub_id, prompt_ids, params, eos, resolved, deadline=deadline, n=parsed.best_of,
            served=version.key,
        )  # fmt: skip
        call.streams.append(stream)
        if version.first_routed_at is None:
            version.first_routed_at = time.monotonic()
    call.dispatched = time.monotonic()
    metrics = app[METRICS]
    metrics.queue_wait.labels(call.model).observe(call.dispatched - call.arrival)
    metrics.prompt_tokens.labels(call.model).inc(sum(len(p) for p in call.prompts))


def refuse(call: Call, exc: ApiError | Refusal) -> web.Response:
    """A call that stopped before it streamed: its requests end, and the refusal is counted and
    answered as its HTTP error."""
    app, metrics = call.request.app, call.request.app[METRICS]
    if isinstance(exc, LimitError):  # its tenant's limits refused it: nothing was admitted or sent
        metrics.rejections.labels(f"tenant_{exc.limit}").inc()
        return responses.error_response(exc)
    release(call, failed=True)
    if isinstance(exc, Refusal) and exc.refused.outcome is not None:  # admission control: a 429
        metrics.rejections.labels(exc.refused.outcome.reason).inc()
        app[OBSERVED].add(Finished(time.monotonic(), sum(map(len, call.prompts)), 0, False, None))
        return responses.error_response(refusal_error(exc.refused))
    err = refusal_error(exc.refused) if isinstance(exc, Refusal) else exc
    metrics.rejections.labels("invalid" if err.status < 500 else "no_capacity").inc()
    if err.status >= 500 and call.version is not None:  # its version could not serve it: rollouts count it
        app[MODELS].observe(call.version, False, None, None)
    return responses.error_response(err)


async def stream(call: Call) -> web.StreamResponse:
    app, parsed, version, resolved = call.request.app, call.parsed, call.version, call.resolved
    assert parsed is not None and version is not None and resolved is not None  # submit ran
    tok, timeout_s = version.tokenizer, app[CONFIG].request_timeout_s
    sources = []
    for p, (req_stream, prompt_ids) in enumerate(zip(call.streams, call.prompts, strict=True)):
        for c in range(parsed.best_of):
            detok = IncrementalDetokenizer(tok, list(prompt_ids), stop=list(parsed.stop))
            primary = call.times if p == 0 and c == 0 else None  # the output the latency metrics follow
            events = responses.events(
                req_stream.queues[c], detok, timeout_s, call.deadline, app[METRICS], call.model,
                call.arrival, primary,
            )  # fmt: skip
            echo = prompts_.prompt_text(tok, parsed, p, prompt_ids) if parsed.echo else None
            logprobs = responses.logprobs_out(tok, parsed)
            index = p * parsed.best_of + c
            sources.append(responses.Source(index, events, req_stream, logprobs, echo, prompt_ids))
    first = call.streams[0]

    def report() -> dict[str, Any]:
        return breakdown(
            first.route, resolved, first.choice, call.arrival, call.dispatched, call.times, first.transfer_s
        )

    reporting = report if "slo" in call.body else None  # clients of the ``slo`` extension get the breakdown
    headers = {VERSION_HEADER: version.label}
    if parsed.stream:
        response, call.outcome = await responses.stream_sse(
            call.request, parsed, call.submitted[0], sources, reporting, headers
        )
    else:
        response, call.outcome = await responses.collect(parsed, call.submitted[0], sources, reporting)
        response.headers.update(headers)
    return response


def settle(call: Call) -> None:
    app, metrics, version = call.request.app, call.request.app[METRICS], call.version
    assert version is not None and call.resolved is not None  # it streamed
    release(call, failed=call.outcome in ("error", "abort"))
    ttft, itl = call.times.latencies(call.arrival)
    app[MODELS].observe(version, call.outcome != "error", ttft, itl)
    budgets = call.resolved.budgets
    app[OBSERVED].add(
        Finished(
            time.monotonic(),
            sum(map(len, call.prompts)),
            sum(s.generated for s in call.streams),
            None if ttft is None else ttft * 1e3 <= budgets.ttft_ms,
            None if itl is None else itl * 1e3 <= budgets.itl_ms,
            call.dispatched - call.arrival,
        )  # fmt: skip
    )
    metrics.requests.labels(call.model, call.outcome).inc()
    metrics.e2e.labels(call.model).observe(time.monotonic() - call.arrival)


def release(call: Call, failed: bool) -> None:
    """Ends the call's requests (every worker still holding one gets an ``Abort``); when its tenant's
    limits had admitted it, settles what it used (``access.settle``)."""
    for request_id in call.submitted:
        call.request.app[DISPATCHER].release(request_id, "request ended")
    if call.admitted:
        access.settle(call.request.app[access.ACCESS], call.tenant, call.streams, call.model, failed)
