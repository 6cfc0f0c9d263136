"""Speculation with a draft model (engine/draft.py): the draft's KV lives in the served model's blocks,
or, for a draft of another layout, in a cache of its own that catches up on what it lacks; its
proposals change speed, never tokens; preemption, rejected proposals and requests of every kind give
what plain decoding gives, with no block leaked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from pdfabric import structure
from pdfabric.engine.draft import DraftModel
from pdfabric.engine.generate import ReferenceEngine
from pdfabric.engine.loader import load_model
from pdfabric.engine.runner import ModelRunner
from pdfabric.sampling_params import SamplingParams
from tests.test_speculate import run

BLOCKS = 128


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine("tiny")


def draft_of(reference: ReferenceEngine, quantization: str = "none") -> Callable[[ModelRunner], DraftModel]:
    """What makes the served model itself, held as ``quantization``, the draft of a served runner."""
    model = load_model(reference.path, quantization=quantization)
    return lambda served: DraftModel(ModelRunner(model, 1, 16, quantization=quantization), served)


def test_the_model_itself_as_draft_proposes_what_it_decodes(reference: ReferenceEngine) -> None:
    """A draft with the served weights drafts the served model's own greedy tokens: every proposal is
    kept whole, and the output is the reference's."""
    prompts = [list(range(10, 40)), [7, 8, 9] * 9]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    got, seqs, core, _ = run(
        reference, prompts, params, draft_of(reference), speculative="draft", speculative_k=4
    )
    assert got == [reference.generate(p, params).token_ids for p in prompts]
    assert all(s.proposed > 0 and s.accepted == s.proposed for s in seqs)
    assert core.scheduler.speculation.proposer.steps < sum(len(out) for out in got)  # several tokens a round
    assert core.tables.pool.num_free == core.tables.pool.num_blocks


def test_an_int4_draft_changes_speed_never_tokens(reference: ReferenceEngine) -> None:
    prompts = [list(range(10, 40)), [3, 4, 5, 6] * 8, list(range(100, 180, 3))]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    got, seqs, core, deltas = run(
        reference, prompts, params, draft_of(reference, "int4"), speculative="draft", speculative_k=6
    )
    assert got == [reference.generate(p, params).token_ids for p in prompts]
    proposed, accepted = sum(s.proposed for s in seqs), sum(s.accepted for s in seqs)
    assert proposed > accepted > 0, (proposed, accepted)  # tiny random weights: some kept, some not
    assert max(len(d.token_ids) for d in deltas) > 1
    assert core.tables.pool.num_free == core.tables.pool.num_blocks


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.3, seed=11),
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.4, logprobs=2),
        SamplingParams(
            max_tokens=40, grammar=structure.response_format_grammar({"type": "regex", "regex": "(ab){15}!"})
        ),
    ],
    ids=["seeded", "penalties-logprobs", "grammar"],
)
def test_every_kind_of_request_gives_what_plain_decoding_gives(
    reference: ReferenceEngine, params: SamplingParams
) -> None:
    prompts = [[3, 4, 5, 6] * 10, [97, 98, 99] * 8]
    plain, *_ = run(reference, prompts, params)
    got, seqs, core, _ = run(reference, prompts, params, draft_of(reference), speculative="draft")
    assert got == plain
    assert sum(s.proposed for s in seqs) > 0
    if params.logprobs:
        want = [reference.generate(p, params).logprobs for p in prompts]
        assert [s.output_logprobs for s in seqs] == [pytest.approx(w, abs=1e-5) for w in want]
    assert core.tables.pool.num_free == core.tables.pool.num_blocks


def test_preempted_sequences_draft_again_from_their_new_blocks(reference: ReferenceEngine) -> None:
    """A pool too small for every sequence at once: sequences are preempted and their KV recomputed,
    in other blocks, by the served model; the draft drafts over it there and the output stays exact."""
    prompts = [list(range(20 + 7 * i, 60 + 7 * i)) for i in range(5)]  # 7 blocks each at the end
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    got, seqs, core, _ = run(
        reference, prompts, params, draft_of(reference, "int4"), blocks=16, speculative="draft",
        speculative_below=5,
    )  # fmt: skip
    assert got == [reference.generate(p, params).token_ids for p in prompts]
    assert core.scheduler.preemptions > 0, "nothing was preempted: the test checks nothing"
    assert sum(s.accepted for s in seqs) > 0
    assert core.tables.pool.num_free == core.tables.pool.num_blocks


