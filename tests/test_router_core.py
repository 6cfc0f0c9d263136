"""The router's core without sockets or processes: calls and worker messages in, effects out
(admission, the route walk, reservations and their timeouts, token order, dead workers, ends)."""

from __future__ import annotations

import pytest

from pdfabric.control import (
    Abort,
    Generate,
    HandedOff,
    Heartbeat,
    Prefill,
    Register,
    Reregister,
    Reserve,
    Reserved,
    StepOutputs,
    TokenDelta,
)
from pdfabric.profile import WorkerProfile
from pdfabric.router.dispatch.core import RouterCore
from pdfabric.router.dispatch.effects import Deliver, FailedOver, Refused, Send, Started, Transferred
from pdfabric.router.routing.routes import Budgets
from pdfabric.routing_config import AdmissionConfig, SloClass
from pdfabric.sampling_params import SamplingParams

PROFILE = WorkerProfile(prefill=(2e-3, 4e-5, 0.0), decode=(5e-3, 1e-3, 0.0))
PARAMS = SamplingParams(max_tokens=4)
LOOSE = Budgets(5000, 100)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def core_with(*workers: tuple[str, str], max_running: int = 64, **kw: object) -> tuple[RouterCore, Clock]:
    clock = Clock()
    core = RouterCore(clock=clock, **kw)  # type: ignore[arg-type]
    for wid, kind in workers:
        endpoint = f"kv://{wid}" if kind == "decode" else ""
        reg = Register(
            wid, kind, "default", "tiny", 4096, 16, 100, endpoint, 1, max_running, 512, 1000, PROFILE
        )
        assert core.on_message(reg) == []
    return core, clock


def heartbeat(wid: str, running: int = 0, received: int = 1 << 30) -> Heartbeat:
    """A report that counts every work message sent so far, unless ``received`` says otherwise."""
    return Heartbeat(wid, 0, running, 0, 100, 100, 1.0, 0, 2e9, PROFILE, received=received)


def submit(core: RouterCore, rid: str, budgets: Budgets = LOOSE, prompt: int = 20) -> list[object]:
    return list(core.submit(rid, (1,) * prompt, PARAMS, (0,), "default", "interactive", budgets))


def delta(wid: str, rid: str, index: int, n: int = 1, finish: str | None = None) -> StepOutputs:
    return StepOutputs(wid, (TokenDelta(rid, index, (7,) * n, (0.0,) * n, finish),))


def sends(effects: list[object]) -> list[tuple[str, type]]:
    return [(e.worker_id, type(e.msg)) for e in effects if isinstance(e, Send)]


def test_admission_refuses_the_impossible_and_starts_waiting_requests_as_room_opens() -> None:
    cfg = AdmissionConfig(classes=(SloClass("interactive", priority=1, max_wait_ms=5000),))
    core, clock = core_with(("c", "colocated"), max_running=1, admission=cfg)
    [refused] = submit(core, "impossible", Budgets(0.01, 100))
    assert isinstance(refused, Refused) and refused.status == 429
    assert refused.outcome is not None and refused.outcome.reason == "ttft_unreachable"
    assert "impossible" not in core
    first = submit(core, "a")
    assert sends(first) == [("c", Generate)] and isinstance(first[1], Started) and first[1].route == "c"
    assert submit(core, "b") == [] and len(core.routing.queue) == 1  # a batch of 1 is full: b waits
    assert submit(core, "gone") == []
    assert core.end("gone") == [] and len(core.routing.queue) == 1  # its client left while it waited
    out = core.on_message(delta("c", "a", 0, 4, "length"))
    assert [type(e) for e in out] == [Deliver]  # still counted on the worker until its handler ends it
    clock.now = 0.5
    out = core.end("a")  # its load is gone: b takes the batch; nobody holds a, nobody is owed an Abort
    assert sends(out) == [("c", Generate)]
    [started] = [e for e in out if isinstance(e, Started)]
    assert started.request_id == "b" and started.waited_ms == pytest.approx(500)
    assert core.next_deadline() is None


