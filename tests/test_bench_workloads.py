"""Trace loaders on the real public traces, Mooncake prefix sharing, scaling and synthetic workloads."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pdfabric.bench.prompts import PromptBuilder, PromptConfig
from pdfabric.bench.scaling import Scaling
from pdfabric.bench.synthetic import LengthSpec, SyntheticConfig, generate
from pdfabric.bench.traces import load_trace
from pdfabric.bench.workload import PREFIX_BLOCK_TOKENS, Request, Workload, shared_prefix_tokens

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
AZURE_CODE = TRACES / "AzureLLMInferenceTrace_code.csv"
AZURE_CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"


def _trace(path: Path) -> Workload:
    if not path.is_file():
        pytest.skip(f"public trace not found at {path} (expected ../shared/traces beside the repository)")
    return load_trace(path)


@pytest.fixture(scope="module")
def mooncake() -> Workload:
    return _trace(MOONCAKE)


@pytest.mark.parametrize(
    ("path", "rows", "rate", "in_p50", "out_p50"),
    [
        (AZURE_CODE, 8819, 2.57, 1469, 13),
        (AZURE_CONV, 19366, 5.53, 1020, 129),
        (MOONCAKE, 12031, 3.40, 6909, 350),
    ],
)
def test_trace_loaders_match_published_stats(
    path: Path, rows: int, rate: float, in_p50: int, out_p50: int
) -> None:
    w = _trace(path)
    assert len(w) == rows and w.source["rows"] == rows
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert w.mean_rate() == pytest.approx(rate, abs=0.01)
    assert np.percentile([r.input_len for r in w.requests], 50) == in_p50
    assert np.percentile([r.output_len for r in w.requests], 50) == out_p50


def test_azure_timestamps_keep_sub_second_resolution() -> None:
    w = _trace(AZURE_CONV)
    # first two rows: 18:15:46.6805900 and 18:15:50.9951690
    assert w.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-5)
    assert w.requests[0].input_len == 374 and w.requests[0].output_len == 44


def test_mooncake_hash_ids_cover_each_prompt(mooncake: Workload) -> None:
    for r in mooncake.requests:
        assert len(r.hash_ids or ()) == math.ceil(r.input_len / PREFIX_BLOCK_TOKENS)
    blocks = [h for r in mooncake.requests for h in r.hash_ids or ()]
    assert len(blocks) == 288_500 and len(set(blocks)) == 182_790


def test_equal_hash_ids_give_equal_token_blocks(mooncake: Workload) -> None:
    builder = PromptBuilder(PromptConfig(vocab_size=32000, seed=7))
    a, b = mooncake.requests[0], mooncake.requests[1]  # both start with hash id 0, then differ
    assert a.hash_ids and b.hash_ids and a.hash_ids[0] == b.hash_ids[0] and a.hash_ids[1] != b.hash_ids[1]
    ta, tb = builder.tokens(a), builder.tokens(b)
    assert len(ta) == a.input_len and len(tb) == b.input_len
    assert ta[:512] == tb[:512] and ta[512:1024] != tb[512:1024]
    assert max(ta) < 32000 and min(ta) >= 0
    # a block id seen in two requests gives the same tokens, and a cut last block is its prefix
    blk = Request(index=100, arrival_s=0, input_len=1024 + 100, output_len=1, hash_ids=(5, 9, a.hash_ids[0]))
    tc = builder.tokens(blk)
    assert tc[1024:] == ta[:100]
    # the same ids from a fresh builder (another deployment in a comparison) are the same tokens
    assert PromptBuilder(PromptConfig(vocab_size=32000, seed=7)).tokens(a) == ta


def test_prompts_without_hash_ids_are_exact_and_seeded() -> None:
    b = PromptBuilder(PromptConfig(vocab_size=50, seed=1))
    r = Request(index=3, arrival_s=0, input_len=777, output_len=1)
    t = b.tokens(r)
    assert len(t) == 777 and max(t) < 50 and t == b.tokens(r)
    assert t != PromptBuilder(PromptConfig(vocab_size=50, seed=2)).tokens(r)
    with pytest.raises(ValueError, match="vocab_size"):
        PromptConfig(vocab_size=1)


def test_scaling_applies_in_order_and_is_recorded(mooncake: Workload) -> None:
    s = Scaling(time_scale=4.0, duration_s=60.0, max_requests=50, length_ratio=0.5, max_input_len=2000,
                max_output_len=64)
    w = s.apply(mooncake)
    assert len(w) == 50
    orig = mooncake.requests[:50]
    assert all(r.arrival_s == pytest.approx(o.arrival_s / 4) for r, o in zip(w.requests, orig, strict=True))
    assert all(r.arrival_s < 60.0 for r in w.requests)
    assert all(r.input_len == min(2000, max(1, round(o.input_len * 0.5))) for r, o in zip(w.requests, orig,
                                                                                          strict=True))
    assert all(r.output_len <= 64 for r in w.requests)
    assert all(len(r.hash_ids or ()) == math.ceil(r.input_len / 512) for r in w.requests)
    assert w.scaling["time_scale"] == 4.0 and w.scaling["max_output_len"] == 64
    assert w.scaling["before"]["requests"] == 12031 and w.scaling["after"]["requests"] == 50


def test_duration_keeps_only_early_arrivals() -> None:
    w = Workload("t", tuple(Request(index=i, arrival_s=float(i), input_len=10, output_len=5)
                            for i in range(10)))
    assert len(Scaling(time_scale=2.0, duration_s=2.0).apply(w)) == 4  # arrivals 0, .5, 1, 1.5
    assert Scaling().is_identity()
    for bad in ({"time_scale": 0}, {"duration_s": -1}, {"max_requests": 0}, {"length_ratio": -2},
                {"max_input_len": 0}):
        with pytest.raises(ValueError):
            Scaling(**bad)


def test_with_rate_rescales_the_clock() -> None:
    w = Workload("t", tuple(Request(index=i, arrival_s=2.0 * i, input_len=10, output_len=5)
                            for i in range(5)))
    assert w.mean_rate() == pytest.approx(0.5)
    fast = w.with_rate(4.0)
    assert fast.mean_rate() == pytest.approx(4.0) and fast.requests[1].arrival_s == pytest.approx(0.25)
    assert fast.scaling["target_rate"] == 4.0


@pytest.mark.parametrize("cv", [1.0, 3.0, 0.5])
def test_synthetic_arrivals_have_the_asked_rate_and_burstiness(cv: float) -> None:
    w = generate(SyntheticConfig(rate=20.0, num_requests=4000, burstiness=cv, seed=5))
    gaps = np.diff([r.arrival_s for r in w.requests])
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.2)


def test_synthetic_lengths_fixed_uniform_and_trace_sampled() -> None:
    fixed = generate(SyntheticConfig(rate=5, num_requests=20, input_len=LengthSpec.parse("100"),
                                     output_len=LengthSpec.parse("7")))
    assert {(r.input_len, r.output_len) for r in fixed.requests} == {(100, 7)}
    uni = generate(SyntheticConfig(rate=5, num_requests=200, input_len=LengthSpec.parse("10:20")))
    assert {r.input_len for r in uni.requests} == set(range(10, 21))
    src = Workload("src", (Request(index=0, arrival_s=0, input_len=300, output_len=30),
                           Request(index=1, arrival_s=1, input_len=900, output_len=90)))
    sampled = generate(SyntheticConfig(rate=5, num_requests=50, input_len=LengthSpec.parse("trace"),
                                       output_len=LengthSpec.parse("trace")), lengths_from=src)
    assert {(r.input_len, r.output_len) for r in sampled.requests} == {(300, 30), (900, 90)}
    with pytest.raises(ValueError, match="trace"):
        generate(SyntheticConfig(rate=5, num_requests=5, input_len=LengthSpec("trace")))
    for bad in ("0", "20:10", "x"):
        with pytest.raises(ValueError):
            LengthSpec.parse(bad)


def test_bad_trace_files_fail_clearly(tmp_path: Path) -> None:
    bad = tmp_path / "t.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_trace(bad)
    with pytest.raises(ValueError, match="not found"):
        load_trace(tmp_path / "none.jsonl")
    j = tmp_path / "t.jsonl"
    j.write_text('{"timestamp": 5, "input_length": 3}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_trace(j)


def test_shared_prefix_tokens_count_what_repeats_an_earlier_prompt() -> None:
    """Token-exact with the prompt builder: blocks named alike hold the same tokens, a prompt's last
    block is cut to its length, and only a leading run of blocks can repeat."""
    b = PREFIX_BLOCK_TOKENS
    reqs = [
        Request(0, 0.0, 2 * b + 100, 1, (1, 2, 3)),  # nothing before it
        Request(1, 1.0, 3 * b, 1, (1, 2, 3)),  # repeats all of request 0: 2 full blocks + 100 of the third
        Request(2, 2.0, b + 7, 1, (1, 9)),  # repeats block 1 only
        Request(3, 3.0, b, 1, (9, 2)),  # block 9 alone has never led a prompt
        Request(4, 0.5, 50, 1, (1,)),  # arrives second: the first 50 tokens of block 1
    ]
    assert shared_prefix_tokens(reqs) == (2 * b + 100) + b + 50
    assert shared_prefix_tokens([Request(0, 0.0, 10, 1)]) is None
    prompts = PromptBuilder(PromptConfig(vocab_size=1000, seed=1))
    t0, t1, t4 = prompts.tokens(reqs[0]), prompts.tokens(reqs[1]), prompts.tokens(reqs[4])
    assert t1[: 2 * b + 100] == t0 and t4 == t0[:50]


def test_smaller_hash_blocks_keep_every_shared_prefix_of_the_trace(mooncake: Workload) -> None:
    """``hash_block_tokens`` shrinks prompts by B/512 but keeps each one's every block id, so the
    reusable share of prompt tokens stays what it was at full length (cutting lengths leaves most
    prompts only their first block, the one every conversation starts with, and inflates it)."""
    head = Scaling(max_requests=600).apply(mooncake)
    small = Scaling(max_requests=600, hash_block_tokens=16).apply(mooncake)
    cut = Scaling(max_requests=600, length_ratio=16 / 512).apply(mooncake)
    for r, o in zip(small.requests, head.requests, strict=True):
        assert r.hash_ids == o.hash_ids and r.hash_block == 16
        assert r.input_len == math.ceil(o.input_len / 32) and r.output_len == o.output_len
    share = {name: shared_prefix_tokens(w.requests) / w.describe()["input_tokens"]
             for name, w in (("head", head), ("small", small), ("cut", cut))}  # fmt: skip
    assert share["small"] == pytest.approx(share["head"], abs=0.01)
    assert share["cut"] > share["head"] + 0.3
    prompts = PromptBuilder(PromptConfig(vocab_size=1000, seed=1))
    a, b = [r for r in small.requests if r.hash_ids and r.hash_ids[0] == 0 and r.input_len > 40][:2]
    assert a.hash_ids and b.hash_ids and a.hash_ids[1] != b.hash_ids[1]
    ta, tb = prompts.tokens(a), prompts.tokens(b)
    assert len(ta) == a.input_len and ta[:16] == tb[:16] and ta[16:32] != tb[16:32]
    assert small.scaling["hash_block_tokens"] == 16
    with pytest.raises(ValueError, match="hash_block_tokens"):
        Scaling(hash_block_tokens=513)