def test_a_draft_of_the_models_first_layers_changes_speed_never_tokens(reference: ReferenceEngine) -> None:
    """The served model cut to its first 2 of 3 layers drafts over the served caches' first 2 layers:
    it proposes, some proposals are kept, and the output is the reference's."""
    from pdfabric.engine.draft import build_draft
    from pdfabric.worker_config import WorkerConfig

    cfg = WorkerConfig(
        kind="decode", model="tiny", speculative="draft", draft_quantization="none", draft_layers=2
    )
    prompts = [list(range(10, 40)), [3, 4, 5, 6] * 8]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    got, seqs, core, _ = run(
        reference, prompts, params, lambda served: build_draft(cfg, reference.path, served),
        speculative="draft", speculative_k=4,
    )  # fmt: skip
    draft = core.scheduler.speculation.proposer
    assert len(draft.runner.model.model.layers) == 2 and len(draft.runner.kv_caches) == 2
    assert all(a is b for a, b in zip(draft.runner.kv_caches, draft.served.kv_caches[:2], strict=True))
    assert got == [reference.generate(p, params).token_ids for p in prompts]
    assert sum(s.proposed for s in seqs) > 0 and sum(s.accepted for s in seqs) > 0
    assert core.tables.pool.num_free == core.tables.pool.num_blocks
    with pytest.raises(ValueError, match="draft_layers must be in"):
        build_draft(replace(cfg, draft_layers=9), reference.path, reference.runner)
    with pytest.raises(ValueError, match="draft_layers must be >= 0"):
        WorkerConfig(kind="decode", draft_layers=-1)


def test_a_draft_of_another_tokenizer_is_refused(reference: ReferenceEngine, hf_llama_dir: Path) -> None:
    from pdfabric.engine.draft import build_draft
    from pdfabric.worker_config import WorkerConfig

    def draft(model: str) -> DraftModel:
        cfg = WorkerConfig(kind="decode", model="tiny", speculative="draft", draft_model=model)
        return build_draft(cfg, reference.path, reference.runner)

    mine = draft("tiny")
    assert mine.served is reference.runner and not mine.own_cache and mine.kv_bytes_per_token == 0
    with pytest.raises(ValueError, match="does not share the served model's tokenizer"):
        draft(str(hf_llama_dir))
    with pytest.raises(ValueError, match="draft_quantization"):
        WorkerConfig(kind="decode", speculative="draft", draft_quantization="int3")
    with pytest.raises(ValueError, match="KV layout"):  # over the served cache only with its layout
        DraftModel(ModelRunner(load_model(ReferenceEngine("cpu-small").path), 1, 16), reference.runner)


def own_draft(reference: ReferenceEngine, blocks: int) -> Callable[[ModelRunner], DraftModel]:
    """The served model itself drafting over a cache of its own of ``blocks`` blocks."""
    model = load_model(reference.path)
    return lambda served: DraftModel(ModelRunner(model, blocks, 16), served, own_cache=True)