def test_a_waiting_request_is_refused_at_its_deadline() -> None:
    cfg = AdmissionConfig(classes=(SloClass("interactive", priority=1, max_wait_ms=2000),))
    core, clock = core_with(("c", "colocated"), max_running=1, admission=cfg)
    submit(core, "a")
    assert submit(core, "b") == []
    deadline = core.next_deadline()
    assert deadline is not None and 2.0 < deadline < 2.01
    clock.now = deadline
    [refused] = core.poll()
    assert isinstance(refused, Refused) and refused.status == 429 and refused.outcome is not None
    assert refused.outcome.reason == "deadline" and "b" not in core


def test_a_pair_reserves_then_prefills_and_deltas_come_out_in_order_once() -> None:
    core, _ = core_with(("p", "prefill"), ("d", "decode"))
    assert sends(submit(core, "r")) == [("d", Reserve)]
    assert core.holders.holders("r") == {"d"}
    out = core.on_message(Reserved("d", "r", (3, 4)))
    [(worker, msg)] = [(e.worker_id, e.msg) for e in out if isinstance(e, Send)]
    assert worker == "p" and isinstance(msg, Prefill)
    assert msg.kv_endpoint == "kv://d" and msg.block_ids == (3, 4)
    assert isinstance(out[-1], Started) and out[-1].route == "p->d"
    assert core.on_message(delta("d", "r", 1)) == []  # early: held back until index 0 is out
    out = core.on_message(delta("p", "r", 0))
    assert [e.delta.index for e in out if isinstance(e, Deliver)] == [0, 1]
    assert core.on_message(delta("d", "r", 1)) == []  # a duplicate is not delivered twice
    [moved] = core.on_message(HandedOff("p", "r", 1000, 0.01))
    assert isinstance(moved, Transferred) and moved.msg.kv_seconds == 0.01
    assert core.holders.holders("r") == {"d"}
    out = core.on_message(delta("d", "r", 2, 2, "length"))
    assert [e.delta.finish_reason for e in out if isinstance(e, Deliver)] == ["length"]
    assert core.on_message(delta("d", "r", 4, 1, "length")) == []  # nothing after the last
    assert core.holders.holders("r") == frozenset() and core.end("r") == []
    assert len(core) == 0 and len(core.holders) == 0


def test_a_decode_workers_finish_overtaking_the_prefill_workers_first_token_still_ends_the_stream() -> None:
    """Two workers' messages keep no order between them: the decode worker's tokens and finish can
    reach the router before the prefill worker's first token, which must then complete the stream."""
    core, _ = core_with(("p", "prefill"), ("d", "decode"))
    submit(core, "r")
    core.on_message(Reserved("d", "r", (3, 4)))
    assert core.on_message(delta("d", "r", 1, 2)) == []
    assert core.on_message(delta("d", "r", 3, 1, "length")) == []  # held: index 0 is not out yet
    assert core.holders.holders("r") == {"p"}  # the decode worker is done with it
    out = core.on_message(delta("p", "r", 0))
    delivered = [e.delta for e in out if isinstance(e, Deliver)]
    assert [d.index for d in delivered] == [0, 1, 3] and delivered[-1].finish_reason == "length"
    core.on_message(HandedOff("p", "r", 1000, 0.01))
    assert core.holders.holders("r") == frozenset() and core.end("r") == []


def test_an_attempt_every_worker_let_go_of_with_tokens_missing_moves_on_from_what_was_delivered() -> None:
    """A first token lost on the way (no worker holds the request, the client misses index 0): the
    request fails over at once instead of waiting out its timeout."""
    core, _ = core_with(("p", "prefill"), ("d", "decode"))
    submit(core, "r")
    core.on_message(Reserved("d", "r", (3, 4)))
    assert core.on_message(delta("d", "r", 1, 3, "length")) == []
    out = core.on_message(HandedOff("p", "r", 1000, 0.01))  # without its index 0 first
    [moved] = [e for e in out if isinstance(e, FailedOver)]
    assert moved.cause == "tokens_lost" and moved.resumed_at == 0
    assert ("d", Reserve) in sends(out)  # the attempt again, from the prompt


