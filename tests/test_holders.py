"""Who holds a request in the router: ``Holders`` alone (no sockets), then the dispatcher over it with
scripted workers on loopback: a cancelled or ended request sends ``Abort`` to every worker holding
it, a dead worker fails exactly the requests it held, and nothing is left held afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import zmq
import zmq.asyncio

from pdfabric.control import (
    Abort,
    Generate,
    HandedOff,
    Heartbeat,
    Prefill,
    Register,
    Reserve,
    Reserved,
    Shutdown,
    StepOutputs,
    TokenDelta,
)
from pdfabric.profile import WorkerProfile
from pdfabric.router.dispatch.dispatcher import Dispatcher
from pdfabric.router.dispatch.stream import RequestStream
from pdfabric.router.routing.holders import Holders
from pdfabric.router.routing.slo import resolve
from pdfabric.routing_config import AdmissionConfig
from pdfabric.sampling_params import SamplingParams
from pdfabric.wire import decode, encode

# --- Holders alone ------------------------------------------------------------------------------


def test_hold_done_and_end_release_each_worker_once() -> None:
    h: Holders[str] = Holders()
    h.hold("r", "p")
    h.hold("r", "d")
    h.hold("s", "d")
    assert h.holders("r") == {"p", "d"} and h.count("d") == 2
    assert h.done("r", "p") and not h.done("r", "p")  # a second hand-off is not a second release
    assert h.end("r") == ("d",)  # only the worker still holding it is owed an Abort
    assert h.end("r") == ()  # ending twice releases nothing twice
    assert h.count("d") == 1 and h.count("p") == 0 and "r" not in h
    assert h.end("s") == ("d",) and len(h) == 0 and h.count("d") == 0


def test_a_reservation_holds_the_request_until_replied_or_ended() -> None:
    h: Holders[str] = Holders()
    h.reserving("r", "d", "waiter")
    assert h.holders("r") == {"d"}
    assert h.replied("r", "d") == "waiter" and h.replied("r", "d") is None  # handed back once
    assert h.holders("r") == {"d"}  # granted blocks: still held
    h.reserving("q", "d", "late")
    assert h.end("q") == ("d",)  # ended while waiting: its blocks may be taken, so it gets an Abort
    assert h.replied("q", "d") is None  # the reply that comes after finds nothing waiting


def test_a_dead_worker_fails_what_it_held_and_answers_its_reservations() -> None:
    h: Holders[str] = Holders()
    h.hold("a", "p")
    h.hold("a", "d")
    h.reserving("b", "d", "waiter-b")
    h.hold("c", "x")
    h.routed("a", 10, ["p", "d"])
    assert h.awaiting("b", "d") == "waiter-b" and h.awaiting("a", "d") is None
    failed, waiting = h.worker_gone("d")
    assert failed == ("a",) and waiting == ("b",)  # b tries its next route; a fails
    assert h.holders("a") == {"p"} and h.holders("b") == frozenset() and h.count("d") == 0
    assert list(h.pending("d")) == [] and list(h.pending("p")) == [10]
    assert h.worker_gone("d") == ((), ())
    assert h.end("a") == ("p",) and h.end("b") == () and h.end("c") == ("x",) and len(h) == 0


def test_pending_load_moves_with_the_route_and_is_spent_by_heartbeats() -> None:
    h: Holders[str] = Holders()
    h.routed("r", 20, ["p0", "d0"])
    h.routed("s", 30, ["p0", "d0"])
    h.routed("r", 20, ["p1", "d0"])  # tried a second route: pending only there
    assert sorted(h.pending("p0")) == [30] and sorted(h.pending("d0")) == [20, 30]
    assert list(h.pending("p1")) == [20]
    h.sent("r", "d0")
    h.sent("s", "d0")
    h.heartbeat("d0", 2)
    assert list(h.pending("d0")) == [] and list(h.pending("p1")) == [20]
    h.unrouted("r")
    assert list(h.pending("p1")) == []


def test_a_heartbeat_spends_only_the_work_it_had_taken_in() -> None:
    """Heartbeats and work cross on the wire: a report written before a message arrived at the worker
    leaves that message's load pending, also when the route is confirmed after the report."""
    h: Holders[str] = Holders()
    h.routed("a", 10, ["c"])
    h.routed("b", 20, ["c"])
    h.routed("z", 40, ["c"])  # admitted, not sent yet (a reservation elsewhere comes first)
    h.sent("a", "c")
    h.sent("b", "c")
    h.heartbeat("c", 0)  # written before either arrived
    assert sorted(h.pending("c")) == [10, 20, 40]
    h.heartbeat("c", 1)
    assert sorted(h.pending("c")) == [20, 40]
    h.sent("y", "w")
    h.heartbeat("w", 1)
    h.routed("y", 5, ["w"])  # routed once its report counted it: no pending load
    assert list(h.pending("w")) == []
    h.heartbeat("c", 2)
    assert list(h.pending("c")) == [40]  # never sent: pending until it is, or until it ends
    h.end("z")
    assert list(h.pending("c")) == []
    h.worker_gone("c")  # a new process under the id numbers its messages from 1 again
    h.routed("n", 7, ["c"])
    h.sent("n", "c")
    h.heartbeat("c", 0)
    assert list(h.pending("c")) == [7]


