"""Runs one forward step for a batch described in host lists: the one place such a batch becomes tensors.

Schedulers (torch-free) hand over ``StepEntry`` records; ``ModelRunner.prepare`` builds the flat
token batch and ``AttentionMetadata``; ``ModelRunner.step`` runs the model and returns the logits of
the entries that asked for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pdfabric.engine.block_pool import blocks_for
from pdfabric.engine.kv_cache import allocate_kv_cache
from pdfabric.engine.model import HeadEmbedding, LlamaForCausalLM
from pdfabric.kernels import AttentionMetadata, get_backend
from pdfabric.kernels.decoder_cpu import Decoder
from pdfabric.kernels.linear import can_pack, check_kind, check_quantization, pack_linears, packed, row_reader
from pdfabric.kernels.paged_attention_cpu import int8_kv_supported, tiled_kv_supported
from pdfabric.kernels.weight_forms import Quantizer

# Steps whose every sequence has at most this many new tokens (decode steps; speculation's checks and
# drafts) run their layers in one C call where it exists (``kernels/decoder_cpu.py``), each token as
# a decode row; longer chunks run the model's forward, whose prompt kernel reads a sequence's keys
# once for 16 tokens at a time.
DECODER_CHUNK_TOKENS = 16


@dataclass(frozen=True)
class StepEntry:
    """One sequence's share of a step: run ``token_ids`` after ``num_cached`` tokens already cached."""

    token_ids: tuple[int, ...]
    num_cached: int
    block_table: tuple[int, ...]
    needs_logits: bool = True
    all_logits: bool = False  # logits for every token of the entry (prompt scoring), not just the last


@dataclass(frozen=True)
class PreparedStep:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states to turn into logits