def test_an_ended_request_aborts_every_holder_and_late_reservations_are_given_back() -> None:
    core, _ = core_with(("p", "prefill"), ("d", "decode"))
    submit(core, "r")
    core.on_message(Reserved("d", "r", (3,)))
    assert sorted(sends(core.end("r", "client gone"))) == [("d", Abort), ("p", Abort)]
    submit(core, "q")
    assert sends(core.end("q")) == [("d", Abort)]  # asked to reserve: its blocks may be taken already
    assert sends(core.on_message(Reserved("d", "q", (5,)))) == [("d", Abort)]  # the late reply's too
    assert core.on_message(Reserved("d", "q", (), "no room")) == []
    assert len(core.holders) == 0


def test_a_reservation_not_answered_in_time_moves_to_the_next_route() -> None:
    core, clock = core_with(("p", "prefill"), ("d0", "decode"), ("d1", "decode"), reserve_timeout_s=2.0)
    [(first, _)] = sends(submit(core, "r"))
    second = "d1" if first == "d0" else "d0"
    deadline = core.next_deadline()
    assert deadline is not None and 2.0 < deadline < 2.01
    clock.now = deadline
    out = core.poll()
    assert sends(out) == [(first, Abort), (second, Reserve)]
    clock.now = 2 * deadline
    out = core.poll()
    assert sends(out) == [(second, Abort)]
    [refused] = [e for e in out if isinstance(e, Refused)]
    assert refused.status == 503 and f"{first} did not answer" in refused.message
    assert "r" not in core and len(core.holders) == 0 and core.next_deadline() is None


def test_a_refused_reservation_tries_the_next_route_and_the_last_refusal_says_why() -> None:
    core, _ = core_with(("p", "prefill"), ("d0", "decode"), ("d1", "decode"))
    [(first, _)] = sends(submit(core, "r"))
    out = core.on_message(Reserved(first, "r", (), "no free blocks"))
    [(second, _)] = sends(out)
    assert second != first
    [refused] = core.on_message(Reserved(second, "r", (), "no free blocks"))
    assert isinstance(refused, Refused) and refused.status == 503
    assert refused.message.count("no free blocks") == 2 and len(core.holders) == 0


def test_a_reservation_refused_for_want_of_blocks_waits_for_the_workers_next_report() -> None:
    core, _ = core_with(("p", "prefill"), ("d", "decode"))
    assert sends(submit(core, "r")) == [("d", Reserve)]
    out = core.on_message(Reserved("d", "r", (), "no free KV blocks", no_room=True))
    assert out == [] and "r" in core  # not refused: the worker was fuller than the router knew
    assert core.registry.workers["d"].out_of_blocks
    assert sends(submit(core, "s")) == [("d", Reserve)]  # the router knows no better until it reports
    assert core.on_message(Reserved("d", "s", (), "no free KV blocks", no_room=True)) == []
    out = core.on_message(heartbeat("d"))  # its report says how full it is: both ask again
    assert sorted(sends(out)) == [("d", Reserve), ("d", Reserve)]
    assert not core.registry.workers["d"].out_of_blocks
    assert sorted(m.msg.request_id for m in out if isinstance(m, Send)) == ["r", "s"]
    core.on_message(Reserved("d", "r", (3,)))
    assert sends(core.end("r")) == [("d", Abort), ("p", Abort)]
    assert sends(core.end("s")) == [("d", Abort)] and len(core.holders) == 0


