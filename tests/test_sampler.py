from __future__ import annotations

import pytest
import torch

from pdfabric.engine.sampler import sample
from pdfabric.sampling_params import SamplingParams


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, 50, generator=torch.Generator().manual_seed(seed))


def test_greedy_picks_argmax() -> None:
    logits = _logits()
    out = sample(logits, [SamplingParams()] * 3, [0, 1, 2])
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()))


def test_same_seed_same_tokens_and_index_changes_draw() -> None:
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    first = [sample(logits, [p], [i])[0].token_id for i in range(20)]
    again = [sample(logits, [p], [i])[0].token_id for i in range(20)]
    other = [sample(logits, [SamplingParams(temperature=1.0, seed=43)], [i])[0].token_id for i in range(20)]
    assert first == again
    assert first != other
    assert len(set(first)) > 10  # the draw depends on the token index


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits(1)
    greedy = logits.argmax(-1).tolist()
    for p in (
        SamplingParams(temperature=1.0, top_k=1, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=3),
    ):
        assert [s.token_id for s in sample(logits, [p] * 3, [5, 6, 7])] == greedy


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0)))]])  # p = [0.25, 0.75]
    hits = sum(
        sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0].token_id for s in range(2000)
    )
    assert 0.70 < hits / 2000 < 0.80


def test_top_p_excludes_the_tail() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {
        sample(logits, [SamplingParams(temperature=1.0, top_p=0.75, seed=s)], [0])[0].token_id
        for s in range(300)
    }
    assert seen == {0, 1}


def test_top_logprobs() -> None:
    logits = _logits(2)
    out = sample(logits[:1], [SamplingParams(logprobs=3)], [0])[0]
    assert [t for t, _ in out.top_logprobs] == logits[0].topk(3).indices.tolist()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_penalties_bias_and_min_tokens_change_the_scores_as_documented() -> None:
    from pdfabric.engine.sampler import History, process_logits

    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0])
    history = History(prompt_ids=(0, 1), output_ids=(2, 2, 3), stop_ids=frozenset({4}))

    def scores(**fields: object) -> list[float]:
        return process_logits(logits, SamplingParams(**fields), 3, history).tolist()  # type: ignore[arg-type]

    # Frequency: once per earlier output (token 2 twice, token 3 once); presence: once for any.
    assert scores(frequency_penalty=0.5) == pytest.approx([2.0, -2.0, 0.0, 0.0, 3.0])
    assert scores(presence_penalty=0.5) == pytest.approx([2.0, -2.0, 0.5, 0.0, 3.0])
    # Repetition: every token seen in prompt or output; positive scores divided, negative multiplied.
    assert scores(repetition_penalty=2.0) == pytest.approx([1.0, -4.0, 0.5, 0.25, 3.0])
    assert scores(logit_bias=((1, 5.0), (4, -100.0))) == pytest.approx([2.0, 3.0, 1.0, 0.5, -97.0])
    # min_tokens: output index 3 < 4, so the stop token cannot be picked; at 4 it can.
    assert scores(min_tokens=4)[4] == float("-inf")
    assert process_logits(logits, SamplingParams(min_tokens=4), 4, history)[4] == 3.0
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5, 3.0]  # the input is left alone


def test_a_resumed_request_counts_its_earlier_output_for_penalties() -> None:
    from pdfabric.engine.sampler import History, process_logits

    logits = torch.zeros(4)
    whole = History(prompt_ids=(0,), output_ids=(1, 1, 2))
    resumed = History(prompt_ids=(0, 1, 1), output_ids=(2,))  # the first two outputs ran elsewhere
    params = SamplingParams(frequency_penalty=1.0)
    after_failover = SamplingParams(frequency_penalty=1.0, output_offset=2)
    assert process_logits(logits, params, 3, whole).tolist() == [0.0, -2.0, -1.0, 0.0]
    assert process_logits(logits, after_failover, 3, resumed).tolist() == [0.0, -2.0, -1.0, 0.0]


