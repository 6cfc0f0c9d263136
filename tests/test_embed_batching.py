"""The embedding batcher and the router's embedding core, without sockets: when batches leave, where
they go, and that no input is lost when workers fail."""

from __future__ import annotations

import pytest

from pdfabric.control import Abort, Embed, Embedded, EmbedResult, Heartbeat, Register
from pdfabric.profile import WorkerProfile
from pdfabric.router.dispatch.effects import Send
from pdfabric.router.dispatch.embedder import NO_WORKER, EmbedCore, EmbedDone
from pdfabric.router.routing.batcher import DEADLINE, FULL, IDLE, Batch, Batcher, Item, bucket
from pdfabric.router.routing.registry import Registry
from pdfabric.routing_config import EmbeddingConfig

KEY = ("", "last", True)


def _batcher(**config: object) -> Batcher:
    # compute: 1 ms per token
    return Batcher(EmbeddingConfig(margin_ms=10.0, **config), lambda key, tokens, n: tokens * 1e-3)


def _item(rid: str, tokens: int, arrived: float = 0.0, budget: float = 1.0, key: object = KEY) -> Item:
    return Item(rid, key, tokens, arrived, arrived + budget)


def test_a_batch_leaves_when_its_deadline_less_compute_and_margin_comes() -> None:
    b = _batcher()
    b.add(_item("a", 100, 0.0))
    b.add(_item("b", 100, 0.2))
    # due: 1.0 (a's deadline) - 0.2 s (200 tokens) - 0.01 = 0.79
    assert b.next_flush() == pytest.approx(0.79)
    assert b.flush(0.78) == []
    (batch,) = b.flush(0.79)
    assert [i.request_id for i in batch.items] == ["a", "b"] and batch.trigger == DEADLINE
    assert len(b) == 0 and b.next_flush() is None


def test_a_full_batch_leaves_at_once_and_the_rest_waits() -> None:
    b = _batcher(batch_tokens=250, length_buckets=False)
    for i in range(5):
        b.add(_item(f"r{i}", 100))
    full = b.flush(0.0)
    assert [[i.request_id for i in x.items] for x in full] == [["r0", "r1"], ["r2", "r3"]]
    assert {x.trigger for x in full} == {FULL}
    assert len(b) == 1 and "r4" in b
    b2 = _batcher(batch_inputs=3)
    for i in range(3):
        b2.add(_item(f"s{i}", 1))
    assert [x.trigger for x in b2.flush(0.0)] == [FULL]


def test_an_idle_worker_takes_what_waits_and_keys_stay_apart() -> None:
    b = _batcher()
    other = ("", "mean", True)
    b.add(_item("a", 10))
    b.add(_item("b", 10, key=other))
    (batch,) = b.flush(0.0, idle={other})
    assert batch.key == other and batch.trigger == IDLE and [i.request_id for i in batch.items] == ["b"]
    assert "a" in b and b.keys() == {KEY}


