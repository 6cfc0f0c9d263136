"""Prometheus metrics of the router, plus each registered worker's gauges from its heartbeats."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdfabric.control import KINDS, HandedOff
from pdfabric.router.dispatch.effects import FailedOver
from pdfabric.router.dispatch.fleet import Fleet
from pdfabric.router.front.embedding_metrics import EmbeddingMetrics
from pdfabric.router.platform.catalog import Catalog
from pdfabric.router.platform.tenants import UsageBook
from pdfabric.router.routing.batcher import Batch
from pdfabric.router.routing.registry import WorkerInfo

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _WorkerGauges(Collector):
    """Read at scrape time, so a worker that is gone disappears from the next scrape."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["worker", "pool", "kind"]
        free = GaugeMetricFamily("pdfabric_kv_blocks_free", "Free KV blocks per worker", labels=labels)
        total = GaugeMetricFamily("pdfabric_kv_blocks_total", "KV blocks per worker", labels=labels)
        running = GaugeMetricFamily(
            "pdfabric_running_sequences", "Sequences decoding per worker", labels=labels
        )
        queued = GaugeMetricFamily(
            "pdfabric_queued_tokens", "Prompt tokens waiting per worker", labels=labels
        )
        count = GaugeMetricFamily("pdfabric_workers", "Registered workers", labels=["pool", "kind"])
        prompt = CounterMetricFamily(
            "pdfabric_prefix_cache_queries", "Prompt tokens looked up in its prefix cache", labels=labels
        )
        hits = CounterMetricFamily(
            "pdfabric_prefix_cache_hits", "Of those, tokens whose KV the prefix cache held", labels=labels
        )
        refused = CounterMetricFamily(
            "pdfabric_kv_refused_peers",
            "Handshakes a worker's KV endpoint refused: peers without the cluster secret",
            labels=labels,
        )
        proposed = CounterMetricFamily(
            "pdfabric_speculative_proposed_tokens",
            "Tokens speculative decoding proposed on a worker",
            labels=labels,
        )
        accepted = CounterMetricFamily(
            "pdfabric_speculative_accepted_tokens",
            "Of those, tokens kept (the model picked them itself)",
            labels=labels,
        )
        checks = CounterMetricFamily(
            "pdfabric_speculative_checks",
            "Decodes that checked a proposal on a worker (tokens a check gives: 1 + accepted / checks)",
            labels=labels,
        )
        speedup = GaugeMetricFamily(
            "pdfabric_speculative_speedup",
            "How many times faster a sequence gets its tokens while the worker speculates (drafting "
            "included) than plain decode steps would give them; the router's ITL prediction divides by it",
            labels=labels,
        )
        per_pool: dict[tuple[str, str], int] = {}
        for w in self.fleet.workers.values():
            key = [w.worker_id, w.reg.pool, w.reg.kind]
            total.add_metric(key, w.reg.num_blocks)
            free.add_metric(key, w.free_blocks)
            if w.load is not None:
                running.add_metric(key, w.load.running)
                queued.add_metric(key, w.load.queued_tokens)
                prompt.add_metric(key, w.load.prompt_tokens)
                hits.add_metric(key, w.load.prefix_hit_tokens)
                refused.add_metric(key, w.load.refused_peers)
                proposed.add_metric(key, w.load.proposed_tokens)
                accepted.add_metric(key, w.load.accepted_tokens)
                checks.add_metric(key, w.load.speculative_checks)
                if w.reg.speculate_below:
                    speedup.add_metric(key, w.load.speculation)
            per_pool[(w.reg.pool, w.reg.kind)] = per_pool.get((w.reg.pool, w.reg.kind), 0) + 1
        for kind in KINDS:
            per_pool.setdefault(("default", kind), 0)
        for (pool, kind), n in sorted(per_pool.items()):
            count.add_metric([pool, kind], n)
        yield from (free, total, running, queued, count, prompt, hits, refused)
        yield from (proposed, accepted, checks, speedup)
        yield from self._store()

    def _store(self) -> Iterator[CounterMetricFamily]:
        """The host KV store as each worker that has one used it (``Heartbeat.kv_store``)."""
        labels, tiered = ["worker", "pool", "kind"], ["worker", "pool", "kind", "tier"]
        families = {
            name: CounterMetricFamily(f"pdfabric_kv_store_{name}", text, labels=tiered)
            for name, text in STORE_TIER_COUNTERS.items()
        }
        flat = {
            name: CounterMetricFamily(f"pdfabric_kv_store_{name}", text, labels=labels)
            for name, text in STORE_COUNTERS.items()
        }
        for w in self.fleet.workers.values():
            got = w.load.kv_store if w.load is not None else {}
            if not got:
                continue
            key = [w.worker_id, w.reg.pool, w.reg.kind]
            for name, family in families.items():
                for tier in ("ram", "disk"):
                    family.add_metric([*key, tier], got.get(f"{tier}_{name}", 0.0))
            for name, family in flat.items():
                family.add_metric(key, got.get(name, 0.0))
        yield from families.values()
        yield from flat.values()


