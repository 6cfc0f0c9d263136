from __future__ import annotations

import pytest
import torch

from pdfabric.engine.sampler import sample
from pdfabric.engine.sampling_params import SamplingParams


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
