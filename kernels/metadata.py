"""The description of a flat batch of tokens that every attention backend reads.

A forward pass sees ``T`` new tokens from ``S`` sequences laid end to end. Sequence ``s`` owns the
query rows ``query_start_loc[s]:query_start_loc[s+1]``; after this step it has ``seq_lens[s]`` tokens
in the paged cache (earlier chunks or decode steps plus the new ones), so its new tokens sit at
positions ``seq_lens[s] - query_len .. seq_lens[s] - 1`` and each attends causally to everything
before it. One layout covers a fresh prefill (``query_len == seq_len``), a chunk that continues a
cached prompt (``query_len < seq_len``) and decode (``query_len == 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    # Device tensors.
    query_start_loc: torch.Tensor  # [S + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [S] int32, cached tokens per sequence after this step
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0 past each table's end
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot (block * block_size + offset) per token
    # Host copies, so references and launchers never sync on a device tensor.
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # The cache's blocks are tiled for the CPU prompt kernel (``attention_ref.untile_blocks``), not dense.
    tiled_kv: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @cached_property
    def token_rows(self) -> SingleQueryRows:
        """Every token of the batch as a kernel row of its own, attending causally: the token's row, its
        sequence's index and how many tokens it attends to (its position + 1). A decode step's rows
        are ``single_query_rows``; a chunk's tokens run as decode rows of one sequence."""
        tokens, seqs, ctx = [], [], []
        for s, (q_len, s_len) in enumerate(zip(self.query_lens_host, self.seq_lens_host, strict=True)):
            tokens.extend(range(len(tokens), len(tokens) + q_len))
            seqs.extend([s] * q_len)
            ctx.extend(range(s_len - q_len + 1, s_len + 1))
        return SingleQueryRows.of(tokens, seqs, ctx, self.seq_lens.device)

    @cached_property
    def single_query_rows(self) -> SingleQueryRows:
        """The batch's one-token sequences (decode steps) as kernel rows, built once per step."""
        tokens, seqs, ctx = [], [], []
        start = 0
        for s, (q_len, s_len) in enumerate(zip(self.query_lens_host, self.seq_lens_host, strict=True)):
            if q_len == 1:
                tokens.append(start)
                seqs.append(s)
                ctx.append(s_len)
            start += q_len
        return SingleQueryRows.of(tokens, seqs, ctx, self.seq_lens.device)

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        tiled_kv: bool = False,
    ) -> AttentionMetadata:
        """Builds the tensors from host lists: the one place a batch description becomes tensors."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 0 < q_len <= s_len:
                raise ValueError(f"query length {q_len} must be in 1..seq_len ({s_len})")
            if len(table) * block_size < s_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                len(block_tables), max_blocks
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
            tiled_kv=tiled_kv,
        )


@dataclass(frozen=True)
class SingleQueryRows:
    """Kernel rows of one query token each: the token's row in the batch, its sequence's index and
    how many cached tokens it attends to (a decode row: its sequence's ``seq_len``)."""

    token: torch.Tensor  # [R] int32
    seq: torch.Tensor  # [R] int32
    ctx_len: torch.Tensor  # [R] int32
    seqs_host: tuple[int, ...]

    @staticmethod
    def of(tokens: list[int], seqs: list[int], ctx: list[int], device: torch.device) -> SingleQueryRows:
        as_int = {"dtype": torch.int32, "device": device}
        return SingleQueryRows(
            token=torch.tensor(tokens, **as_int),
            seq=torch.tensor(seqs, **as_int),
            ctx_len=torch.tensor(ctx, **as_int),
            seqs_host=tuple(seqs),
        )
