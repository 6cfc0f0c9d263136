"""The Llama-family decoder (Llama, Mistral, Qwen2) for a flat batch of tokens over a paged KV cache.

One forward serves fresh prefills, chunked prefills that continue a cached prompt, and decode steps of
many sequences: the batch is ``T`` tokens laid end to end, and ``AttentionMetadata`` says which
sequence each belongs to, where its KV goes and how much context it sees. Parameter names follow the
Hugging Face checkpoints, except that the projections reading the same input are stacked into one
matrix (``stacked_shards``: q, k and v; gate and up), so each layer runs two matmuls fewer; the loader
assigns each checkpoint tensor to its rows. No parallelism, transport or scheduling lives here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pdfabric.engine.config import ModelConfig, RopeScaling
from pdfabric.kernels import AttentionMetadata, apply_rope, paged_attention, rms_norm, silu_and_mul, store_kv


def stacked_shards(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each stacked projection's checkpoint parts, in row order, with their row counts."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
        "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)),
    }


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; normalised in float32, scaled in the model dtype (as Hugging Face does)
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, factors: tuple[float, ...] | None = None
) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim / 2]`` in float32, with Llama-3 scaling if configured, or
    each divided by its factor (``ModelConfig.rope_freq_factors``: a GGUF file's, as llama.cpp divides)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    )
    if factors is not None:
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    if scaling is None:
        return inv_freq
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_rows, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_out_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [T, hidden]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)  # q and k heads together
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, heads | kv_heads, head_dim]
        v = qkv[:, self.num_heads + self.num_kv_heads :]  # [T, kv_heads, head_dim]
        store_kv(k, v, kv_cache, meta.slot_mapping, meta.tiled_kv)
        out = paged_attention(q, kv_cache, meta, self.scale)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> gate, up: [T, intermediate] -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [T, hidden], the residual stream: each block's output is added to it in place
        x += self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x += self.mlp(self.post_attention_layernorm(x))
        return x


class HeadEmbedding(nn.Module):
    """The token embedding of a tied head that a runner packed: each looked-up row is read from the
    head's packed weight (``rows``, ``kernels.linear.row_reader``: the table as the head multiplies it,
    quantized where the head is), so the table is held once instead of twice."""

    def __init__(self, rows: Callable[[torch.Tensor], torch.Tensor], embedding_dim: int) -> None:
        super().__init__()
        self._rows = rows  # a function over the head, not a submodule: the weights are the head's
        self.embedding_dim = embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [...] -> [..., hidden]
        return self._rows(input_ids.reshape(-1)).reshape(*input_ids.shape, self.embedding_dim)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head. Build it on the meta device and load weights with ``assign=True``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # A plain attribute, not a buffer: it is derived from the config, never loaded.
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_freq_factors)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Runs the batch and returns the final hidden states ``[T, hidden]``.

        Each layer writes the new tokens' KV into its cache tensor before attending; ``after_layer(i)``
        is called once layer ``i`` is done, when its KV for this batch is final.
        """
        # input_ids, positions: [T]
        cos, sin = self.rotary(positions)
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, kv_cache, meta)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm(x)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's ``cos`` and ``sin`` ``[T, 1, head_dim]`` (float32) at ``positions``."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, head_dim / 2]
        cos = freqs.cos().repeat(1, 2)[:, None, :]  # [T, 1, head_dim]
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)[:, None, :]  # first half negated
        return cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab] in float32. An unpacked head rounds them to the model
        # dtype first (as Hugging Face computes them); the CPU's invariant kernel, packed by a runner,
        # returns its float32 sums (bfloat16 logits near 25 are 0.125 apart: a greedy choice between two
        # that float32 tells apart became a tie). A tied head multiplies by the embedding table unless a
        # runner packed it.
        if self.lm_head is None:
            return nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
