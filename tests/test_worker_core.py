"""The worker cores with no process, socket or model: control messages in, messages out.

A fake model samples a token that depends on the sequence's history; time is a number passed in.
"""

from __future__ import annotations

import subprocess
import sys

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
from pdfabric.decode.core import ColocatedCore, DecodeCore
from pdfabric.kvtransfer.state import TransferResult, TransferState
from pdfabric.prefill.core import PrefillCore
from pdfabric.profile import WorkerProfile
from pdfabric.sampling_params import SamplingParams
from pdfabric.worker.core import Out, WorkerCore, background_tokens
from pdfabric.worker.kv import CancelKV, ExpectKV, PushKV
from pdfabric.worker.spec import CoreSpec, FixedProfile
from tests.core_helpers import core_spec

PROFILE = FixedProfile(WorkerProfile())


def _spec(kind: str, num_blocks: int = 64, **kw: int) -> CoreSpec:
    return core_spec(kind, num_blocks, block_size=4, max_model_len=128, max_batch_tokens=16, **kw)


def _token(history: tuple[int, ...]) -> int:
    return (sum(history) * 31 + len(history)) % 97 + 3


def _run_step(core: WorkerCore) -> Out:
    """One step with the fake model; ``[]`` when the core has nothing to run."""
    step = core.schedule()
    if step is None:
        return []
    sampled = [(_token(c.seq.token_slice(0, c.stop)), -0.5) for c in step.chunks if c.sample]
    assert len(sampled) == step.num_samples
    return core.complete(step, sampled, 0.01)


def _deltas(out: Out) -> list[TokenDelta]:
    return [d for m in out if isinstance(m, StepOutputs) for d in m.deltas]


def _tokens(deltas: list[TokenDelta], rid: str) -> list[int]:
    return [t for d in sorted(deltas, key=lambda d: d.index) if d.request_id == rid for t in d.token_ids]


def _generate_colocated(prompts: dict[str, tuple[int, ...]], max_tokens: int) -> dict[str, list[int]]:
    core = ColocatedCore(_spec("colocated"), PROFILE)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        assert core.handle(Generate(rid, prompt, params, ())) == []
    deltas: list[TokenDelta] = []
    while core.has_work:
        deltas += _deltas(_run_step(core))
    assert core.tables.pool.num_free == core.tables.pool.num_blocks
    return {rid: _tokens(deltas, rid) for rid in prompts}


PROMPTS = {"a": tuple(range(1, 11)), "b": tuple(range(5, 30)), "c": (7, 7, 7)}


def test_colocated_core_generates_and_frees_everything() -> None:
    out = _generate_colocated(PROMPTS, 6)
    assert all(len(tokens) == 6 for tokens in out.values())