def test_a_failover_refused_for_want_of_blocks_by_a_restarted_worker_waits_instead_of_failing() -> None:
    core, _ = core_with(("p", "prefill"), ("d0", "decode"), ("d1", "decode"))
    [(first, _)] = sends(submit(core, "r"))
    second = "d1" if first == "d0" else "d0"
    core.on_message(Reserved(first, "r", (3,)))
    core.on_message(delta("p", "r", 0))
    core.on_message(delta(first, "r", 1, 2))
    endpoint = f"kv://{second}"
    again = Register(second, "decode", "default", "tiny", 4096, 16, 100, endpoint, 2, 64, 512, 1000, PROFILE)
    core.on_message(again)  # restarted: the router sees it empty until its first heartbeat
    out = core.worker_gone(first, "killed")
    assert sends(out) == [("p", Abort), (second, Reserve)]
    out = core.on_message(Reserved(second, "r~1", (), "no free KV blocks", no_room=True))
    assert out == [] and "r" in core  # held for the worker's report instead of ending the stream
    out = core.on_message(heartbeat(second))
    assert sends(out) == [(second, Reserve)] and out[0].msg.request_id == "r~1"
    out = core.on_message(Reserved(second, "r~1", (5,)))
    assert sends(out) == [("p", Prefill)] and out[0].msg.prompt_ids == (1,) * 20 + (7, 7, 7)
    out = core.on_message(delta("p", "r~1", 0, 1, "length"))
    [last] = [e.delta for e in out if isinstance(e, Deliver)]
    assert (last.index, last.finish_reason) == (3, "length")
    assert sends(core.end("r")) == [(second, Abort)] and len(core.holders) == 0


def test_a_request_refused_for_want_of_blocks_ends_if_its_client_leaves_while_held() -> None:
    core, _ = core_with(("p", "prefill"), ("d", "decode"))
    submit(core, "r")
    core.on_message(Reserved("d", "r", (), "no free KV blocks", no_room=True))
    assert core.end("r") == [] and "r" not in core
    assert sends(core.on_message(heartbeat("d"))) == [] and len(core.holders) == 0


def test_a_dead_workers_reservations_move_on_and_a_request_with_nowhere_to_go_fails_once() -> None:
    core, _ = core_with(("p", "prefill"), ("d0", "decode"), ("d1", "decode"))
    [(first, _)] = sends(submit(core, "r"))
    second = "d1" if first == "d0" else "d0"
    assert sends(core.worker_gone(first, "killed")) == [(second, Reserve)]
    core.on_message(Reserved(second, "r", (3,)))
    core.on_message(delta("p", "r", 0))
    out = core.worker_gone("p", "killed")  # no prefill worker is left to move to
    assert sends(out) == [(second, Abort)]
    [failed] = [e.delta for e in out if isinstance(e, Deliver)]
    assert failed.finish_reason == "error" and failed.index == 1
    assert "worker p failed: killed" in failed.error and "no_workers" in failed.error
    assert core.worker_gone("p", "again") == []
    assert core.on_message(delta(second, "r", 1, 1, "length")) == []  # it ended already for the client
    assert sends(core.end("r")) == []
    assert len(core.holders) == 0


