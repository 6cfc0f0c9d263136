"""Prompt-lookup speculative decoding: proposals from a sequence's own history (engine/speculate.py),
checked in one step and kept where the model picks them itself, so greedy output is what plain
decoding gives, token for token, with no block leaked."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable

import aiohttp
import pytest

from pdfabric import structure
from pdfabric.control import Generate, StepOutputs
from pdfabric.decode.core import ColocatedCore
from pdfabric.engine.generate import ReferenceEngine
from pdfabric.engine.runner import ModelRunner
from pdfabric.engine.speculate import Proposer, Wanted, propose
from pdfabric.engine.stepper import Stepper
from pdfabric.profile import WorkerProfile
from pdfabric.sampling_params import SamplingParams
from pdfabric.worker.spec import FixedProfile
from tests.core_helpers import core_spec
from tests.fabric import get_json, metric_values, running_fabric, wait_blocks_free


def test_proposals_come_from_the_latest_earlier_occurrence_of_the_last_ngram() -> None:
    assert propose([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 3) == (4, 5, 6)
    assert propose([1, 2, 9, 1, 2, 8, 1, 2], 2) == (8, 1)  # the latest occurrence
    assert propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2) == (9, 2)  # the longest n-gram first
    assert propose([5, 6, 7, 8, 9], 3) == () and propose([1, 2], 3) == () and propose([1, 2, 1, 2], 0) == ()
    assert propose([7, 7, 7, 7], 5) == (7,)  # what followed, up to the end
    big = [2**20 + 1, 7, 2**20 + 1, 7]  # token ids whose bytes could match across a token boundary
    assert propose([1, 256, 0, 0, 1, 256], 2) == (0, 0) and propose(big, 4) == (2**20 + 1, 7)


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine("tiny")


def run(
    reference: ReferenceEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    proposer: Proposer | Callable[[ModelRunner], Proposer] | None = None,
    blocks: int = 128,
    step_seconds: float = 0.0,
    profile: WorkerProfile | None = None,
    **config: object,
):
    """Serves the prompts on a colocated core with the real model (``blocks`` KV blocks of 16 tokens;
    ``proposer``: one, or what makes one of the served model's runner, as a draft model is made;
    each step reported as taking ``step_seconds``, against ``profile``); returns each request's
    output, the core and its deltas."""
    spec = core_spec("colocated", blocks, worker_id="c", max_model_len=2048, **config)
    served = ModelRunner(reference.model, blocks, 16, kv_cache_dtype=reference.runner.kv_cache_dtype)
    if proposer is not None and not hasattr(proposer, "propose"):
        proposer = proposer(served)
    core = ColocatedCore(spec, FixedProfile(profile or WorkerProfile()), "", proposer)
    stepper = Stepper(served, reference.grammars)
    eos = tuple(sorted(reference.tokenizer.eos_token_ids))
    for i, prompt in enumerate(prompts):
        core.handle(Generate(f"r{i}", tuple(prompt), params, eos))
    seqs = [core.scheduler.get(f"r{i}") for i in range(len(prompts))]
    deltas = []
    while core.has_work:
        step = core.schedule()
        assert step is not None
        out = core.complete(step, stepper.run(step.chunks, core.tables), step_seconds)
        deltas += [d for msg in out if isinstance(msg, StepOutputs) for d in msg.deltas]
    return [s.output_ids for s in seqs], seqs, core, deltas


def test_greedy_output_with_speculation_equals_plain_decoding(reference: ReferenceEngine) -> None:
    # prompts that repeat themselves, so that proposals are found and some are kept
    prompts = [([3, 4, 5, 6, 7, 8] * 12)[: 20 + 7 * i] for i in range(4)] + [list(range(10, 40))]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    want = [reference.generate(p, params).token_ids for p in prompts]
    got, seqs, core, deltas = run(reference, prompts, params, speculative="ngram", speculative_k=6,
                                  speculative_below=8)  # fmt: skip
    assert got == want
    assert sum(s.accepted for s in seqs) > 0, "no proposal was kept: the test checks nothing"
    assert sum(s.proposed for s in seqs) > sum(s.accepted for s in seqs)  # and some were not
    assert max(len(d.token_ids) for d in deltas) > 1  # kept tokens leave in one delta
    # the deltas tile each output: every index once, in order
    for i, out in enumerate(got):
        mine = [d for d in deltas if d.request_id == f"r{i}"]
        assert [t for d in mine for t in d.token_ids] == out
        assert [d.index for d in mine] == [sum(len(m.token_ids) for m in mine[:j]) for j in range(len(mine))]
    assert core.tables.pool.num_free == core.tables.pool.num_blocks and len(core.tables) == 0


def test_speculation_stops_at_max_tokens_and_eos(reference: ReferenceEngine) -> None:
    prompt = [3, 4, 5, 6] * 10
    for max_tokens in (1, 2, 5, 13):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        got, *_ = run(reference, [prompt], params, speculative="ngram", speculative_k=8, speculative_below=4)
        assert got == [reference.generate(prompt, params).token_ids]
    params = SamplingParams(max_tokens=40)  # stops at an eos if the model picks one
    got, seqs, core, _ = run(reference, [prompt], params, speculative="ngram", speculative_below=4)
    assert got == [reference.generate(prompt, params).token_ids]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.05, seed=3),  # near greedy: kept often
        SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.9, top_p=0.9, seed=4),
        SamplingParams(max_tokens=50, ignore_eos=True, repetition_penalty=1.1, frequency_penalty=0.1),
        SamplingParams(max_tokens=50, ignore_eos=True, logprobs=3),
        SamplingParams(
            max_tokens=50, grammar=structure.response_format_grammar({"type": "regex", "regex": "(abc){12}!"})
        ),
    ],
    ids=["seeded-cold", "seeded-hot", "penalties", "logprobs", "grammar"],
)
def test_every_kind_of_request_speculates_and_gives_what_plain_decoding_gives(
    reference: ReferenceEngine, params: SamplingParams
) -> None:
    """A seeded row keeps a proposed token only where the seeded draw of that position picks it, a
    penalised row sees the proposal in its history, a structured row the grammar's mask after it: so
    each gives exactly what it gives without speculation (and the model's own log-probabilities)."""
    prompts = [[3, 4, 5, 6] * 10, [97, 98, 99] * 8]
    plain, _, _, _ = run(reference, prompts, params)
    assert plain == [reference.generate(p, params).token_ids for p in prompts]
    got, seqs, core, _ = run(reference, prompts, params, speculative="ngram", speculative_below=4)
    assert got == plain
    if (params.temperature and params.temperature < 0.5) or params.grammar:  # others rarely repeat
        assert sum(s.accepted for s in seqs) > 0
    if params.logprobs:
        want = [reference.generate(p, params).logprobs for p in prompts]
        assert [s.output_logprobs for s in seqs] == [pytest.approx(w, abs=1e-5) for w in want]
        assert all(len(top) == 3 for s in seqs for top in s.output_top)
    assert core.tables.pool.num_free == core.tables.pool.num_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.9, seed=4),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, repetition_penalty=1.3, seed=5),
], ids=["greedy", "seeded", "penalties"])  # fmt: skip
def test_a_proposal_of_the_right_tokens_is_kept_whole_and_a_wrong_token_ends_it(
    reference: ReferenceEngine, params: SamplingParams
) -> None:
    """Proposals made to order: the very tokens plain decoding gives (each kept: a seeded row draws
    the same token at the same index), or those with one wrong (kept up to it, then the right one)."""
    prompt = list(range(20, 60))
    want = reference.generate(prompt, params).token_ids

    def right(tokens: list[int], k: int) -> tuple[int, ...]:
        done = len(tokens) - len(prompt)
        return tuple(want[done : done + k])

    def wrong(tokens: list[int], k: int) -> tuple[int, ...]:
        good = list(right(tokens, k))
        if len(good) > 2:
            good[2] = (good[2] + 1) % 260
        return tuple(good)

    class Made:  # a Proposer of tokens made to order
        runs_model = False

        def __init__(self, guess: Callable[[list[int], int], tuple[int, ...]]) -> None:
            self.guess = guess

        def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]:
            return [self.guess(list(seq.token_slice(0, seq.num_tokens)), k) for seq, _, k in wanted]

    for guess, kept in ((right, "all"), (wrong, "some")):
        got, (seq,), core, deltas = run(
            reference, [prompt], params, Made(guess), speculative="ngram", speculative_k=4
        )
        assert got == [want]
        assert seq.accepted > 0 and (seq.accepted == seq.proposed) == (kept == "all")
        assert len(deltas) < len(want)  # several tokens a step
        assert core.tables.pool.num_free == core.tables.pool.num_blocks