def test_prefill_and_decode_cores_hand_over_and_match_colocated() -> None:
    """The whole disaggregated path, cores wired by hand: same tokens as colocated, no leaked block."""
    pre, dec = PrefillCore(_spec("prefill"), PROFILE), DecodeCore(_spec("decode"), PROFILE, "kv://d")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    deltas: list[TokenDelta] = []
    pushes: list[PushKV] = []
    for rid, prompt in PROMPTS.items():
        expect, reserved = dec.handle(Reserve(rid, prompt, params, ()))
        assert isinstance(expect, ExpectKV) and isinstance(reserved, Reserved)
        assert expect.blocks == reserved.block_ids and len(reserved.block_ids) == -(-len(prompt) // 4)
        assert pre.handle(Prefill(rid, prompt, params, (), "kv://d", reserved.block_ids)) == []
    while pre.has_work:
        out = _run_step(pre)
        deltas += _deltas(out)
        pushes += [m for m in out if isinstance(m, PushKV)]
    assert sorted(p.request_id for p in pushes) == sorted(PROMPTS)
    assert all(d.finish_reason is None and d.index == 0 for d in deltas)  # first tokens only
    held = pre.tables.pool.num_blocks - pre.tables.pool.num_free
    assert held == sum(len(p.local_blocks) for p in pushes)  # blocks stay held while KV moves
    for push in pushes:
        meta = {"first_token": push.first_token, "first_logprob": push.first_logprob}
        ok = TransferResult(push.request_id, TransferState.DONE, nbytes=1000, seconds=0.001, meta=meta,
                            transport="shm")  # fmt: skip
        assert dec.transfer_ended(ok) == []
        (handed,) = pre.transfer_ended(ok)
        assert handed == HandedOff("prefill-0", push.request_id, 1000, 0.001)
    assert pre.tables.pool.num_free == pre.tables.pool.num_blocks
    while dec.has_work:
        deltas += _deltas(_run_step(dec))
    assert dec.tables.pool.num_free == dec.tables.pool.num_blocks
    assert {rid: _tokens(deltas, rid) for rid in PROMPTS} == _generate_colocated(PROMPTS, 6)
    hb = pre.heartbeat(now=0.0)
    assert isinstance(hb, Heartbeat) and hb.kv_bytes_per_s == 1e6 and hb.kv_rates == {"shm": 1e6}


def test_heartbeat_is_due_by_the_clock_passed_in() -> None:
    core = ColocatedCore(_spec("colocated", heartbeat_s=1), PROFILE)
    assert isinstance(core.heartbeat(10.0), Heartbeat)
    assert core.heartbeat(10.5) is None
    hb = core.heartbeat(11.0)
    assert hb is not None and (hb.free_blocks, hb.total_blocks, hb.kv_bytes_per_s) == (64, 64, 0.0)
    reg = core.registration()
    assert isinstance(reg, Register)
    assert (reg.kind, reg.num_blocks, reg.max_model_len) == ("colocated", 64, 128)


def test_decode_core_refuses_without_room_and_oversized_prompts() -> None:
    dec = DecodeCore(_spec("decode", num_blocks=4), PROFILE)
    params = SamplingParams(max_tokens=2)
    (big,) = dec.handle(Reserve("big", tuple(range(200)), params, ()))
    assert isinstance(big, Reserved) and big.block_ids == () and "does not fit" in big.reason
    assert not big.no_room  # never worth asking again
    assert len(dec.handle(Reserve("a", tuple(range(16)), params, ()))) == 2
    (full,) = dec.handle(Reserve("b", (1, 2), params, ()))
    assert full.block_ids == () and full.reason == "no free KV blocks" and full.no_room


def test_abort_while_kv_is_in_flight_quarantines_blocks_until_released() -> None:
    dec = DecodeCore(_spec("decode", num_blocks=8), PROFILE)
    dec.handle(Reserve("r", tuple(range(10)), SamplingParams(), ()))
    assert dec.tables.pool.num_free == 5
    assert dec.handle(Abort("r", "client gone")) == [CancelKV("r", "client gone")]
    assert dec.tables.pool.num_free == 5 and dec.scheduler.get("r") is None  # ended, blocks still out
    late = TransferResult("r", TransferState.DONE, meta={"first_token": 3})
    assert dec.transfer_ended(late) == []  # a result for an aborted request changes nothing
    dec.kv_released("r")
    assert dec.tables.pool.num_free == 8
    hb = dec.heartbeat(0.0)
    assert hb is not None and (hb.running, hb.waiting, hb.context_tokens) == (0, 0, 0)


def test_failed_transfer_ends_with_one_error_on_each_side() -> None:
    pre, dec = PrefillCore(_spec("prefill"), PROFILE), DecodeCore(_spec("decode"), PROFILE)
    params = SamplingParams(max_tokens=4)
    _, reserved = dec.handle(Reserve("r", (1, 2, 3), params, ()))
    pre.handle(Prefill("r", (1, 2, 3), params, (), "kv://d", reserved.block_ids))
    out = _run_step(pre)
    assert [type(m) for m in out] == [StepOutputs, PushKV]
    failed = TransferResult("r", TransferState.FAILED, "receiver refused: bad frame")
    (err,) = _deltas(pre.transfer_ended(failed))
    assert err.finish_reason == "error" and "bad frame" in err.error
    assert pre.tables.pool.num_free == pre.tables.pool.num_blocks
    (derr,) = _deltas(dec.transfer_ended(failed))
    assert derr.finish_reason == "error" and derr.index == 1
    assert dec.tables.pool.num_free < dec.tables.pool.num_blocks  # quarantined until released
    dec.kv_released("r")
    assert dec.tables.pool.num_free == dec.tables.pool.num_blocks
    hb = pre.heartbeat(0.0)
    assert hb is not None and hb.kv_bytes_per_s == 0.0  # failures measure no rate


def test_prefill_abort_during_push_cancels_it_and_frees_blocks() -> None:
    pre = PrefillCore(_spec("prefill"), PROFILE)
    pre.handle(Prefill("r", (1, 2, 3, 4, 5), SamplingParams(), (), "kv://d", (0, 1)))
    _run_step(pre)
    assert pre.handle(Abort("r", "client gone")) == [CancelKV("r", "client gone")]
    assert pre.tables.pool.num_free == pre.tables.pool.num_blocks
    assert pre.transfer_ended(TransferResult("r", TransferState.DONE)) == []  # nothing to hand off
    assert pre.handle(Abort("r", "again")) == []


def test_oversized_prompt_is_one_error_delta() -> None:
    long, params = tuple(range(128)), SamplingParams()
    for core, msg in (
        (ColocatedCore(_spec("colocated"), PROFILE), Generate("x", long, params, ())),
        (PrefillCore(_spec("prefill"), PROFILE), Prefill("x", long, params, (), "", ())),
    ):
        (delta,) = _deltas(core.handle(msg))
        assert delta.finish_reason == "error" and not core.has_work


def test_first_token_that_stops_ends_the_request_on_arrival() -> None:
    dec = DecodeCore(_spec("decode"), PROFILE)
    dec.handle(Reserve("r", (1, 2), SamplingParams(max_tokens=5, stop_token_ids=(9,)), ()))
    (out,) = dec.transfer_ended(TransferResult("r", TransferState.DONE, meta={"first_token": 9}))
    assert isinstance(out, StepOutputs) and out.deltas == (TokenDelta("r", 1, (), (), "stop"),)
    assert dec.tables.pool.num_free == dec.tables.pool.num_blocks and not dec.has_work


def test_prefill_step_opens_the_transfers_of_the_prompts_it_finishes() -> None:
    pre = PrefillCore(_spec("prefill"), PROFILE)  # 16 tokens per step
    params = SamplingParams(max_tokens=2)
    pre.handle(Prefill("long", tuple(range(1, 21)), params, (), "kv://d", (10, 11, 12, 13, 14)))
    pre.handle(Prefill("short", (1, 2), params, (), "kv://d", (20,)))
    first = pre.schedule()
    assert first is not None and first.opens == ()  # 16 of 20 tokens: not finished yet
    pre.complete(first, [], 0.01)
    second = pre.schedule()
    assert second is not None
    assert [(o.request_id, o.remote_blocks) for o in second.opens] == [
        ("long", (10, 11, 12, 13, 14)),
        ("short", (20,)),
    ]
    assert second.opens[0].local_blocks == tuple(pre.tables.table("long"))
    out = pre.complete(second, [(4, 0.0), (5, 0.0)], 0.01)
    assert [m.request_id for m in out if isinstance(m, PushKV)] == ["long", "short"]


def test_cores_and_the_simulator_never_import_torch() -> None:
    code = (
        "import sys, pdfabric.prefill.core, pdfabric.decode.core, pdfabric.bench.simulator; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_draining_core_finishes_what_it_holds_and_refuses_new_requests() -> None:
    core = ColocatedCore(_spec("colocated"), PROFILE)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    core.handle(Generate("a", (5, 6, 7), params, ()))
    core.heartbeat(0.0)
    core.drain()
    hb = core.heartbeat(0.01)  # due at once, so the router hears of it before routing again
    assert isinstance(hb, Heartbeat) and hb.draining
    [refused] = _deltas(core.handle(Generate("b", (1, 2), params, ())))
    assert (refused.request_id, refused.finish_reason) == ("b", "error") and "draining" in refused.error
    assert not core.idle
    out: list[TokenDelta] = []
    while not core.idle:
        out += _deltas(_run_step(core))
    assert len(_tokens(out, "a")) == 3 and out[-1].finish_reason == "length"  # "a" ran to its end
    decode = DecodeCore(_spec("decode"), PROFILE, "kv://d")
    decode.drain()
    [no_room] = decode.handle(Reserve("c", (1, 2, 3), params, ()))
    assert isinstance(no_room, Reserved) and no_room.block_ids == () and "draining" in no_room.reason
    prefill = PrefillCore(_spec("prefill"), PROFILE)
    prefill.drain()
    [err] = _deltas(prefill.handle(Prefill("d", (1, 2), params, (), "kv://d", (0,))))
    assert err.finish_reason == "error" and prefill.idle


def test_reregister_drops_everything_held_and_registers_again() -> None:
    """After the router restarts it knows none of this worker's requests: the worker frees them all
    (a transfer in flight is cancelled, its blocks kept until released) and registers anew."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    col = ColocatedCore(_spec("colocated"), PROFILE)
    col.handle(Generate("a", (5, 6, 7), params, ()))
    col.handle(Generate("b", (1, 2), params, ()))
    _run_step(col)
    assert col.heartbeat(0.0).received == 2  # the work it took in, for the router's pending load
    out = col.handle(Reregister("router restarted"))
    assert [type(m) for m in out] == [Register] and out[0].worker_id == "colocated-0"
    assert col.idle and col.scheduler.request_ids() == []
    hb = col.heartbeat(0.01)  # due at once: the router hears the load right away
    assert hb is not None and hb.received == 0  # counted anew, as the router numbers its messages
    dec = DecodeCore(_spec("decode"), PROFILE, "kv://d")
    dec.handle(Reserve("r", tuple(range(10)), params, ()))
    out = dec.handle(Reregister("router restarted"))
    assert [type(m) for m in out] == [CancelKV, Register]
    assert not dec.idle  # quarantined until the KV side says the sender can no longer write
    dec.kv_released("r")
    assert dec.idle
    pre = PrefillCore(_spec("prefill"), PROFILE)
    pre.handle(Prefill("p", (1, 2, 3, 4, 5), params, (), "kv://d", (0, 1)))
    _run_step(pre)  # its KV is being pushed
    assert [type(m) for m in pre.handle(Reregister("router restarted"))] == [CancelKV, Register]
    assert pre.idle


def test_a_decode_worker_prefills_a_prompt_sent_as_generate() -> None:
    """The router's local prefill: a decode worker given ``Generate`` prefills and decodes the prompt
    itself, as a colocated worker would, from its first token on."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    dec = DecodeCore(_spec("decode"), PROFILE, "kv://d")
    assert dec.handle(Generate("g", (5, 6, 7), params, ())) == []
    indices = []
    while not dec.idle:
        indices += [d.index for d in _deltas(_run_step(dec))]
    assert indices == [0, 1, 2] and dec.received == 1


def test_the_kinds_table_lists_every_kind_the_router_knows() -> None:
    from pdfabric.control import KINDS as NAMES
    from pdfabric.kinds.table import KINDS, kind

    assert tuple(KINDS) == NAMES and all(KINDS[name].name == name for name in NAMES)
    assert kind("decode").core is DecodeCore and kind("colocated").open_kv is None
    with pytest.raises(ValueError, match="worker kind must be one of"):
        kind("router")


def test_a_decode_core_holds_a_failed_transfers_blocks_until_they_are_released() -> None:
    """Its ``BlockTables`` owns the blocks all along: out of the pool while a sender might still write
    them, back in it on ``kv_released``."""
    dec = DecodeCore(_spec("decode", num_blocks=8), PROFILE)
    out = dec.handle(Reserve("r", tuple(range(3, 13)), SamplingParams(max_tokens=4), ()))
    reserved = next(m for m in out if isinstance(m, Reserved))
    assert len(reserved.block_ids) == 3 and dec.tables.pool.num_free == 5
    dec.transfer_ended(TransferResult("r", TransferState.FAILED, "sender gone"))
    assert dec.tables.held == 1 and dec.tables.pool.num_free == 5 and not dec.idle
    dec.kv_released("r")
    assert dec.tables.held == 0 and dec.tables.pool.num_free == 8 and dec.idle


def test_background_prompts_get_the_tokens_a_short_step_holds_by_the_profile() -> None:
    """``[worker] background_step_ms``: the tokens whose prefill step the profile predicts within it
    (16 at least, the step's budget at most); 0 is no cap."""
    slow = WorkerProfile(prefill=(0.0125, 0.000586, 0.0))  # 12.5 ms a step + 0.586 ms a token
    assert background_tokens(slow, 40.0, 512) == 32  # 31.3 ms; 48 tokens would take 40.6 ms
    assert background_tokens(slow, 5.0, 512) == 16  # never below 16: background prompts progress
    assert background_tokens(WorkerProfile(prefill=(1e-3, 1e-6, 0.0)), 40.0, 512) == 512
    assert background_tokens(slow, 0.0, 512) == 0