def test_penalised_rows_need_their_history_and_logprobs_stay_the_models_own() -> None:
    from pdfabric.engine.sampler import History

    logits = torch.tensor([[0.0, 1.0, 0.5]])
    biased = SamplingParams(logit_bias=((0, 50.0),), logprobs=2)
    with pytest.raises(ValueError, match="history"):
        sample(logits, [biased], [0])
    (got,) = sample(logits, [biased], [0], [History((1,), ())])
    assert got.token_id == 0  # the bias decided the pick
    model = torch.log_softmax(logits[0], -1)
    assert got.logprob == pytest.approx(float(model[0]))
    assert [t for t, _ in got.top_logprobs] == [1, 2]  # the model's own ranking, before the bias


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": 40},
        {"top_p": 0.9},
        {"top_p": 0.995},
        {"top_p": 0.01},
        {"top_k": 200, "top_p": 0.7},
        {"top_k": 1},
        {"top_k": 1000, "top_p": 0.01},
        {},
    ],
)
def test_a_batch_of_draws_is_the_whole_vocabulary_references_row_by_row(kwargs: dict) -> None:
    """The sampler's batched draws (the C kernel here) equal the references', which sort the whole
    vocabulary, on peaked and flat rows, bfloat16-rounded ones (ties) and masked ones."""
    from pdfabric.engine.sampler import choice_seed, step_seed
    from pdfabric.kernels.sample_ref import gumbel_argmax_ref, gumbel_top_ref

    gen = torch.Generator().manual_seed(9)
    vocab = 49152  # SmolLM2's
    rows = torch.randn(24, vocab, generator=gen) * torch.tensor([4.0, 1.0] * 12)[:, None]
    rows[::3, :4] += 10.0  # peaked
    rows[1::4] = rows[1::4].bfloat16().float()
    rows[5, 1000:40000] = float("-inf")  # a grammar's mask
    rows[6] = float("-inf")  # every token masked
    rows[7, 9] = float("nan")
    params = [SamplingParams(temperature=0.7, seed=seed, **kwargs) for seed in range(24)]
    got = [s.token_id for s in sample(rows, params, list(range(24)))]
    keys = [step_seed(choice_seed(p.seed, p.choice), i) for i, p in enumerate(params)]
    temps = [0.7] * 24
    if kwargs:
        k, p = kwargs.get("top_k", 0), kwargs.get("top_p", 1.0)
        assert got == gumbel_top_ref(rows, temps, [k] * 24, [p] * 24, keys)
    else:
        assert got == gumbel_argmax_ref(rows, temps, keys)
    if kwargs.get("top_k") == 1:
        assert got == rows.argmax(-1).tolist()


def test_noise_is_a_function_of_the_token_id_alone_and_the_kernel_gives_the_references_bits() -> None:
    from pdfabric.kernels import sample_cpu
    from pdfabric.kernels.sample_ref import gumbel_noise_ref

    full = gumbel_noise_ref(77, torch.arange(5000))
    some = torch.tensor([4999, 3, 1024, 17])
    assert torch.equal(gumbel_noise_ref(77, some), full[some])
    assert not torch.equal(gumbel_noise_ref(78, some), full[some])
    # standard Gumbel: mean Euler's constant, standard deviation pi / sqrt(6)
    assert abs(float(full.mean()) - 0.5772) < 0.05 and abs(float(full.std()) - 1.2825) < 0.05
    if not sample_cpu.available():
        pytest.skip("no C compiler here")
    for key in (0, 77, 2**64 - 1, 2**63 + 5):
        ids = torch.arange(49152)
        assert torch.equal(sample_cpu.gumbel_noise_cpu(key, ids), gumbel_noise_ref(key, ids))
        assert torch.equal(sample_cpu.gumbel_noise_cpu(key, None, 49152), gumbel_noise_ref(key, ids))


def test_a_batch_of_temperature_draws_is_the_references_row_by_row() -> None:
    """The C kernel's batched draw equals the reference's, whatever the batch; and its draws follow
    softmax(logits / temperature)."""
    from pdfabric.kernels import sample_cpu
    from pdfabric.kernels.sample_ref import gumbel_argmax_ref

    if not sample_cpu.available():
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(24, 49152, generator=gen) * 3
    scores[5, 100:200] = float("-inf")  # a grammar's mask
    scores[6, 7] = float("nan")  # wins, as in torch.argmax
    scores[8] = 0.0  # every token tied: the noise alone decides
    scores[9] = scores[9].bfloat16().float()
    temps = [0.3 + 0.1 * r for r in range(24)]
    temps[10] = 0.01  # scores far apart: the bound skips nearly every token
    temps[13] = 1e-5  # scores near 1e6: the bound's margin must cover their rounding
    scores[11] = float("-inf")  # every token masked
    scores[12, 3] = float("inf")
    keys = [r * 7919 + 2**63 for r in range(24)]
    whole = sample_cpu.gumbel_argmax_cpu(scores, temps, keys)
    assert whole == gumbel_argmax_ref(scores, temps, keys)
    assert sample_cpu.gumbel_argmax_cpu(scores[7:9], temps[7:9], keys[7:9]) == whole[7:9]
    assert not 100 <= whole[5] < 200
    # 4,000 draws over four tokens land near their probabilities
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]]).expand(4000, 4).contiguous()
    draws = torch.tensor(sample_cpu.gumbel_argmax_cpu(logits, [1.0] * 4000, list(range(4000))))
    freq = torch.bincount(draws, minlength=4).double() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0].double(), -1), atol=0.03)


