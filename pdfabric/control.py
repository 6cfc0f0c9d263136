"""Messages on the control channel between the router and its workers (ZeroMQ ROUTER/DEALER).

Workers connect to the router's one control socket and register; afterwards the router sends work
and aborts, and workers send token batches and heartbeats. A request's prompt travels once; after
that only new tokens and block ids move.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdfabric.profile import WorkerProfile
from pdfabric.sampling_params import Branch, SamplingParams
from pdfabric.wire import message

# Worker kinds.
PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"
KINDS = (PREFILL, DECODE, COLOCATED)


# --- worker -> router ---------------------------------------------------------------------------


@message(1)
@dataclass(frozen=True)
class Register:
    worker_id: str
    kind: str
    pool: str
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    kv_endpoint: str  # where prefill workers push KV (decode workers only; "" otherwise)
    pid: int
    max_running: int
    max_batch_tokens: int
    kv_bytes_per_token: int
    profile: WorkerProfile  # fitted from the start-up profiling run
    host: str = ""  # host name and boot id: workers on one host move KV over shared memory ("": unknown)
    served: str = ""  # the model version it serves, "name@version" ("": the deployment's one model)
    weights: str = "none"  # how it holds its linear weights: its quantization (QUANTIZATIONS)
    speculate_below: int = 0  # it speculates while at most this many sequences decode (0: never)
    weight_bytes: int = 0  # its model's weights as held in memory (quantized or not; 0: not measured)
    kv_cache_dtype: str = "auto"  # what its KV cache stores a row as (auto: the model's dtype, or int8)
    # the host KV store it shares with the host's other workers (an id of its directories and key
    # salt; "": none) and how many blocks that store holds at most
    kv_store: str = ""
    kv_store_blocks: int = 0

    def __post_init__(self) -> None:  # a registration the router could not serve with is refused
        if not self.worker_id or self.kind not in KINDS:
            raise ValueError(f"Register: a worker id and a kind in {KINDS} are needed, got {self.kind!r}")
        for name in ("max_model_len", "block_size", "num_blocks", "max_running", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Register.{name} must be at least 1, got {getattr(self, name)}")
        if self.pid < 0 or self.kv_bytes_per_token < 0:
            raise ValueError("Register.pid and kv_bytes_per_token must be >= 0")


@message(2)
@dataclass(frozen=True)
class Heartbeat:
    worker_id: str
    queued_tokens: int  # prompt tokens waiting to be prefilled
    running: int  # sequences decoding
    waiting: int  # sequences queued (or waiting for KV)
    free_blocks: int
    total_blocks: int
    step_ms: float  # recent median step time
    context_tokens: int  # tokens held by the sequences here (running, waiting, awaiting KV)
    kv_bytes_per_s: float  # recent KV transfer rate, all transports (0: none measured yet)
    profile: WorkerProfile  # refined online from real steps
    kv_rates: dict[str, float] = field(default_factory=dict)  # the same, per transport ("shm", "zmq")
    draining: bool = False  # it takes no new requests and exits once those it holds are done
    prompt_tokens: int = 0  # prompt tokens it has scheduled, since it started (prefix cache queries)
    prefix_hit_tokens: int = 0  # of those, found in its prefix cache
    cached: tuple[bytes, ...] = ()  # prefix hashes of the blocks it cached since its last heartbeat
    evicted: tuple[bytes, ...] = ()  # prefix hashes it dropped from its cache since then
    # prefix hashes it saved in its host KV store since then while its cache keeps them (write-through;
    # what it evicts goes there too), and of blocks it deleted from that store (to make room)
    stored: tuple[bytes, ...] = ()
    store_dropped: tuple[bytes, ...] = ()
    # prefix hashes of blocks other stores on its host wrote (another model's) that it deleted from the
    # shared tiers to make room, by the identity of the store that wrote them (``Register.kv_store``)
    store_dropped_others: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    received: int = 0  # work messages (Generate, Reserve, Prefill) taken in since it registered
    refused_peers: int = 0  # handshakes its KV endpoint refused since it started (no cluster secret)
    proposed_tokens: int = 0  # tokens speculative decoding proposed here since it started
    accepted_tokens: int = 0  # of those, kept (the model picked them itself)
    speculative_checks: int = 0  # decodes that checked a proposal since it started
    # while it speculates (at most speculate_below sequences decoding), how many times faster a
    # sequence gets its tokens than plain decode steps of its profile would give them (1: not measured)
    speculation: float = 1.0
    # the host KV store as this worker used it since it started (empty: no store): per tier ("ram_",
    # "disk_") hits, bytes_read, writes, bytes_written, evictions, bad, write_errors; and dropped
    # (saves the full write queue dropped), load_seconds, hit_tokens (prompt tokens read from it)
    kv_store: dict[str, float] = field(default_factory=dict)


@message(3)
@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request; ``finish_reason`` set on its last delta from this worker."""

    request_id: str
    index: int  # position in the output of token_ids[0] (or of the finish, when there are no tokens)
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str = ""
    cached_tokens: int = 0  # on a request's first delta: prompt tokens found in the prefix cache
    # Per token, when the request asked for logprobs: the most likely (token id, logprob) pairs.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    choice: int = 0  # which of the request's outputs (``SamplingParams.choice``)
    # On a request's first delta, when it asked for prompt log-probabilities: per prompt token after
    # the first, (log-probability, top (token id, logprob) pairs), computed where the prompt was.
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()


