"""The worker core: a worker's logic as messages in, messages out. No sockets, no clocks, no torch.

A core owns a worker's ``Scheduler`` over its ``BlockTables`` and everything it decides: admission,
block accounting, what a step's tokens become, what happens to transfers, and what a heartbeat says.
It is driven the same way by the ZeroMQ worker loop (``pdfabric.worker.loop``) and by the simulator
(``bench.sim_worker``), and by unit tests with nothing else:

1. ``handle(msg)``: a control message from the router (``Generate``, ``Reserve``, ``Prefill``, ``Embed``,
   ``Abort``, ``Reregister``);
2. ``schedule()``: the next ``Step`` (chunks and their shape), or ``None``; the driver runs the model on
   its chunks (the simulator: waits for the profile's time) and calls ``complete(step, sampled,
   seconds)`` with one ``(token, logprob)`` per sampling chunk;
3. ``transfer_ended(result)`` / ``kv_released(request_id)``: what the KV side reports;
4. ``heartbeat(now)``: a ``Heartbeat`` when one is due (time is a value the driver passes in).

A prefill core's ``Step`` also lists ``opens``: the transfers of the prompts this step finishes, so
that a driver can ship each layer's KV as the model finishes that layer (the server's loop does; the
simulator's link model starts the push at the step's end).

Each call returns the messages to send: control messages for the router (``pdfabric.control``) and
commands for the worker's own KV side (``PushKV``, ``ExpectKV``, ``CancelKV``: ``worker.kv``), which the
driver hands to the kvtransfer state machines (or to the simulator's link model).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from pdfabric.control import (
    Abort,
    Embed,
    Embedded,
    EmbedResult,
    Generate,
    Heartbeat,
    Prefill,
    Register,
    Reregister,
    Reserve,
    Reserved,
    StepOutputs,
    TokenDelta,
)
from pdfabric.engine.block_pool import BlockPool, BlockTables, prefix_salt
from pdfabric.engine.chunk import Chunk, Pick, step_shape
from pdfabric.engine.prefix_cache import HostTier
from pdfabric.engine.scheduler import Scheduler, SchedulerConfig
from pdfabric.engine.sequence import SeqState, Sequence
from pdfabric.engine.speculate import Proposer, SpeculationGain
from pdfabric.kvtransfer.state import TransferResult
from pdfabric.profile import StepShape, WorkerProfile
from pdfabric.sampling_params import SamplingParams
from pdfabric.worker.kv import OpenPush
from pdfabric.worker.spec import CoreSpec, ProfileSource


class WrongMessage(TypeError):
    """A control message that this kind of worker does not take (the loop logs and drops it)."""


Out = list[object]  # control messages for the router and KV commands, in the order they were made


@dataclass(frozen=True)
class Step:
    """What ``schedule()`` chose: the chunks to run and their shape (for the step-time profile)."""

    chunks: list[Chunk]
    shape: StepShape
    opens: tuple[OpenPush, ...] = ()  # transfers whose layers may leave during this step

    @property
    def num_samples(self) -> int:
        return sum(1 for c in self.chunks if c.sample)


@dataclass
class KVRates:
    """Recent successful transfers' bytes and seconds: the rate overall and per transport."""

    window: deque[tuple[str, int, float]] = field(default_factory=lambda: deque(maxlen=32))

    def add(self, result: TransferResult) -> None:
        if result.ok and result.nbytes > 0 and result.seconds > 0:
            self.window.append((result.transport, result.nbytes, result.seconds))

    def overall(self) -> float:
        seconds = sum(s for _, _, s in self.window)
        return sum(b for _, b, _ in self.window) / seconds if seconds else 0.0

    def per_transport(self) -> dict[str, float]:
        totals: dict[str, list[float]] = {}
        for transport, nbytes, seconds in self.window:
            t = totals.setdefault(transport, [0.0, 0.0])
            t[0] += nbytes
            t[1] += seconds
        return {k: b / s for k, (b, s) in totals.items()}


