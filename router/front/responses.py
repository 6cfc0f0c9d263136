"""What a client gets back: a request's worker deltas turned into text events (stop strings, timeouts,
the request's deadline), written as a server-sent event stream or collected into one JSON body in
OpenAI's response shapes (``router/front/shapes.py``), with log-probabilities when asked for; and error
responses.

A response has one ``Source`` per output it returns (``choices[i]``): each prompt of a batch times
``n``. Their events interleave in a stream, each chunk naming its choice's index; the first failure
ends the whole response. With ``best_of`` > ``n`` every output generated is collected and the ``n``
likeliest per prompt (highest mean log-probability per token) are returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from pdfabric.control import TokenDelta
from pdfabric.engine.detokenizer import IncrementalDetokenizer
from pdfabric.engine.sequence import TopLogprobs
from pdfabric.engine.tokenizer import Tokenizer
from pdfabric.router.dispatch.stream import RequestStream
from pdfabric.router.errors import ApiError
from pdfabric.router.front import openai_api as api
from pdfabric.router.front import shapes, tool_calls
from pdfabric.router.front.breakdown import TokenTimes
from pdfabric.router.front.logprobs import LogprobsOut
from pdfabric.router.front.metrics import RouterMetrics
from pdfabric.router.front.tool_calls import ToolCallStream

ECHO_WAIT_S = 30.0  # how long another output of a request waits for the prompt's scores


@dataclass(frozen=True)
class Event:
    text: str
    token_ids: tuple[int, ...]  # the tokens this event covers
    finish_reason: str | None = None
    error: str = ""
    status: int = 503  # of an error: what a non-streaming client gets
    logprobs: tuple[float, ...] = ()  # per token of token_ids
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per token, when the request asked for them


def error_response(err: ApiError) -> web.Response:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, round(err.retry_after_s * 1e3)))
    return web.json_response(err.body(), status=err.status, headers=headers)


@dataclass
class Source:
    """One output of a response: its index in ``choices``, its events, its log-probabilities (None:
    not asked for), and the stream of the request it comes from. With ``echo`` (the prompt's text)
    its text starts with the prompt, and its log-probabilities with the prompt's scores."""

    index: int
    events: AsyncIterator[Event]
    stream: RequestStream
    logprobs: LogprobsOut | None = None
    echo: str | None = None
    prompt_ids: tuple[int, ...] = ()

    async def echoed(self, event: Event, timeout_s: float) -> Event:
        """The output's first event with the echoed prompt in front (its scores go to ``logprobs``
        first; on one of a request's other outputs they may come a moment later)."""
        if self.echo is None:
            return event
        if self.logprobs is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stream.scored.wait(), timeout_s)
            self.logprobs.add_prompt(self.prompt_ids, self.stream.prompt_logprobs)
        return replace(event, text=self.echo + event.text)


async def events(
    queue: asyncio.Queue[TokenDelta],
    detok: IncrementalDetokenizer,
    timeout_s: float,
    deadline: float | None,
    metrics_: RouterMetrics,
    model: str,
    arrival: float,
    times: TokenTimes | None,
) -> AsyncIterator[Event]:
    """One output's text in order (its deltas come from ``queue``), ending with exactly one event that
    carries a finish reason. It ends with an error when no delta comes for ``timeout_s`` or at the
    request's ``deadline`` (``time.monotonic()``). ``times``: the output whose token times the
    latency metrics and the breakdown follow (None for a response's other outputs); its failures count
    as a lost request, by cause."""
    last = None
    while True:
        left = deadline - time.monotonic() if deadline is not None else math.inf
        try:
            delta = await asyncio.wait_for(queue.get(), max(0.0, min(timeout_s, left)))
        except TimeoutError:
            if left < timeout_s:
                if times is not None:
                    metrics_.lost.labels("deadline").inc()
                yield Event("", (), "error", f"the request's deadline ({deadline - arrival:g}s) passed", 504)
            else:
                if times is not None:
                    metrics_.lost.labels("no_progress").inc()
                yield Event("", (), "error", f"no progress for {timeout_s:.0f}s")
            return
        if delta.finish_reason in ("error", "abort"):
            if times is not None:
                metrics_.lost.labels("worker_failed").inc()
            yield Event("", (), delta.finish_reason, delta.error or "aborted by a worker")
            return
        if delta.token_ids:
            metrics_.generation_tokens.labels(model).inc(len(delta.token_ids))
        if delta.token_ids and times is not None:
            now = time.monotonic()
            if last is None:
                metrics_.ttft.labels(model).observe(now - arrival)
            else:
                metrics_.itl.labels(model).observe(now - last)
            last = now
            times.seen(len(delta.token_ids))
        text, used = "", 0
        lps, tops = delta.logprobs, delta.top_logprobs
        for token in delta.token_ids:
            used += 1
            text += detok.step(token)
            if detok.stopped:
                yield Event(
                    text, delta.token_ids[:used], "stop", logprobs=lps[:used], top_logprobs=tops[:used]
                )
                return
        if delta.finish_reason is not None:
            yield Event(
                text + detok.flush(), delta.token_ids, delta.finish_reason, logprobs=lps, top_logprobs=tops
            )
            return
        yield Event(text, delta.token_ids, logprobs=lps, top_logprobs=tops)


