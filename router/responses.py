"""What a client gets back: a request's worker deltas turned into text events (stop strings, timeouts,
the request's deadline), written as a server-sent event stream or collected into one JSON body in
OpenAI's response shapes, with log-probabilities when asked for; and error responses."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdfabric.engine.detokenizer import IncrementalDetokenizer
from pdfabric.engine.sequence import TopLogprobs
from pdfabric.engine.tokenizer import Tokenizer
from pdfabric.router import openai_api as api
from pdfabric.router.breakdown import TokenTimes
from pdfabric.router.dispatcher import RequestStream
from pdfabric.router.logprobs import LogprobsOut
from pdfabric.router.metrics import RouterMetrics


@dataclass(frozen=True)
class Event:
    text: str
    token_ids: tuple[int, ...]  # the tokens this event covers
    finish_reason: str | None = None
    error: str = ""
    status: int = 503  # of an error: what a non-streaming client gets
    logprobs: tuple[float, ...] = ()  # per token of token_ids
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per token, when the request asked for them


def error_response(err: api.ApiError) -> web.Response:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, round(err.retry_after_s * 1e3)))
    return web.json_response(err.body(), status=err.status, headers=headers)


async def events(
    stream: RequestStream,
    detok: IncrementalDetokenizer,
    timeout_s: float,
    deadline: float | None,
    metrics_: RouterMetrics,
    model: str,
    arrival: float,
    times: TokenTimes,
) -> AsyncIterator[Event]:
    """The request's text in order, ending with exactly one event that carries a finish reason. It
    ends with an error when no delta comes for ``timeout_s`` or at the request's ``deadline``
    (``time.monotonic()``); each such end counts as a lost request, by cause."""
    last = None
    while True:
        left = deadline - time.monotonic() if deadline is not None else math.inf
        try:
            delta = await asyncio.wait_for(stream.queue.get(), max(0.0, min(timeout_s, left)))
        except TimeoutError:
            if left < timeout_s:
                metrics_.lost.labels("deadline").inc()
                yield Event("", (), "error", f"the request's deadline ({deadline - arrival:g}s) passed", 504)
            else:
                metrics_.lost.labels("no_progress").inc()
                yield Event("", (), "error", f"no progress for {timeout_s:.0f}s")
            return
        if delta.finish_reason in ("error", "abort"):
            metrics_.lost.labels("worker_failed").inc()
            yield Event("", (), delta.finish_reason, delta.error or "aborted by a worker")
            return
        if delta.token_ids:
            now = time.monotonic()
            if last is None:
                metrics_.ttft.labels(model).observe(now - arrival)
            else:
                metrics_.itl.labels(model).observe(now - last)
            last = now
            times.seen(len(delta.token_ids))
            metrics_.generation_tokens.labels(model).inc(len(delta.token_ids))
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


async def stream_sse(
    request: web.Request,
    parsed: api.ParsedRequest,
    request_id: str,
    stream: RequestStream,
    events: AsyncIterator[Event],
    logprobs: LogprobsOut | None = None,
    report: Callable[[], dict[str, Any]] | None = None,
) -> tuple[web.StreamResponse, str]:
    """Writes ``events`` as server-sent events; returns the response and how the request ended."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": request_id}
    )
    await response.prepare(request)
    held: tuple[int, ...] = ()
    created, first, completion_tokens, outcome = now(), True, 0, "abort"
    async for event in events:
        completion_tokens += len(event.token_ids)
        if event.finish_reason == "error" or event.finish_reason == "abort":
            err = api.ApiError(503, event.error, kind="server_error")
            await send(response, err.body())
            outcome = event.finish_reason
            break
        held += event.token_ids  # tokens whose text is not out yet (half a character, a possible stop)
        if logprobs is not None:
            logprobs.add(event.token_ids, event.logprobs, event.top_logprobs)
        if event.text or event.finish_reason or first:
            lp = logprobs.take() if logprobs is not None and held else None
            text_chunk = chunk(parsed, request_id, created, event.text, event.finish_reason, first, held, lp)
            await send(response, text_chunk)
            first, held = False, ()
        if event.finish_reason is not None:
            outcome = event.finish_reason
    if parsed.include_usage:
        usage_chunk = {
            "id": request_id,
            "object": "chat.completion.chunk" if parsed.chat else "text_completion",
            "created": created,
            "model": parsed.model,
            "choices": [],
            "usage": usage(
                stream.prompt_len,
                completion_tokens,
                stream.cached_tokens,
                {"pdfabric": report()} if report else None,
            ),
        }
        await send(response, usage_chunk)
    try:
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left after its last event: the request ended as it did
        pass
    return response, outcome


async def send(response: web.StreamResponse, obj: dict) -> None:
    await response.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def logprobs_out(tokenizer: Tokenizer, parsed: api.ParsedRequest) -> LogprobsOut | None:
    """Where the request's log-probabilities are gathered, or None when it did not ask for them."""
    if parsed.logprobs is None:
        return None
    return LogprobsOut(parsed.chat, lambda t: tokenizer.decode([t], skip_special_tokens=False))


async def collect(
    parsed: api.ParsedRequest,
    request_id: str,
    stream: RequestStream,
    events: AsyncIterator[Event],
    logprobs: LogprobsOut | None = None,
    report: Callable[[], dict[str, Any]] | None = None,
) -> tuple[web.Response, str]:
    """Gathers ``events`` into one JSON body; returns the response and how the request ended."""
    parts: list[str] = []
    token_ids: list[int] = []
    async for event in events:
        token_ids.extend(event.token_ids)
        if logprobs is not None:
            logprobs.add(event.token_ids, event.logprobs, event.top_logprobs)
        if event.finish_reason in ("error", "abort"):
            failed = api.ApiError(event.status, event.error, kind="server_error")
            return error_response(failed), event.finish_reason
        parts.append(event.text)
        if event.finish_reason is not None:
            body = full_response(
                parsed,
                request_id,
                now(),
                "".join(parts),
                event.finish_reason,
                usage(
                    stream.prompt_len,
                    len(token_ids),
                    stream.cached_tokens,
                    {"pdfabric": report()} if report else None,
                ),
                token_ids,
                logprobs.take() if logprobs is not None else None,
            )
            return web.json_response(body), event.finish_reason
    raise AssertionError("the event stream ended without a finish")


# --- OpenAI's response shapes ------------------------------------------------------------------------------


def chunk(
    req: api.ParsedRequest,
    request_id: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    first: bool = False,
    token_ids: tuple[int, ...] = (),
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk; ``logprobs``: its tokens' block (``router/logprobs.py``)."""
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return {"id": request_id, "object": obj, "created": created, "model": req.model, "choices": [choice]}


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose KV came from the prefix cache."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if extra:
        out.update(extra)
    return out


def full_response(
    req: api.ParsedRequest,
    request_id: str,
    created: int,
    text: str,
    finish_reason: str,
    usage_: dict[str, Any],
    token_ids: list[int],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The body of a non-streaming response."""
    if req.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": usage_,
    }


def now() -> int:
    return int(time.time())
