"""Loader errors name what is wrong; sharded checkpoints load like single files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdfabric.engine.config import ModelConfig
from pdfabric.engine.loader import CheckpointError, load_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_weights_file(hf_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(hf_llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(d)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_wrong_shape_names_the_tensor(hf_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(hf_llama_dir, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(3, 3\)"):
        load_model(d)


def test_missing_tensor_names_it(hf_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(hf_llama_dir, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_model(d)


def test_unsupported_architecture(hf_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(hf_llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(d)


def test_sharded_checkpoint_and_dtype(hf_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(hf_llama_dir, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, d / file)
    (d / "model.safetensors").unlink()
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(d, dtype="bfloat16")
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert not any(p.is_meta for p in model.parameters())
    ref = load_model(hf_llama_dir)
    torch.testing.assert_close(model.lm_head.weight.float(), ref.lm_head.weight.bfloat16().float())
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="00002"):
        load_model(d)


def test_config_checks() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 3,
    }
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf_dict(base)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        ModelConfig.from_hf_dict({**base, "num_key_value_heads": 2, "rope_scaling": {"rope_type": "yarn"}})
    cfg = ModelConfig.from_hf_dict(
        {**base, "num_key_value_heads": 2, "sliding_window": 128, "max_position_embeddings": 1024}
    )
    assert cfg.max_position_embeddings == 128  # served exactly up to the window only