async def merged(sources: list[Source]) -> AsyncIterator[tuple[Source, Event]]:
    """Every source's events as they come, tagged with their source (each source's in its order)."""
    if len(sources) == 1:
        async for event in sources[0].events:
            yield sources[0], event
        return
    queue: asyncio.Queue[tuple[Source, Event | BaseException | None]] = asyncio.Queue()

    async def pump(source: Source) -> None:
        try:
            async for event in source.events:
                queue.put_nowait((source, event))
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader below
            queue.put_nowait((source, exc))
        queue.put_nowait((source, None))

    tasks = [asyncio.create_task(pump(source)) for source in sources]
    try:
        left = len(sources)
        while left:
            source, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield source, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_sse(
    request: web.Request,
    parsed: api.ParsedRequest,
    request_id: str,
    sources: list[Source],
    report: Callable[[], dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[web.StreamResponse, str]:
    """Writes the sources' events as server-sent events (with ``headers`` besides the stream's own);
    returns the response and how the request ended (the first failure, else the last output's
    finish)."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": request_id,
            **(headers or {}),
        }
    )  # fmt: skip
    await response.prepare(request)
    try:
        outcome = await _write_events(response, parsed, request_id, sources, report)
    except ConnectionResetError:  # the client left mid-stream: its request is aborted, nothing to log
        return response, "abort"
    try:
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left after its last event: the request ended as it did
        pass
    return response, outcome


async def _write_events(
    response: web.StreamResponse,
    parsed: api.ParsedRequest,
    request_id: str,
    sources: list[Source],
    report: Callable[[], dict[str, Any]] | None,
) -> str:
    """Writes every chunk and the usage chunk; returns how the request ended."""
    held: dict[int, tuple[int, ...]] = {s.index: () for s in sources}  # tokens whose text is not out yet
    first = {s.index for s in sources}  # choices that have not sent a chunk yet
    calls = {s.index: ToolCallStream() for s in sources} if parsed.tools else {}
    created, completion_tokens, outcome = shapes.now(), 0, "abort"
    async for source, event in merged(sources):
        completion_tokens += len(event.token_ids)
        if event.finish_reason == "error" or event.finish_reason == "abort":
            err = ApiError(503, event.error, kind="server_error")
            await send(response, err.body())
            outcome = event.finish_reason
            break
        i, logprobs = source.index, source.logprobs
        if i in first:
            event = await source.echoed(event, ECHO_WAIT_S)
        held[i] += event.token_ids  # half a character, or a possible stop string
        if logprobs is not None:
            logprobs.add(event.token_ids, event.logprobs, event.top_logprobs)
        text, finish, deltas = event.text, event.finish_reason, None
        if calls:  # a reply that may call tools: its calls leave as delta.tool_calls
            text, deltas = calls[i].feed(text, final=finish is not None)
            finish = finish and tool_calls.finish_reason(finish, calls[i].calls)
        if text or deltas or finish or i in first:
            lp = logprobs.take() if logprobs is not None and held[i] else None
            part = shapes.chunk(parsed, request_id, created, text, finish, i in first, held[i], lp, i, deltas)
            await send(response, part)
            first.discard(i)
            held[i] = ()
        if event.finish_reason is not None:
            outcome = event.finish_reason
    if parsed.include_usage:
        usage_chunk = {
            "id": request_id,
            "object": "chat.completion.chunk" if parsed.chat else "text_completion",
            "created": created,
            "model": parsed.model,
            "choices": [],
            "usage": _usage(sources, completion_tokens, report),
        }
        await send(response, usage_chunk)
    return outcome


def _usage(
    sources: list[Source], completion_tokens: int, report: Callable[[], dict[str, Any]] | None
) -> dict[str, Any]:
    """Usage over every prompt of the response (each counted once) and every output generated."""
    streams = list({id(s.stream): s.stream for s in sources}.values())
    return shapes.usage(
        sum(st.prompt_len for st in streams),
        completion_tokens,
        sum(st.cached_tokens for st in streams),
        {"pdfabric": report()} if report else None,
    )


async def send(response: web.StreamResponse, obj: dict) -> None:
    await response.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def logprobs_out(tokenizer: Tokenizer, parsed: api.ParsedRequest) -> LogprobsOut | None:
    """Where the request's log-probabilities are gathered, or None when it did not ask for them."""
    if parsed.logprobs is None:
        return None
    return LogprobsOut(parsed.chat, lambda t: tokenizer.decode([t], skip_special_tokens=False))


@dataclass
class Collected:
    """One output gathered whole."""

    source: Source
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprob_sum: float = 0.0
    finish_reason: str | None = None
    started: bool = False

    @property
    def mean_logprob(self) -> float:
        return self.logprob_sum / len(self.token_ids) if self.token_ids else -math.inf


async def collect(
    parsed: api.ParsedRequest,
    request_id: str,
    sources: list[Source],
    report: Callable[[], dict[str, Any]] | None = None,
) -> tuple[web.Response, str]:
    """Gathers the sources' events into one JSON body; returns the response and how the request
    ended. With ``best_of`` > ``n`` the sources come ``best_of`` per prompt, in index order, and the
    ``n`` likeliest of each prompt's are returned, as indices ``prompt * n + rank``."""
    got = {s.index: Collected(s) for s in sources}
    async for source, event in merged(sources):
        out = got[source.index]
        if not out.started and event.finish_reason not in ("error", "abort"):
            event, out.started = await source.echoed(event, ECHO_WAIT_S), True
        out.token_ids.extend(event.token_ids)
        out.logprob_sum += sum(event.logprobs)
        if source.logprobs is not None:
            source.logprobs.add(event.token_ids, event.logprobs, event.top_logprobs)
        if event.finish_reason in ("error", "abort"):
            failed = ApiError(event.status, event.error, kind="server_error")
            return error_response(failed), event.finish_reason
        out.text += event.text
        out.finish_reason = event.finish_reason or out.finish_reason
    outputs = sorted(got.values(), key=lambda c: c.source.index)
    completion_tokens = sum(len(c.token_ids) for c in outputs)
    chosen = [(c.source.index, c) for c in outputs]
    best_of, n = parsed.best_of, parsed.n
    if best_of > n:
        chosen = []
        for p in range(0, len(outputs), best_of):
            ranked = sorted(outputs[p : p + best_of], key=lambda c: -c.mean_logprob)[:n]
            chosen += [(p // best_of * n + rank, c) for rank, c in enumerate(ranked)]
    choices = []
    for index, c in chosen:
        assert c.finish_reason is not None, "an output's events ended without a finish"
        lp = c.source.logprobs.take() if c.source.logprobs is not None else None
        choices.append(shapes.choice_body(parsed, index, c.text, c.finish_reason, c.token_ids, lp))
    body = shapes.full_response(
        parsed, request_id, shapes.now(), choices, _usage(sources, completion_tokens, report)
    )
    return web.json_response(body), outputs[-1].finish_reason or "stop"