# --- the dispatcher over Holders, with scripted workers ------------------------------------------

PROFILE = WorkerProfile(prefill=(2e-3, 4e-5, 0.0), decode=(5e-3, 1e-3, 0.0))
PARAMS = SamplingParams(max_tokens=4)


class FakeWorker:
    """A worker's control socket whose answers the test scripts; it records every message."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, worker_id: str, kind: str) -> None:
        self.worker_id, self.kind = worker_id, kind
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.got: list[object] = []
        self.on_reserve: Callable[[Reserve], Reserved | None] = lambda m: Reserved(
            self.worker_id, m.request_id, (1, 2)
        )

    async def start(self) -> None:
        endpoint = "tcp://127.0.0.1:1" if self.kind == "decode" else ""
        self.send(Register(self.worker_id, self.kind, "default", "tiny", 4096, 16, 64, endpoint, 1, 8, 512,
                           1000, PROFILE))  # fmt: skip
        self.send(Heartbeat(self.worker_id, 0, 0, 0, 64, 64, 1.0, 0, 1e9, PROFILE))

    def send(self, msg: object) -> None:
        self.sock.send(encode(msg))

    async def run(self) -> None:
        while True:
            msg = decode(await self.sock.recv())
            self.got.append(msg)
            if isinstance(msg, Reserve):
                reply = self.on_reserve(msg)
                if reply is not None:
                    self.send(reply)

    def aborted(self) -> list[str]:
        return [m.request_id for m in self.got if isinstance(m, Abort)]

    def delta(self, rid: str, index: int, finish: str | None = None) -> None:
        self.send(StepOutputs(self.worker_id, (TokenDelta(rid, index, (7,), (0.0,), finish),)))


@asynccontextmanager
async def fabric(*kinds: tuple[str, str]) -> AsyncIterator[tuple[Dispatcher, dict[str, FakeWorker]]]:
    dispatcher = Dispatcher("tcp://127.0.0.1:0", worker_timeout_s=30.0, reserve_timeout_s=5.0)
    await dispatcher.start()
    ctx = zmq.asyncio.Context()
    workers = {wid: FakeWorker(ctx, dispatcher.address, wid, kind) for wid, kind in kinds}
    tasks = [asyncio.create_task(w.run()) for w in workers.values()]
    try:
        for w in workers.values():
            await w.start()
        await until(lambda: len(dispatcher.fleet.workers) == len(workers))
        yield dispatcher, workers
    finally:
        await dispatcher.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in workers.values():
            w.sock.close()
        ctx.term()


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def submit(dispatcher: Dispatcher, rid: str) -> RequestStream:
    resolved = resolve(AdmissionConfig(), None, "default")
    return await dispatcher.submit(rid, (1, 2, 3), PARAMS, (0,), resolved)


def terminals(stream: RequestStream) -> list[TokenDelta]:
    out = []
    while not stream.queue.empty():
        d = stream.queue.get_nowait()
        if d.finish_reason is not None:
            out.append(d)
    return out


def test_ended_requests_abort_every_holder_and_nothing_stays_held() -> None:
    async def scenario() -> None:
        async with fabric(("p", "prefill"), ("d", "decode")) as (dispatcher, w):
            # 1. A client gone mid-stream: the prefill and the decode worker both get an Abort.
            await submit(dispatcher, "gone")
            await until(lambda: any(isinstance(m, Prefill) for m in w["p"].got))
            assert dispatcher.fleet.holders_of("gone") == {"p", "d"}
            dispatcher.release("gone", "request ended")
            await until(lambda: "gone" in w["p"].aborted() and "gone" in w["d"].aborted())
            # 2. A finished request: the prefill worker handed off, the decode worker finished; no Abort.
            stream = await submit(dispatcher, "done")
            w["p"].delta("done", 0)
            w["p"].send(HandedOff("p", "done"))
            w["d"].delta("done", 1, "length")
            await until(lambda: dispatcher.fleet.holders_of("done") == frozenset())
            assert [d.finish_reason for d in terminals(stream)] == ["length"]
            dispatcher.release("done", "request ended")
            await asyncio.sleep(0.05)
            assert "done" not in w["p"].aborted() + w["d"].aborted()
            assert dispatcher.fleet.held == 0 and dispatcher.streams == {}

    asyncio.run(scenario())


def test_a_client_gone_while_blocks_are_reserved_aborts_the_decode_worker() -> None:
    async def scenario() -> None:
        async with fabric(("p", "prefill"), ("d", "decode")) as (dispatcher, w):
            w["d"].on_reserve = lambda m: None  # the reply is slow: the client leaves first
            task = asyncio.create_task(submit(dispatcher, "r"))
            await until(lambda: any(isinstance(m, Reserve) for m in w["d"].got))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: "r" in w["d"].aborted())
            assert "r" not in w["p"].aborted() and not any(isinstance(m, Prefill) for m in w["p"].got)
            w["d"].send(Reserved("d", "r", (5, 6)))  # the late reply's blocks are given back too
            await until(lambda: w["d"].aborted().count("r") == 2)
            assert dispatcher.fleet.held == 0 and dispatcher.streams == {}

    asyncio.run(scenario())


def test_a_dead_worker_fails_its_requests_once_and_reservations_fail_over() -> None:
    async def scenario() -> None:
        async with fabric(("p", "prefill"), ("d0", "decode"), ("d1", "decode")) as (dispatcher, w):
            w["d0"].on_reserve = w["d1"].on_reserve = lambda m: None  # both sit on their replies
            task = asyncio.create_task(submit(dispatcher, "r"))
            await until(lambda: any(isinstance(m, Reserve) for x in ("d0", "d1") for m in w[x].got))
            first = "d0" if any(isinstance(m, Reserve) for m in w["d0"].got) else "d1"
            second = "d1" if first == "d0" else "d0"
            w[second].on_reserve = lambda m: Reserved(second, m.request_id, (3,))
            dispatcher.worker_gone(first, "test")  # its reservation fails over to the other pair
            stream = await asyncio.wait_for(task, 5)
            assert dispatcher.fleet.holders_of("r") == {"p", second} and stream.route == f"p->{second}"
            dispatcher.worker_gone("p", "test")
            dispatcher.worker_gone("p", "test again")
            [end] = terminals(stream)
            assert end.finish_reason == "error" and "worker p failed" in end.error
            dispatcher.release("r", "request ended")
            await until(lambda: "r" in w[second].aborted())
            assert dispatcher.fleet.held == 0
            assert not any(isinstance(m, Generate | Shutdown) for m in w["p"].got)

    asyncio.run(scenario())
