"""The router's embedding inputs, without sockets, an event loop or a clock of its own: calls and
worker messages in, effects out (``Send``; each input's end, ``EmbedDone``; each ``Batch`` sent).

An input's life here:
1. ``submit``: it waits in the ``Batcher`` (``routing/batcher.py``) under its compatibility key (the
   model version, pooling and normalization) with its deadline (arrival + latency budget);
2. ``poll`` (run after every call and at ``next_deadline()``): each batch due goes to the worker of
   that version (prefill or colocated, not draining) with the least work ahead of it, one ``Embed``
   per input, back to back, so that they share its steps;
3. the worker's ``Embedded`` ends it with its vector (``EmbedDone``); an error there, or the worker's
   death, puts it back at the head of its queue under a new wire id (``rid~1``, ...), at most
   ``max_failovers`` times, after which it ends with the error (a late reply from an earlier
   attempt is ignored);
4. ``end`` forgets it (its client is done or gone): out of the queue, or an ``Abort`` to the worker.

An ``EmbedDone`` splits the input's latency three ways for the metrics: waiting to be batched
(arrival to its batch leaving), waiting for a worker (the rest, less compute) and compute (the steps
that ran it), so that "slow because we wait to batch" and "slow because the model is slow" differ.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pdfabric.control import COLOCATED, PREFILL, Abort, Embed, Embedded
from pdfabric.profile import queued_attention
from pdfabric.router.dispatch.effects import Send
from pdfabric.router.routing.batcher import Batch, Batcher, Item
from pdfabric.router.routing.registry import Registry, WorkerInfo
from pdfabric.routing_config import EmbeddingConfig

NO_WORKER = "no worker can compute embeddings for this model now"


@dataclass(frozen=True)
class EmbedDone:
    """An input's end: its vector (float32 bytes), or ``error``; and where its time went."""

    request_id: str
    vector: bytes = b""
    error: str = ""
    batch_wait_s: float = 0.0
    worker_wait_s: float = 0.0
    compute_s: float = 0.0
    batch_inputs: int = 0  # the inputs of the batch it left in (0: it never left)
    trigger: str = ""  # what flushed that batch (routing/batcher.py)


@dataclass
class _Input:
    request_id: str
    prompt_ids: tuple[int, ...]
    key: tuple[str, str, bool]  # (served, pooling, normalize)
    arrived: float
    deadline: float
    priority: int = 0  # its class's: the worker computes higher ones first
    background: bool = False  # its class's: the worker computes it in short chunks
    attempt: int = 0
    worker: str = ""  # where it runs now ("": waiting in the batcher)
    left: float = 0.0  # when its batch left
    batch_inputs: int = 0
    trigger: str = ""

    @property
    def wire_id(self) -> str:
        return self.request_id if not self.attempt else f"{self.request_id}~{self.attempt}"