def test_length_buckets_keep_short_inputs_out_of_a_long_ones_batch() -> None:
    assert [bucket(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    b = _batcher()
    b.add(_item("long", 500))
    b.add(_item("short", 5))
    batches = b.flush(0.0, idle={KEY})
    assert sorted(len(x.items) for x in batches) == [1, 1]
    b = _batcher(length_buckets=False)
    b.add(_item("long", 500))
    b.add(_item("short", 5))
    assert [len(x.items) for x in b.flush(0.0, idle={KEY})] == [2]


def test_an_input_longer_than_the_budget_goes_alone_and_removed_inputs_never_leave() -> None:
    b = _batcher(batch_tokens=100)
    b.add(_item("huge", 400))
    b.add(_item("gone", 40))
    assert b.remove("gone") is not None and b.remove("gone") is None
    (batch,) = b.flush(0.0)
    assert [i.request_id for i in batch.items] == ["huge"] and batch.trigger == FULL
    with pytest.raises(ValueError, match="already"):
        b.add(_item("x", 1)) or b.add(_item("x", 1))


# --- the router's embedding core ---------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _register(registry: Registry, worker_id: str, kind: str = "prefill") -> None:
    registry.register(
        Register(worker_id, kind, "default", "m", 4096, 16, 256, "", 1, 8, 512, 0, WorkerProfile())
    )


def _sent(out: list) -> list[tuple[str, Embed]]:
    return [(e.worker_id, e.msg) for e in out if isinstance(e, Send) and isinstance(e.msg, Embed)]


def _core(*workers: str) -> tuple[EmbedCore, Registry, Clock]:
    registry, clock = Registry(), Clock()
    for w in workers:
        _register(registry, w)
    _register(registry, "decode-0", "decode")  # never gets embedding work
    return EmbedCore(registry, EmbeddingConfig(), clock, max_failovers=1), registry, clock


def test_inputs_go_to_an_idle_worker_and_come_back_with_their_timings() -> None:
    core, _, clock = _core("p0")
    out = core.submit("a", (1, 2, 3), "last", True, "", clock.now + 1.0)
    (batch,) = [e for e in out if isinstance(e, Batch)]
    assert batch.trigger == IDLE
    assert _sent(out) == [("p0", Embed("a", (1, 2, 3), "last", True))]
    out = core.submit("b", (4,), "last", True, "", clock.now + 1.0)  # p0 is busy with a: b waits
    assert _sent(out) == [] and len(core.batcher) == 1
    clock.now += 0.05
    out = core.on_result(Embedded("p0", (EmbedResult("a", b"\0" * 8, 0.02),)))
    (done,) = [e for e in out if isinstance(e, EmbedDone)]
    assert done.request_id == "a" and done.vector == b"\0" * 8 and not done.error
    assert done.batch_wait_s == 0.0 and done.compute_s == 0.02 and done.worker_wait_s == pytest.approx(0.03)
    assert _sent(out) == [("p0", Embed("b", (4,), "last", True))]  # p0 idle again: b leaves


def test_the_least_loaded_worker_gets_the_batch() -> None:
    core, registry, clock = _core("p0", "p1")
    hb = Heartbeat("p0", 5000, 0, 1, 256, 256, 0.0, 5000, 0.0, WorkerProfile())
    registry.heartbeat(hb)
    out = core.submit("a", (1,) * 8, "mean", False, "", clock.now + 1.0)
    assert [w for w, _ in _sent(out)] == ["p1"]


def test_a_dead_workers_inputs_move_and_late_replies_are_ignored() -> None:
    core, registry, clock = _core("p0", "p1")
    out = core.submit("a", (1, 2), "cls", True, "", clock.now + 1.0)
    ((first, _),) = _sent(out)
    registry.remove(first)
    out = core.worker_gone(first, "killed")
    ((second, msg),) = _sent(out)
    assert second != first and msg.request_id == "a~1"
    assert core.on_result(Embedded(first, (EmbedResult("a", b"x"),))) == []  # the failed attempt's
    (done,) = [
        e for e in core.on_result(Embedded(second, (EmbedResult("a~1", b"v"),))) if isinstance(e, EmbedDone)
    ]
    assert done.vector == b"v" and len(core) == 0


def test_failovers_run_out_and_errors_are_reported() -> None:
    core, registry, clock = _core("p0")
    out = core.submit("a", (1,), "last", True, "", clock.now + 1.0)
    out = core.on_result(Embedded("p0", (EmbedResult("a", error="p0 is draining"),)))
    ((_, msg),) = _sent(out)
    assert msg.request_id == "a~1"
    out = core.on_result(Embedded("p0", (EmbedResult("a~1", error="still draining"),)))
    (done,) = [e for e in out if isinstance(e, EmbedDone)]
    assert "still draining" in done.error and "after 1 failovers" in done.error and len(core) == 0
    registry.remove("p0")
    assert core.submit("b", (1,), "last", True, "", clock.now + 1.0) == [EmbedDone("b", error=NO_WORKER)]


def test_ending_an_input_aborts_it_where_it_runs_and_forgets_a_waiting_one() -> None:
    core, _, clock = _core("p0")
    core.submit("a", (1,), "last", True, "", clock.now + 5.0)
    core.submit("b", (2,), "last", True, "", clock.now + 5.0)  # waits: p0 runs a
    core.submit("c", (3,), "last", True, "", clock.now + 5.0)
    assert core.end("c") == [] and len(core.batcher) == 1  # it never left
    out = core.end("a")
    assert out[0] == Send("p0", Abort("a", "request ended"))
    assert _sent(out) == [("p0", Embed("b", (2,), "last", True))]  # p0 is free: b leaves
    assert core.end("b")[0] == Send("p0", Abort("b", "request ended"))
    assert len(core) == 0 and len(core.batcher) == 0
    assert core.on_result(Embedded("p0", (EmbedResult("a", b"v"),))) == []


def test_a_waiting_batch_leaves_at_its_deadline() -> None:
    core, registry, clock = _core("p0")
    core.submit("a", (1,), "last", True, "", clock.now + 5.0)  # p0 busy from here on
    core.submit("b", (2,) * 4, "last", True, "", clock.now + 0.5)
    due = core.next_deadline()
    assert due is not None and clock.now < due <= clock.now + 0.5
    clock.now = due
    out = core.poll()
    assert [m.request_id for _, m in _sent(out)] == ["b"]
    assert [e.trigger for e in out if isinstance(e, Batch)] == [DEADLINE]


def test_a_background_class_s_inputs_tell_the_worker_so() -> None:
    """A batch job's embedding inputs carry their class's priority and background flag to the worker,
    whose scheduler then computes them in short chunks (``SamplingParams.background``)."""
    core, _, clock = _core("p0")
    out = core.submit("a", (1, 2, 3), "last", True, "", clock.now + 1.0, priority=0, background=True)
    assert _sent(out) == [("p0", Embed("a", (1, 2, 3), "last", True, 0, True))]
