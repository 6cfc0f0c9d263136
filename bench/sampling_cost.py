"""What sampling adds to a decode step (``pdfabric bench engine --sampling``): the sampler's time for a
batch's real last-token logits under the settings clients send, each row with its own seed, without
log-probabilities (what the router asks for when a request wants none)."""

from __future__ import annotations

from pdfabric.bench.floors import median_time

# name -> SamplingParams fields
MODES = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top-k 50": {"temperature": 0.8, "top_k": 50},
}


def sampling_cost(logits: object, repeats: int = 5) -> dict:
    """For ``logits`` ``[batch, vocab]`` (float32): the median seconds of one ``sample`` call over the
    whole batch, per mode of ``MODES``."""
    import torch

    from pdfabric.engine.sampler import sample
    from pdfabric.sampling_params import SamplingParams

    assert isinstance(logits, torch.Tensor)
    batch = logits.shape[0]
    out: dict = {"batch": batch, "seconds": {}}
    for name, fields in MODES.items():
        params = [SamplingParams(seed=row, token_logprob=False, **fields) for row in range(batch)]
        out["seconds"][name] = median_time(lambda p=params: sample(logits, p, [7] * batch), repeats)
    return out
