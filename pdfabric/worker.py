"""What every worker process shares: model and cache set-up, the control connection, the main loop.

The loop never blocks for long: it drains control messages, lets the subclass poll its transfers,
runs one model step when there is work, and sends a heartbeat when one is due. The worker exits when
the router says ``Shutdown`` or when the process that started it is gone.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from pdfabric.config import WorkerConfig
from pdfabric.control import Abort, Heartbeat, Register, Shutdown, StepOutputs, TokenDelta
from pdfabric.engine.block_pool import BlockPool, BlockTables
from pdfabric.engine.scheduler import Scheduler, SchedulerConfig
from pdfabric.engine.sequence import Sequence
from pdfabric.engine.stepper import Stepper
from pdfabric.wire import WireError, decode, encode

if TYPE_CHECKING:
    from pdfabric.engine.runner import ModelRunner

log = logging.getLogger("pdfabric.worker")


class Worker:
    """Base class; subclasses handle their message kinds and what happens to stepped sequences."""

    on_prefilled = "decode"

    def __init__(self, cfg: WorkerConfig, parent_pid: int = 0) -> None:
        self.cfg = cfg
        self.worker_id = cfg.worker_id or f"{cfg.kind}-{os.getpid()}"
        self.parent_pid = parent_pid
        engine = build_engine(cfg, self.on_prefilled)
        self.runner, self.tables, self.max_model_len = engine.runner, engine.tables, engine.max_model_len
        self.scheduler, self.stepper = engine.scheduler, engine.stepper
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(cfg.join)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._running = True
        self._next_heartbeat = 0.0

    # --- subclass hooks -------------------------------------------------------------------------

    def kv_endpoint(self) -> str:
        return ""

    def handle(self, msg: Any) -> None:
        raise NotImplementedError

    def poll_transfers(self) -> None:
        """Advances KV transfers (their sockets wake the loop, see ``watch``)."""

    def watch(self, sock: zmq.Socket) -> None:
        """Lets ``sock``'s incoming messages wake the main loop."""
        self._poller.register(sock, zmq.POLLIN)

    def after_step(self, changed: list[Sequence]) -> list[TokenDelta]:
        """Turns the step's sequences into deltas for the router."""
        return [delta_of(seq) for seq in changed]

    def close(self) -> None:
        self.sock.close(linger=1000)

    # --- loop -----------------------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        self.sock.send(encode(msg))

    def register(self) -> None:
        self.send(
            Register(
                self.worker_id,
                self.cfg.kind,
                self.cfg.pool,
                self.cfg.model,
                self.max_model_len,
                self.cfg.block_size,
                self.tables.pool.num_blocks,
                self.kv_endpoint(),
                os.getpid(),
                self.cfg.max_running,
                self.cfg.max_batch_tokens,
                self.runner.config.kv_bytes_per_token,
                self.stepper.profile.profile(force=True),
            )
        )

    def profile_startup(self) -> None:
        """Seeds the latency profile with a short measured grid of step shapes (bounded in time)."""
        from pdfabric.engine.profiler import run_plan
        from pdfabric.profile import profiling_plan

        if self.cfg.profile_seconds <= 0:
            return
        plan = profiling_plan(
            self.cfg.max_batch_tokens,
            self.cfg.max_running,
            self.max_model_len,
            self.tables.pool.num_blocks * self.cfg.block_size,
        )
        done = run_plan(self.runner, plan, self.stepper.profile, self.cfg.profile_seconds)
        log.info(
            "%s: profiled %d steps in %.1fs%s",
            self.worker_id,
            done.steps,
            done.seconds,
            "" if done.complete else " (time budget reached; the profile refines online)",
        )

    def serve_forever(self) -> None:
        self.profile_startup()
        self.register()
        try:
            while self._running:
                self.poll_transfers()
                self._drain(timeout_ms=0 if self.scheduler.has_work else 5)
                if self.scheduler.has_work:
                    deltas = self.after_step(self.stepper.step())
                    if deltas:
                        self.send(StepOutputs(self.worker_id, tuple(deltas)))
                self._heartbeat()
        finally:
            self.close()

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
            if isinstance(msg, Abort):
                self.abort(msg.request_id, msg.reason)
            else:
                self.handle(msg)

    def abort(self, request_id: str, reason: str) -> None:
        self.scheduler.finish(request_id, reason)

    def fits(self, request_id: str, prompt_len: int) -> bool:
        """Whether a prompt leaves room for a token here; if not, the request ends with an error."""
        if prompt_len < self.max_model_len:
            return True
        error = f"prompt of {prompt_len} tokens does not fit this worker's {self.max_model_len}"
        self.send(StepOutputs(self.worker_id, (TokenDelta(request_id, 0, (), (), "error", error),)))
        return False

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.cfg.heartbeat_s
        if self.parent_pid and not _alive(self.parent_pid):
            log.warning("parent process %d is gone; exiting", self.parent_pid)
            self._running = False
            return
        s = self.scheduler
        self.send(
            Heartbeat(
                self.worker_id,
                s.queued_tokens,
                len(s.running),
                len(s.waiting) + len(s.awaiting_kv),
                self.tables.pool.num_free,
                self.tables.pool.num_blocks,
                self.stepper.recent_step_ms,
                s.context_tokens,
                self.kv_rate(),
                self.stepper.profile.profile(),
            )
        )

    def kv_rate(self) -> float:
        """Recent KV transfer bytes per second (transfer-capable workers override)."""
        return 0.0


@dataclass(frozen=True)
class Engine:
    """What a worker computes with: model runner, KV block tables, scheduler and stepper."""

    runner: ModelRunner
    tables: BlockTables
    scheduler: Scheduler
    stepper: Stepper
    max_model_len: int


def build_engine(cfg: WorkerConfig, on_prefilled: str = "decode") -> Engine:
    """Loads the model and sizes its KV cache as ``cfg`` says (threads, dtype, device, block budget);
    no sockets, so ``pdfabric profile`` measures exactly what a worker runs."""
    from pdfabric.engine.default_model import resolve_model
    from pdfabric.engine.loader import load_model
    from pdfabric.engine.runner import ModelRunner

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    model = load_model(resolve_model(cfg.model), cfg.dtype, _device(cfg.device))
    mcfg = model.config
    num_blocks = cfg.kv_blocks(mcfg.kv_bytes_per_token)
    # One sequence must always fit in the pool on its own, or it could wait forever.
    max_model_len = min(mcfg.max_position_embeddings, num_blocks * cfg.block_size)
    runner = ModelRunner(model, num_blocks, cfg.block_size)
    tables = BlockTables(BlockPool(num_blocks, cfg.block_size))
    sched_cfg = SchedulerConfig(cfg.max_batch_tokens, cfg.max_running, max_model_len, on_prefilled)
    scheduler = Scheduler(tables, sched_cfg)
    return Engine(runner, tables, scheduler, Stepper(runner, scheduler), max_model_len)


def delta_of(seq: Sequence) -> TokenDelta:
    """The delta for a sequence that just got one token (and maybe finished)."""
    index = len(seq.output_ids) - 1
    return TokenDelta(
        seq.request_id, index, (seq.output_ids[-1],), (seq.output_logprobs[-1],), seq.finish_reason
    )


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