def test_a_draft_with_a_cache_of_its_own_catches_up_and_drafts_what_is_decoded(
    reference: ReferenceEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served model drafting in a cache of its own: it computes each prompt there itself (a
    prompt longer than a pass's catch-up in several passes), then only what each check kept, and
    every proposal is kept: a position it held stale (a rejected token, a lost block) would draft
    another token somewhere. The served pool gets every block back."""
    import pdfabric.engine.draft as draft_module

    monkeypatch.setattr(draft_module, "CATCH_UP_TOKENS", 48)
    prompts = [list(range(10, 40)), [7, 8, 9] * 9, list(range(50, 170))]  # the last: three passes
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    got, seqs, core, _ = run(
        reference, prompts, params, own_draft(reference, 64), speculative="draft", speculative_k=4
    )
    assert got == [reference.generate(p, params).token_ids for p in prompts]
    assert all(s.proposed > 0 and s.accepted == s.proposed for s in seqs)
    draft = core.scheduler.speculation.proposer
    assert draft.own_cache and draft.runner.kv_caches[0] is not draft.served.kv_caches[0]
    assert draft.caught_up < sum(len(p) + len(out) for p, out in zip(prompts, got, strict=True))
    assert seqs[2].proposed < seqs[0].proposed  # it proposed nothing while its prompt was caught up on
    assert core.tables.pool.num_free == core.tables.pool.num_blocks


def test_a_long_prompt_catching_up_leaves_the_others_their_proposals(
    reference: ReferenceEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt longer than a pass's catch-up fills the own cache over several passes; a sequence
    beside it that lacks only what its last check kept (two tokens after a proposal kept whole) still
    drafts in those passes, after it in the batch as before it."""
    import pdfabric.engine.draft as draft_module
    from pdfabric.engine.sequence import SeqState, Sequence

    monkeypatch.setattr(draft_module, "CATCH_UP_TOKENS", 48)
    served = ModelRunner(load_model(reference.path), 64, 16)
    draft = own_draft(reference, 64)(served)

    def decoding(name: str, prompt: list[int]) -> Sequence:
        seq = Sequence(name, tuple(prompt), SamplingParams(max_tokens=64, ignore_eos=True))
        seq.state, seq.num_cached = SeqState.RUNNING, len(prompt) - 1
        return seq

    short = decoding("short", list(range(10, 30)))
    (guess,) = draft.propose([(short, (), 3)])  # its prompt caught up, three tokens proposed
    assert len(guess) == 3
    short.output_ids += [*guess, 5]  # the proposal kept whole, and the check's own token
    short.num_cached = short.num_tokens - 1
    long = decoding("long", list(range(40, 200)))
    before = draft.caught_up
    got = draft.propose([(long, (), 3), (short, (), 3)])
    assert got[0] == () and len(got[1]) == 3  # the long prompt fills; the short one drafts
    assert draft.caught_up - before == 48 + 1  # the pass's budget for the long one, 2 - 1 for the short


def test_an_own_cache_too_small_for_every_sequence_gives_blocks_to_the_latest(
    reference: ReferenceEngine,
) -> None:
    """Twelve blocks of draft cache for three sequences of up to six blocks: sequences take blocks of
    those that drafted least recently, catch up again, or propose nothing while none are free; the
    output stays exact and what is proposed is still all kept."""
    prompts = [list(range(20 + 9 * i, 66 + 9 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    got, seqs, core, _ = run(
        reference, prompts, params, own_draft(reference, 12), speculative="draft", speculative_k=4
    )
    assert got == [reference.generate(p, params).token_ids for p in prompts]
    assert sum(s.proposed for s in seqs) > 0 and all(s.accepted == s.proposed for s in seqs)
    draft = core.scheduler.speculation.proposer
    assert draft.taken > 0, "no sequence took another's blocks"
    assert len(draft._free) + sum(len(h.blocks) for h in draft._held.values()) == 12


def test_a_smaller_model_of_another_kv_layout_drafts_in_a_cache_of_its_own(
    reference: ReferenceEngine,
) -> None:
    """cpu-small served (bfloat16, 8 KV heads of 128) with tiny as its draft (float32, 2 KV heads of
    16): the draft gets a cache of its own, sized with the worker's budget, and the output is the
    served model's own."""
    from pdfabric.engine.draft import build_draft
    from pdfabric.worker.loop import build_engine
    from pdfabric.worker_config import WorkerConfig

    cfg = WorkerConfig(kind="decode", model="cpu-small", speculative="draft", draft_model="tiny",
                       draft_quantization="none", kv_memory_mb=64)  # fmt: skip
    engine = build_engine(cfg)
    draft = engine.proposer
    assert draft is not None and draft.own_cache and draft.runner.num_blocks == engine.spec.num_blocks
    plain = build_engine(replace(cfg, speculative="off"))
    # the draft's tokens take their share of the KV budget: the served cache gets fewer blocks
    assert engine.spec.num_blocks < plain.spec.num_blocks
    served = ReferenceEngine("cpu-small")
    prompts = [[3, 4, 5, 6] * 8, list(range(40, 90))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def draft_of_tiny(runner: ModelRunner) -> DraftModel:
        draft = build_draft(cfg, served.path, runner)
        draft.resize(runner.num_blocks)  # as the worker does once its budget is split
        return draft

    got, seqs, core, _ = run(served, prompts, params, draft_of_tiny, speculative="draft", speculative_k=4)
    assert got == [served.generate(p, params).token_ids for p in prompts]
    assert core.scheduler.speculation.proposer.own_cache and sum(s.proposed for s in seqs) > 0
    assert core.tables.pool.num_free == core.tables.pool.num_blocks
