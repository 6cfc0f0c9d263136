"""The prefix cache: block hashes, the pool's cached and idle blocks, the scheduler starting prompts
from cached prefixes, and token-exact output with the real model whether the cache hits or not."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdfabric.control import Generate, Prefill, Reserve, Reserved, StepOutputs, TokenDelta
from pdfabric.decode.core import ColocatedCore, DecodeCore
from pdfabric.engine.block_pool import BlockPool, BlockTables, chain_hashes
from pdfabric.kvtransfer.state import TransferResult, TransferState
from pdfabric.prefill.core import PrefillCore
from pdfabric.profile import WorkerProfile
from pdfabric.sampling_params import SamplingParams
from pdfabric.worker.core import WorkerCore
from pdfabric.worker.kv import ExpectKV, PushKV
from pdfabric.worker.spec import CoreSpec, FixedProfile
from tests.core_helpers import core_spec
from tests.test_worker_core import _run_step, _tokens

SALT = b"model"


def test_chain_hashes_cover_the_whole_prefix_and_extend_incrementally() -> None:
    tokens = list(range(100, 148))
    whole = chain_hashes(tokens, 16, SALT)
    assert len(whole) == 3 and chain_hashes(tokens[:40], 16, SALT) == whole[:2]  # partial blocks: none
    assert chain_hashes(tokens[32:], 16, SALT, whole[:2]) == whole  # only the new blocks are hashed
    changed = [*tokens[:5], 7, *tokens[6:]]
    # A change in the first block changes every hash after it.
    assert all(a != b for a, b in zip(chain_hashes(changed, 16, SALT), whole, strict=True))
    assert chain_hashes(tokens, 16, b"other model") != whole


def test_cached_blocks_wait_idle_count_as_free_and_are_evicted_oldest_first() -> None:
    pool = BlockPool(4, 16)
    a, b = pool.allocate(1), pool.allocate(1)
    assert a is not None and b is not None
    pool.cache(a[0], b"ha")
    pool.cache(b[0], b"hb")
    pool.cache(b[0], b"other")  # a block is cached once
    assert pool.num_cached == 2
    pool.free(a + b)
    assert pool.num_free == 4 and pool.num_cached == 2  # idle, not wiped
    assert pool.lookup([b"ha", b"hb", b"hc"]) == a + b and pool.lookup([b"hb"]) == b
    pool.acquire(b)
    assert pool.num_free == 3 and pool.ref_count(b[0]) == 1
    fresh = pool.allocate(3)  # two free blocks, then the idle cached one
    assert fresh is not None and a[0] in fresh and pool.lookup([b"ha"]) == [] and pool.num_cached == 1
    assert pool.allocate(1) is None
    pool.free(fresh + b)
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="is free"):
        pool.cache(a[0], b"ha")
    with pytest.raises(ValueError, match="not cached"):
        pool.acquire(a)


def _spec(num_blocks: int = 64, caching: bool = True) -> CoreSpec:
    return core_spec("colocated", num_blocks, block_size=4, max_model_len=256, max_batch_tokens=16,
                     model="m", prefix_caching=caching)  # fmt: skip


def _serve(core: WorkerCore, prompts: dict[str, tuple[int, ...]], max_tokens: int) -> list[TokenDelta]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        core.handle(Generate(rid, prompt, params, ()))
    deltas: list[TokenDelta] = []
    while core.has_work:
        deltas += [d for m in _run_step(core) if isinstance(m, StepOutputs) for d in m.deltas]
    return deltas


def test_a_prompt_starts_after_its_cached_prefix_and_turns_reuse_their_output() -> None:
    core = ColocatedCore(_spec(), FixedProfile(WorkerProfile()))
    first = tuple(range(3, 33))  # 30 tokens: 7 full blocks
    out1 = _tokens(_serve(core, {"a": first}, 8), "a")
    assert core.tables.pool.num_free == 64 and core.tables.pool.num_cached == 9  # prompt + output blocks
    core.handle(Generate("b", first[:24] + (90, 91, 92), SamplingParams(max_tokens=2), ()))
    step = core.schedule()
    assert step is not None and (step.chunks[0].start, step.chunks[0].stop) == (24, 27)  # 24 tokens hit
    [d] = [d for m in core.complete(step, [(5, -0.1)], 0.01) if isinstance(m, StepOutputs) for d in m.deltas]
    assert d.index == 0 and d.cached_tokens == 24
    _serve(core, {}, 1)  # b runs to its end
    turn2 = first + tuple(out1) + (50, 51, 52)  # a conversation's next turn re-sends its history
    deltas = _serve(core, {"c": turn2}, 4)
    assert deltas[0].cached_tokens == 36  # the 38 tokens of turn 1 (prompt and output) in full blocks
    plain = ColocatedCore(_spec(caching=False), FixedProfile(WorkerProfile()))
    assert _tokens(deltas, "c") == _tokens(_serve(plain, {"c": turn2}, 4), "c")
    assert core.scheduler.prefix.prompt_tokens == 30 + 27 + 41 and core.scheduler.prefix.hit_tokens == 24 + 36


def test_a_prompt_part_way_through_continues_from_blocks_another_prompt_cached_meanwhile() -> None:
    """b shares a's 28 tokens and arrives with it: b starts from the 16 a computed in the first step,
    computes one block beside a's last chunk, then takes a's next two blocks instead of computing them."""
    core = ColocatedCore(_spec(), FixedProfile(WorkerProfile()))
    shared = tuple(range(3, 31))  # 7 blocks of 4
    deltas = _serve(core, {"a": shared, "b": (*shared, 60, 61)}, 3)
    hits = {d.request_id: d.cached_tokens for d in deltas if d.index == 0}
    assert hits == {"a": 0, "b": 16 + 8}
    plain = ColocatedCore(_spec(caching=False), FixedProfile(WorkerProfile()))
    want = _serve(plain, {"a": shared, "b": (*shared, 60, 61)}, 3)
    assert all(_tokens(deltas, r) == _tokens(want, r) for r in "ab")
    assert core.tables.pool.num_free == core.tables.pool.num_blocks


def test_under_block_pressure_the_cache_gives_way_and_no_block_leaks() -> None:
    rng = random.Random(3)
    base = [tuple(rng.randrange(3, 90) for _ in range(20)) for _ in range(3)]
    prompts = {f"r{i}": base[i % 3] + tuple(rng.randrange(3, 90) for _ in range(rng.randrange(1, 9)))
               for i in range(24)}  # fmt: skip
    cached = ColocatedCore(_spec(num_blocks=24), FixedProfile(WorkerProfile()))
    plain = ColocatedCore(_spec(num_blocks=24, caching=False), FixedProfile(WorkerProfile()))
    for batch in (list(prompts)[i : i + 4] for i in range(0, 24, 4)):
        want = _serve(plain, {r: prompts[r] for r in batch}, 6)
        got = _serve(cached, {r: prompts[r] for r in batch}, 6)
        assert all(_tokens(got, r) == _tokens(want, r) for r in batch)
    pool = cached.tables.pool
    assert pool.num_free == pool.num_blocks and cached.scheduler.prefix.hit_tokens > 0
    assert cached.scheduler.request_ids() == []


@pytest.fixture(scope="module")
def tiny() -> tuple:
    from pdfabric.engine.generate import ReferenceEngine
    from pdfabric.engine.loader import load_model
    from pdfabric.engine.runner import ModelRunner
    from pdfabric.engine.stepper import Stepper

    reference = ReferenceEngine("tiny")
    runner = ModelRunner(load_model(Path(reference.path)), 128, 16)
    return reference, Stepper(runner)


def test_with_the_real_model_cache_hits_change_no_token(tiny: tuple) -> None:
    """Greedy and seeded requests sharing prefixes (a system prompt, a conversation's turns), some at
    once and some after others: every output equals the single-process reference."""
    reference, stepper = tiny
    spec = core_spec("colocated", 128, block_size=16, max_model_len=2048, max_running=8, max_batch_tokens=64,
                     model="tiny", prefix_caching=True)  # fmt: skip
    core = ColocatedCore(spec, FixedProfile(WorkerProfile()))
    system = tuple(range(40, 90))  # 50 tokens: three full blocks
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=11)

    def run(requests: dict[str, tuple[tuple[int, ...], SamplingParams]]) -> dict[str, list[int]]:
        for rid, (prompt, params) in requests.items():
            core.handle(Generate(rid, prompt, params, ()))
        deltas: list[TokenDelta] = []
        while core.has_work:
            step = core.schedule()
            assert step is not None
            out = core.complete(step, stepper.run(step.chunks, core.tables), 0.01)
            deltas += [d for m in out if isinstance(m, StepOutputs) for d in m.deltas]
        return {rid: _tokens(deltas, rid) for rid in requests}

    first = run({"a": (system + (5, 6, 7), greedy), "b": (system + (8,) * 20, seeded)})
    turn2 = system + (5, 6, 7) + tuple(first["a"]) + (9, 10)
    second = run({"a2": (turn2, greedy), "c": (system + (11,), seeded), "d": (system[:33], greedy)})
    assert core.scheduler.prefix.hit_tokens >= 48 + 48 + 32
    for rid, (prompt, params) in {
        "a": (system + (5, 6, 7), greedy), "b": (system + (8,) * 20, seeded),
        "a2": (turn2, greedy), "c": (system + (11,), seeded), "d": (system[:33], greedy),
    }.items():  # fmt: skip
        got = first.get(rid) or second[rid]
        assert got == reference.generate(list(prompt), params).token_ids, rid
    assert core.tables.pool.num_free == 128


def test_tables_attach_a_cached_prefix_once() -> None:
    tables = BlockTables(BlockPool(4, 4))
    tables.attach("s", [0, 1])
    with pytest.raises(ValueError, match="already has a table"):
        tables.attach("s", [2])


def _disaggregated(pre: WorkerCore, dec: WorkerCore, rid: str, prompt: tuple[int, ...], n: int) -> tuple:
    """One request through a prefill and a decode core wired by hand (the transfer succeeds at
    once); returns (its tokens, the decode worker's Reserved, the prefill worker's PushKV)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    expect, reserved = dec.handle(Reserve(rid, prompt, params, ()))
    assert isinstance(expect, ExpectKV) and isinstance(reserved, Reserved)
    assert expect.blocks == reserved.block_ids
    pre.handle(Prefill(rid, prompt, params, (), "kv://d", reserved.block_ids, reserved.cached_blocks))
    deltas: list[TokenDelta] = []
    pushes: list[PushKV] = []
    while pre.has_work:
        out = _run_step(pre)
        deltas += [d for m in out if isinstance(m, StepOutputs) for d in m.deltas]
        pushes += [m for m in out if isinstance(m, PushKV)]
    [push] = pushes
    assert len(push.local_blocks) == len(push.remote_blocks) == len(reserved.block_ids)
    meta = {"first_token": push.first_token, "first_logprob": push.first_logprob}
    done = TransferResult(rid, TransferState.DONE, nbytes=1, seconds=0.001, meta=meta)
    dec.transfer_ended(done)
    pre.transfer_ended(done)
    while dec.has_work:
        deltas += [d for m in _run_step(dec) if isinstance(m, StepOutputs) for d in m.deltas]
    return _tokens(deltas, rid), reserved, push


def test_a_decode_worker_that_holds_a_prefix_receives_only_the_rest() -> None:
    """Turn 2 of a conversation on the decode worker that served turn 1: it reserves only the blocks
    it lacks and the prefill worker ships only those; the tokens are what colocated gives."""
    def spec(kind: str) -> CoreSpec:
        return core_spec(kind, 64, block_size=4, max_model_len=256, max_batch_tokens=16,
                        model="m", prefix_caching=True)  # fmt: skip

    pre, dec = PrefillCore(spec("prefill"), FixedProfile(WorkerProfile())), DecodeCore(
        spec("decode"), FixedProfile(WorkerProfile()), "kv://d"
    )
    turn1 = tuple(range(3, 33))  # 30 tokens
    out1, first, _ = _disaggregated(pre, dec, "t1", turn1, 10)
    assert first.cached_blocks == 0 and len(first.block_ids) == 8
    turn2 = turn1 + tuple(out1) + (60, 61)  # 42 tokens; turn 1's 40 have their KV on the decode worker
    out2, second, push = _disaggregated(pre, dec, "t2", turn2, 5)
    assert second.cached_blocks == 9 and len(second.block_ids) == 2  # blocks 9 and 10 travel
    plain = ColocatedCore(_spec(caching=False), FixedProfile(WorkerProfile()))
    assert out2 == _tokens(_serve(plain, {"t2": turn2}, 5), "t2")
    for core in (pre, dec):
        assert core.tables.pool.num_free == core.tables.pool.num_blocks


def test_the_routers_view_follows_reports_and_stays_bounded() -> None:
    from pdfabric.router.routing.prefix_index import PrefixIndex

    view = PrefixIndex()
    view.update("w", [b"a", b"b", b"c"], [], limit=3)
    assert view.cached_blocks("w", [b"a", b"b", b"x"]) == 2 and view.cached_blocks("v", [b"a"]) == 0
    view.update("w", [b"d"], [b"b"], limit=3)
    assert view.cached_blocks("w", [b"a", b"b"]) == 1
    view.update("w", [b"e", b"f"], [], limit=3)  # past the worker's block count: the oldest go
    assert view.cached_blocks("w", [b"a"]) == 0 and view.cached_blocks("w", [b"d"]) == 1
    view.forget("w")
    assert view.cached_blocks("w", [b"d"]) == 0