def background_tokens(profile: WorkerProfile, step_ms: float, max_tokens: int) -> int:
    """Background prompts' tokens a step: as many as ``step_ms`` holds by ``profile``; 0 (no cap) for 0."""
    return profile.chunk_within(step_ms / 1e3, max_tokens) if step_ms else 0


def delta_of(seq: Sequence, new: int = 1) -> TokenDelta:
    """The delta for a sequence that just got ``new`` tokens (and maybe finished)."""
    index = len(seq.output_ids) - new
    cached = (seq.prefix_hit or 0) if index == 0 else 0
    top = tuple(seq.output_top[index:]) if seq.params.logprobs else ()
    scored = tuple(seq.prompt_logprobs) if index == 0 and seq.params.prompt_logprobs else ()
    return TokenDelta(
        seq.reply_id, index, tuple(seq.output_ids[index:]), tuple(seq.output_logprobs[index:]),
        seq.finish_reason, cached_tokens=cached, top_logprobs=top, choice=seq.params.choice,
        prompt_logprobs=scored,
    )  # fmt: skip


class WorkerCore:
    """What every kind shares; subclasses handle their messages and what stepped sequences become."""

    on_prefilled = "decode"
    embeds = False  # it takes ``Embed``: its kind computes prompts for the router (prefill, colocated)

    def __init__(
        self,
        spec: CoreSpec,
        profile: ProfileSource,
        kv_endpoint: str = "",
        proposer: Proposer | None = None,
        store: HostTier | None = None,
    ) -> None:
        """``proposer``: what guesses tokens for speculation with ``speculative = "draft"`` (the draft
        model, ``engine/draft.py``); with ``"ngram"``, prompt lookup. ``store``: the host's KV store,
        which takes the blocks the pool evicts and serves the prefixes it holds (with prefix caching
        on; ``kvtransfer/host_store.py``)."""
        self.spec = spec
        self.worker_id = spec.worker_id
        self.kv_endpoint = kv_endpoint
        self.profile = profile
        c = spec.config
        store = store if c.prefix_caching else None
        self.store = store
        evict = store.save if store is not None else None
        self.tables = BlockTables(BlockPool(spec.num_blocks, c.block_size, on_evict=evict))
        background = background_tokens(profile.profile(), c.background_step_ms, c.max_batch_tokens)
        sched = SchedulerConfig(
            max_batch_tokens=c.max_batch_tokens, max_running=c.max_running, max_model_len=spec.max_model_len,
            on_prefilled=self.on_prefilled, prefix_salt=prefix_salt(c.model) if c.prefix_caching else None,
            speculate_k=c.speculative_k if self._speculates(c.speculative, proposer) else 0,
            speculate_below=c.speculative_below,
            background_chunk_tokens=background,
        )  # fmt: skip
        self.scheduler = Scheduler(self.tables, sched, proposer, store)
        self.speculation = SpeculationGain()  # what speculating steps gained over plain ones
        self.kv_rates = KVRates()
        self._recent_ms: deque[float] = deque(maxlen=32)
        self.next_heartbeat = 0.0
        self.draining = False  # ``drain()``: no new requests; the loop exits once ``idle``
        self.received = 0  # work messages taken in since it registered: what its load counts

    def _speculates(self, speculative: str, proposer: Proposer | None) -> bool:
        """Whether this core proposes tokens: a decoding kind with prompt lookup, or with a draft
        model when it was given one."""
        if self.on_prefilled != "decode":
            return False
        return speculative == "ngram" or (speculative == "draft" and proposer is not None)

    # --- inputs ---------------------------------------------------------------------------------

    def registration(self) -> Register:
        reg = self.spec.registration(self.kv_endpoint, self.profile.profile(force=True))
        if self.store is None:
            return reg
        return replace(reg, kv_store=self.store.ident, kv_store_blocks=self.store.capacity_blocks)

    def handle(self, msg: object) -> Out:
        """A control message from the router. A draining worker refuses new requests: a reservation
        gets no blocks, a prompt an error (the router moves it to another worker)."""
        if isinstance(msg, Abort):
            return self.abort(msg.request_id, msg.reason)
        if isinstance(msg, Reregister):
            return self.rejoin(msg.reason)
        if isinstance(msg, Embed):
            return self.embed(msg)
        if isinstance(msg, Generate | Reserve | Prefill):
            self.received += 1
        if self.draining and isinstance(msg, Reserve):
            return [Reserved(self.worker_id, msg.request_id, (), f"{self.worker_id} is draining")]
        if self.draining and isinstance(msg, Generate | Prefill):
            return self.error(msg.request_id, 0, f"{self.worker_id} is draining")
        return self.on_message(msg)

    def embed(self, msg: Embed) -> Out:
        """An embedding input: queued as a prompt that ends once computed and pooled (its vector goes
        out in ``Embedded`` from the step that finishes it); refused at once when this worker is
        draining or the prompt is longer than its context."""
        if not self.embeds:
            raise WrongMessage(f"a {type(self).__name__} does not compute embeddings")
        # (not counted in ``received``: the router counts the load of its generation requests by it)
        rid, n = msg.request_id, len(msg.prompt_ids)
        why = f"{self.worker_id} is draining" if self.draining else ""
        if not why and n > self.spec.max_model_len:
            why = f"input of {n} tokens does not fit this worker's {self.spec.max_model_len}"
        if why:
            return [Embedded(self.worker_id, (EmbedResult(rid, error=why),))]
        params = SamplingParams(max_tokens=1, priority=msg.priority, background=msg.background)
        seq = Sequence(rid, msg.prompt_ids, params, pooling=msg.pooling, normalize=msg.normalize)
        self.scheduler.add(seq)
        return []

    def rejoin(self, reason: str) -> Out:
        """The router no longer knows this worker (it restarted, or gave the worker up as silent):
        every request held here is dropped (their KV transfers cancelled, their blocks freed) and the
        worker registers again; its next heartbeat is due at once."""
        out: Out = []
        for request_id in self.scheduler.request_ids():
            out += self.abort(request_id, f"router lost the request: {reason}")
        self.next_heartbeat, self.received = 0.0, 0
        return [*out, self.registration()]

    def drain(self) -> None:
        """Takes no new requests from now on; the next heartbeat, due at once, tells the router."""
        self.draining = True
        self.next_heartbeat = 0.0

    @property
    def idle(self) -> bool:
        """Nothing to run and no block held (no sequence, no reservation, no transfer in flight)."""
        return not self.scheduler.has_work and self.tables.pool.num_free == self.tables.pool.num_blocks

    def on_message(self, msg: object) -> Out:
        raise NotImplementedError

    def abort(self, request_id: str, reason: str) -> Out:
        self.scheduler.finish(request_id, reason)
        return []

    def schedule(self) -> Step | None:
        """The next step's chunks, or ``None`` when there is nothing to run (idle, or short of blocks)."""
        if not self.scheduler.has_work:
            return None
        chunks = self.scheduler.schedule()
        return Step(chunks, step_shape(chunks)) if chunks else None

    def complete(
        self, step: Step, sampled: list[Pick | list[Pick]], seconds: float, drafting: float = 0.0
    ) -> Out:
        """The step ran for ``seconds`` after ``drafting`` seconds of scheduling it (a draft model's
        proposals among them); ``sampled``: one pick per chunk with ``sample`` (``Pick``), a list of
        them for a chunk with a proposal (``Scheduler.complete``)."""
        self._recent_ms.append(seconds * 1e3)
        self.profile.observe(step.shape, seconds)
        chunks = step.chunks
        speculated = any(c.proposal for c in chunks) and all(c.seq.state is SeqState.RUNNING for c in chunks)
        changed = self.scheduler.complete(chunks, sampled)
        if speculated:  # a decode step that checked proposals: what it gave each sequence, and in what time
            tokens = sum(c.seq.step_tokens for c in chunks)
            self.speculation.record(len(chunks), sum(c.stop for c in chunks), tokens, seconds + drafting)
        for chunk in chunks:
            if chunk.seq.pooling:  # an embedding input reports the time of the steps that ran it
                chunk.seq.compute_s += seconds
        pooled = [seq for seq in changed if seq.pooling]
        results = tuple(EmbedResult(seq.request_id, seq.embedding, seq.compute_s) for seq in pooled)
        done = [Embedded(self.worker_id, results)] if results else []
        return done + self.stepped([seq for seq in changed if not seq.pooling])

    def stepped(self, changed: list[Sequence]) -> Out:
        """Turns the sequences that got a token into messages."""
        return self.outputs([delta_of(seq, seq.step_tokens) for seq in changed])

    def transfer_ended(self, result: TransferResult) -> Out:
        return []

    def kv_released(self, request_id: str) -> Out:
        return []

    def heartbeat(self, now: float, refused_peers: int = 0) -> Heartbeat | None:
        """This worker's load, if a heartbeat is due at ``now``; ``refused_peers``: the handshakes its
        KV endpoint has refused so far (the driver's KV side counts them)."""
        if now < self.next_heartbeat:
            return None
        cfg, s, pool = self.spec.config, self.scheduler, self.tables.pool
        self.next_heartbeat = now + cfg.heartbeat_s
        cached, evicted = pool.take_events()
        profile = self.profile.profile()
        s.background_tokens = background_tokens(profile, cfg.background_step_ms, s.config.max_batch_tokens)
        return Heartbeat(
            worker_id=self.worker_id,
            queued_tokens=s.queued_tokens,
            running=len(s.running),
            waiting=len(s.waiting) + len(s.awaiting_kv),
            free_blocks=pool.num_free,
            total_blocks=pool.num_blocks,
            step_ms=statistics.median(self._recent_ms) if self._recent_ms else 0.0,
            context_tokens=s.context_tokens,
            kv_bytes_per_s=self.kv_rates.overall(),
            profile=profile,
            kv_rates=self.kv_rates.per_transport(),
            draining=self.draining,
            prompt_tokens=s.prefix.prompt_tokens,
            prefix_hit_tokens=s.prefix.hit_tokens,
            cached=cached,
            evicted=evicted,
            stored=self.store.take_stored() if self.store is not None else (),
            store_dropped=self.store.take_dropped() if self.store is not None else (),
            store_dropped_others=self.store.take_dropped_others() if self.store is not None else {},
            received=self.received,
            refused_peers=refused_peers,
            proposed_tokens=s.speculation.proposed_tokens,
            accepted_tokens=s.speculation.accepted_tokens,
            speculative_checks=s.speculation.checks,
            speculation=self.speculation.gain(profile.decode_step_seconds),
            kv_store=self._store_counters(),
        )

    def _store_counters(self) -> dict[str, float]:
        if self.store is None:
            return {}
        return {**self.store.counters(), "hit_tokens": self.scheduler.prefix.tier_hit_tokens}

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- helpers --------------------------------------------------------------------------------

    def outputs(self, deltas: list[TokenDelta]) -> Out:
        return [StepOutputs(self.worker_id, tuple(deltas))] if deltas else []

    def error(self, request_id: str, index: int, message: str) -> Out:
        return self.outputs([TokenDelta(request_id, index, (), (), "error", message)])

    def cannot_take(self, msg: Generate | Reserve) -> str:
        """Why a request cannot run here (``too_long``, or branches that make no sense), or ``""``."""
        total = msg.params.max_tokens + msg.params.output_offset
        choices = [msg.params.choice, *(b.choice for b in msg.branches)]
        if len(set(choices)) < len(choices) or min(choices) < 0:
            return f"a request's outputs must have distinct choices >= 0, got {choices}"
        if any(len(b.output) >= total for b in msg.branches):
            return "a branch's earlier output leaves it no token to generate"
        return self.too_long(msg.request_id, len(msg.prompt_ids))

    def too_long(self, request_id: str, prompt_len: int) -> str:
        """Why a prompt cannot run here (it must leave room for one token), or ``""``."""
        if prompt_len < self.spec.max_model_len:
            return ""
        return f"prompt of {prompt_len} tokens does not fit this worker's {self.spec.max_model_len}"
