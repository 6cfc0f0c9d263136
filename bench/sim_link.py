"""The simulator's KV side: what a worker core's ``PushKV`` / ``ExpectKV`` / ``CancelKV`` cost in time.

The server hands these commands to the kvtransfer state machines; the simulation hands them here.
A push, as the server's sender and receiver would carry it:

1. it starts when the core asks (at the end of the step that finished the prompt; the server starts
   it during that step, layer by layer, so the model is pessimistic by up to that overlap) and takes
   its bytes over the slower end's ``kv_bytes_per_s``, one push at a time on each worker's link;
2. the decode worker takes the KV (and the first token) at its next step boundary, like the
   receiver's ``poll`` at the top of its loop, and acknowledges it to the sender;
3. the prefill worker handles the acknowledgement at its own next boundary: its result's seconds run
   from the push to that acknowledgement, which is what its heartbeat's KV rate is made of.

A decode worker's cancel releases its blocks at once (nothing here can still write into them);
expecting a transfer and a prefill worker's cancel need nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pdfabric.bench.sim_spec import SimWorker
from pdfabric.control import DECODE
from pdfabric.kvtransfer.state import TransferResult, TransferState
from pdfabric.worker.kv import CancelKV, ExpectKV, PushKV, kv_meta

SIM_TRANSPORT = "sim"  # the transport name simulated pushes report (rates per transport in heartbeats)
At = Callable[[float, Callable[[Any], None], Any], None]  # the simulation's event scheduler


class LinkedWorker(Protocol):
    """What the link needs of a simulated worker (``bench.sim_worker.SimulatedWorker``): its spec, and
    a way to hand it a KV event at its next step boundary."""

    spec: SimWorker

    def post_kv(self, event: object) -> None: ...


def endpoint_of(worker_id: str) -> str:
    """A simulated decode worker's KV endpoint."""
    return f"sim://{worker_id}"


class SimLink:
    """Every worker's KV link in one simulation."""

    def __init__(self, workers: dict[str, LinkedWorker], clock: Callable[[], float], at: At) -> None:
        self._clock, self._at = clock, at
        self._free = dict.fromkeys(workers, 0.0)  # when each worker's link is next free
        self._by_endpoint = {endpoint_of(wid): w for wid, w in workers.items()}
        self._pushes: dict[str, tuple[LinkedWorker, float]] = {}  # request -> (prefill worker, start)

    def command(self, worker: LinkedWorker, cmd: PushKV | ExpectKV | CancelKV) -> None:
        now = self._clock()
        if isinstance(cmd, PushKV):
            decode = self._by_endpoint[cmd.endpoint]
            spec = worker.spec
            nbytes = len(cmd.local_blocks) * spec.core.config.block_size * spec.core.kv_bytes_per_token
            rate = min(spec.kv_bytes_per_s, decode.spec.kv_bytes_per_s)
            pid, did = spec.worker_id, decode.spec.worker_id
            done = max(now, self._free[pid], self._free[did]) + nbytes / rate
            self._free[pid] = self._free[did] = done
            self._pushes[cmd.request_id] = (worker, now)
            meta = kv_meta(cmd)
            result = TransferResult(cmd.request_id, TransferState.DONE, "", nbytes, done - now,
                                    meta=meta, transport=SIM_TRANSPORT)  # fmt: skip
            self._at(done, decode.post_kv, result)
        elif isinstance(cmd, CancelKV) and worker.spec.kind == DECODE:
            worker.post_kv(cmd.request_id)

    def landed(self, worker: LinkedWorker, result: TransferResult) -> None:
        """A decode worker took a push's KV at its boundary: the acknowledgement goes to the sender."""
        push = self._pushes.pop(result.request_id, None) if worker.spec.kind == DECODE else None
        if push is not None:
            prefill, started = push
            now = self._clock()
            ack = TransferResult(result.request_id, TransferState.DONE, "", result.nbytes, now - started,
                                 transport=result.transport)  # fmt: skip
            self._at(now, prefill.post_kv, ack)