@pytest.mark.parametrize("runs_model", [True, False])
def test_a_draft_whose_proposals_keep_missing_backs_off(reference: ReferenceEngine, runs_model: bool) -> None:
    """Every proposal wrong: a proposer that runs a model (a draft) is asked at the 1st, 2nd, 4th,
    8th ... decode step, then every 32nd; prompt lookup, which costs nothing, at every step. The
    output is plain decoding's either way."""
    prompt = list(range(20, 60))
    params = SamplingParams(max_tokens=101, ignore_eos=True)  # 100 decode steps after the prompt's
    want = reference.generate(prompt, params).token_ids

    class Wrong:
        def __init__(self) -> None:
            self.runs_model = runs_model

        def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]:
            nexts = [want[seq.num_tokens - len(prompt)] for seq, _, _ in wanted]
            return [((t + 1) % 260,) * k for t, (_, _, k) in zip(nexts, wanted, strict=True)]

    got, (seq,), core, _ = run(reference, [prompt], params, Wrong(), speculative="ngram", speculative_k=4)
    assert got == [want] and seq.accepted == 0
    # steps 0, 1, 3, 7, 15, 31, then 63 and 95 (a wait of 31 steps between them; the last step has
    # no room for one)
    assert core.scheduler.speculation.checks == (8 if runs_model else 99)


