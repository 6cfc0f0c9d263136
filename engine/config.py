"""Model configuration read from a Hugging Face ``config.json`` (Llama family)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    # Each rotary frequency's divisor, as a GGUF file gives them (its rope_freqs tensor, the converter's
    # config key "rope_freq_factors": Llama 3.1's scaling, precomputed); None: no divisors.
    rope_freq_factors: tuple[float, ...] | None = None
    attention_bias: bool = False  # biases on q/k/v
    attention_out_bias: bool = False  # bias on o_proj (Llama's attention_bias has both; Qwen2 only q/k/v)
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"pdfabric runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any], dtype: str | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
        arch = archs[0]
        num_heads = _field(cfg, "num_attention_heads")
        hidden = _field(cfg, "hidden_size")
        torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        # Newer checkpoints keep theta and scaling together in rope_parameters.
        rope = cfg.get("rope_parameters") or {}
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported by pdfabric's Llama implementation")
        return ModelConfig(
            architecture=arch,
            vocab_size=_field(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_field(cfg, "intermediate_size"),
            num_layers=_field(cfg, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=_context_limit(cfg),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(rope or cfg.get("rope_scaling")),
            rope_freq_factors=_freq_factors(cfg, cfg.get("head_dim") or hidden // num_heads),
            # Qwen2 always carries q/k/v biases; Llama and Mistral say so with attention_bias.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            attention_out_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype or str(torch_dtype),
            extra=cfg,
        )

    @staticmethod
    def from_pretrained(path: str | Path, dtype: str | None = None) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face model directory")
        return ModelConfig.from_hf_dict(json.loads(file.read_text()), dtype)


def _field(cfg: dict[str, Any], name: str) -> Any:
    if name not in cfg:
        raise ValueError(f"config.json lacks required field {name!r}")
    return cfg[name]


def _context_limit(cfg: dict[str, Any]) -> int:
    """The longest context served exactly: sliding-window attention is not implemented, so a model
    with a window shorter than its context is served only up to that window."""
    limit = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True):
        limit = min(limit, int(window))
    return limit


def _freq_factors(cfg: dict[str, Any], head_dim: int) -> tuple[float, ...] | None:
    raw = cfg.get("rope_freq_factors")
    if raw is None:
        return None
    factors = tuple(float(v) for v in raw)
    if len(factors) != head_dim // 2 or not all(f > 0 for f in factors):
        raise ValueError(f"rope_freq_factors must be {head_dim // 2} positive numbers (one per frequency)")
    scaled = (cfg.get("rope_parameters") or {}).get("rope_type") not in (None, "default")
    if cfg.get("rope_scaling") or scaled:
        raise ValueError("rope_freq_factors and rope_scaling are two ways of one thing: give one")
    return factors


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; pdfabric supports 'llama3'")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )
