"""One simulated worker of ``bench.simulator``: the server's own worker core (``PrefillCore``,
``DecodeCore`` or ``ColocatedCore``, as ``kinds.table`` maps its kind) driven by simulated time
instead of sockets.

The core does everything the real worker decides (admission, scheduling, block accounting, the
messages it sends, heartbeat content); this driver only models time the way the real loop
(``pdfabric.worker.loop``) spends it:

1. messages are handled only between steps: KV-side events first (transfers that ended, blocks
   released), then control messages from the router;
2. a step runs if the core schedules one; it lasts ``profile.step_seconds`` of its shape, and its
   outputs leave at its end (the samples are token 0: the bench's requests ignore EOS). A worker that
   speculates (``SimWorker.acceptance``) proposes token 0s; each is kept with that probability until
   one is not (a seeded draw, so a run is deterministic), and with a draft model the step first
   spends ``draft_ratio`` decode steps per proposed token drafting;
3. a heartbeat goes out after a step once the core says it is due (a busy worker's waits for the
   step's end), and on time when idle.

Control messages go to the simulation's router (``Simulation.receive``); KV commands go to its link
model (``bench.sim_link``).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from pdfabric.bench.sim_link import SimLink, endpoint_of
from pdfabric.bench.sim_spec import SimWorker
from pdfabric.control import DECODE, Register
from pdfabric.engine.speculate import Wanted
from pdfabric.kinds.table import KINDS
from pdfabric.kvtransfer.state import TransferResult
from pdfabric.worker.core import Out, Step
from pdfabric.worker.kv import CancelKV, ExpectKV, PushKV
from pdfabric.worker.spec import FixedProfile


class Host(Protocol):
    """What a simulated worker needs of its simulation (``bench.simulator.Simulation``): the clock, the
    event queue, the router's inbox and the KV link."""

    now: float
    link: SimLink

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None, work: bool = True) -> None: ...

    def receive(self, msg: object) -> None: ...


class SimulatedWorker:
    """One worker's loop: messages between steps, then a step of ``profile.step_seconds`` if it has work."""

    def __init__(self, sim: Host, spec: SimWorker) -> None:
        self.sim = sim
        self.spec = spec
        endpoint = endpoint_of(spec.worker_id) if spec.kind == DECODE else ""
        core, proposer = spec.core, None
        if spec.speculates:  # its tokens are not real: proposals and what is kept are modelled
            core = replace(core, config=replace(core.config, speculative="ngram"))  # with this proposer
            proposer = _Zeros(spec.core.config.speculative == "draft")
        else:
            core = replace(core, config=replace(core.config, speculative="off"))
        self.core = KINDS[spec.kind].core(core, FixedProfile(spec.profile), endpoint, proposer)
        self._drafts = spec.draft_ratio if spec.core.config.speculative == "draft" else 0.0
        self._kept = random.Random(zlib.crc32(spec.worker_id.encode()))  # what each check keeps
        self.scheduler, self.tables = self.core.scheduler, self.core.tables
        self.busy = False  # a step is running
        self._wake = False  # a boundary is queued for an idle worker
        self._control: list[object] = []
        self._kv: list[TransferResult | str] = []  # ended transfers, and released request ids
        self._step: Step | None = None
        self._drafting = 0.0  # the running step's drafting time
        self._hb_armed: float | None = 0.0

    def registration(self) -> Register:
        return self.core.registration()

    # --- messages -------------------------------------------------------------------------------

    def post(self, msg: object) -> None:
        """A control message from the router, handled at the next step boundary."""
        self._control.append(msg)
        self._poke()

    def post_kv(self, event: TransferResult | str) -> None:
        """A transfer that ended, or a request whose blocks the KV side released (handled first)."""
        self._kv.append(event)
        self._poke()

    def _poke(self) -> None:
        if not self.busy and not self._wake:
            self._wake = True
            self.sim.at(self.sim.now, self._woken)  # after everything else arriving at this instant

    def _woken(self, _: object) -> None:
        self._wake = False
        if not self.busy:
            self._boundary()

    def _boundary(self) -> None:
        """The top of the real loop: KV events, control messages, then a step if there is work."""
        core = self.core
        while self._kv or self._control:
            events, self._kv = self._kv, []
            for event in events:
                if isinstance(event, str):
                    self._emit(core.kv_released(event))
                else:
                    self.sim.link.landed(self, event)
                    self._emit(core.transfer_ended(event))
            control, self._control = self._control, []
            for msg in control:
                self._emit(core.handle(msg))
        self._start_step()

    def _emit(self, out: Out) -> None:
        for msg in out:
            if isinstance(msg, PushKV | ExpectKV | CancelKV):
                self.sim.link.command(self, msg)
            else:
                self.sim.at(self.sim.now, self.sim.receive, msg)

    # --- steps ----------------------------------------------------------------------------------

    def _start_step(self) -> None:
        step = self.core.schedule()
        if step is None:  # idle, or waiting for blocks: the next message wakes it
            self._idle()
            return
        self.busy, self._step = True, step
        self._drafting = self._draft_seconds(step)
        seconds = self.spec.profile.step_seconds(step.shape)
        self.sim.at(self.sim.now + self._drafting + seconds, self._step_end, self.sim.now)

    def _draft_seconds(self, step: Step) -> float:
        """A draft model's time for the step's proposals: one draft step of every proposing sequence
        per token of the longest proposal, each ``draft_ratio`` of a plain decode step."""
        proposing = [c for c in step.chunks if c.proposal]
        if not proposing or not self._drafts:
            return 0.0
        batch, context = len(proposing), sum(c.stop for c in proposing)
        k = max(len(c.proposal) for c in proposing)
        return k * self._drafts * self.spec.profile.decode_step_seconds(batch, context)

    def _samples(self, step: Step) -> list:
        """Token 0 for each chunk that samples; for a checked proposal, the tokens kept and the one
        after them."""
        out: list = []
        for chunk in step.chunks:
            if chunk.proposal:
                kept = 0
                while kept < len(chunk.proposal) and self._kept.random() < self.spec.acceptance:
                    kept += 1
                out.append([(0, 0.0)] * (kept + 1))
            elif chunk.sample:
                out.append((0, 0.0))
        return out

    def _step_end(self, started: float) -> None:
        step, self._step, self.busy = self._step, None, False
        assert step is not None
        seconds = self.sim.now - started - self._drafting
        self._emit(self.core.complete(step, self._samples(step), seconds, drafting=self._drafting))
        self._heartbeat()
        self._boundary()

    # --- heartbeats -----------------------------------------------------------------------------

    def _idle(self) -> None:
        due = self.core.next_heartbeat
        if self._hb_armed != due:
            self._hb_armed = due
            self.sim.at(max(due, self.sim.now), self.heartbeat_timer, due, work=False)

    def heartbeat_timer(self, due: float) -> None:
        if self._hb_armed == due:
            self._hb_armed = None
        if self.busy or due != self.core.next_heartbeat:
            return
        self._heartbeat()
        self._idle()

    def _heartbeat(self) -> None:
        hb = self.core.heartbeat(self.sim.now)
        if hb is not None:
            self.sim.at(self.sim.now, self.sim.receive, hb)


class _Zeros:
    """The simulated proposer: token 0, as many as asked (what is kept is drawn at the step's end);
    ``runs_model`` for a simulated draft model (its sequences back off after misses)."""

    def __init__(self, runs_model: bool) -> None:
        self.runs_model = runs_model

    def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]:
        return [(0,) * k for _, _, k in wanted]