class EmbedCore:
    def __init__(
        self, registry: Registry, config: EmbeddingConfig, clock: Callable[[], float], max_failovers: int = 2
    ) -> None:
        self.registry = registry
        self.config = config
        self.clock = clock
        self.max_failovers = max_failovers
        self.batcher = Batcher(config, self._predict)
        self._inputs: dict[str, _Input] = {}
        self._wire: dict[str, _Input] = {}
        self._tokens: dict[str, int] = {}  # worker id -> tokens of the inputs it runs for us

    def __len__(self) -> int:
        return len(self._inputs)

    def submit(
        self, request_id: str, prompt_ids: tuple[int, ...], pooling: str, normalize: bool, served: str,
        deadline: float, priority: int = 0, background: bool = False,
    ) -> list[object]:  # fmt: skip
        """A new input, due at ``deadline`` (on the clock), of its class's ``priority`` (and
        ``background``, ``SamplingParams.background``); it ends at once if no worker could run it."""
        if request_id in self._inputs:
            raise ValueError(f"input {request_id!r} is already here")
        key = (served, pooling, normalize)
        if not self._workers(key):
            return [EmbedDone(request_id, error=NO_WORKER)]
        inp = _Input(request_id, prompt_ids, key, self.clock(), deadline, priority, background)
        self._inputs[request_id] = self._wire[request_id] = inp
        self.batcher.add(Item(request_id, key, len(prompt_ids), inp.arrived, deadline))
        return self.poll()

    def end(self, request_id: str, reason: str = "request ended") -> list[object]:
        inp = self._inputs.pop(request_id, None)
        if inp is None:
            return []
        self._wire.pop(inp.wire_id, None)
        worker = inp.worker
        if self.batcher.remove(request_id) is not None or not worker:
            return []
        self._let_go(inp)  # its worker may now be idle: what waits can go there
        abort = [Send(worker, Abort(inp.wire_id, reason))] if worker in self.registry.workers else []
        return abort + self.poll()

    def on_result(self, msg: Embedded) -> list[object]:
        out: list[object] = []
        for r in msg.results:
            inp = self._wire.get(r.request_id)
            if inp is None or inp.wire_id != r.request_id or inp.worker != msg.worker_id:
                continue  # ended meanwhile, or a reply to an attempt that failed
            self._let_go(inp)
            if r.error:
                self._retry(inp, f"{msg.worker_id}: {r.error}", out)
                continue
            now = self.clock()
            waited = max(0.0, now - inp.left - r.compute_s)
            self._forget(inp)
            done = EmbedDone(
                inp.request_id, r.vector, batch_wait_s=inp.left - inp.arrived, worker_wait_s=waited,
                compute_s=r.compute_s, batch_inputs=inp.batch_inputs, trigger=inp.trigger,
            )  # fmt: skip
            out.append(done)
        return out + self.poll()

    def worker_gone(self, worker_id: str, why: str) -> list[object]:
        """Every input the worker was running goes back to its queue (or ends, out of failovers)."""
        out: list[object] = []
        for inp in [i for i in self._inputs.values() if i.worker == worker_id]:
            self._let_go(inp)
            self._retry(inp, f"worker {worker_id} failed: {why}", out)
        self._tokens.pop(worker_id, None)
        return out + self.poll()

    def poll(self) -> list[object]:
        """Sends the batches due now (registry changes, results and time make them due)."""
        out: list[object] = []
        for batch in self.batcher.flush(self.clock(), self._idle_keys()):
            self._send(batch, out)
        return out

    def next_deadline(self) -> float | None:
        at = self.batcher.next_flush()
        return at + 1e-3 if at is not None else None  # a hair after: the batch is surely due

    # --- internals ------------------------------------------------------------------------------

    def _workers(self, key: Hashable) -> list[WorkerInfo]:
        served = key[0]  # type: ignore[index]
        return [
            w for w in self.registry.serving(served) if w.reg.kind in (PREFILL, COLOCATED) and not w.draining
        ]

    def _idle_keys(self) -> set[Hashable]:
        return {k for k in self.batcher.keys() if any(self._idle(w) for w in self._workers(k))}

    def _idle(self, w: WorkerInfo) -> bool:
        """Nothing of ours runs there and its last report had no prompt waiting."""
        return not self._tokens.get(w.worker_id) and (w.load is None or w.load.queued_tokens == 0)

    def _ahead(self, w: WorkerInfo) -> int:
        return self._tokens.get(w.worker_id, 0) + (w.load.queued_tokens if w.load is not None else 0)

    def _predict(self, key: Hashable, tokens: int, inputs: int) -> float:
        """A batch's compute on the key's fastest worker, from its latency profile."""
        workers = self._workers(key)
        if not workers:
            return 0.0
        attention = queued_attention(tokens, inputs)
        return min(_profile(w).prefill_seconds(tokens, w.reg.max_batch_tokens, attention) for w in workers)

    def _send(self, batch: Batch, out: list[object]) -> None:
        workers = self._workers(batch.key)
        now = self.clock()
        if not workers:
            for item in batch.items:
                inp = self._inputs[item.request_id]
                self._forget(inp)
                out.append(EmbedDone(inp.request_id, error=NO_WORKER, batch_wait_s=now - inp.arrived))
            return
        worker = min(workers, key=lambda w: (self._ahead(w), w.worker_id))
        out.append(batch)
        _, pooling, normalize = batch.key  # type: ignore[misc]
        for item in batch.items:
            inp = self._inputs[item.request_id]
            inp.worker, inp.left = worker.worker_id, now
            inp.batch_inputs, inp.trigger = len(batch.items), batch.trigger
            self._tokens[worker.worker_id] = self._tokens.get(worker.worker_id, 0) + len(inp.prompt_ids)
            embed = Embed(inp.wire_id, inp.prompt_ids, pooling, normalize, inp.priority, inp.background)
            out.append(Send(worker.worker_id, embed))

    def _retry(self, inp: _Input, why: str, out: list[object]) -> None:
        if inp.attempt >= self.max_failovers:
            self._forget(inp)
            out.append(EmbedDone(inp.request_id, error=f"{why} (after {inp.attempt} failovers)"))
            return
        self._wire.pop(inp.wire_id, None)
        inp.attempt += 1
        self._wire[inp.wire_id] = inp
        self.batcher.add(Item(inp.request_id, inp.key, len(inp.prompt_ids), inp.arrived, inp.deadline))

    def _let_go(self, inp: _Input) -> None:
        """The input no longer runs on its worker."""
        if inp.worker:
            self._tokens[inp.worker] = max(0, self._tokens.get(inp.worker, 0) - len(inp.prompt_ids))
            inp.worker = ""

    def _forget(self, inp: _Input) -> None:
        self._inputs.pop(inp.request_id, None)
        self._wire.pop(inp.wire_id, None)


def _profile(w: WorkerInfo):  # noqa: ANN202 - WorkerProfile
    return w.load.profile if w.load is not None else w.reg.profile
