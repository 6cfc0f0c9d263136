"""Shared fixtures: small Hugging Face checkpoints made on the spot (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 Llama checkpoint with grouped-query attention and random weights."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(path)
    return path


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Built-in models are written under a per-run directory, never the user's cache."""
    import os

    os.environ.setdefault("PDFABRIC_CACHE_DIR", str(tmp_path_factory.mktemp("pdfabric-cache")))