def test_a_stream_moves_to_another_worker_mid_stream_and_goes_on_where_it_stopped() -> None:
    core, _ = core_with(("c0", "colocated"), ("c1", "colocated"))
    [(first, _)] = sends(submit(core, "r"))
    second = "c1" if first == "c0" else "c0"
    out = core.on_message(delta(first, "r", 0, 2))
    assert [e.delta.token_ids for e in out if isinstance(e, Deliver)] == [(7, 7)]
    core.on_message(delta(first, "r", 3))  # early: never delivered, the new attempt makes it again
    out = core.worker_gone(first, "killed")
    [moved] = [e for e in out if isinstance(e, FailedOver)]
    assert (moved.cause, moved.worker_id, moved.resumed_at) == ("worker_gone", first, 2)
    [(worker, msg)] = [(e.worker_id, e.msg) for e in out if isinstance(e, Send)]
    assert worker == second and isinstance(msg, Generate) and msg.request_id == "r~1"
    assert msg.prompt_ids == (1,) * 20 + (7, 7)  # the prompt and what the client already has
    assert (msg.params.max_tokens, msg.params.output_offset, msg.params.seed) == (2, 2, PARAMS.seed)
    assert not any(isinstance(e, Started | Deliver) for e in out)  # the client sees nothing of it
    assert core.on_message(delta(first, "r", 2)) == []  # a late word from the failed attempt
    out = core.on_message(delta(second, "r~1", 0, 2, "length"))
    [last] = [e.delta for e in out if isinstance(e, Deliver)]
    assert (last.request_id, last.index, last.finish_reason) == ("r", 2, "length")
    assert core.end("r") == [] and len(core.holders) == 0 and len(core) == 0


def test_a_worker_error_fails_over_aborting_the_rest_of_the_attempt_and_attempts_are_bounded() -> None:
    core, _ = core_with(("p", "prefill"), ("d", "decode"), max_failovers=1)
    submit(core, "r")
    core.on_message(Reserved("d", "r", (3,)))
    out = core.on_message(
        StepOutputs("d", (TokenDelta("r", 0, (), (), "error", "KV transfer failed: checksum"),))
    )
    assert sends(out) == [("p", Abort), ("d", Reserve)]  # the prefill worker still held attempt 0
    assert [m.msg.request_id for m in out if isinstance(m, Send)] == ["r", "r~1"]
    [moved] = [e for e in out if isinstance(e, FailedOver)]
    assert moved.cause == "error" and "checksum" in moved.message and moved.resumed_at == 0
    core.on_message(Reserved("d", "r~1", (4,)))
    out = core.on_message(StepOutputs("d", (TokenDelta("r~1", 0, (), (), "error", "again"),)))
    [failed] = [e.delta for e in out if isinstance(e, Deliver)]
    assert failed.finish_reason == "error" and failed.error == "again (after 1 failovers)"
    assert sends(core.end("r")) == [("p", Abort)] and len(core.holders) == 0


def test_with_failover_off_a_dead_worker_ends_the_stream_with_its_error() -> None:
    core, _ = core_with(("c0", "colocated"), ("c1", "colocated"), max_failovers=0)
    [(first, _)] = sends(submit(core, "r"))
    [failed] = [e.delta for e in core.worker_gone(first, "killed") if isinstance(e, Deliver)]
    assert failed.error == f"worker {first} failed: killed (failover is off)"


def test_heartbeats_from_unknown_workers_are_asked_to_register_and_no_route_is_a_503() -> None:
    core, _ = core_with(("p", "prefill"))
    assert sends(core.on_message(heartbeat("stranger"))) == [("stranger", Reregister)]
    [refused] = submit(core, "r")
    assert isinstance(refused, Refused) and refused.status == 503 and "r" not in core
    with pytest.raises(TypeError):
        core.on_message(Generate("x", (1,), PARAMS, ()))


def test_a_worker_registering_again_under_its_id_is_a_new_process_and_the_old_ones_requests_move() -> None:
    core, _ = core_with(("c0", "colocated"), ("c1", "colocated"))
    [(first, _)] = sends(submit(core, "r"))
    core.on_message(delta(first, "r", 0, 2))
    again = Register(first, "colocated", "default", "tiny", 4096, 16, 100, "", 2, 64, 512, 1000, PROFILE)
    out = core.on_message(again)
    [moved] = [e for e in out if isinstance(e, FailedOver)]
    assert moved.worker_id == first and "registered again" in moved.message and moved.resumed_at == 2
    assert first in core.registry.workers and core.registry.workers[first].reg.pid == 2
    assert [m for _, m in sends(out)] == [Generate]  # the resumed attempt, on either worker


