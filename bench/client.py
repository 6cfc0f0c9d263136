"""The open-loop replay client: every request leaves at its scheduled time, finished or not the others.

A request's life in the client:

1. scheduled: its task is created ``lookahead_s`` before its arrival time and builds the JSON body
   (token ids, or text of the exact token count) off the event loop;
2. waiting: it sleeps until its arrival time, then is sent (the send lateness is recorded);
3. streaming: token events are timed as they arrive (see ``pdfabric.bench.sse`` for the token rule);
4. finished: one ``RequestRecord`` with status ok, rejected, error, timeout or cancelled. A stream is
   ok only when it ended with a finish reason; one that broke off without a finish reason or an error
   event (no terminal event) is an error, and its record says ``terminal=False``.

The run stops when every request has finished, when ``max_run_s`` has passed, or when ``stop`` is set
(Ctrl-C): requests not yet sent are counted as not sent, requests in flight are cancelled and recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdfabric.bench.progress import Progress
from pdfabric.bench.prompts import PromptBuilder
from pdfabric.bench.records import CANCELLED, ERROR, OK, REJECTED, STATUSES, TIMEOUT, RequestRecord
from pdfabric.bench.sse import chunk_text, iter_events, spread_tokens
from pdfabric.bench.workload import Request, Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send. ``url`` is the server's base URL (``/v1/completions`` is appended)."""

    url: str
    model: str
    request_timeout_s: float = 600.0
    max_run_s: float | None = None  # None: last arrival + request timeout
    ignore_eos: bool = True
    include_usage: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    lookahead_s: float = 1.0
    lateness_warn_ms: float = 20.0
    keep_output: bool = False  # records carry the output text (and token ids, when the server sends them)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if not self.model:
            raise ValueError("model must not be empty")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_run_s is not None and not self.max_run_s > 0:
            raise ValueError(f"max_run_s must be > 0, got {self.max_run_s}")
        if self.lookahead_s < 0 or self.lateness_warn_ms <= 0:
            raise ValueError("lookahead_s must be >= 0 and lateness_warn_ms > 0")

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        if base.endswith("/completions"):
            return base
        return base + ("/completions" if base.endswith("/v1") else "/v1/completions")


@dataclass(frozen=True)
class ReplayResult:
    """Every sent request's record (by index), how many were never sent, and why the run stopped early."""

    records: list[RequestRecord]
    not_sent: int
    stopped: str | None  # None, "interrupted" or "time bound"
    wall_s: float
    warnings: list[str]


class _Run:
    def __init__(self, workload: Workload, cfg: ClientConfig, prompts: PromptBuilder) -> None:
        self.workload, self.cfg, self.prompts = workload, cfg, prompts
        self.records: list[RequestRecord] = []
        self.sent = 0
        self.t0 = 0.0
        self.session: aiohttp.ClientSession | None = None

    def body(self, req: Request) -> bytes:
        payload: dict[str, Any] = {
            "model": self.cfg.model,
            "prompt": self.prompts.prompt(req),
            "max_tokens": req.output_len,
            "stream": True,
        }
        if self.cfg.include_usage:
            payload["stream_options"] = {"include_usage": True}
        if self.cfg.ignore_eos:
            payload["ignore_eos"] = True
        payload.update(self.cfg.extra_body)
        return json.dumps(payload, separators=(",", ":")).encode()

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for r in self.records:
            out[r.status] += 1
        return out

    async def send(self, req: Request) -> None:
        body = await asyncio.to_thread(self.body, req)
        delay = self.t0 + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        self.sent += 1
        st = _Stream()
        status, err = OK, None
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                status, err = await self._stream(body, sent, st)
        except TimeoutError:
            status, err = TIMEOUT, f"no complete answer within {self.cfg.request_timeout_s:g} s"
        except asyncio.CancelledError:
            self._finish(req, sent, st, CANCELLED, "run stopped before the answer was complete")
            raise
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            status, err = ERROR, f"{type(exc).__name__}: {exc}"
        self._finish(req, sent, st, status, err)

    async def _stream(self, body: bytes, sent: float, st: _Stream) -> tuple[str, str | None]:
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key:
            headers["Authorization"] = f"Bearer {self.cfg.api_key}"
        assert self.session is not None
        async with self.session.post(self.cfg.endpoint, data=body, headers=headers) as resp:
            st.http_status = resp.status
            if resp.status == 429 or (resp.status == 503 and "Retry-After" in resp.headers):
                await resp.read()
                return REJECTED, f"HTTP {resp.status}"
            if resp.status != 200:
                return ERROR, f"HTTP {resp.status}: {(await resp.text())[:300]}"
            async for chunk in iter_events(resp.content):
                now_ms = (time.perf_counter() - sent) * 1000.0
                if "error" in chunk:
                    st.terminal = True
                    return ERROR, f"error event: {str(chunk['error'])[:300]}"
                if text := chunk_text(chunk):
                    st.events.append(now_ms)
                    if self.cfg.keep_output:
                        st.text.append(text)
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    st.usage = int(usage["completion_tokens"])
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    st.cached_tokens = int(details["cached_tokens"])
                for choice in chunk.get("choices") or []:
                    st.first_choice_ms = now_ms if st.first_choice_ms is None else st.first_choice_ms
                    st.finish = choice.get("finish_reason") or st.finish
                    if self.cfg.keep_output and choice.get("token_ids") is not None:
                        st.token_ids.extend(choice["token_ids"])
        st.terminal = st.finish is not None
        if not st.events and st.usage and st.first_choice_ms is not None:
            st.events.append(st.first_choice_ms)  # its tokens decode to no text (a special token)
        if not st.events:
            return ERROR, "stream ended without any token"
        if st.finish is None:
            return ERROR, "stream ended without a finish reason"
        if st.finish in ("error", "abort"):
            return ERROR, f"finish_reason {st.finish}"
        return OK, None

    def _finish(self, req: Request, sent: float, st: _Stream, status: str, err: str | None) -> None:
        end_ms = (time.perf_counter() - sent) * 1000.0
        n, gaps = spread_tokens(st.events, st.usage)
        self.records.append(RequestRecord(
            index=req.index, scheduled_s=req.arrival_s, sent_s=sent - self.t0, input_len=req.input_len,
            output_len=req.output_len, status=status, http_status=st.http_status,
            ttft_ms=st.events[0] if st.events else None, e2e_ms=end_ms, output_tokens=n,
            token_count_source="usage" if st.usage is not None else "chunks", chunk_ms=list(st.events),
            itl_ms=gaps, finish_reason=st.finish, error=err, terminal=st.terminal,
            text="".join(st.text) if self.cfg.keep_output else None,
            token_ids=list(st.token_ids) if self.cfg.keep_output and st.token_ids else None,
            cached_tokens=st.cached_tokens,
        ))


