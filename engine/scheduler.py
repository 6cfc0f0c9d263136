"""Continuous batching with chunked prefill, shared by every worker kind. No torch here.

Each step: 1. every running sequence gets one decode token (preempting the newest running sequence
back to the waiting queue when blocks run out), 2. waiting sequences fill the rest of the token
budget with prefill chunks, higher priority first, then oldest first (background ones only while no
foreground sequence decodes, together at most ``background_chunk_tokens``). After the model runs,
``complete`` advances each sequence: a finished prompt either starts decoding
(``on_prefilled="decode"``) or is parked for hand-over (``"handoff"``, the prefill worker), an
embedding input (``Sequence.pooling``) ends with its prompt, a request with several outputs starts
its branches (``engine/branches.py``), and finished sequences give their blocks back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdfabric.engine.block_pool import BlockTables
from pdfabric.engine.branches import Branches
from pdfabric.engine.chunk import Chunk, Pick
from pdfabric.engine.prefix_cache import HostTier, PrefixCache
from pdfabric.engine.sequence import SeqState, Sequence, TopLogprobs
from pdfabric.engine.speculate import PromptLookup, Proposer, Speculation, Wanted


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """A worker's limits as its scheduler applies them; the worker core builds it from its
    ``CoreSpec`` (the limits' defaults are ``WorkerConfig``'s, written there once)."""

    max_batch_tokens: int  # tokens per forward step (decode tokens + prefill chunks)
    max_running: int  # sequences decoding at once
    max_model_len: int  # tokens one sequence may hold
    on_prefilled: str = "decode"  # or "handoff"
    prefix_salt: bytes | None = None  # prefix caching on, hashes salted by the model (None: off)
    # Speculation (engine/speculate.py): up to this many proposed tokens per decode (0: off), while at
    # most speculate_below sequences decode (beyond, a step is compute-bound).
    speculate_k: int = 0
    speculate_below: int = 0
    # prompt tokens a step gives background sequences (``SamplingParams.background``), all together,
    # in steps where no foreground sequence decodes (in those, none); the worker core sets
    # ``Scheduler.background_tokens`` from its profile as it learns it
    background_chunk_tokens: int = 0  # 0: no cap

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be at least 1")
        if self.speculate_k < 0 or self.speculate_below < 0:
            raise ValueError("speculate_k and speculate_below must be >= 0")
        if self.on_prefilled not in ("decode", "handoff"):
            raise ValueError(f"on_prefilled must be 'decode' or 'handoff', got {self.on_prefilled!r}")


class Scheduler:
    def __init__(
        self,
        tables: BlockTables,
        config: SchedulerConfig,
        proposer: Proposer | None = None,
        tier: HostTier | None = None,
    ) -> None:
        """``proposer`` guesses decoding sequences' next tokens when ``config.speculate_k`` is on
        (default: prompt lookup); ``tier``: where cached prefixes continue beyond the pool (with
        prefix caching on)."""
        self.tables = tables
        self.config = config
        proposer = proposer or PromptLookup()
        c = config
        self.speculation = Speculation(tables, c.speculate_k, c.speculate_below, c.max_model_len, proposer)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting_kv: dict[str, Sequence] = {}
        self.handoff: dict[str, Sequence] = {}
        self._by_id: dict[str, Sequence] = {}
        self.branches = Branches(tables)
        self.prefix = PrefixCache(tables, config.prefix_salt, tier)
        self.preemptions = 0  # running sequences sent back to wait, their blocks freed
        self.background_tokens = config.background_chunk_tokens  # the cap now (0: none)

    # --- admission ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a sequence whose prompt must be prefilled here: behind every waiting sequence of its
        priority or higher (``SamplingParams.priority``), ahead of those of a lower one."""
        self._admit(seq)
        seq.state = SeqState.WAITING
        self.prefix.read_ahead(seq)
        ahead = next((i for i, w in enumerate(self.waiting) if w.params.priority < seq.params.priority), None)
        if ahead is None:
            self.waiting.append(seq)
        else:
            self.waiting.insert(ahead, seq)

    def reserve(self, seq: Sequence) -> tuple[list[int], int] | None:
        """Reserves blocks for a prompt whose KV arrives from elsewhere: (its whole block table, how
        many leading blocks came from the prefix cache and need no KV sent); ``None`` when short. A
        host store's part of the prefix is read while the KV travels, not here (``kv_arrived``)."""
        if seq.request_id in self._by_id or seq.request_id in self.tables:
            return None
        self.prefix.attach(seq, defer=True)
        cached = seq.num_cached // self.tables.pool.block_size
        table = self.tables.grow(seq.request_id, len(seq.prompt_ids))
        if table is None:
            self.prefix.forget(seq.request_id)
            self.tables.release(seq.request_id)  # the cached prefix goes back as it was
            seq.num_cached = seq.recorded = 0
            return None
        self._admit(seq)
        seq.state = SeqState.WAITING_FOR_KV
        self.awaiting_kv[seq.request_id] = seq
        return list(table), cached

    def kv_arrived(
        self, request_id: str, first_token: int, logprob: float, top: TopLogprobs = ()
    ) -> Sequence | None:
        """The prompt's KV is in the reserved blocks: start decoding after ``first_token``, once the
        blocks a host store holds are read in. Should one fail its check, the sequence is computed
        again here (as a preempted one is) before it decodes on.

        Returns the sequence, finished already if its first token ended it.
        """
        seq = self.awaiting_kv.pop(request_id, None)
        if seq is None:
            return None
        if not self.prefix.load_deferred(seq):
            self.tables.release(seq.request_id)
            seq.num_cached = seq.recorded = 0
            seq.state = SeqState.WAITING
            self.waiting.appendleft(seq)
            self._append(seq, first_token, logprob, top)
            return seq
        seq.num_cached = len(seq.prompt_ids)
        self.prefix.record(seq)
        self._branch(seq)
        self._append(seq, first_token, logprob, top)
        if seq.state is not SeqState.FINISHED:
            seq.state = SeqState.RUNNING
            self.running.append(seq)
        return seq

    def _admit(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request {seq.request_id!r} is already here")
        self._by_id[seq.request_id] = seq

    # --- a step ---------------------------------------------------------------------------------

    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        wanted: list[Wanted] = []  # decoding sequences to propose tokens for, with room for k of them
        spots: list[int] = []  # their chunks' indices
        budget = self.config.max_batch_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.state is not SeqState.RUNNING:  # preempted while making room for an earlier one
                continue
            while not self.tables.can_grow(seq.request_id, seq.num_tokens):
                if self._reclaim_partial(keep=set()):
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.state is SeqState.RUNNING:
                self.tables.grow(seq.request_id, seq.num_tokens)
                k = self.speculation.room(seq, budget - 1, len(self.running))
                if k:
                    wanted.append((seq, tuple(self.tables.table(seq.request_id)), k))
                    spots.append(len(chunks))
                chunks.append(Chunk(seq, seq.num_cached, seq.num_tokens))
                budget -= 1 + k
        if wanted:  # each proposal on its sequence's decode chunk; tokens not proposed give budget back
            for i, (_, _, k), proposal in zip(spots, wanted, self.speculation.propose(wanted), strict=True):
                chunks[i] = Chunk(chunks[i].seq, chunks[i].start, chunks[i].stop, proposal)
                budget += k - len(proposal)
        prefills = 0
        # what background prompts may take: nothing while a foreground sequence decodes (its next token
        # would wait for their chunk), else their share of the step
        cap = self.background_tokens
        background = budget if not cap else 0 if any(not s.params.background for s in self.running) else cap
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) + prefills >= self.config.max_running:
                break
            room = min(budget, background) if seq.params.background else budget
            if room == 0:
                continue  # the background share of the step is spent; a foreground prompt may come later
            self.prefix.extend(seq)  # its cached prefix, or what follows its chunks so far if cached by now
            stop = min(seq.num_tokens, seq.num_cached + room)
            if not self.tables.can_grow(seq.request_id, stop):
                self._reclaim_partial(keep={c.seq for c in chunks} | {seq})
                stop = min(stop, self._room(seq))
            if stop <= seq.num_cached:
                break  # wait for blocks to come back; the queue keeps its order
            self.tables.grow(seq.request_id, stop)
            chunks.append(Chunk(seq, seq.num_cached, stop))
            taken = stop - seq.num_cached
            budget -= taken
            if seq.params.background:
                background -= taken
            prefills += 1
            if stop < seq.num_tokens and not (seq.params.background and background == 0):
                break  # cut by the budget or the blocks: a partly prefilled prompt stays at the head
        return chunks

    def _room(self, seq: Sequence) -> int:
        """Tokens the sequence could hold with its own blocks plus every free one."""
        held = len(self.tables.table(seq.request_id)) if seq.request_id in self.tables else 0
        return (held + self.tables.pool.num_free) * self.tables.pool.block_size

    def _reclaim_partial(self, keep: set[Sequence]) -> bool:
        """Frees the blocks of partly prefilled waiting sequences (they restart later), so that a
        queued prompt never holds blocks that running sequences or the queue's head need."""
        freed = False
        for seq in self.waiting:
            if seq not in keep and seq.request_id in self.tables:
                self.tables.release(seq.request_id)
                seq.num_cached = seq.recorded = 0
                freed = True
        return freed

    def _preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks; it will be recomputed from its tokens later."""
        self.preemptions += 1
        self.running.remove(seq)
        self.tables.release(seq.request_id)
        seq.num_cached = seq.recorded = 0
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)

    def complete(self, chunks: list[Chunk], sampled: list[Pick | list[Pick]]) -> list[Sequence]:
        """Advances the step's sequences; ``sampled`` holds (token, logprob) or (token, logprob, top
        log-probabilities) for each chunk with ``sample``, in order, and for a chunk with a proposal
        the list of its kept tokens (``_verified``). Returns the sequences that got new tokens
        (finished ones included)."""
        got = iter(sampled)
        changed: list[Sequence] = []
        for chunk in chunks:
            seq = chunk.seq
            if chunk.proposal:
                self._verified(chunk, next(got))  # type: ignore[arg-type]
                changed.append(seq)
                continue
            seq.num_cached = chunk.stop
            self.prefix.record(seq)
            if seq.pooling and chunk.last:  # an embedding input is done once its prompt is
                self._finish(seq, "pooled")
                changed.append(seq)
            if not chunk.sample:
                continue
            token, logprob, *top = next(got)  # type: ignore[misc]
            if seq.state is SeqState.WAITING:
                self.waiting.remove(seq)
                if self.config.on_prefilled == "handoff":
                    seq.state = SeqState.HANDOFF
                    self.handoff[seq.request_id] = seq
                else:
                    seq.state = SeqState.RUNNING
                    self.running.append(seq)
                    self._branch(seq)
            self._append(seq, token, logprob, top[0] if top else ())
            seq.step_tokens = 1
            changed.append(seq)
        return changed

    def _verified(self, chunk: Chunk, picks: list[Pick]) -> None:
        """A decode chunk with a proposal ran: ``picks`` are the proposed tokens the model picked
        itself, in order, then the token after them. The sequence takes them (up to its end); the
        cache holds its KV up to the last kept proposed token, and blocks past the new end go back."""
        seq = chunk.seq
        kept = len(picks) - 1
        self.speculation.checked(seq, len(chunk.proposal), kept)
        seq.step_tokens = 0
        for token, logprob, *top in picks:
            self._append(seq, token, logprob, top[0] if top else ())
            seq.step_tokens += 1
            if seq.state is SeqState.FINISHED:
                return
        seq.num_cached = chunk.stop + kept
        self.prefix.record(seq)
        self.tables.shrink(seq.request_id, seq.num_tokens)

    def _branch(self, seq: Sequence) -> None:
        """Queues the branches of a sequence whose prompt's KV is complete at the head of the queue."""
        started = self.branches.start(seq)
        for child in started:
            self._admit(child)
        self.waiting.extendleft(reversed(started))

    def _append(self, seq: Sequence, token: int, logprob: float, top: TopLogprobs = ()) -> None:
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        seq.output_top.append(top)
        reason = seq.finish_reason_after(token, self.config.max_model_len)
        if reason is not None and seq.state is not SeqState.HANDOFF:
            self._finish(seq, reason)

    # --- endings --------------------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        elif seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
        self.awaiting_kv.pop(seq.request_id, None)
        self.handoff.pop(seq.request_id, None)
        self.prefix.forget(seq.request_id)
        self.tables.release(seq.request_id)
        self._by_id.pop(seq.request_id, None)
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        self.branches.ended(seq)

    def finish(self, request_id: str, reason: str) -> Sequence | None:
        """Ends a request in any state (abort, error, hand-over done), with every branch it started,
        and frees their blocks."""
        seq = self._by_id.get(request_id)
        for member in self.branches.others(request_id):
            if member in self._by_id:
                self._finish(self._by_id[member], reason)
        if seq is not None:
            self._finish(seq, reason)
        return seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def request_ids(self) -> list[str]:
        """Every request held here, in any state."""
        return list(self._by_id)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def context_tokens(self) -> int:
        """Tokens of every sequence held here (their KV is, or will be, in the cache)."""
        return sum(seq.num_tokens for seq in self._by_id.values())

    @property
    def queued_tokens(self) -> int:
        return sum(s.num_tokens - s.num_cached for s in self.waiting)

    def __len__(self) -> int:
        return len(self._by_id)


__all__ = ["Scheduler", "SchedulerConfig"]
