"""One request's stream of deltas, as the dispatcher fills it and the HTTP handler reads it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdfabric.control import TokenDelta
from pdfabric.router.routing.routes import Choice


@dataclass
class RequestStream:
    """One request's deltas, for the HTTP handler to consume: one queue per output (choice), each in
    output order; a failure goes to every queue."""

    request_id: str
    prompt_len: int
    n: int = 1
    queues: list[asyncio.Queue[TokenDelta]] = field(init=False)
    route: str = ""
    choice: Choice | None = None  # the route taken, with its predicted latencies
    waited_ms: float = 0.0  # time spent waiting for admission in the router
    transfer_s: float | None = None  # KV push, start to acknowledgement (0 colocated; None: not yet told)
    cached_tokens: int = 0  # prompt tokens whose KV came from a worker's prefix cache
    generated: int = 0  # tokens its workers generated for it, every output (what its tenant is billed)
    started: asyncio.Future[None] | None = None  # set while ``submit`` waits for the start
    prompt_logprobs: tuple = ()  # the prompt's scores (``TokenDelta.prompt_logprobs``), once they came
    scored: asyncio.Event = field(default_factory=asyncio.Event)  # they came (or the request failed)

    def __post_init__(self) -> None:
        self.queues = [asyncio.Queue() for _ in range(self.n)]

    @property
    def queue(self) -> asyncio.Queue[TokenDelta]:
        """The first output's queue (the only one when ``n`` is 1)."""
        return self.queues[0]

    def put(self, delta: TokenDelta) -> None:
        if delta.prompt_logprobs and not self.scored.is_set():
            self.prompt_logprobs = delta.prompt_logprobs
            self.scored.set()
        if delta.finish_reason in ("error", "abort"):
            self.scored.set()
            for q in self.queues:
                q.put_nowait(delta)
        elif 0 <= delta.choice < self.n:
            self.queues[delta.choice].put_nowait(delta)