class ModelRunner:
    """Owns the model and its KV-cache tensors on one device.

    It packs the model's linear layers and its head once (``kernels/linear.py``; by default the
    batch-invariant kernel of the model's device: C on CPUs, Triton on CUDA; ``linears="onednn"`` or
    ``"cublas"`` for the vendor library's, which gives up batch invariance) unless the kernel
    backend is ``torch`` (the plain reference path); the model passed in is changed in place. Steps
    of decode rows and short chunks (``DECODER_CHUNK_TOKENS``) then run their decoder layers in one
    C call (``kernels/decoder_cpu.py``) where every kernel of a layer is a C one; other steps run
    the model's forward. ``quantizer``: where the weights ``quantization`` holds quantized come from
    (``engine/quantized_cache.py``; default: computed here).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        linears: str = "invariant",
        quantization: str = "none",
        kv_cache_dtype: str = "auto",
        quantizer: Quantizer | None = None,
    ) -> None:
        if get_backend() != "torch":
            _pack_model(model, linears, quantization, quantizer)
        elif quantization != "none":
            raise ValueError(f"quantization {quantization!r} needs the C kernels (not the torch backend)")
        self.model = model
        self.config = model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = model.model.norm.weight.device
        cfg = self.config
        # Tiled where the CPU prompt kernel reads a tiled cache in place; the torch backend, the plain
        # reference path, keeps the dense layout.
        self.kv_tiled = (
            self.device.type == "cpu"
            and get_backend() in ("auto", "cpu")
            and tiled_kv_supported(
                model.model.norm.weight.dtype,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                block_size,
            )
        )
        self.kv_cache_dtype = kv_cache_dtype
        if kv_cache_dtype == "int8" and not (
            self.kv_tiled and int8_kv_supported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
        ):
            raise ValueError(
                "kv_cache_dtype 'int8' needs a bfloat16 model on a CPU with AVX512-BF16 and AVX512-VNNI, "
                "the C kernels, heads of a multiple of 64 dims and blocks of a multiple of 16 tokens"
            )
        self.kv_caches = allocate_kv_cache(cfg, num_blocks, block_size, self.device, kv_cache_dtype)
        self.decoder_chunk_tokens = DECODER_CHUNK_TOKENS  # (0: every step by the forward, to compare)

    @property
    def weight_bytes(self) -> int:
        """The model's weights as this runner holds them (packed, quantized or not), each tensor once."""
        seen: dict[int, int] = {}
        for t in (*self.model.parameters(), *self.model.buffers()):
            if t.device.type == "meta" or not t.numel():
                continue
            try:  # by storage: views and tied tensors count once
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):  # oneDNN's packed weights have no storage
                seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def resize_kv(self, num_blocks: int) -> None:
        """A KV cache of ``num_blocks`` blocks in place of the one it has (before any step ran)."""
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(
            self.config, num_blocks, self.block_size, self.device, self.kv_cache_dtype
        )

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """One cache tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``; its blocks are
        tiled for the CPU prompt kernel where ``kv_tiled`` (``AttentionMetadata.tiled_kv``); an int8
        cache (``kv_cache_dtype``) is tiled, its last dimension ``head_dim + 4`` bytes."""
        return self._kv_caches

    @kv_caches.setter
    def kv_caches(self, caches: list[torch.Tensor]) -> None:
        # (a decode worker moves them into shared memory) decode steps run their layers in one C
        # call where every kernel of a layer is a C one; that call holds the caches' addresses
        self._kv_caches = caches
        self.decoder = Decoder.build(self.model, caches, self.kv_tiled) if self.device.type == "cpu" else None

    def prepare(self, entries: list[StepEntry]) -> PreparedStep:
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        for e in entries:
            if not e.token_ids:
                raise ValueError("a step entry must carry at least one token")
            total = e.num_cached + len(e.token_ids)
            if total > self.config.max_position_embeddings:
                raise ValueError(
                    f"sequence of {total} tokens exceeds the model's {self.config.max_position_embeddings}"
                )
            if blocks_for(total, self.block_size) > len(e.block_table):
                raise ValueError(f"block table of {len(e.block_table)} blocks cannot hold {total} tokens")
            ids.extend(e.token_ids)
            positions.extend(range(e.num_cached, total))
            if e.all_logits:
                logits_rows.extend(range(len(ids) - len(e.token_ids), len(ids)))
            elif e.needs_logits:
                logits_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(
            query_lens=[len(e.token_ids) for e in entries],
            seq_lens=[e.num_cached + len(e.token_ids) for e in entries],
            block_tables=[list(e.block_table) for e in entries],
            block_size=self.block_size,
            device=self.device,
            tiled_kv=self.kv_tiled,
        )
        as_long = {"dtype": torch.int64, "device": self.device}
        return PreparedStep(
            input_ids=torch.tensor(ids, **as_long),
            positions=torch.tensor(positions, **as_long),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, **as_long),
        )

    def step(
        self, entries: list[StepEntry], after_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Runs the batch, writing its KV into the cache; returns float32 logits ``[N, vocab]`` for the
        entries with ``needs_logits`` (their last token) or ``all_logits`` (each of their tokens), in
        order. ``after_layer(i)``: called as each layer finishes."""
        return self.run(entries, after_layer)[0]

    def _decoder_tokens(self) -> int:
        """The most new tokens a sequence may have in a step that the C decoder serves: one where its
        decode rows are not a prompt chunk's to the bit (``Decoder.rows_only``)."""
        return min(1, self.decoder_chunk_tokens) if self.decoder.rows_only else self.decoder_chunk_tokens

    @torch.inference_mode()
    def run(
        self, entries: list[StepEntry], after_layer: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step``'s logits, and the final hidden states ``[T, hidden]`` (after the last norm) of every
        token of the batch, the entries' tokens end to end: what embeddings are pooled from."""
        prepared = self.prepare(entries)
        if self.decoder is not None and prepared.meta.max_query_len <= self._decoder_tokens():
            model = self.model
            cos, sin = model.rotary(prepared.positions)
            x = model.model.embed_tokens(prepared.input_ids)  # [T, hidden], updated in place
            self.decoder(x, cos, sin, prepared.meta, after_layer)
            hidden = model.model.norm(x)
        else:
            hidden = self.model(
                prepared.input_ids, prepared.positions, self.kv_caches, prepared.meta, after_layer
            )
        return self.model.compute_logits(hidden[prepared.logits_indices]), hidden


def head_quantization(quantization: str, device: str) -> str:
    """How the head is held when the layers are held as ``quantization``: the same, except that an
    int4 model keeps its head in int8 on CPUs and in its dtype elsewhere (at 4 bits SmolLM2's head
    cost 27% in perplexity against bfloat16, in 8 bits 0.1%: docs/engine.md; GGUF files too keep
    their output layer in 6 or 8 bits); a ``w4a8`` model keeps its head in ``w8a8``."""
    if quantization == "w4a8":
        return "w8a8"
    if quantization != "int4":
        return quantization
    return "int8" if device == "cpu" else "none"


def _pack_model(
    model: LlamaForCausalLM, kind: str, quantization: str = "none", quantizer: Quantizer | None = None
) -> None:
    """Packs the linear layers, and the head (a tied one as a layer of its own: it then runs the same
    kernel as every other projection; on CUDA it multiplies the table itself). ``quantization``: how
    the packed weights are held (``kernels/linear.py``), the head's as ``head_quantization`` says. A
    tied head packed for the CPU kernels also serves the embedding lookup (``HeadEmbedding``): the
    table is held once, as the head holds it (quantized rows where the head is quantized).
    ``quantizer``: where quantized weights come from (``engine/quantized_cache.py``; default: computed)."""
    device = model.model.norm.weight.device.type  # (the table may be the packed head's already)
    check_kind(kind, device)
    check_quantization(quantization, kind, device)
    pack_linears(model.model, kind, quantization, quantizer, "model.")
    head = model.lm_head
    if head is None:
        embed = model.model.embed_tokens.weight
        head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
        head.weight = embed
        head.gguf_blocks = model.__dict__.pop("tied_head_blocks", None)  # load_model's, under "gguf"
    held_as = head_quantization(quantization, device)
    if isinstance(head, nn.Linear) and can_pack(head, kind, held_as):
        model.lm_head = packed(head, kind, held_as, quantizer, "lm_head", float_out=True)
        rows = row_reader(model.lm_head) if head.weight is model.model.embed_tokens.weight else None
        if rows is not None:
            model.model.embed_tokens = HeadEmbedding(rows, head.in_features)
