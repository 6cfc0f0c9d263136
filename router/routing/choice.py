"""Route choice in the router: candidates from the registry, predictions, and the admission queue.

A request's life here:
1. ``core.RouterCore`` hands its ``Ticket`` to ``queue.arrive`` (``AdmissionQueue``) with ``fit``,
   which ranks the routes (``policies.rank_routes`` under the configured policy over
   ``candidates()``): admitted at once (the ranking's routes, best first), rejected at once (reason
   and Retry-After), or waiting until a ``queue.poll`` with ``fit`` admits or rejects it;
2. from admission on, the request counts as *pending* load on its route's workers until each of them
   reports its next heartbeat (which then includes it): ``routed`` moves it when the request ends
   up on another route than the first, ``forget`` drops it when no route took it. The pending load is
   kept by ``holders.Holders``, the record of which workers hold which request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from pdfabric.control import COLOCATED, PREFILL
from pdfabric.router.routing.admission import AdmissionQueue, Ticket
from pdfabric.router.routing.holders import Holders
from pdfabric.router.routing.policies import rank_routes
from pdfabric.router.routing.predictor import sparing
from pdfabric.router.routing.prefix_index import prompt_hashes
from pdfabric.router.routing.registry import Registry, Route, WorkerInfo, store_key
from pdfabric.router.routing.routes import Budgets, Candidate, Choice, Ranking, WorkerLoad
from pdfabric.routing_config import AdmissionConfig, PredictorConfig


def worker_load(info: WorkerInfo, prompt_rate: float = 0.0) -> WorkerLoad:
    """A worker's load as of its last heartbeat (an idle worker before its first one), with the
    ``prompt_rate`` (tokens/s) recently sent to it."""
    reg, hb = info.reg, info.load
    if hb is None:
        return WorkerLoad(free_kv_tokens=reg.num_blocks * reg.block_size, prompt_tokens_per_s=prompt_rate)
    return WorkerLoad(
        queued_tokens=hb.queued_tokens,
        running=hb.running,
        waiting=hb.waiting,
        context_tokens=hb.context_tokens,
        free_kv_tokens=hb.free_blocks * reg.block_size,
        kv_bytes_per_s=hb.kv_bytes_per_s,
        speculation=hb.speculation,
        prompt_tokens_per_s=prompt_rate,
    )


def with_pending(load: WorkerLoad, kind: str, prompt_len: int, requests: int = 1) -> WorkerLoad:
    """``load`` once one more request of ``prompt_len`` tokens (or ``requests`` requests of that many
    tokens in all) has been sent to a ``kind`` worker."""
    if kind == PREFILL:
        return load.with_prefill(prompt_len, requests)
    return load.with_decode(prompt_len, requests, prefill=kind == COLOCATED)


def candidate(
    info: WorkerInfo,
    config: AdmissionConfig,
    pending: Iterable[int] = (),
    prompt_rate: float = 0.0,
    cached_tokens: int = 0,
    store_tokens: int = 0,
    background: int = 0,
) -> Candidate:
    """The predictor's view of one worker: its latest profile and load plus ``pending`` prompts (token
    counts) sent since its last heartbeat and the ``prompt_rate`` (tokens/s) recently sent to it,
    under the lower of its own and its pool's limits; ``cached_tokens`` of the prompt being ranked
    are in its prefix cache, ``store_tokens`` of those only in its host KV store (read at the rate
    its reads measured, ``store_read_rate``); ``background`` of the sequences it holds are of a
    background class."""
    reg = info.reg
    pool = config.pool(reg.kind, reg.pool)
    max_batch, chunk_tokens = pool.limits(reg.max_running, reg.max_batch_tokens)
    load = worker_load(info, prompt_rate)
    lengths = list(pending)
    if lengths:  # the pending load adds up: one step for all of it
        load = with_pending(load, reg.kind, sum(lengths), len(lengths))
    profile = info.load.profile if info.load is not None else reg.profile
    rates = info.load.kv_rates if info.load is not None else {}
    return Candidate(
        worker_id=reg.worker_id, kind=reg.kind, pool=reg.pool, profile=profile, load=load,
        max_batch=max_batch, chunk_tokens=chunk_tokens, kv_bytes_per_token=reg.kv_bytes_per_token,
        cost=pool.cost, host=reg.host, kv_rates=rates, cached_tokens=cached_tokens,
        speculate_below=reg.speculate_below, store_tokens=store_tokens,
        store_seconds_per_token=reg.kv_bytes_per_token / store_read_rate(info) if store_tokens else 0.0,
        background=background,
    )  # fmt: skip


# A host KV store's read rate until a worker has measured its own (bytes/s): below what
# ``pdfabric bench store`` measured on a 2-core VM (2.1-2.4 GB/s), so that an unmeasured store is not
# preferred over computing for less than it costs
STORE_READ_RATE = 1e9


def store_read_rate(info: WorkerInfo) -> float:
    """Bytes per second the worker's host KV store reads hits at, from its heartbeats' counters."""
    got = info.load.kv_store if info.load is not None else {}
    nbytes = got.get("ram_bytes_read", 0.0) + got.get("disk_bytes_read", 0.0)
    seconds = got.get("load_seconds", 0.0)
    return nbytes / seconds if nbytes > 0 and seconds > 0 else STORE_READ_RATE


def route_of(registry: Registry, choice: Choice) -> Route | None:
    """The registered workers of a predicted route, or None if one of them is gone."""
    if choice.colocated:
        info = registry.workers.get(choice.decode)
        return Route(colocated=info) if info is not None else None
    decode, prefill = registry.workers.get(choice.decode), registry.workers.get(choice.prefill)
    return Route(decode=decode, prefill=prefill) if decode is not None and prefill is not None else None


RATE_WINDOW_S = 30.0  # prompt tokens sent to a worker are averaged over this window


class Routing:
    """The router's route choice: predictor, admission queue and pending load, over a ``Registry``."""

    def __init__(
        self,
        registry: Registry,
        config: AdmissionConfig | None = None,
        predictor: PredictorConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.config = config or AdmissionConfig()
        self.predictor = predictor or PredictorConfig()
        self.turn = 0  # requests admitted so far: where round robin goes next, the order among equals
        self.queue = AdmissionQueue(self.config)
        self.clock = clock
        self.holders: Holders = Holders()  # which workers hold which request; the pending load
        self._sent: dict[str, deque[tuple[float, int]]] = {}  # worker id -> (time, prompt tokens) sent
        self._sent_tokens: dict[str, int] = {}  # worker id -> the prompt tokens in its _sent window
        self._first_sent: dict[str, float] = {}  # worker id -> when its first prompt was sent
        self._background: set[str] = set()  # requests admitted in a background class, until forgotten

    # --- predictions ----------------------------------------------------------------------------

    def candidates(self, ticket: Ticket | None = None) -> list[Candidate]:
        """Every worker that takes requests, as the predictor sees it; with a ``ticket``, each with
        the prompt tokens of that request it holds in its prefix cache (as far as the router knows)."""
        now = self.clock()
        return [
            candidate(
                w,
                self.config,
                self.holders.pending(wid),
                self.prompt_rate(wid, now),
                *self._cached(w, ticket),
                len(self.holders.on(wid) & self._background) if self._background else 0,
            )
            for wid, w in self.registry.workers.items()
            if not w.draining  # a draining worker takes no new requests
            and (ticket is None or w.reg.served == ticket.served)  # another model version's
        ]

    def prefix_of(
        self, prompt_ids: tuple[int, ...], served: str = ""
    ) -> tuple[tuple[int, str], tuple[bytes, ...]]:
        """(block size, model) of the model version's workers and the prompt's prefix hashes for them
        (none when it has no worker registered)."""
        for w in self.registry.serving(served):
            key = (w.reg.block_size, w.reg.model)
            return key, prompt_hashes(prompt_ids, *key)
        return (0, ""), ()

    def _cached(self, info: WorkerInfo, ticket: Ticket | None) -> tuple[int, int]:
        """Tokens of the ticket's prompt the worker holds: in its pool or its host KV store, and of
        those, the ones only the store holds."""
        if ticket is None or not ticket.prefix or ticket.prefix_key != (info.reg.block_size, info.reg.model):
            return 0, 0
        pool = self.registry.prefixes.cached_blocks(info.worker_id, ticket.prefix)
        store = 0  # the blocks after the pool's that the store holds (the worker reads them next)
        if info.reg.kv_store:
            store = self.registry.stores.cached_blocks(store_key(info.reg), ticket.prefix[pool:])
        bs = info.reg.block_size
        return (pool + store) * bs, store * bs

    def prompt_rate(self, worker_id: str, now: float) -> float:
        """Prompt tokens per second sent to the worker over the last ``RATE_WINDOW_S`` (or since its
        first prompt, if that is more recent; at least a second)."""
        sent = self._sent.get(worker_id)
        if not sent:
            return 0.0
        while sent and sent[0][0] < now - RATE_WINDOW_S:
            self._sent_tokens[worker_id] -= sent.popleft()[1]
        span = max(min(RATE_WINDOW_S, now - self._first_sent[worker_id]), 1.0)
        return self._sent_tokens[worker_id] / span

    def fit(self, ticket: Ticket, budgets: Budgets) -> Ranking:
        """``FitFn`` for the admission queue: ranks the routes under the configured policy; an admitted
        ticket becomes pending load on its first choice at once, so the next prediction sees it."""
        ranking = rank_routes(
            self.config.policy, ticket.prompt_len, budgets, self.candidates(ticket), self.predictor, self.turn
        )
        background = self.config.slo_class(ticket.slo_class).background
        if background:
            ranking = sparing(ranking, self.config.background_slowdown, self.predictor)
        if ranking.fits:
            if background:
                self._background.add(ticket.request_id)
            self.turn += 1
            self.routed(ticket.request_id, ticket.prompt_len, ranking.choices[0])
            first, now = ranking.choices[0].prefill, self.clock()  # the worker that prefills it
            self._sent.setdefault(first, deque()).append((now, ticket.prompt_len))
            self._sent_tokens[first] = self._sent_tokens.get(first, 0) + ticket.prompt_len
            self._first_sent.setdefault(first, now)
        return ranking

    def routed(self, request_id: str, prompt_len: int, choice: Choice) -> None:
        """Counts ``request_id`` as pending on ``choice``'s workers (and nowhere else)."""
        self.holders.routed(request_id, prompt_len, {choice.prefill, choice.decode})

    def forget(self, request_id: str) -> None:
        """No route took ``request_id`` (or it ended): it is pending nowhere."""
        self.holders.unrouted(request_id)
        self._background.discard(request_id)

    def on_heartbeat(self, worker_id: str, received: int) -> None:
        """The worker's report counts the first ``received`` work messages sent to it: their pending
        load is spent."""
        self.holders.heartbeat(worker_id, received)
