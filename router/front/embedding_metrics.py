"""The router's embedding metrics: where each input's time went, and the batches the batcher sent
(docs/embeddings.md, Metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdfabric.router.dispatch.embedder import EmbedDone
from pdfabric.router.routing.batcher import Batch

_PARTS = (
    ("batch_wait", "An embedding input's wait to be batched: arrival to its batch leaving"),
    ("worker_wait", "Its batch's departure to its vector's return, less compute"),
    ("compute", "The worker steps that computed it (shared with what they ran beside it)"),
)


class EmbeddingMetrics:
    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]) -> None:
        """Registers them in ``registry``; latencies in ``buckets`` (seconds), as the router's others."""
        r = registry
        self.inputs = Counter("pdfabric_embedding_inputs", "Embedding inputs computed", ["model"], registry=r)
        self.waits = {
            part: Histogram(
                f"pdfabric_embedding_{part}_seconds", what, ["model"], buckets=buckets, registry=r
            )
            for part, what in _PARTS
        }
        self.batch_inputs = Histogram(
            "pdfabric_embedding_batch_inputs",
            "Inputs per embedding batch, by what sent it (full, deadline, idle)",
            ["trigger"],
            buckets=tuple(2.0**k for k in range(9)),
            registry=r,
        )

    def embedded(self, model: str, done: EmbedDone) -> None:
        """An embedding input that got its vector: where its time went."""
        self.inputs.labels(model).inc()
        waits = {
            "batch_wait": done.batch_wait_s,
            "worker_wait": done.worker_wait_s,
            "compute": done.compute_s,
        }
        for part, seconds in waits.items():
            self.waits[part].labels(model).observe(seconds)

    def batched(self, batch: Batch) -> None:
        self.batch_inputs.labels(batch.trigger).observe(len(batch.items))
