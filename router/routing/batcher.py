"""Dynamic batching of fixed-cost work (embeddings): when to send which inputs together. Pure: no
sockets, no event loop; times are values the caller passes in.

An input waits in the queue of its compatibility key (the model version that serves it, its pooling,
and a length bucket) until one of three triggers flushes a batch of that key:

1. ``full``: the queue holds a whole batch (``batch_tokens`` tokens or ``batch_inputs`` inputs):
   waiting longer could not make it larger;
2. ``deadline``: the batch the queue would send now must leave to meet its oldest input's deadline::

       now >= oldest.deadline - predict(batch tokens, batch inputs) - margin

   so the linger is what the budget leaves after the predicted compute, never a constant;
3. ``idle``: a worker that could run the key's inputs has nothing to do: holding them back would
   only waste it.

A batch takes a queue's inputs oldest first, up to the token and input limits (an input longer than
the whole token budget goes alone). Length buckets (powers of two of the input's tokens) keep short
inputs out of a long one's batch, whose compute they would otherwise wait for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass

from pdfabric.routing_config import EmbeddingConfig

FULL, DEADLINE, IDLE = "full", "deadline", "idle"  # flush triggers

# (tokens, inputs) of a batch -> its predicted compute seconds on the best worker for the key
Predict = Callable[[Hashable, int, int], float]


@dataclass(frozen=True)
class Item:
    """One input waiting to be batched: its id, its compatibility key (without the length bucket),
    its length, when it arrived and when its result is due (seconds on the caller's clock)."""

    request_id: str
    key: Hashable
    tokens: int
    arrived: float
    deadline: float


@dataclass(frozen=True)
class Batch:
    key: Hashable  # the items' compatibility key (without the length bucket)
    items: tuple[Item, ...]
    trigger: str  # FULL, DEADLINE or IDLE

    @property
    def tokens(self) -> int:
        return sum(i.tokens for i in self.items)


def bucket(tokens: int) -> int:
    """The length bucket of an input: the power of two at or above its length."""
    return 1 << max(0, tokens - 1).bit_length()


class Batcher:
    def __init__(self, config: EmbeddingConfig, predict: Predict) -> None:
        """``predict(key, tokens, inputs)``: the compute time of such a batch for the key's workers."""
        self.config = config
        self.predict = predict
        self._queues: dict[tuple[Hashable, int], deque[Item]] = {}
        self._where: dict[str, tuple[Hashable, int]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._where

    def keys(self) -> set[Hashable]:
        """The compatibility keys with inputs waiting."""
        return {where[0] for where in self._queues}

    def add(self, item: Item) -> None:
        if item.request_id in self._where:
            raise ValueError(f"input {item.request_id!r} is already waiting")
        where = (item.key, bucket(item.tokens) if self.config.length_buckets else 0)
        self._queues.setdefault(where, deque()).append(item)
        self._where[item.request_id] = where

    def remove(self, request_id: str) -> Item | None:
        """Takes an input out of its queue (its client left); None if it is not waiting."""
        where = self._where.pop(request_id, None)
        if where is None:
            return None
        queue = self._queues[where]
        item = next(i for i in queue if i.request_id == request_id)
        queue.remove(item)
        if not queue:
            del self._queues[where]
        return item

    def flush(self, now: float, idle: Collection[Hashable] = ()) -> list[Batch]:
        """The batches due at ``now``; ``idle``: the keys with a worker that has nothing to do."""
        out: list[Batch] = []
        for where in list(self._queues):
            queue = self._queues[where]
            while queue:
                items = self._take(queue)
                trigger = self._trigger(where[0], queue, items, now, idle)
                if trigger is None:
                    break
                for _ in items:
                    self._where.pop(queue.popleft().request_id)
                out.append(Batch(where[0], items, trigger))
            if not queue:
                del self._queues[where]
        return out

    def next_flush(self) -> float | None:
        """When the earliest ``deadline`` trigger fires (None: nothing waits)."""
        times = [self._due(where[0], q, self._take(q)) for where, q in self._queues.items()]
        return min(times) if times else None

    def _take(self, queue: deque[Item]) -> tuple[Item, ...]:
        """The queue's next batch: oldest first, within the token and input limits (at least one)."""
        c = self.config
        items: list[Item] = []
        tokens = 0
        for item in queue:
            if items and (tokens + item.tokens > c.batch_tokens or len(items) == c.batch_inputs):
                break
            items.append(item)
            tokens += item.tokens
        return tuple(items)

    def _trigger(
        self,
        key: Hashable,
        queue: deque[Item],
        items: tuple[Item, ...],
        now: float,
        idle: Collection[Hashable],
    ) -> str | None:
        if len(items) < len(queue) or sum(i.tokens for i in items) >= self.config.batch_tokens:
            return FULL
        if len(items) == self.config.batch_inputs:
            return FULL
        if now >= self._due(key, queue, items):
            return DEADLINE
        return IDLE if key in idle else None

    def _due(self, key: Hashable, queue: deque[Item], items: tuple[Item, ...]) -> float:
        """Formula 2: the latest time the batch can leave and still meet its oldest input's deadline."""
        compute = self.predict(key, sum(i.tokens for i in items), len(items))
        return min(i.deadline for i in items) - compute - self.config.margin_ms / 1e3