def test_a_token_logprob_is_computed_only_for_rows_that_ask() -> None:
    logits = _logits(4)
    norms = torch.logsumexp(logits, -1)
    asked, silent = SamplingParams(), SamplingParams(token_logprob=False)
    out = sample(logits, [silent, asked, SamplingParams(token_logprob=False, logprobs=2)], [0, 0, 0])
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()  # the same picks
    assert out[0].logprob == 0.0 and out[0].top_logprobs == ()
    assert out[1].logprob == pytest.approx(float(logits[1].max() - norms[1]))
    # top log-probabilities need the normaliser, so such a row gets its token's too
    assert out[2].logprob == pytest.approx(float(logits[2].max() - norms[2]))
    assert out[2].top_logprobs[0][1] == pytest.approx(out[2].logprob)
    assert [s.logprob for s in sample(logits, [silent] * 3, [0, 0, 0])] == [0.0] * 3


def test_the_router_asks_for_token_logprobs_where_a_response_needs_them() -> None:
    from pdfabric.router.front.openai_api import parse_request

    base = {"model": "m", "prompt": "hi", "max_tokens": 2}
    params = lambda body: parse_request(body, False, ("m",), 100).sampling_params(2, 0)  # noqa: E731
    assert not params(base).token_logprob
    assert params({**base, "logprobs": 0}).token_logprob
    assert params({**base, "best_of": 3, "n": 1, "temperature": 1.0}).token_logprob


def test_the_greedy_kernel_picks_what_torch_argmax_picks() -> None:
    """The first maximum, the first NaN where a row has one, -0 and +0 alike, any row length."""
    from pdfabric.kernels import sample_cpu

    if not sample_cpu.available():
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(9, 49157, generator=gen)
    rows[1, 7], rows[1, 9000] = float("nan"), float("inf")
    rows[2, 49156] = float("nan")  # in the tail past the last whole 16
    rows[3] = float("-inf")
    rows[4, 40:60] = 50.0  # a tie: the first wins
    rows[5].zero_()
    rows[5, 0] = -0.0
    rows[6, 49156] = 99.0
    assert sample_cpu.argmax_rows_cpu(rows) == rows.argmax(-1).tolist()
    assert sample_cpu.argmax_rows_cpu(rows[:, :5]) == rows[:, :5].argmax(-1).tolist()
    wide = torch.zeros(2, 60000)[:, :49157]  # rows with a stride past their length
    wide[1, 123] = 1.0
    assert sample_cpu.argmax_rows_cpu(wide) == [0, 123]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_workers_logits_draw_a_cpu_workers_tokens() -> None:
    """A GPU worker's batch (greedy, temperature, top-k / top-p and logprob rows) draws the tokens a CPU
    worker's draws from the same logits: its temperature rows go through the CPU kernels on one copy."""
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(12, 49152, generator=gen) * 3
    rows[3, 500:30000] = float("-inf")
    kinds = [
        {},
        {"temperature": 0.8},
        {"temperature": 0.8, "top_p": 0.95},
        {"temperature": 1.1, "top_k": 50},
        {"temperature": 0.6, "top_k": 200, "top_p": 0.7},
        {"logprobs": 3},
    ]
    params = [SamplingParams(seed=r, **kinds[r % len(kinds)]) for r in range(12)]
    on_cpu = sample(rows, params, list(range(12)))
    on_gpu = sample(rows.cuda(), params, list(range(12)))
    assert [s.token_id for s in on_gpu] == [s.token_id for s in on_cpu]
    for a, b in zip(on_gpu, on_cpu, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