def test_the_worker_measures_what_speculating_gains_over_plain_steps(reference: ReferenceEngine) -> None:
    """Every proposal right and 4 long: each speculating step gives its sequence 5 tokens in the time
    (10 ms, drafting included) that the profile gives a plain step for 1, so speculation is 5x."""
    prompt = list(range(20, 60))
    params = SamplingParams(max_tokens=21, ignore_eos=True)  # 1 from the prompt, then 4 steps of 5
    want = reference.generate(prompt, params).token_ids

    class Right:
        runs_model = False

        def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]:
            done = [seq.num_tokens - len(prompt) for seq, _, _ in wanted]
            return [tuple(want[d : d + k]) for d, (_, _, k) in zip(done, wanted, strict=True)]

    flat = WorkerProfile(prefill=(0.01, 0.0, 0.0), decode=(0.01, 0.0, 0.0))  # every step 10 ms
    got, _, core, deltas = run(reference, [prompt], params, Right(), step_seconds=0.01, profile=flat,
                               speculative="ngram", speculative_k=4, speculative_below=3)  # fmt: skip
    assert got == [want] and [len(d.token_ids) for d in deltas] == [1, 5, 5, 5, 5]
    heartbeat = core.heartbeat(1e9)
    assert heartbeat is not None and heartbeat.speculation == pytest.approx(5.0)
    assert (heartbeat.speculative_checks, heartbeat.proposed_tokens, heartbeat.accepted_tokens) == (4, 16, 16)
    assert core.registration().speculate_below == 3
    _, _, plain, _ = run(reference, [prompt], params, step_seconds=0.01, profile=flat)
    assert plain.heartbeat(1e9).speculation == 1.0 and plain.registration().speculate_below == 0


def test_a_request_can_turn_speculation_off_or_lower_its_k(reference: ReferenceEngine) -> None:
    prompt = [3, 4, 5, 6] * 10
    off = SamplingParams(max_tokens=30, ignore_eos=True, speculative_k=0)
    _, seqs, *_ = run(reference, [prompt], off, speculative="ngram", speculative_below=4)
    assert seqs[0].proposed == 0
    one = SamplingParams(max_tokens=30, ignore_eos=True, speculative_k=1)
    got, seqs, _, deltas = run(reference, [prompt], one, speculative="ngram", speculative_below=4)
    assert seqs[0].proposed > 0 and max(len(d.token_ids) for d in deltas) <= 2  # one proposed, one drawn
    assert got == [reference.generate(prompt, one).token_ids]


def test_busy_workers_do_not_speculate(reference: ReferenceEngine) -> None:
    prompt = [3, 4, 5, 6] * 10
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    _, seqs, *_ = run(reference, [prompt] * 3, greedy, speculative="ngram", speculative_below=2)
    assert sum(s.proposed for s in seqs) == 0  # three decoding: above speculative_below
    _, seqs, *_ = run(reference, [prompt], greedy)  # off by default
    assert seqs[0].proposed == 0