@dataclass
class _Stream:
    events: list[float] = field(default_factory=list)
    usage: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server sends it
    finish: str | None = None
    http_status: int | None = None
    terminal: bool = False  # a finish reason or an error event arrived
    text: list[str] = field(default_factory=list)  # kept only with ClientConfig.keep_output
    token_ids: list[int] = field(default_factory=list)
    first_choice_ms: float | None = None  # when the first chunk with a choice came, text or not


async def replay(
    workload: Workload,
    cfg: ClientConfig,
    prompts: PromptBuilder,
    stop: asyncio.Event | None = None,
    progress: Progress | None = None,
    start_at: float | None = None,
) -> ReplayResult:
    """Replay ``workload`` open-loop against ``cfg.url``; returns when done, bounded or stopped.
    ``start_at`` is the run's time zero on ``time.perf_counter()`` (default: 50 ms from now), for a
    caller that acts on the same clock while the run goes on."""
    stop = stop or asyncio.Event()
    run = _Run(workload, cfg, prompts)
    reqs = workload.requests
    last = reqs[-1].arrival_s if reqs else 0.0
    max_run = cfg.max_run_s if cfg.max_run_s is not None else last + cfg.request_timeout_s + 5.0
    tasks: list[asyncio.Task[None]] = []
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue requests in the client
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as s:
        run.session = s
        run.t0 = time.perf_counter() + 0.05 if start_at is None else start_at
        deadline = run.t0 + max_run

        async def dispatch() -> None:
            for req in reqs:
                wait = run.t0 + req.arrival_s - cfg.lookahead_s - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(run.send(req)))

        async def show() -> None:
            while progress is not None:
                progress.update(run.sent, len(run.records), run.counts(), time.perf_counter() - run.t0)
                await asyncio.sleep(0.5)

        dispatcher = asyncio.create_task(dispatch())
        shower = asyncio.create_task(show())
        stopper = asyncio.create_task(stop.wait())
        stopped: str | None = None
        while True:
            pending = [t for t in tasks if not t.done()]
            if dispatcher.done() and not pending:
                break
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                stopped = "time bound"
                break
            waiters: list[asyncio.Task[Any]] = [stopper, *pending]
            if not dispatcher.done():
                waiters.append(dispatcher)
            await asyncio.wait(waiters, timeout=min(remaining, 1.0), return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                stopped = "interrupted"
                break
        for t in (dispatcher, stopper, shower, *tasks):
            t.cancel()
        await asyncio.gather(dispatcher, stopper, shower, *tasks, return_exceptions=True)
        wall = time.perf_counter() - run.t0
    if progress is not None:
        progress.update(run.sent, len(run.records), run.counts(), wall)
        progress.close()
    records = sorted(run.records, key=lambda r: r.index)
    return ReplayResult(records=records, not_sent=len(reqs) - len(records), stopped=stopped,
                        wall_s=wall, warnings=lateness_warnings(records, cfg.lateness_warn_ms))


def lateness_warnings(records: list[RequestRecord], warn_ms: float) -> list[str]:
    """Warnings when the client sent requests late enough that it, not the server, shaped the load."""
    late = sorted(r.lateness_ms for r in records)
    if not late:
        return []
    p99 = late[min(len(late) - 1, math.ceil(0.99 * len(late)) - 1)]
    if p99 <= warn_ms:
        return []
    return [
        f"the client was the bottleneck: p99 send lateness {p99:.1f} ms (max {late[-1]:.1f} ms) is above "
        f"{warn_ms:g} ms, so the offered load was lower than scheduled; use a faster client machine, "
        "fewer or shorter requests, or a lower rate"
    ]
