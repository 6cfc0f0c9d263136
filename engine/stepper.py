"""One worker step: schedule, run the model, sample, advance the sequences. Shared by all workers."""

from __future__ import annotations

import statistics
import time
from collections import deque

from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.engine.sampler import sample
from pdfabric.engine.scheduler import Chunk, Scheduler, step_shape
from pdfabric.engine.sequence import Sequence
from pdfabric.profile import ProfileBuilder


class Stepper:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self._recent_ms: deque[float] = deque(maxlen=32)
        self.profile = ProfileBuilder()

    def step(self) -> list[Sequence]:
        """Runs one step if there is work; returns the sequences that got a token."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        shape = step_shape(chunks)
        start = time.perf_counter()
        logits = self.runner.step([self._entry(c) for c in chunks])
        sampled_chunks = [c for c in chunks if c.sample]
        picks = sample(
            logits,
            [c.seq.params for c in sampled_chunks],
            [len(c.seq.output_ids) for c in sampled_chunks],
        )
        changed = self.scheduler.complete(chunks, [(p.token_id, p.logprob) for p in picks])
        seconds = time.perf_counter() - start
        self._recent_ms.append(seconds * 1e3)
        self.profile.observe(shape, seconds)
        return changed

    def _entry(self, chunk: Chunk) -> StepEntry:
        seq = chunk.seq
        return StepEntry(
            token_ids=seq.token_slice(chunk.start, chunk.stop),
            num_cached=chunk.start,
            block_table=tuple(self.scheduler.tables.table(seq.request_id)),
            needs_logits=chunk.sample,
        )

    @property
    def recent_step_ms(self) -> float:
        return statistics.median(self._recent_ms) if self._recent_ms else 0.0