@pytest.mark.parametrize(("flags", "method"), [
    (("--colocated", "2"), "ngram"), (("--prefill", "1", "--decode", "2"), "ngram"),
    (("--prefill", "1", "--decode", "2"), "draft"),
    # a draft with a cache of its own: each decode worker's computes the prompts it is handed, the
    # new worker's the prompt and output so far
    (("--prefill", "1", "--decode", "2", "--draft-cache", "own"), "draft"),
])  # fmt: skip
def test_a_fabric_that_speculates_survives_a_kill_token_exact(
    flags: tuple[str, ...], method: str, reference: ReferenceEngine
) -> None:
    """kill -9 of the worker decoding the most streams while 6 greedy streams run with speculation
    on: every stream moves and ends exactly as the single-process reference (proposals never leave
    the worker, so the new one simply goes on), and kept proposals arrive several tokens a delta."""
    prompts = [([5 + i, 6, 7, 8, 9, 10] * 10)[: 30 + 5 * i] for i in range(6)]
    kind = "colocated" if "--colocated" in flags else "decode"
    with running_fabric("--model", "tiny", "--num-blocks", "256", "--speculative", method, *flags) as url:
        started = [asyncio.Event() for _ in prompts]

        async def one(i: int) -> tuple[list[int], int]:
            ids, biggest = [], 0
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        data = json.loads(line[6:])
                        assert "error" not in data, data
                        for choice in data["choices"]:
                            ids += choice["token_ids"]
                            biggest = max(biggest, len(choice["token_ids"]))
                        if len(ids) >= 10:
                            started[i].set()
            return ids, biggest

        async def run_all() -> list[tuple[list[int], int]]:
            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            workers = [w for w in get_json(url + "/health")[1]["workers"] if w["kind"] == kind]
            os.kill(max(workers, key=lambda w: w["requests"])["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        results = asyncio.run(run_all())
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        for prompt, (ids, _) in zip(prompts, results, strict=True):
            assert ids == reference.generate(prompt, params).token_ids
        assert max(biggest for _, biggest in results) > 1  # kept proposals: several tokens a chunk
        assert sum(metric_values(url, "pdfabric_failovers_total").values()) >= 1
        wait_blocks_free(url)
        proposed = sum(metric_values(url, "pdfabric_speculative_proposed_tokens_total").values())
        accepted = sum(metric_values(url, "pdfabric_speculative_accepted_tokens_total").values())
        assert proposed >= accepted > 0, (proposed, accepted)
        checks = sum(metric_values(url, "pdfabric_speculative_checks_total").values())
        assert 0 < checks <= proposed  # a check holds one proposed token at least
        speedups = metric_values(url, "pdfabric_speculative_speedup")  # one per speculating worker
        assert speedups and all(v > 0 for v in speedups.values()), speedups


def test_a_proposal_takes_new_blocks_only_while_each_decoding_sequence_keeps_one_free() -> None:
    from pdfabric.engine.block_pool import BlockPool, BlockTables
    from pdfabric.engine.scheduler import Scheduler, SchedulerConfig
    from pdfabric.engine.sequence import Sequence

    def decode_step(num_blocks: int) -> list:
        tables = BlockTables(BlockPool(num_blocks, 4))
        config = SchedulerConfig(max_batch_tokens=64, max_running=4, max_model_len=64, speculate_k=4,
                                 speculate_below=4)  # fmt: skip
        scheduler = Scheduler(tables, config)
        for name, prompt in (("a", (1, 2, 3, 1, 2, 3, 1)), ("b", (5, 6, 7, 5, 6, 7, 5))):
            scheduler.add(Sequence(name, prompt, SamplingParams(max_tokens=20)))
        first = scheduler.schedule()  # both prompts: two blocks each
        scheduler.complete(first, [(2, 0.0), (6, 0.0)])  # 8 tokens each: their two blocks are full
        return scheduler.schedule()

    # four blocks taken, one free, two decoding: a guess would take the block the other may need
    assert [c.proposal for c in decode_step(5)] == [(), ()]
    # room to spare: the repeated prompts' next tokens are proposed, into a block of their own
    assert [c.proposal for c in decode_step(8)] == [(3, 1, 2), (7, 5, 6)]
