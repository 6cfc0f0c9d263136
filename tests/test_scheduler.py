"""The shared scheduler under a fake model: budgets hold, everything finishes, no block leaks."""

from __future__ import annotations

import random

import pytest

from pdfabric.engine.block_pool import BlockPool, BlockTables
from pdfabric.engine.scheduler import Scheduler, SchedulerConfig
from pdfabric.engine.sequence import SeqState, Sequence
from pdfabric.sampling_params import SamplingParams


def _config(**kw: object) -> SchedulerConfig:
    """A scheduler's limits: a worker's defaults (``WorkerConfig``) and a 4096-token context."""
    limits = {"max_batch_tokens": 512, "max_running": 64, "max_model_len": 4096, **kw}
    return SchedulerConfig(**limits)  # type: ignore[arg-type]


def _fake_token(seq: Sequence, start: int, stop: int) -> int:
    # Depends on the whole token history, like a model would.
    return hash((seq.request_id, seq.token_slice(0, stop))) % 1000 + 10


def _drive(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_work:
        chunks = sched.schedule()
        assert chunks, "scheduler stalled with work queued"
        assert sum(c.stop - c.start for c in chunks) <= sched.config.max_batch_tokens
        sched.complete(chunks, [(_fake_token(c.seq, c.start, c.stop), -1.0) for c in chunks if c.sample])
        steps += 1
        assert steps < max_steps
    return steps


def _seqs(n: int, rng: random.Random, eos: frozenset[int] = frozenset()) -> list[Sequence]:
    return [
        Sequence(
            f"r{i}",
            tuple(rng.randrange(1000) for _ in range(rng.randint(1, 60))),
            SamplingParams(max_tokens=rng.randint(1, 40)),
            eos,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("num_blocks", [8, 16, 200])
def test_everything_finishes_without_leaks(num_blocks: int) -> None:
    rng = random.Random(num_blocks)
    tables = BlockTables(BlockPool(num_blocks, 4))
    sched = Scheduler(tables, _config(max_batch_tokens=24, max_running=6, max_model_len=num_blocks * 4))
    seqs = [s for s in _seqs(30, rng) if s.num_tokens + s.params.max_tokens <= num_blocks * 4]
    for s in seqs:
        sched.add(s)
    _drive(sched)
    assert tables.pool.num_free == num_blocks and len(tables) == 0 and len(sched) == 0
    for s in seqs:
        assert s.state is SeqState.FINISHED and s.finish_reason == "length"
        assert len(s.output_ids) == s.params.max_tokens


def test_preemption_recomputes_to_the_same_tokens() -> None:
    rng = random.Random(3)
    seqs_small = _seqs(12, rng)
    rng = random.Random(3)
    seqs_large = _seqs(12, rng)
    for seqs, blocks in ((seqs_small, 40), (seqs_large, 1000)):
        sched = Scheduler(BlockTables(BlockPool(blocks, 4)), _config(max_batch_tokens=64, max_model_len=160))
        for s in seqs:
            sched.add(s)
        _drive(sched)
    assert [s.output_ids for s in seqs_small] == [s.output_ids for s in seqs_large]


def test_stop_tokens_and_eos() -> None:
    tables = BlockTables(BlockPool(32, 4))
    sched = Scheduler(tables, _config())
    seq = Sequence("a", (1, 2, 3), SamplingParams(max_tokens=50), frozenset({5}))
    sched.add(seq)
    chunks = sched.schedule()
    sched.complete(chunks, [(7, 0.0)])
    chunks = sched.schedule()
    assert [(c.start, c.stop) for c in chunks] == [(3, 4)]
    sched.complete(chunks, [(5, 0.0)])
    assert seq.finish_reason == "stop" and seq.output_ids == [7, 5]
    ignoring = Sequence("b", (1,), SamplingParams(max_tokens=2, ignore_eos=True), frozenset({5}))
    sched.add(ignoring)
    sched.complete(sched.schedule(), [(5, 0.0)])
    assert ignoring.state is SeqState.RUNNING
    assert tables.pool.num_free == 32 - 1


def test_chunked_prefill_respects_budget_and_keeps_order() -> None:
    sched = Scheduler(BlockTables(BlockPool(64, 4)), _config(max_batch_tokens=10))
    a = Sequence("a", tuple(range(25)), SamplingParams(max_tokens=3))
    b = Sequence("b", tuple(range(4)), SamplingParams(max_tokens=3))
    sched.add(a)
    sched.add(b)
    spans = []
    for _ in range(3):
        chunks = sched.schedule()
        spans.append([(c.seq.request_id, c.start, c.stop) for c in chunks])
        sched.complete(chunks, [(1, 0.0) for c in chunks if c.sample])
    assert spans == [[("a", 0, 10)], [("a", 10, 20)], [("a", 20, 25), ("b", 0, 4)]]


def test_handoff_reserve_and_abort() -> None:
    tables = BlockTables(BlockPool(10, 4))
    prefill = Scheduler(tables, _config(on_prefilled="handoff"))
    seq = Sequence("p", tuple(range(9)), SamplingParams(max_tokens=1))
    prefill.add(seq)
    prefill.complete(prefill.schedule(), [(42, 0.0)])
    assert seq.state is SeqState.HANDOFF and len(tables.table("p")) == 3  # kept for shipping
    prefill.finish("p", "handed_off")
    assert tables.pool.num_free == 10

    decode = Scheduler(tables, _config())
    reserved = decode.reserve(Sequence("d", tuple(range(9)), SamplingParams(max_tokens=4)))
    assert reserved is not None and len(reserved[0]) == 3 and reserved[1] == 0  # no prefix cache here
    assert decode.reserve(Sequence("e", tuple(range(40)), SamplingParams())) is None  # 10 blocks, 3 taken
    assert tables.pool.num_free == 7
    got = decode.kv_arrived("d", 11, -0.1)
    assert got is not None and got.state is SeqState.RUNNING and got.num_cached == 9
    assert decode.kv_arrived("unknown", 1, 0.0) is None
    assert decode.finish("d", "abort") is got and tables.pool.num_free == 10
    assert decode.finish("d", "abort") is None


def test_a_higher_priority_prompt_is_prefilled_before_lower_ones_that_came_first() -> None:
    """``SamplingParams.priority``: an online prompt overtakes a batch job's waiting prompts (first
    come, first served among equals); one already prefilling keeps its chunks' progress."""
    sched = Scheduler(BlockTables(BlockPool(64, 16)), _config(max_batch_tokens=32))
    low = [Sequence(f"low{i}", tuple(range(1, 41)), SamplingParams(max_tokens=1)) for i in range(3)]
    for seq in low:
        sched.add(seq)
    first = sched.schedule()
    assert [c.seq.request_id for c in first] == ["low0"] and first[0].stop == 32  # low0 is partway
    sched.complete(first, [])
    high = [Sequence(f"high{i}", (7, 8, 9), SamplingParams(max_tokens=1, priority=10)) for i in range(2)]
    for seq in high:
        sched.add(seq)
    assert [s.request_id for s in sched.waiting] == ["high0", "high1", "low0", "low1", "low2"]
    chunks = sched.schedule()
    assert [c.seq.request_id for c in chunks][:2] == ["high0", "high1"]
    assert low[0].num_cached == 32  # what it computed before is kept
    _drive(sched)
    assert sched.tables.pool.num_free == 64


def test_background_prompts_share_a_short_part_of_each_step() -> None:
    """``SamplingParams.background``: background prompts together take at most
    ``background_chunk_tokens`` of a step, so a foreground prompt arriving waits for a short step, and
    none of a step in which a foreground sequence decodes; the foreground prompts take the rest of the
    budget, and every prompt still completes."""
    sched = Scheduler(
        BlockTables(BlockPool(128, 16)), _config(max_batch_tokens=512, background_chunk_tokens=128)
    )
    bg = SamplingParams(max_tokens=2, background=True)
    for i in range(3):
        sched.add(Sequence(f"bg{i}", tuple(range(1, 301)), bg))
    first = sched.schedule()
    assert [(c.seq.request_id, c.stop - c.start) for c in first] == [("bg0", 128)]
    sched.complete(first, [])
    sched.add(Sequence("fg", tuple(range(1, 201)), SamplingParams(max_tokens=2, priority=10)))
    second = sched.schedule()
    assert [(c.seq.request_id, c.stop - c.start) for c in second] == [("fg", 200), ("bg0", 128)]
    sched.complete(second, [(_fake_token(c.seq, c.start, c.stop), -1.0) for c in second if c.sample])
    assert [(c.seq.request_id, c.stop - c.start) for c in sched.schedule()] == [("fg", 1)]  # fg decodes alone
    steps = 0
    while sched.has_work:  # never more than the share of background prompt tokens in a step
        chunks = sched.schedule()
        prompt = [c for c in chunks if c.seq.state is SeqState.WAITING]
        assert sum(c.stop - c.start for c in prompt if c.seq.params.background) <= 128
        sched.complete(chunks, [(_fake_token(c.seq, c.start, c.stop), -1.0) for c in chunks if c.sample])
        steps += 1
        assert steps < 100
    assert sched.tables.pool.num_free == 128
    uncapped = Scheduler(BlockTables(BlockPool(128, 16)), _config(max_batch_tokens=512))
    uncapped.add(Sequence("bg", tuple(range(1, 301)), bg))
    assert [c.stop - c.start for c in uncapped.schedule()] == [300]
