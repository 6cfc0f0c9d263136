"""One simulated worker of ``bench.simulator``: the engine's own ``Scheduler`` over its own
``BlockTables``, stepping for ``profile.step_seconds`` of each step's shape.

It follows the real worker loop: messages are handled only between steps (KV arrivals and
acknowledgements first, then control messages), a step runs if there is work, tokens leave at the
step's end, and a heartbeat goes out after a step once it is due (on time when idle).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import TYPE_CHECKING, Any

from pdfabric.control import DECODE, PREFILL, Heartbeat, Register
from pdfabric.engine.block_pool import BlockPool, BlockTables
from pdfabric.engine.scheduler import Chunk, Scheduler, SchedulerConfig, step_shape
from pdfabric.engine.sequence import SeqState, Sequence

if TYPE_CHECKING:
    from pdfabric.bench.simulator import SimulatedRequest, Simulation, SimWorker

_PROMPTS: dict[int, tuple[int, ...]] = {}


def _prompt(n: int) -> tuple[int, ...]:
    """A prompt of ``n`` tokens (the ids do not matter to the scheduler; one tuple per length)."""
    ids = _PROMPTS.get(n)
    if ids is None:
        ids = _PROMPTS[n] = (0,) * n
    return ids


class SimulatedWorker:
    """One worker's loop: messages between steps, then a step of ``profile.step_seconds`` if it has work."""

    def __init__(self, sim: Simulation, spec: SimWorker) -> None:
        self.sim = sim
        self.spec = spec
        self.tables = BlockTables(BlockPool(spec.num_blocks, spec.block_size))
        on_prefilled = "handoff" if spec.kind == PREFILL else "decode"
        cfg = SchedulerConfig(spec.max_batch_tokens, spec.max_running, spec.max_model_len, on_prefilled)
        self.scheduler = Scheduler(self.tables, cfg)
        self.heartbeat_s = spec.heartbeat_s or sim.config.heartbeat_s
        self.busy = False  # a step is running
        self._wake = False  # a boundary is queued for an idle worker
        self._control: list[tuple[Any, ...]] = []
        self._transfers: list[tuple[Any, ...]] = []
        self._chunks: list[Chunk] = []
        self._sampled: list[tuple[int, float]] = []
        self._block_bytes = spec.block_size * spec.kv_bytes_per_token
        self._targets: dict[str, str] = {}  # prefill worker: request -> its decode worker
        self._reqs: dict[str, SimulatedRequest] = {}
        self._next_hb = 0.0
        self._hb_armed: float | None = 0.0
        self._recent_ms: deque[float] = deque(maxlen=32)

    def registration(self) -> Register:
        s = self.spec
        endpoint = f"sim://{s.worker_id}" if s.kind == DECODE else ""
        return Register(
            s.worker_id,
            s.kind,
            s.pool,
            "simulated",
            s.max_model_len,
            s.block_size,
            s.num_blocks,
            endpoint,
            0,
            s.max_running,
            s.max_batch_tokens,
            s.kv_bytes_per_token,
            s.profile,
        )

    # --- messages -------------------------------------------------------------------------------

    def post(self, msg: tuple[Any, ...]) -> None:
        """A control message from the router, handled at the next step boundary."""
        self._control.append(msg)
        self._poke()

    def post_transfer(self, msg: tuple[Any, ...]) -> None:
        """A KV arrival or acknowledgement, handled at the next step boundary before control messages."""
        self._transfers.append(msg)
        self._poke()

    def _poke(self) -> None:
        if not self.busy and not self._wake:
            self._wake = True
            self.sim.at(self.sim.now, self._woken)  # after everything else arriving at this instant

    def _woken(self, _: Any) -> None:
        self._wake = False
        if not self.busy:
            self._boundary()

    def _boundary(self) -> None:
        """The top of the real loop: transfers, control messages, then a step if there is work."""
        while self._transfers or self._control:
            transfers, self._transfers = self._transfers, []
            for msg in transfers:
                self._transfer(msg)
            control, self._control = self._control, []
            for msg in control:
                self._handle(msg)
        self._step()

    def _transfer(self, msg: tuple[Any, ...]) -> None:
        sim, req = self.sim, msg[1]
        if msg[0] == "kv":  # decode side: the prompt's KV (and its first token) is in
            seq = self.scheduler.kv_arrived(req.rid, 0, 0.0)
            if seq is not None and seq.finish_reason is not None:  # the first token ended it
                del self._reqs[req.rid]
                sim.token(req, self.spec.worker_id, False, seq.finish_reason)
            sim.at(sim.now, sim.workers[msg[2]].post_transfer, ("ack", req))
        else:  # prefill side: the decode worker has the blocks
            self._targets.pop(req.rid, None)
            self._reqs.pop(req.rid, None)
            if self.scheduler.finish(req.rid, "handed_off") is not None:
                sim.at(sim.now, sim.handed_off, (req, self.spec.worker_id))

    def _handle(self, msg: tuple[Any, ...]) -> None:
        sim, kind, req = self.sim, msg[0], msg[1]
        rid, prompt_len = req.rid, req.request.input_len
        if kind == "abort":
            self._targets.pop(rid, None)
            self._reqs.pop(rid, None)
            self.scheduler.finish(rid, "abort")
            return
        seq = Sequence(rid, _prompt(prompt_len), req.params)
        if kind == "reserve":
            ok = prompt_len < self.spec.max_model_len and self.scheduler.reserve(seq) is not None
            if ok:
                self._reqs[rid] = req
            sim.at(sim.now, sim.reserved, (req, ok))
            return
        if prompt_len >= self.spec.max_model_len:  # ``Worker.fits``: an error delta
            sim.token(req, self.spec.worker_id, False, "error")
            return
        if kind == "prefill":
            self._targets[rid] = msg[2]
        self._reqs[rid] = req
        self.scheduler.add(seq)

    # --- steps ----------------------------------------------------------------------------------

    def _step(self) -> None:
        chunks = self.scheduler.schedule() if self.scheduler.has_work else []
        if not chunks:  # idle, or waiting for blocks: the next message wakes it
            self._idle()
            return
        self.busy = True
        self._chunks = chunks
        sampled = sum(1 for c in chunks if c.seq.state is SeqState.RUNNING or c.sample)
        self._sampled = [(0, 0.0)] * sampled
        seconds = self.spec.profile.step_seconds(step_shape(chunks))
        self._recent_ms.append(seconds * 1e3)
        self.sim.at(self.sim.now + seconds, self._step_end)

    def _step_end(self, _: Any) -> None:
        sim, chunks = self.sim, self._chunks
        self.busy, self._chunks = False, []
        wid, token = self.spec.worker_id, sim.token
        for seq in self.scheduler.complete(chunks, self._sampled):
            req = self._reqs[seq.request_id]
            if seq.state is SeqState.HANDOFF:  # first token to the router, KV to the decode worker
                token(req, wid, True, None)
                blocks = len(self.tables.table(seq.request_id))
                sim.push_kv(self, req, self._targets[seq.request_id], blocks * self._block_bytes)
                continue
            token(req, wid, True, seq.finish_reason)
            if seq.state is SeqState.FINISHED:
                del self._reqs[seq.request_id]
        if sim.now >= self._next_hb:
            self._heartbeat()
        self._boundary()

    # --- heartbeats -----------------------------------------------------------------------------

    def _idle(self) -> None:
        if self._hb_armed != self._next_hb:
            self._hb_armed = self._next_hb
            self.sim.at(max(self._next_hb, self.sim.now), self.heartbeat_timer, self._next_hb, work=False)

    def heartbeat_timer(self, due: float) -> None:
        if self._hb_armed == due:
            self._hb_armed = None
        if self.busy or due != self._next_hb:
            return
        self._heartbeat()
        self._idle()

    def _heartbeat(self) -> None:
        sim, s = self.sim, self.scheduler
        self._next_hb = sim.now + self.heartbeat_s
        pool = self.tables.pool
        step_ms = statistics.median(self._recent_ms) if self._recent_ms else 0.0
        hb = Heartbeat(
            self.spec.worker_id,
            s.queued_tokens,
            len(s.running),
            len(s.waiting) + len(s.awaiting_kv),
            pool.num_free,
            pool.num_blocks,
            step_ms,
            s.context_tokens,
            0.0,
            self.spec.profile,
        )
        sim.at(sim.now, sim.heartbeat, hb)