@message(4)
@dataclass(frozen=True)
class StepOutputs:
    """Everything one worker step produced, sent as one frame."""

    worker_id: str
    deltas: tuple[TokenDelta, ...]


@message(5)
@dataclass(frozen=True)
class Reserved:
    """A decode worker's answer to ``Reserve``: block ids, or an empty tuple and the reason."""

    worker_id: str
    request_id: str
    block_ids: tuple[int, ...]  # the blocks the prompt's KV goes into (after those it had cached)
    reason: str = ""
    cached_blocks: int = 0  # the prompt's leading blocks already in its prefix cache: not to be sent
    no_room: bool = False  # refused for want of free blocks now (worth asking again), not for good


@message(6)
@dataclass(frozen=True)
class HandedOff:
    """A prefill worker has shipped the request's KV and no longer holds it."""

    worker_id: str
    request_id: str
    kv_bytes: int = 0  # what the transfer moved
    kv_seconds: float = 0.0  # from the end of the prefill step to the receiver's acknowledgement


@dataclass(frozen=True)
class EmbedResult:
    """One embedding input's outcome: its pooled vector (float32, little-endian: a few KB, so it rides
    in the message), or an error."""

    request_id: str
    vector: bytes = b""
    compute_s: float = 0.0  # the time of the steps that ran it (shared with what they ran beside it)
    error: str = ""


@message(7)
@dataclass(frozen=True)
class Embedded:
    """The embedding inputs one worker step finished (or refused)."""

    worker_id: str
    results: tuple[EmbedResult, ...]


# --- router -> worker ---------------------------------------------------------------------------


@message(20)
@dataclass(frozen=True)
class Generate:
    """Run a whole request (colocated worker): prefill, then decode until it finishes. Its ``branches``
    (the request's other outputs, ``n`` > 1) start from the same computed prompt once it is done."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    branches: tuple[Branch, ...] = ()


@message(27)
@dataclass(frozen=True)
class Embed:
    """Compute a prompt and pool its last hidden states into one vector (``engine/pooling.py``): a
    prefill or colocated worker runs it in its steps beside its other prompts and answers ``Embedded``.
    A batch of inputs arrives as one ``Embed`` each, back to back."""

    request_id: str
    prompt_ids: tuple[int, ...]
    pooling: str  # "last", "mean" or "cls"
    normalize: bool
    priority: int = 0  # its class's (``SamplingParams.priority``): higher ones are computed first
    background: bool = False  # its class's (``SamplingParams.background``): computed in short chunks

    def __post_init__(self) -> None:
        if self.pooling not in ("last", "mean", "cls") or not self.prompt_ids:
            raise ValueError(f"Embed: a prompt and a pooling of last, mean or cls, got {self.pooling!r}")


@message(21)
@dataclass(frozen=True)
class Reserve:
    """Decode worker: reserve blocks for a prompt whose KV a prefill worker will push. The prompt's
    ids come along so that a preempted sequence can be recomputed locally. Its ``branches`` start
    here, sharing the prompt's blocks, once the KV has arrived."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    branches: tuple[Branch, ...] = ()


@message(22)
@dataclass(frozen=True)
class Prefill:
    """Prefill worker: compute the prompt, push its KV into ``block_ids`` at ``kv_endpoint``, all but
    the first ``skip_blocks`` blocks, which the decode worker has cached."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    kv_endpoint: str
    block_ids: tuple[int, ...]  # the decode worker's blocks for the prompt's blocks after the skipped
    skip_blocks: int = 0  # leading blocks the decode worker holds already (its prefix cache): not sent


@message(23)
@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str = "abort"


@message(24)
@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@message(25)
@dataclass(frozen=True)
class Reregister:
    """The router does not know this worker (it restarted, or it gave the worker up as silent): the
    worker drops every request it holds (the router has none of them any more) and registers again."""

    reason: str = ""


@message(26)
@dataclass(frozen=True)
class Drain:
    """Take no new requests, finish those held (the router moves what is left after the worker's
    ``drain_timeout_s``), then exit, as on SIGTERM."""

    reason: str = ""