# The host KV store's counters per worker and tier, and per worker (docs/kvtransfer.md)
STORE_TIER_COUNTERS = {
    "hits": "KV blocks read from a host KV store tier and checked",
    "bytes_read": "Bytes of KV read from a host KV store tier",
    "writes": "KV blocks a worker wrote to a host KV store tier",
    "bytes_written": "Bytes of KV a worker wrote to a host KV store tier",
    "evictions": "Blocks a worker deleted from a host KV store tier to keep it within its size",
    "bad": "Block files that failed their checks on reading (deleted; the block is recomputed)",
    "write_errors": "Block writes that failed (a full disk): the block is not kept",
}
STORE_COUNTERS = {
    "dropped": "Evicted blocks not saved because the host KV store's write queue was full",
    "load_seconds": "Seconds spent reading host KV store hits into the KV cache",
    "hit_tokens": "Prompt tokens whose KV was read from the host KV store",
    "ahead_hits": "KV blocks of host KV store hits read ahead, while earlier steps ran",
}


class _Waiting(Collector):
    """Requests waiting in the router's admission queue, read at scrape time."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        help_ = "Requests waiting in the router for a route"
        yield GaugeMetricFamily("pdfabric_admission_waiting", help_, value=self.fleet.waiting)


class _Supervision(Collector):
    """Worker restarts by the launcher and workers it left down, read at scrape time."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        restarts = CounterMetricFamily(
            "pdfabric_worker_restarts", "Times the launcher started an exited worker again", labels=["worker"]
        )
        for worker_id, n in sorted(self.fleet.restarts.items()):
            restarts.add_metric([worker_id], n)
        yield restarts
        yield GaugeMetricFamily(
            "pdfabric_workers_down", "Workers the launcher no longer restarts (drained, or failing)",
            value=len(self.fleet.down),
        )  # fmt: skip
        yield CounterMetricFamily(
            "pdfabric_refused_peers",
            "Handshakes the control socket refused: peers without the cluster secret",
            value=self.fleet.refused_peers,
        )


class _TenantUsage(Collector):
    """Each tenant's usage per model (``tenants.UsageBook``), read at scrape time."""

    def __init__(self, usage: UsageBook) -> None:
        self.usage = usage

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = ["tenant", "model"]
        requests = CounterMetricFamily(
            "pdfabric_tenant_requests", "Requests a tenant's limits admitted and that started", labels=labels
        )
        failed = CounterMetricFamily(
            "pdfabric_tenant_failed_requests", "Of those, requests that did not finish", labels=labels
        )
        tokens = CounterMetricFamily(
            "pdfabric_tenant_tokens",
            "Tokens used, by kind: prompt, cached (prompt tokens from a prefix cache), completion (every "
            "token generated, a failed request's partial output included)",
            labels=[*labels, "kind"],
        )
        for (tenant, model), u in sorted(self.usage.usage.items()):
            requests.add_metric([tenant, model], u.requests)
            failed.add_metric([tenant, model], u.failed)
            tokens.add_metric([tenant, model, "prompt"], u.prompt_tokens)
            tokens.add_metric([tenant, model, "cached"], u.cached_tokens)
            tokens.add_metric([tenant, model, "completion"], u.completion_tokens)
        yield from (requests, failed, tokens)


