"""The worker process: a ZeroMQ loop around a worker core (``pdfabric.worker.core``) and the model.

Everything a worker decides lives in its core; this loop only moves messages and runs the model. One
turn of the loop, never blocking for long:

1. the KV side (the kvtransfer sender or receiver) is polled; transfers that ended, and blocks it
   gave back, go to the core;
2. control messages from the router go to the core (waiting up to 5 ms when there is no work; a
   control or KV socket wakes it);
3. if the core schedules a step, the model runs it (``Stepper``; a prefill worker's KV side ships each
   finished prompt's layers as the model completes them) and the core completes it with the samples
   and the measured time;
4. a heartbeat goes out when the core says one is due.

Whatever the core returns is sent: control messages to the router, KV commands to the KV side. The
worker exits when the router says ``Shutdown``, when it has drained (SIGTERM or the router's
``Drain``), or when the process that started it is gone. If the router restarts, the control socket
reconnects by itself; the new router answers the first heartbeat with ``Reregister``, and the core
drops what it held and registers again.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from pdfabric.cluster_secret import ClusterSecret
from pdfabric.control import Drain, Shutdown
from pdfabric.engine.stepper import Stepper
from pdfabric.kvtransfer.frames import layout_of
from pdfabric.kvtransfer.host_store import HostKVStore, store_salt
from pdfabric.kvtransfer.transport import host_id
from pdfabric.proc import alive
from pdfabric.profile import ProfileBuilder
from pdfabric.wire import WireError, decode, encode
from pdfabric.worker.core import Out, WrongMessage
from pdfabric.worker.kind import WorkerKind
from pdfabric.worker.kv import CancelKV, ExpectKV, PushKV
from pdfabric.worker.spec import CoreSpec
from pdfabric.worker_config import WorkerConfig

if TYPE_CHECKING:
    from pdfabric.engine.draft import DraftModel
    from pdfabric.engine.grammar import Grammars
    from pdfabric.engine.runner import ModelRunner

log = logging.getLogger("pdfabric.worker.loop")


class Worker:
    """One worker process's loop around the core and KV side of its ``kind``."""

    def __init__(
        self, cfg: WorkerConfig, kind: WorkerKind, secret: ClusterSecret | None, parent_pid: int = 0
    ) -> None:
        """``secret``: the cluster secret, which the router's control socket and the decode workers'
        KV endpoints ask for (None: plain ZeroMQ, for a router without one)."""
        if kind.name != cfg.kind:
            raise ValueError(f"a {kind.name} worker cannot run a {cfg.kind} config")
        self.cfg = cfg
        self.parent_pid = parent_pid
        engine = build_engine(cfg)
        self.worker_id = engine.spec.worker_id
        self.runner, self.profile = engine.runner, engine.profile
        self.stepper = Stepper(engine.runner, engine.grammars)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        if secret is not None:
            secret.connect(self.sock)
        self.sock.connect(cfg.join)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._watched: set[zmq.Socket] = set()
        self._running = True
        self._drain_until = float("inf")
        self.kv = None if kind.open_kv is None else kind.open_kv(cfg, self.worker_id, engine.runner, secret)
        self.store = open_store(cfg, engine) if cfg.kv_store else None  # after the KV side moved the caches
        self.core = kind.core(
            engine.spec, self.profile, self.kv.endpoint if self.kv is not None else "", engine.proposer,
            self.store,
        )  # fmt: skip

    # --- loop -----------------------------------------------------------------------------------

    def send(self, msg: object) -> None:
        self.sock.send(encode(msg))

    def dispatch(self, out: Out) -> None:
        """Sends what the core returned: KV commands to the KV side, the rest to the router."""
        for msg in out:
            if isinstance(msg, PushKV | ExpectKV | CancelKV):
                if self.kv is None:
                    raise TypeError(f"{self.cfg.kind} worker has no KV side for {type(msg).__name__}")
                self.kv.command(msg)
                self._watch_kv()
            else:
                self.send(msg)

    def profile_startup(self) -> None:
        """Seeds the latency profile with a short measured grid of step shapes (bounded in time)."""
        from pdfabric.engine.profiler import run_plan
        from pdfabric.profile import profiling_plan

        if self.cfg.profile_seconds <= 0:
            return
        spec = self.core.spec
        plan = profiling_plan(
            self.cfg.max_batch_tokens,
            self.cfg.max_running,
            spec.max_model_len,
            spec.num_blocks * self.cfg.block_size,
        )
        done = run_plan(self.runner, plan, self.profile, self.cfg.profile_seconds)
        log.info(
            "%s: profiled %d steps in %.1fs%s",
            self.worker_id,
            done.steps,
            done.seconds,
            "" if done.complete else " (time budget reached; the profile refines online)",
        )

    def drain(self) -> None:
        """Stops taking new requests (SIGTERM); the loop ends once those held are done, or after
        ``drain_timeout_s`` (the router moves what is left to other workers)."""
        if not self.core.draining:
            log.warning("%s: draining (at most %.0fs)", self.worker_id, self.cfg.drain_timeout_s)
            self.core.drain()
            self._drain_until = time.monotonic() + self.cfg.drain_timeout_s

    def serve_forever(self) -> None:
        self.profile_startup()
        self.send(self.core.registration())
        self._watch_kv()
        core = self.core
        try:
            while self._running:
                if core.draining and (core.idle or time.monotonic() > self._drain_until):
                    log.warning("%s: drained, exiting", self.worker_id)
                    break
                self._poll_kv()
                self._drain(timeout_ms=0 if core.has_work else 5)
                planned = time.perf_counter()
                step = core.schedule()  # a draft model drafts here
                if step is not None:
                    start = time.perf_counter()
                    hook = self.kv.layer_hook(step.opens) if self.kv is not None and step.opens else None
                    sampled = self.stepper.run(step.chunks, core.tables, hook)
                    seconds = time.perf_counter() - start
                    self.dispatch(core.complete(step, sampled, seconds, drafting=start - planned))
                self._heartbeat()
        finally:
            self.close()

    def close(self) -> None:
        if self.store is not None:  # what the pool holds is kept for the next start
            self.store.flush(*self.core.tables.pool.cached_blocks())
            self.store.close()
        if self.kv is not None:
            self.kv.close()
        self.sock.close(linger=1000)

    def _watch_kv(self) -> None:
        """Lets the KV side's sockets (a sender opens one per decode worker) wake the loop."""
        if self.kv is None:
            return
        for sock in self.kv.sockets():
            if sock not in self._watched:
                self._watched.add(sock)
                self._poller.register(sock, zmq.POLLIN)

    def _poll_kv(self) -> None:
        if self.kv is None:
            return
        results, released = self.kv.poll()
        for result in results:
            self.dispatch(self.core.transfer_ended(result))
        for request_id in released:
            self.dispatch(self.core.kv_released(request_id))

    def _drain(self, timeout_ms: int) -> None:
        """Waits up to ``timeout_ms`` for a control or transfer message, then handles control ones."""
        if not self._poller.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame)
            except WireError as exc:
                log.error("dropping bad control frame: %s", exc)
                continue
            if isinstance(msg, Shutdown):
                self._running = False
                return
            if isinstance(msg, Drain):  # the router's admin endpoint: as SIGTERM
                self.drain()
                continue
            try:
                out = self.core.handle(msg)
            except WrongMessage as exc:
                log.error("%s", exc)
                continue
            self.dispatch(out)

    def _heartbeat(self) -> None:
        hb = self.core.heartbeat(time.monotonic(), self.kv.refused_peers() if self.kv is not None else 0)
        if hb is None:
            return
        if self.parent_pid and not alive(self.parent_pid):
            log.warning("parent process %d is gone; exiting", self.parent_pid)
            self._running = False
            return
        self.send(hb)


