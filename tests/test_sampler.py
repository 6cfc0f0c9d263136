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
        sample(logits, [SamplingParams(temperature=1.0, top_p=0.8, seed=s)], [0])[0].token_id
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


def _full_vocabulary_draw(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    """The textbook draw over the whole vocabulary (mask, softmax, sort, cumulative sum), with the same
    per-token noise: what the sampler's partial sorts must reproduce."""
    from pdfabric.engine.sampler import choice_seed, exponential_noise, step_seed

    scaled = logits / p.temperature
    if p.top_k:
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled.double(), dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        sorted_probs[sorted_probs.cumsum(0) - sorted_probs >= p.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    key = step_seed(choice_seed(p.seed, p.choice), index)
    return int((probs / exponential_noise(key, torch.arange(logits.numel())).double()).argmax())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": 40},
        {"top_p": 0.9},  # a peaked row: the nucleus lies within the first partial sort
        {"top_p": 0.995},  # past it: a wider partial sort or the whole vocabulary
        {"top_k": 200, "top_p": 0.7},
        {},
    ],
)
def test_partial_sorts_draw_what_the_whole_vocabulary_draws(kwargs: dict) -> None:
    gen = torch.Generator().manual_seed(9)
    vocab = 49152  # SmolLM2's
    mismatches = 0
    for seed in range(40):
        row = torch.randn(vocab, generator=gen) * (4.0 if seed % 2 else 1.0)  # peaked and flat rows
        p = SamplingParams(temperature=0.7, seed=seed, **kwargs)
        got = sample(row[None], [p], [seed])[0].token_id
        mismatches += got != _full_vocabulary_draw(row, p, seed)
    assert mismatches == 0


def test_noise_is_a_function_of_the_token_id_alone() -> None:
    from pdfabric.engine.sampler import exponential_noise

    full = exponential_noise(77, torch.arange(5000))
    some = torch.tensor([4999, 3, 1024, 17])
    assert torch.equal(exponential_noise(77, some), full[some])
    assert not torch.equal(exponential_noise(78, some), full[some])
    assert 0.95 < float(full.mean()) < 1.05 and float(full.min()) > 0


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