class _Versions(Collector):
    """Each served version's traffic weight, state and cold start (``catalog.Catalog``), read at scrape
    time; a version not yet ready or routed to has no ready or cold-start sample."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model", "version"]
        weight = GaugeMetricFamily("pdfabric_version_weight", "A version's traffic weight", labels=labels)
        state = GaugeMetricFamily(
            "pdfabric_version_state", "1 for a version's state (warming, ready, failed, retired)",
            labels=[*labels, "state"],
        )  # fmt: skip
        ready = GaugeMetricFamily(
            "pdfabric_version_ready_seconds", "From a version being added to its warm-up passing",
            labels=labels,
        )  # fmt: skip
        cold = GaugeMetricFamily(
            "pdfabric_version_cold_start_seconds",
            "From a version being added to its first routed client request",
            labels=labels,
        )
        for model in self.catalog.models.values():
            for v in model.versions.values():
                key = [v.model, v.name]
                weight.add_metric(key, v.weight)
                state.add_metric([*key, v.state], 1)
                if v.ready_at is not None:
                    ready.add_metric(key, v.ready_at - v.added_at)
                if v.cold_start_s is not None:
                    cold.add_metric(key, v.cold_start_s)
        yield from (weight, state, ready, cold)


class RouterMetrics:
    """The router's metrics, the fleet's read at scrape time (its workers' gauges, the admission queue,
    restarts), and a listener of the dispatcher's events (``dispatcher.DispatchEvents``)."""

    def __init__(self, fleet: Fleet, usage: UsageBook | None = None, catalog: Catalog | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pdfabric_ttft_seconds", "Time to first token", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pdfabric_itl_seconds",
            "Gap between streamed tokens",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdfabric_e2e_seconds",
            "Request latency, arrival to last token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "pdfabric_queue_wait_seconds",
            "Arrival to dispatch to a worker",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pdfabric_requests", "Finished requests by outcome", ["model", "outcome"], registry=r
        )
        self.prompt_tokens = Counter(
            "pdfabric_prompt_tokens", "Prompt tokens of accepted requests", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            "pdfabric_generation_tokens", "Tokens generated", ["model"], registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "pdfabric_kv_transfer_seconds",
            "KV push, start to acknowledgement",
            ["pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bytes = Histogram(
            "pdfabric_kv_transfer_bytes",
            "KV bytes moved per request",
            ["pool"],
            buckets=tuple(2.0**k for k in range(16, 34, 2)),
            registry=r,
        )
        self.rejections = Counter(
            "pdfabric_rejections", "Requests refused, by reason", ["reason"], registry=r
        )
        self.failovers = Counter(
            "pdfabric_failovers",
            "Requests moved off a failed worker mid-stream, by cause (worker_gone, error, tokens_lost)",
            ["cause"],
            registry=r,
        )
        self.lost = Counter(
            "pdfabric_requests_lost",
            "Accepted requests that ended with an error, by cause: worker_failed (no failover left or no "
            "worker to take it), no_progress (request_timeout_s), deadline (the request's own timeout)",
            ["cause"],
            registry=r,
        )
        self.idempotent_replays = Counter(
            "pdfabric_idempotent_replays",
            "Responses answered from an earlier request with the same Idempotency-Key, not computed",
            registry=r,
        )
        self.embeddings = EmbeddingMetrics(r, LATENCY_BUCKETS)
        for collector in (_WorkerGauges(fleet), _Waiting(fleet), _Supervision(fleet)):
            r.register(collector)
        if usage is not None:
            r.register(_TenantUsage(usage))
        if catalog is not None:
            r.register(_Versions(catalog))

    # --- what the dispatcher and the front tell it ---------------------------------------------

    def handed_off(self, msg: HandedOff, worker: WorkerInfo | None) -> None:
        pool = worker.reg.pool if worker is not None else "unknown"
        self.kv_transfer_seconds.labels(pool).observe(msg.kv_seconds)
        self.kv_transfer_bytes.labels(pool).observe(msg.kv_bytes)

    def batched(self, batch: Batch) -> None:
        self.embeddings.batched(batch)

    def failed_over(self, moved: FailedOver) -> None:
        self.failovers.labels(moved.cause).inc()

    def unauthenticated(self) -> None:
        self.rejections.labels("unauthenticated").inc()
