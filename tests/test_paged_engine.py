"""Paged attention gives the same answers as recomputing everything, whatever the batch shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.engine.loader import load_model
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.sampling_params import SamplingParams

BLOCK = 4


def _ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


@pytest.fixture(scope="module")
def runner(hf_llama_dir: Path) -> ModelRunner:
    return ModelRunner(load_model(hf_llama_dir), num_blocks=128, block_size=BLOCK)


def _prefill(runner: ModelRunner, ids: tuple[int, ...], table: tuple[int, ...], chunk: int) -> torch.Tensor:
    """Prefills ``ids`` in chunks of ``chunk`` tokens; returns the last token's logits."""
    logits = None
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        last = start + chunk >= len(ids)
        logits = runner.step([StepEntry(piece, start, table, needs_logits=last)])
    assert logits is not None
    return logits[0]


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 8, 9, 23])
def test_chunked_prefill_equals_one_shot(runner: ModelRunner, chunk: int) -> None:
    ids = _ids(23, 0)  # 23 tokens: ends mid-block
    one_shot = _prefill(runner, ids, tuple(range(0, 6)), len(ids))
    chunked = _prefill(runner, ids, tuple(range(40, 46)[::-1]), chunk)  # other, reversed blocks
    torch.testing.assert_close(chunked, one_shot, rtol=1e-5, atol=1e-5)


def test_paged_decode_equals_full_recompute(hf_llama_dir: Path, runner: ModelRunner) -> None:
    engine = ReferenceEngine(hf_llama_dir, num_blocks=64, block_size=BLOCK)
    prompt = list(_ids(7, 1))
    out = engine.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    seq = prompt + out.token_ids
    for i in range(len(out.token_ids)):
        context = tuple(seq[: len(prompt) + i])
        logits = _prefill(runner, context, tuple(range(64, 64 + -(-len(context) // BLOCK))), len(context))
        assert int(logits.argmax()) == out.token_ids[i]
        assert float(torch.log_softmax(logits, -1)[out.token_ids[i]]) == pytest.approx(
            out.logprobs[i], abs=1e-4
        )
    assert engine.tables.pool.num_free == 64


def test_mixed_batch_equals_each_alone(runner: ModelRunner) -> None:
    # Cached state first: B has 9 prompt tokens cached, C and D are decoding after 30 and 1 tokens.
    b_ids, c_ids, d_ids = _ids(15, 2), _ids(31, 3), _ids(2, 4)
    tables = {"a": tuple(range(0, 4)), "b": (20, 5, 21, 6), "c": tuple(range(100, 108)), "d": (30,)}
    _prefill(runner, b_ids[:9], tables["b"], 9)
    _prefill(runner, c_ids[:30], tables["c"], 7)
    _prefill(runner, d_ids[:1], tables["d"], 1)
    entries = [
        StepEntry(_ids(13, 5), 0, tables["a"]),  # fresh prefill
        StepEntry(b_ids[9:], 9, tables["b"]),  # chunk continuing a cached prompt
        StepEntry(c_ids[30:], 30, tables["c"]),  # decode, long context
        StepEntry(d_ids[1:], 1, tables["d"]),  # decode, one cached token
    ]
    snapshot = [t.clone() for t in runner.kv_caches]
    batched = runner.step(entries)
    after_batch = [t.clone() for t in runner.kv_caches]
    for cache, saved in zip(runner.kv_caches, snapshot, strict=True):
        cache.copy_(saved)
    alone = torch.cat([runner.step([e]) for e in entries])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    for got, want in zip(after_batch, runner.kv_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_decode_only_batch_equals_each_alone(runner: ModelRunner) -> None:
    seqs = [_ids(n, 10 + n) for n in (1, 4, 5, 17, 33)]
    tables = [tuple(range(50 + 10 * i, 60 + 10 * i)) for i in range(len(seqs))]
    for ids, table in zip(seqs, tables, strict=True):
        if len(ids) > 1:
            _prefill(runner, ids[:-1], table, len(ids) - 1)
    entries = [StepEntry(ids[-1:], len(ids) - 1, t) for ids, t in zip(seqs, tables, strict=True)]
    batched = runner.step(entries)
    alone = torch.cat([runner.step([e]) for e in entries])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


def test_entry_validation(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        runner.step([StepEntry(_ids(9, 0), 0, (0, 1))])
    with pytest.raises(ValueError, match="at least one token"):
        runner.step([StepEntry((), 0, (0,))])


def test_prompt_scores_are_the_same_whole_chunked_and_in_a_worker(hf_llama_dir: Path) -> None:
    """``prompt_logprobs``: each prompt token's score, from the single-process reference in one piece
    or in chunks, and from a worker core's steps with a small token budget (several chunks, beside
    another request), agree."""
    from pdfabric.control import Generate
    from pdfabric.decode.core import ColocatedCore
    from pdfabric.engine.stepper import Stepper
    from pdfabric.profile import WorkerProfile
    from pdfabric.worker.spec import FixedProfile
    from tests.core_helpers import core_spec

    prompt = list(_ids(21, 5))
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=True)
    reference = ReferenceEngine(hf_llama_dir, block_size=BLOCK)
    whole = reference.generate(prompt, params)
    assert len(whole.prompt_logprobs) == len(prompt) - 1 and all(
        len(t) == 2 for _, t in whole.prompt_logprobs
    )
    chunked = reference.generate(prompt, params, chunk_size=4)
    spec = core_spec("colocated", 64, worker_id="c", block_size=BLOCK, max_model_len=256, max_batch_tokens=6)
    core = ColocatedCore(spec, FixedProfile(WorkerProfile()))
    stepper = Stepper(ModelRunner(reference.model, 64, BLOCK))
    core.handle(Generate("other", tuple(_ids(9, 6)), SamplingParams(max_tokens=4), ()))
    core.handle(Generate("r", tuple(prompt), params, ()))
    seq = core.scheduler.get("r")
    while core.has_work:
        step = core.schedule()
        assert step is not None
        core.complete(step, stepper.run(step.chunks, core.tables), 0.0)
    for got in (chunked.prompt_logprobs, seq.prompt_logprobs):
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in whole.prompt_logprobs], abs=1e-4)
        assert [[t for t, _ in top] for _, top in got] == [
            [t for t, _ in top] for _, top in whole.prompt_logprobs
        ]
    assert seq.output_ids == whole.token_ids
