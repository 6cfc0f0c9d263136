"""One request as the router keeps it: what the client asked for, what it has been sent, and the
attempt now running it (``core.RouterCore`` decides what happens to it; this is its record).

Deltas reach the client in output order, each index once: ``accept`` holds early ones back and
lets a failure through at once. After a failure, ``resume`` sets up the next attempt: a new id on the
wire (``rid~k``), a prompt of the client's prompt plus every token delivered so far, and sampling
parameters for the remaining tokens at the same output positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from pdfabric.control import TokenDelta
from pdfabric.engine.sampling_params import SamplingParams
from pdfabric.router.admission import Ticket
from pdfabric.router.routes import Choice


@dataclass(eq=False)
class RouterRequest:
    ticket: Ticket
    prompt_ids: tuple[int, ...]  # the client's prompt
    params: SamplingParams  # the client's parameters
    eos: tuple[int, ...]
    deadline: float | None = None  # the client's bound on the whole request (None: none), on the clock
    wire_id: str = field(init=False)  # the current attempt's id on the wire
    run_prompt: tuple[int, ...] = field(init=False)  # what the current attempt prefills (prompt + tokens out)
    run_params: SamplingParams = field(init=False)  # the current attempt's (remaining tokens, offset)
    failovers: int = 0
    base: int = 0  # the output index the current attempt's tokens start at
    output: list[int] = field(default_factory=list)  # token ids delivered, in order
    choices: tuple[Choice, ...] = ()  # the current attempt's routes, best first
    tried: int = 0  # routes tried so far
    waited_ms: float = 0.0
    reasons: list[str] = field(default_factory=list)  # why each route tried did not take it
    started: bool = False
    finished: bool = False  # its last delta is out
    next_index: int = 0  # the output index delivered next
    pending: dict[int, TokenDelta] = field(default_factory=dict)  # deltas that came early

    def __post_init__(self) -> None:
        self.wire_id, self.run_prompt, self.run_params = self.request_id, self.prompt_ids, self.params

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    def wire_ids(self) -> Iterator[str]:
        """Every attempt's id on the wire, the first (the request id) included."""
        yield self.request_id
        for k in range(1, self.failovers + 1):
            yield f"{self.request_id}~{k}"

    def accept(self, delta: TokenDelta) -> list[TokenDelta]:
        """A delta in client output indices; returns those now due to the client, in order (an error
        or abort at once). Nothing after the last one."""
        if self.finished:
            return []
        if delta.finish_reason in ("error", "abort"):  # failures jump the queue
            self.finished = True
            return [delta]
        due: list[TokenDelta] = []
        self.pending[delta.index] = delta
        while self.next_index in self.pending:
            d = self.pending.pop(self.next_index)
            self.next_index += len(d.token_ids)
            self.output.extend(d.token_ids)
            due.append(d)
            if d.finish_reason is not None:
                self.finished = True
                self.pending.clear()
                break
            if not d.token_ids:
                break
        return due

    def resume(self) -> bool:
        """Sets up the next attempt after a failure; False when every token is out already (only the
        finish was lost), and there is nothing to run."""
        n = len(self.output)
        remaining = self.params.max_tokens - n
        if remaining < 1:
            return False
        self.failovers += 1
        self.wire_id = f"{self.request_id}~{self.failovers}"
        self.run_prompt = self.prompt_ids + tuple(self.output)
        offset = self.params.output_offset + n
        self.run_params = replace(self.params, max_tokens=remaining, output_offset=offset)
        self.base, self.pending = n, {}  # early deltas of the failed attempt will come again
        self.choices, self.tried = (), 0
        return True