def test_stale_messages_from_workers_a_restarted_router_never_knew_change_nothing() -> None:
    core, _ = core_with(("d", "decode"))
    assert core.on_message(delta("old", "gone-request", 0, 3)) == []
    assert core.on_message(HandedOff("old", "gone-request", 10, 0.1)) == []
    assert sends(core.on_message(Reserved("d", "gone-request", (1, 2)))) == [("d", Abort)]  # blocks back


def test_a_deadline_bounds_admission_and_failover() -> None:
    core, clock = core_with(("c0", "colocated"), ("c1", "colocated"))
    [refused] = core.submit("hurry", (1,) * 20, PARAMS, (0,), "default", "interactive", LOOSE, deadline=1e-6)
    assert isinstance(refused, Refused) and refused.status == 429  # no first token before it
    out = core.submit("r", (1,) * 20, PARAMS, (0,), "default", "interactive", LOOSE, deadline=10.0)
    [(first, _)] = sends(out)
    core.on_message(delta(first, "r", 0, 1))
    clock.now = 10.5  # past its deadline: a failure ends it instead of moving it
    [failed] = [e.delta for e in core.worker_gone(first, "killed") if isinstance(e, Deliver)]
    assert failed.finish_reason == "error" and "deadline has passed" in failed.error


def test_routing_prefers_the_worker_that_holds_the_prompts_prefix_and_survives_a_stale_view() -> None:
    from dataclasses import replace

    from pdfabric.router.routing.prefix_index import prompt_hashes

    core, _ = core_with(("c0", "colocated"), ("c1", "colocated"), ("c2", "colocated"))
    prompt = tuple(range(3, 103))  # 100 tokens: 6 cacheable 16-token blocks
    hashes = prompt_hashes(prompt, 16, "tiny")
    assert len(hashes) == 6
    core.on_message(replace(heartbeat("c2"), cached=hashes[:4]))
    core.on_message(replace(heartbeat("c1"), cached=hashes))  # c1 holds the most
    for i in range(5):  # whatever the shuffle among equals, the longest cached prefix wins
        out = core.submit(f"r{i}", prompt, PARAMS, (0,), "default", "interactive", LOOSE)
        assert sends(out) == [("c1", Generate)] and out[1].choice.cached_tokens == 96
        core.end(f"r{i}")
    core.on_message(replace(heartbeat("c1"), evicted=hashes[2:]))  # c1 dropped the tail: c2 now leads
    out = core.submit("s", prompt, PARAMS, (0,), "default", "interactive", LOOSE)
    assert sends(out) == [("c2", Generate)] and out[1].choice.cached_tokens == 64
    core.worker_gone("c2", "killed")  # its view goes with it; a stale view is only a worse guess
    out = core.submit("t", prompt, PARAMS, (0,), "default", "interactive", LOOSE)
    assert sends(out)[0][0] == "c1" and out[1].choice.cached_tokens == 32


def test_a_failover_with_every_worker_full_waits_for_room_instead_of_failing() -> None:
    core, _ = core_with(("c0", "colocated"), ("c1", "colocated"), max_running=1)
    [(w0, _)] = sends(submit(core, "a"))
    [(w1, _)] = sends(submit(core, "b"))
    assert {w0, w1} == {"c0", "c1"}
    core.on_message(heartbeat(w0, running=1))
    core.on_message(heartbeat(w1, running=1))
    core.on_message(delta(w0, "a", 0, 2))
    out = core.worker_gone(w0, "killed")
    assert [type(e) for e in out] == [FailedOver] and sends(out) == []  # the survivor is full: "a" waits
    assert len(core.routing.queue) == 1 and core.next_deadline() is not None
    core.on_message(delta(w1, "b", 0, 4, "length"))
    out = core.on_message(heartbeat(w1, running=0))  # room on the survivor
    assert sends(out) == [(w1, Generate)] and len(core.routing.queue) == 0
    [resumed] = [e.msg for e in out if isinstance(e, Send)]
    assert resumed.request_id == "a~1" and len(resumed.prompt_ids) == 20 + 2
    assert core.end("a") == [Send(w1, Abort("a~1", "request ended"))]


