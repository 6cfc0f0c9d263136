"""One request as the router keeps it: what the client asked for, what it has been sent, and the
attempt now running it (``core.RouterCore`` decides what happens to it; this is its record).

A request has ``n`` outputs (choices); an attempt runs them all on one route, the prompt computed
once (choice 0 as the request's own sequence, the others as its ``Branch``es). Each output's deltas
reach the client in its output order, each index once: ``accept`` holds early ones back and lets a
failure through at once. After a failure, ``resume`` sets up the next attempt for the outputs not
finished: a new id on the wire (``rid~k``), a prompt of the client's prompt plus every token the first
of them delivered so far, the others as branches carrying theirs, and sampling parameters for the
remaining tokens at the same output positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from pdfabric.control import TokenDelta
from pdfabric.router.routing.admission import Ticket
from pdfabric.router.routing.routes import Choice
from pdfabric.sampling_params import Branch, SamplingParams


@dataclass(eq=False)
class Output:
    """One of the request's outputs (``choice``) as the client has been sent it."""

    choice: int
    tokens: list[int] = field(default_factory=list)  # token ids delivered, in order
    next_index: int = 0  # the output index delivered next
    pending: dict[int, TokenDelta] = field(default_factory=dict)  # deltas that came early
    finished: bool = False  # its last delta is out
    base: int = 0  # the output index the current attempt's tokens of this output start at

    def accept(self, delta: TokenDelta) -> list[TokenDelta]:
        """A delta in client output indices; returns those now due to the client, in order."""
        if self.finished:
            return []
        due: list[TokenDelta] = []
        self.pending[delta.index] = delta
        while self.next_index in self.pending:
            d = self.pending.pop(self.next_index)
            self.next_index += len(d.token_ids)
            self.tokens.extend(d.token_ids)
            due.append(d)
            if d.finish_reason is not None:
                self.finished = True
                self.pending.clear()
                break
            if not d.token_ids:
                break
        return due


@dataclass(eq=False)
class RouterRequest:
    ticket: Ticket
    prompt_ids: tuple[int, ...]  # the client's prompt
    params: SamplingParams  # the client's parameters (``output_offset`` 0)
    eos: tuple[int, ...]
    deadline: float | None = None  # the client's bound on the whole request (None: none), on the clock
    n: int = 1  # outputs (choices) asked for
    wire_id: str = field(init=False)  # the current attempt's id on the wire
    run_prompt: tuple[int, ...] = field(init=False)  # what the current attempt prefills (prompt + tokens out)
    run_params: SamplingParams = field(init=False)  # the current attempt's (remaining tokens, offset)
    run_branches: tuple[Branch, ...] = field(init=False)  # the current attempt's other outputs
    outs: list[Output] = field(init=False)  # one per choice
    run_choices: frozenset[int] = field(init=False)  # the outputs the current attempt runs
    running: set[int] = field(init=False)  # those whose finish has not come from a worker yet
    failovers: int = 0
    choices: tuple[Choice, ...] = ()  # the current attempt's routes, best first
    tried: int = 0  # routes tried so far
    waited_ms: float = 0.0
    reasons: list[str] = field(default_factory=list)  # why each route tried did not take it
    no_room: bool = False  # a route of this admission refused it for want of free KV blocks
    started: bool = False
    failed: bool = False  # a failure went out: nothing more will

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        self.wire_id, self.run_prompt, self.run_params = self.request_id, self.prompt_ids, self.params
        self.run_branches = tuple(Branch(c) for c in range(1, self.n))
        self.outs = [Output(c) for c in range(self.n)]
        self.run_choices = frozenset(range(self.n))
        self.running = set(self.run_choices)

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    @property
    def finished(self) -> bool:
        """Every output's last delta is out (or a failure is)."""
        return self.failed or all(o.finished for o in self.outs)

    @property
    def delivered(self) -> int:
        """Tokens delivered so far, over every output."""
        return sum(len(o.tokens) for o in self.outs)

    def wire_ids(self) -> Iterator[str]:
        """Every attempt's id on the wire, the first (the request id) included."""
        yield self.request_id
        for k in range(1, self.failovers + 1):
            yield f"{self.request_id}~{k}"

    def from_wire(self, delta: TokenDelta) -> TokenDelta | None:
        """A delta of the current attempt in the client's terms (its id, its output's indices; None for
        an output it does not run). An output's finish may arrive before its earlier tokens: a
        disaggregated output's first token comes from the prefill worker, the rest from the decode
        worker, on connections that keep no order between them; those tokens are still taken."""
        if delta.choice not in self.run_choices:
            return None
        cached = delta.cached_tokens if self.failovers == 0 else 0  # the client's prompt's, not a resume's
        index = delta.index + self.outs[delta.choice].base
        return replace(delta, request_id=self.request_id, index=index, cached_tokens=cached)

    def attempt_done(self, choice: int) -> bool:
        """The current attempt finished output ``choice``; True when it has finished every one."""
        self.running.discard(choice)
        return not self.running

    def accept(self, delta: TokenDelta) -> list[TokenDelta]:
        """A delta in client output indices; returns those now due to the client, in order (an error
        or abort at once). Nothing after the request's last one."""
        if self.finished:
            return []
        if delta.finish_reason in ("error", "abort"):  # failures jump the queue
            self.failed = True
            return [delta]
        if not 0 <= delta.choice < self.n:
            return []
        return self.outs[delta.choice].accept(delta)

    def spent(self) -> list[TokenDelta]:
        """Finishes for the outputs not finished whose every token is out (only the finish was lost)."""
        limit = self.params.max_tokens
        return [
            TokenDelta(self.request_id, len(o.tokens), (), (), "length", choice=o.choice)
            for o in self.outs
            if not o.finished and len(o.tokens) >= limit
        ]

    def resume(self) -> bool:
        """Sets up the next attempt after a failure, for the outputs not finished (``spent`` ones
        delivered first); False when there are none, and nothing to run."""
        left = [o for o in self.outs if not o.finished]
        if not left:
            return False
        first, n = left[0], len(left[0].tokens)
        self.failovers += 1
        self.wire_id = f"{self.request_id}~{self.failovers}"
        self.run_prompt = self.prompt_ids + tuple(first.tokens)
        offset = self.params.output_offset + n
        # The prompt is scored again only if the client has not had its scores (the first delta).
        scoring = self.params.prompt_logprobs and first.choice == 0 and first.next_index == 0
        self.run_params = replace(
            self.params,
            max_tokens=self.params.max_tokens - n,
            output_offset=offset,
            choice=first.choice,
            prompt_logprobs=scoring,
        )
        self.run_branches = tuple(Branch(o.choice, tuple(o.tokens)) for o in left[1:])
        for o in left:
            o.base, o.pending = len(o.tokens), {}  # early deltas of the failed attempt will come again
        self.run_choices = frozenset(o.choice for o in left)
        self.running = set(self.run_choices)
        self.choices, self.tried = (), 0
        return True