@dataclass(frozen=True)
class Engine:
    """What a worker computes with: the model runner, its core's spec (the KV blocks and context limit
    sized for the model) and the online latency profile."""

    runner: ModelRunner
    spec: CoreSpec
    profile: ProfileBuilder
    grammars: Grammars | None = None  # None: the model directory has no tokenizer.json
    proposer: DraftModel | None = None  # speculative = "draft": the draft model (engine/draft.py)
    model_dir: Path | None = None  # the checkpoint's directory


def build_engine(cfg: WorkerConfig) -> Engine:
    """Loads the model and sizes its KV cache as ``cfg`` says (threads, dtype, device, block budget);
    no sockets, so ``pdfabric profile`` measures exactly what a worker runs. The worker's name is
    ``cfg.worker_id``, else ``KIND-PID``."""
    from pdfabric.engine.default_model import resolve_model
    from pdfabric.engine.grammar import Grammars
    from pdfabric.engine.kv_cache import kv_bytes_per_token
    from pdfabric.engine.loader import load_model
    from pdfabric.engine.quantized_cache import quantizer_for
    from pdfabric.engine.runner import ModelRunner
    from pdfabric.kernels.dispatch import prepare_sampler

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    # Now, not in the first request's step: a second of compiling there was learnt by the latency
    # profile as a slow step (and the router then refused requests as beyond their ITL budget).
    prepare_sampler()
    path = resolve_model(cfg.model)
    model = load_model(path, cfg.dtype, _device(cfg.device), cfg.quantization)
    # the weights are packed (and quantized, or read quantized from the model cache) first: with
    # memory_mb the KV cache gets what they leave
    quantizer = quantizer_for(path, model, cfg.quantization)
    runner = ModelRunner(
        model, 1, cfg.block_size, linears=cfg.linears, quantization=cfg.quantization,
        kv_cache_dtype=cfg.kv_cache_dtype, quantizer=quantizer,
    )  # fmt: skip
    if quantizer is not None:
        log.info("%s weights: %d layers read from %s, %d quantized now",
                 cfg.quantization, quantizer.read, quantizer.root, quantizer.written)  # fmt: skip
    proposer = None
    if cfg.speculative == "draft" and cfg.kind != "prefill":  # prefill workers never speculate
        from pdfabric.engine.draft import build_draft

        proposer = build_draft(cfg, path, runner)
    # a draft's weights, and a cache of its own (as many blocks as the served one), share the budget
    spec = CoreSpec.sized(
        cfg, worker_id=cfg.worker_id or f"{cfg.kind}-{os.getpid()}",
        model_max_len=model.config.max_position_embeddings,
        kv_bytes_per_token=kv_bytes_per_token(model.config, cfg.kv_cache_dtype), pid=os.getpid(),
        host=host_id(), weight_bytes=runner.weight_bytes + (proposer.runner.weight_bytes if proposer else 0),
        draft_kv_bytes_per_token=proposer.kv_bytes_per_token if proposer else 0,
    )  # fmt: skip
    runner.resize_kv(spec.num_blocks)
    if proposer is not None:
        proposer.resize(spec.num_blocks)
    has_tokenizer = (path / "tokenizer.json").exists()
    grammars = Grammars.for_model(path, model.config.vocab_size) if has_tokenizer else None
    return Engine(runner, spec, ProfileBuilder(), grammars, proposer, path)


def open_store(cfg: WorkerConfig, engine: Engine) -> HostKVStore:
    """The host KV store as this worker sees it: its tiers, and keys salted by its model and layout."""
    runner = engine.runner
    layout = layout_of(runner.kv_caches, runner.kv_tiled)
    salt = store_salt(cfg, engine.model_dir or Path(cfg.model), layout)
    spec = engine.spec  # a prompt's reservation, or its hit read from the store, evicts up to this many
    burst = min(spec.num_blocks, -(-spec.max_model_len // layout.block_size))
    return HostKVStore(cfg, salt, lambda: runner.kv_caches, runner.kv_tiled, burst_blocks=burst)


def run_worker(
    cfg: WorkerConfig, kind: WorkerKind, secret: ClusterSecret | None, parent_pid: int = 0
) -> None:
    """The worker process: builds the worker of ``kind`` and serves until told to stop; SIGTERM
    drains it (no new requests; it exits once idle or after ``drain_timeout_s``)."""
    worker = Worker(cfg, kind, secret, parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: worker.drain())
    worker.serve_forever()


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name