def _choice_delta(wid: str, rid: str, choice: int, index: int, tokens: tuple[int, ...], finish=None):  # noqa: ANN001, ANN202
    return StepOutputs(wid, (TokenDelta(rid, index, tokens, (0.0,) * len(tokens), finish, choice=choice),))


def test_a_request_with_several_outputs_runs_them_on_one_route_and_is_held_until_the_last_ends() -> None:
    core, _ = core_with(("c", "colocated"))
    out = core.submit("r", (1,) * 20, PARAMS, (0,), "default", "interactive", LOOSE, n=3)
    [msg] = [e.msg for e in out if isinstance(e, Send)]
    assert isinstance(msg, Generate) and msg.params.choice == 0
    assert [(b.choice, b.output) for b in msg.branches] == [(1, ()), (2, ())]
    out = core.on_message(_choice_delta("c", "r", 2, 1, (9,)))  # early for its output: held back
    assert not any(isinstance(e, Deliver) for e in out)
    out = core.on_message(_choice_delta("c", "r", 2, 0, (8,)))
    assert [(e.delta.choice, e.delta.index, e.delta.token_ids) for e in out if isinstance(e, Deliver)] == [
        (2, 0, (8,)), (2, 1, (9,)),
    ]  # fmt: skip
    core.on_message(_choice_delta("c", "r", 0, 0, (5,), "stop"))
    core.on_message(_choice_delta("c", "r", 1, 0, (6,), "stop"))
    assert core.holders.count("c") == 1  # output 2 still runs there
    out = core.on_message(_choice_delta("c", "r", 2, 2, (), "length"))
    assert [e.delta.finish_reason for e in out if isinstance(e, Deliver)] == ["length"]
    assert core.holders.count("c") == 0
    assert core.end("r") == [] and len(core) == 0


def test_a_failover_resumes_each_unfinished_output_where_it_stopped_from_one_prompt() -> None:
    core, _ = core_with(("c0", "colocated"), ("c1", "colocated"))
    params = SamplingParams(max_tokens=3)
    out = core.submit("r", (1,) * 20, params, (0,), "default", "interactive", LOOSE, n=4)
    [(first, _)] = sends(out)
    second = "c1" if first == "c0" else "c0"
    core.on_message(_choice_delta(first, "r", 0, 0, (5,)))
    core.on_message(_choice_delta(first, "r", 1, 0, (6, 6)))
    core.on_message(_choice_delta(first, "r", 2, 0, (4,), "stop"))  # done: never run again
    core.on_message(_choice_delta(first, "r", 3, 0, (3, 3, 3)))  # every token out, its finish lost
    out = core.worker_gone(first, "killed")
    finished = [e.delta for e in out if isinstance(e, Deliver)]
    assert [(d.choice, d.index, d.finish_reason) for d in finished] == [(3, 3, "length")]
    [moved] = [e for e in out if isinstance(e, FailedOver)]
    assert moved.resumed_at == 7
    [(worker, msg)] = [(e.worker_id, e.msg) for e in out if isinstance(e, Send)]
    assert worker == second and isinstance(msg, Generate) and msg.request_id == "r~1"
    assert msg.prompt_ids == (1,) * 20 + (5,)  # output 0 runs as the request's own sequence
    assert (msg.params.choice, msg.params.max_tokens, msg.params.output_offset) == (0, 2, 1)
    assert [(b.choice, b.output) for b in msg.branches] == [(1, (6, 6))]
    out = core.on_message(_choice_delta(second, "r~1", 1, 0, (2,), "length"))
    [d] = [e.delta for e in out if isinstance(e, Deliver)]
    assert (d.request_id, d.choice, d.index, d.token_ids) == ("r", 1, 2, (2,))
    out = core.on_message(_choice_delta(second, "r~1", 0, 0, (2, 2), "length"))
    [d] = [e.delta for e in out if isinstance(e, Deliver)]
    assert (d.choice, d.index, d.finish_reason) == (0, 1, "length")
    assert core.holders.count(second) == 0 and core.end("r") == []


