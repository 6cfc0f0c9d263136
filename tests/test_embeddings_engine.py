"""Embeddings in the engine and the worker cores: pooled vectors against transformers, the same vector
whichever batch and chunks an input runs in, and an embedding input's blocks back in the pool."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest
import torch

from pdfabric.control import Abort, Embed, Embedded, Generate
from pdfabric.decode.core import ColocatedCore, DecodeCore
from pdfabric.engine.generate import ReferenceEngine
from pdfabric.engine.pooling import Pooling, declared_pooling
from pdfabric.engine.runner import ModelRunner
from pdfabric.engine.stepper import Stepper
from pdfabric.prefill.core import PrefillCore
from pdfabric.profile import WorkerProfile
from pdfabric.sampling_params import SamplingParams
from pdfabric.worker.core import WrongMessage
from pdfabric.worker.spec import FixedProfile
from tests.core_helpers import core_spec

BLOCK = 16
PROFILE = FixedProfile(WorkerProfile())


def _ids(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 300, (n,), generator=g).tolist())


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_vectors_match_transformers(hf_llama_dir: Path, mode: str, normalize: bool) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModel.from_pretrained(hf_llama_dir).float().eval()
    ids = list(_ids(29, 1))
    with torch.no_grad():
        states = hf(torch.tensor([ids])).last_hidden_state[0]  # [tokens, hidden], after the final norm
    want = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[mode]
    if normalize:
        want = torch.nn.functional.normalize(want, dim=0)
    got = torch.tensor(ReferenceEngine(hf_llama_dir, block_size=BLOCK).embed(ids, mode, normalize))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _drive(core, stepper: Stepper) -> dict[str, bytes]:  # noqa: ANN001 - any worker core
    vectors: dict[str, bytes] = {}
    while core.has_work:
        step = core.schedule()
        assert step is not None
        for msg in core.complete(step, stepper.run(step.chunks, core.tables), 0.01):
            if isinstance(msg, Embedded):
                for r in msg.results:
                    assert not r.error and r.compute_s > 0
                    vectors[r.request_id] = r.vector
    return vectors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_a_vector_is_the_same_in_any_batch_and_chunks(hf_llama_dir: Path, dtype: str, mode: str) -> None:
    """Inputs of several lengths pooled by a colocated core with a small token budget (several chunks
    each, beside a generation request and each other) get the vector the reference computes for each
    alone, in one piece: to the bit in bfloat16, where a position's hidden state does not depend on
    its chunk (docs/engine.md, Batch invariance); float32's prompt attention sums a chunk's context
    in another order. The generation's tokens are unchanged; every block is back in the pool."""
    reference = ReferenceEngine(hf_llama_dir, dtype=dtype, block_size=BLOCK)
    inputs = {f"e{i}": _ids(n, i) for i, n in enumerate((5, 40, 17, 1, 33))}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want_tokens = reference.generate(list(_ids(23, 9)), params).token_ids
    spec = core_spec("colocated", 64, block_size=BLOCK, max_model_len=256, max_batch_tokens=24)
    core = ColocatedCore(spec, PROFILE)
    stepper = Stepper(ModelRunner(reference.model, 64, BLOCK))
    core.handle(Generate("gen", _ids(23, 9), params, ()))
    for rid, ids in inputs.items():
        assert core.handle(Embed(rid, ids, mode, True)) == []
    gen = core.scheduler.get("gen")
    vectors = _drive(core, stepper)
    assert gen is not None and gen.output_ids == want_tokens
    assert set(vectors) == set(inputs)
    for rid, ids in inputs.items():
        got, want = array("f", vectors[rid]).tolist(), reference.embed(list(ids), mode, True)
        if dtype == "bfloat16":
            assert got == want, rid
        else:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), rid
    assert core.tables.pool.num_free == 64


def test_prefill_core_embeds_and_decode_core_refuses(hf_llama_dir: Path) -> None:
    reference = ReferenceEngine(hf_llama_dir, block_size=BLOCK)
    core = PrefillCore(core_spec("prefill", 32, block_size=BLOCK, max_model_len=64), PROFILE)
    core.handle(Embed("a", _ids(20, 2), "mean", False, priority=0, background=True))
    assert core.scheduler.get("a").params.background  # a batch job's input: prefilled in short chunks
    vectors = _drive(core, Stepper(ModelRunner(reference.model, 32, BLOCK)))
    assert array("f", vectors["a"]).tolist() == reference.embed(list(_ids(20, 2)), "mean", False)
    assert core.tables.pool.num_free == 32 and core.received == 0
    with pytest.raises(WrongMessage):
        DecodeCore(core_spec("decode", 8), PROFILE).handle(Embed("b", (1, 2), "last", True))


def test_refused_inputs_and_aborts_free_everything() -> None:
    core = ColocatedCore(core_spec("colocated", 8, block_size=BLOCK, max_model_len=40), PROFILE)
    (too_long,) = core.handle(Embed("long", tuple(range(41)), "last", True))
    assert isinstance(too_long, Embedded) and "does not fit" in too_long.results[0].error
    assert core.handle(Embed("fits", tuple(range(40)), "last", True)) == []
    step = core.schedule()
    assert step is not None and step.num_samples == 0  # an embedding input samples nothing
    assert core.tables.pool.num_free < 8
    assert core.handle(Abort("fits", "client gone")) == []
    assert core.tables.pool.num_free == 8 and not core.has_work
    core.drain()
    (draining,) = core.handle(Embed("late", (1,), "cls", True))
    assert "draining" in draining.results[0].error


def test_declared_pooling(tmp_path: Path) -> None:
    assert declared_pooling(tmp_path) == Pooling("last", True)
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [256, 64, 128]}))
    (tmp_path / "1_Pooling").mkdir()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    pooling = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    assert declared_pooling(tmp_path) == Pooling("mean", False, (64, 128, 256))
    modules.append(
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert declared_pooling(tmp_path) == Pooling("mean", True, (64, 128, 256))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling"):
        declared_pooling(tmp_path)
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="not computed"):
        declared_pooling(tmp_path)
    with pytest.raises(ValueError, match="pooling mode"):
        Pooling("max")