def test_a_failover_scores_the_prompt_again_only_if_the_client_has_not_had_its_scores() -> None:
    scored = SamplingParams(max_tokens=4, logprobs=1, prompt_logprobs=True)
    for first_delta_out in (False, True):
        core, _ = core_with(("c0", "colocated"), ("c1", "colocated"))
        [(first, _)] = sends(core.submit("r", (1,) * 20, scored, (0,), "default", "interactive", LOOSE))
        if first_delta_out:
            core.on_message(_choice_delta(first, "r", 0, 0, (5,)))
        [msg] = [e.msg for e in core.worker_gone(first, "killed") if isinstance(e, Send)]
        assert isinstance(msg, Generate) and msg.params.prompt_logprobs is not first_delta_out


def test_routing_counts_what_a_workers_host_kv_store_holds_and_the_time_to_read_it() -> None:
    from dataclasses import replace

    from pdfabric.router.routing.prefix_index import prompt_hashes

    core, _ = core_with()
    for wid, host in (("a0", "hostA"), ("a1", "hostA"), ("b0", "hostB")):  # a0 and a1 share a store
        reg = Register(wid, "colocated", "default", "tiny", 4096, 16, 100, "", 1, 64, 512, 1000, PROFILE,
                       host=host, kv_store="s1", kv_store_blocks=1000)  # fmt: skip
        core.on_message(reg)
    prompt = tuple(range(3, 103))  # 6 cacheable blocks
    hashes = prompt_hashes(prompt, 16, "tiny")
    core.on_message(replace(heartbeat("a0"), evicted=hashes[2:]))  # a0 evicted blocks 2-5 to host A's store
    core.on_message(replace(heartbeat("a1"), cached=hashes[:2]))  # a1's pool holds blocks 0-1
    core.on_message(replace(heartbeat("b0"), cached=hashes[:3]))  # b0's pool holds blocks 0-2
    by_id = {c.worker_id: c for c in core.routing.candidates(_ticket(core, prompt))}
    assert (by_id["a1"].cached_tokens, by_id["a1"].store_tokens) == (96, 64)  # pool, then host store
    assert (by_id["a0"].cached_tokens, by_id["a0"].store_tokens) == (0, 0)  # the store starts at block 2
    assert (by_id["b0"].cached_tokens, by_id["b0"].store_tokens) == (48, 0)  # another host's store
    assert by_id["a1"].store_seconds_per_token == 1000 / 1e9  # unmeasured: the default read rate
    out = core.submit("r", prompt, PARAMS, (0,), "default", "interactive", LOOSE)
    assert sends(out) == [("a1", Generate)] and out[1].choice.cached_tokens == 96
    # A read rate measured so slow that reading 64 tokens costs more than computing them: b0 wins.
    slow = {"ram_bytes_read": 1000.0, "load_seconds": 10.0}
    core.on_message(replace(heartbeat("a1"), cached=(), kv_store=slow))
    core.end("r")
    out = core.submit("s", prompt, PARAMS, (0,), "default", "interactive", LOOSE)
    assert sends(out) == [("b0", Generate)]
    core.worker_gone("a0", "killed")  # the store outlives the worker that filled it
    assert core.routing.registry.stores.cached_blocks("hostA/s1", hashes[2:]) == 4


def _ticket(core: RouterCore, prompt: tuple[int, ...]):  # noqa: ANN202
    from pdfabric.router.routing.admission import Ticket

    key, prefix = core.routing.prefix_of(prompt)
    return Ticket("t", "default", "interactive", LOOSE, len(prompt), 0.0, prefix=prefix, prefix_key=key)
