"""Weights quantized in groups of 32 inputs: pdfabric's int4, and GGUF's Q4_0, Q4_1, Q4_K and Q8_0 as
they are; and in groups of 16 inputs: GGUF's Q3_K and Q6_K.

A ``GroupedWeight`` holds an ``[n, k]`` weight as one small integer ``q`` a weight and, for each output
and each run of 32 inputs (a group), a float32 scale ``d`` and (4 bits) a float32 offset ``m``:

    w[n, j] = d[n, j // 32] * q[n, j] + m[n, j // 32]

(8-bit weights may come in groups of 16 inputs instead, ``group``: Q6_K's sub-blocks; or, in groups of
32, with offsets: Q5_1's and Q5_K's.)

- ``quantize_int4`` (``[worker] quantization = "int4"``): 4 bits a weight on each group's own range,
  ``m`` its smallest weight and ``d`` a fifteenth of its span, every weight rounded to the nearest
  of the 16 levels (``q`` in 0..15, within half a step). Asymmetric because on SmolLM2 the symmetric
  rule (GGUF's Q4_0: the weight of largest magnitude at ``-8 d``) cost 27% in perplexity against
  bfloat16 and this one 0.1% (docs/engine.md).
- ``from_gguf`` (``quantization = "gguf"``): a GGUF tensor's blocks, unpacked without dequantizing.
  Q4_0 (``m = -8 d``), Q4_1 (``d``, ``m`` half precision), Q8_0 (8 bits, no offset) and Q4_K (a scale
  and an offset per 32-input sub-block: products of a half-precision number and a 6-bit integer,
  which float32 holds exactly), Q5_0 (8 bits: ``q - 16`` in -16..15, ``d`` half precision), Q5_1 and
  Q5_K (8 bits with offsets: ``q`` in 0..31; Q5_K's scales and offsets made as Q4_K's) and Q6_K
  (8 bits in groups of 16: ``q - 32`` in -32..31 and ``d``
  the super-block's half-precision scale times the sub-block's 8-bit one, exact in float32) and Q3_K
  (8 bits in groups of 16: ``q`` in -4..3 and ``d`` the half-precision scale times the sub-block's
  6-bit one less 32, exact too).
  ``dequantize`` of the result equals the ``gguf`` package's own dequantization to the bit
  (``tests/test_quantized.py``).

``csrc/linear_cpu.c`` multiplies them as they are (``pd_linear_pack_grouped``); ``dequantize`` is the
reference its tests multiply with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # inputs per quantization group
GGUF_TYPES = (
    "Q4_0",
    "Q4_1",
    "Q3_K",
    "Q4_K",
    "Q5_0",
    "Q5_1",
    "Q5_K",
    "Q6_K",
    "Q8_0",
)  # served as blocks; others dequantized


@dataclass(frozen=True)
class GroupedWeight:
    """An ``[n, k]`` weight in groups of ``group`` inputs (32; 16 for 8 bits): ``q`` ``[n, k]`` (4 bits:
    uint8 in 0..15; 8 bits: int8), ``scales`` ``[n, k / group]`` float32, ``offsets`` like ``scales``
    (4 bits always; 8 bits in groups of 32 may have them; None otherwise)."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group: int = GROUP

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.group not in (GROUP, 16) or (self.group == 16 and self.bits != 8):
            raise ValueError(f"groups of {self.group} inputs: 32, or 16 for 8 bits")
        if k % self.group or self.scales.shape != (n, k // self.group):
            raise ValueError(f"a {tuple(self.q.shape)} grouped weight needs [n, k / {self.group}] scales")
        if self.bits not in (4, 8) or (self.bits == 4 and self.offsets is None):
            raise ValueError("4-bit groups have offsets; 8-bit groups may, in groups of 32")
        if self.offsets is not None and (self.group != GROUP or self.offsets.shape != self.scales.shape):
            raise ValueError("offsets come one a group of 32, like the scales")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def rows(self, keep: slice | torch.Tensor) -> GroupedWeight:
        """The weight of some outputs (a slice or an index of rows)."""
        offsets = None if self.offsets is None else self.offsets[keep]
        return GroupedWeight(self.q[keep], self.scales[keep], offsets, self.bits, self.group)

    @staticmethod
    def stack(parts: list[GroupedWeight]) -> GroupedWeight | None:
        """The parts' outputs one after another (a stacked projection), or None where their formats
        differ (each part then has to be held in the compute dtype)."""
        if len({(p.bits, p.group, p.offsets is None, p.shape[1]) for p in parts}) != 1:
            return None
        offsets = None if parts[0].offsets is None else torch.cat([p.offsets for p in parts])
        q, scales = torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts])
        return GroupedWeight(q, scales, offsets, parts[0].bits, parts[0].group)


def dequantize(weight: GroupedWeight) -> torch.Tensor:
    """The float32 ``[n, k]`` weight: ``d * q + m`` group by group (the kernels' reference)."""
    n, k = weight.shape
    group = weight.group
    q = (weight.q.to(torch.int8) if weight.bits == 8 else weight.q).float().reshape(n, k // group, group)
    w = q * weight.scales[..., None]
    if weight.offsets is not None:
        w = w + weight.offsets[..., None]
    return w.reshape(n, k)


def quantize_int4(weight: torch.Tensor) -> GroupedWeight:
    """``weight`` ``[n, k]`` (k a multiple of 32) in 4-bit groups on each group's range (module
    docstring); a group of one value gets a scale of 0 and dequantizes to that value exactly."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = w.amin(dim=2), w.amax(dim=2)
    d = (high - low) / 15.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((w - low[..., None]) * inverse[..., None]).clamp_(0, 15)
    return GroupedWeight(q.to(torch.uint8).reshape(n, k).contiguous(), d.contiguous(), low.contiguous(), 4)


def from_gguf(type_name: str, blocks: np.ndarray, shape: tuple[int, int]) -> GroupedWeight:
    """The weight ``[n, k]`` whose GGUF blocks of ``type_name`` (one of ``GGUF_TYPES``) are ``blocks``
    (uint8, one row of bytes per output), unpacked as they are."""
    n, k = shape
    if type_name not in GGUF_TYPES:
        raise ValueError(f"GGUF type {type_name} has no kernel; served are {', '.join(GGUF_TYPES)}")
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    if type_name == "Q4_K":
        return _from_q4_k(blocks, n, k)
    if type_name == "Q6_K":
        return _from_q6_k(blocks, n, k)
    if type_name == "Q3_K":
        return _from_q3_k(blocks, n, k)
    if type_name in ("Q5_0", "Q5_1"):
        return _from_q5(type_name, blocks, n, k)
    if type_name == "Q5_K":
        return _from_q5_k(blocks, n, k)
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    b = blocks.reshape(n, k // GROUP, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        q = b[..., 2:].copy().view(np.int8).reshape(n, k)
        return GroupedWeight(torch.from_numpy(q).view(torch.uint8), torch.from_numpy(d), None, 8)
    body = b[..., 4:] if type_name == "Q4_1" else b[..., 2:]
    q = _nibbles(body).reshape(n, k)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if type_name == "Q4_1" else d * -8.0
    return GroupedWeight(
        torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m)), 4
    )


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """A GGUF 4-bit block's 16 bytes as its 32 values: the low nibbles first, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _from_q5(type_name: str, blocks: np.ndarray, n: int, k: int) -> GroupedWeight:
    # 32 inputs: d (half; Q5_1: then m, half), 32 fifth bits (a little-endian word, bit j for input j),
    # then 16 bytes of low nibbles (inputs j and 16 + j in byte j). Q5_0: w = d * (q - 16), held as 8
    # bits without an offset; Q5_1: w = d * q + m.
    offset = type_name == "Q5_1"
    size = 24 if offset else 22
    b = blocks.reshape(n, k // GROUP, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    high = np.unpackbits(b[..., size - 20 : size - 16], axis=-1, bitorder="little")  # [n, groups, 32]
    q = (_nibbles(b[..., size - 16 :]) | (high << 4)).astype(np.int8) - np.int8(0 if offset else 16)
    q8 = torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))).view(torch.uint8)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if offset else None
    return GroupedWeight(q8, torch.from_numpy(d), None if m is None else torch.from_numpy(m), 8)


def _from_q6_k(blocks: np.ndarray, n: int, k: int) -> GroupedWeight:
    # A super-block of 256 inputs: 128 bytes of low nibbles (each 64 bytes: inputs 0-63 low, 64-127
    # high, per half of the block), 64 bytes of high bit pairs (each 32 bytes: four inputs 32 apart),
    # sixteen int8 sub-block scales, then d (half): w = d * scale * (q - 32) over 16-input sub-blocks.
    b = blocks.reshape(n, k // 256, 210)
    nibble, pair = np.array([0, 4], dtype=np.uint8), np.array([0, 2, 4, 6], dtype=np.uint8)
    ql = b[..., :128].reshape(n, k // 256, 2, 1, 64) >> nibble.reshape(1, 1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, k // 256, 2, 4, 32)
    qh = b[..., 128:192].reshape(n, k // 256, 2, 1, 32) >> pair.reshape(1, 1, 1, 4, 1)
    q = ((ql | ((qh & 0x03) << 4)).astype(np.int8) - np.int8(32)).reshape(n, k)
    scale = b[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = b[..., 208:210].copy().view(np.float16).astype(np.float32)
    scales = (d * scale).reshape(n, k // 16)
    return GroupedWeight(
        torch.from_numpy(np.ascontiguousarray(q)).view(torch.uint8), torch.from_numpy(scales), None, 8, 16
    )


def _from_q3_k(blocks: np.ndarray, n: int, k: int) -> GroupedWeight:
    # A super-block of 256 inputs, 110 bytes: 32 bytes of high bits (bit j of byte i for input 32 j + i),
    # 64 bytes of low bit pairs (each 32 bytes: four inputs 32 apart, pairs 0, 2, 4, 6 of each byte),
    # sixteen 6-bit sub-block scales in 12 bytes (low nibbles of bytes 0-7, scales 0-7 then 8-15; high
    # bit pairs of bytes 8-11, scales 0-3, 4-7, ... in pairs 0, 2, 4, 6), then d (half). A weight is
    # d * (scale - 32) * q, q the low pair minus 4 where its high bit is clear (-4..3), over 16-input
    # sub-blocks: held as 8 bits in groups of 16, each group's scale d * (scale - 32), exact in float32.
    b = blocks.reshape(n, k // 256, 110)
    high = _fields(b[..., :32], 1) & 1
    low = _fields(b[..., 32:96].reshape(n, k // 256, 2, 32), 2).reshape(n, k // 256, 256) & 3
    q = low.astype(np.int8) - (4 * (high ^ 1)).astype(np.int8)
    nibbles = _fields(b[..., 96:104], 4) & 0x0F
    pairs = _fields(b[..., 104:108], 2) & 3
    scale = (nibbles | (pairs << 4)).astype(np.float32) - 32.0
    d = b[..., 108:110].copy().view(np.float16).astype(np.float32)
    q8 = torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))).view(torch.uint8)
    return GroupedWeight(q8, torch.from_numpy((d * scale).reshape(n, k // 16)), None, 8, 16)


def _fields(packed: np.ndarray, bits: int) -> np.ndarray:
    """Each byte of ``packed`` (its last axis) shifted right by 0, ``bits``, 2 ``bits``, ... up to 8:
    the byte's fields, lowest first, as runs over the last axis (run i: every byte's field i)."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    fields = packed[..., None, :] >> shifts.reshape(len(shifts), 1)
    return fields.reshape(*packed.shape[:-1], len(shifts) * packed.shape[-1])


def _k_scales(b: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A K-quant super-block's (Q4_K's, Q5_K's: its first 16 bytes) scales and offsets for its eight
    sub-blocks of 32: d, dmin (half), then 12 bytes of 6-bit scales and offsets; ``[n, k / 32]``."""
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = b[..., 4:16].astype(np.uint8)
    lo, hi, mixed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
    scales = (d[..., None] * sc).reshape(n, k // GROUP)
    offsets = -(dmin[..., None] * mn).reshape(n, k // GROUP)
    return torch.from_numpy(scales), torch.from_numpy(offsets)


def _from_q4_k(blocks: np.ndarray, n: int, k: int) -> GroupedWeight:
    # A super-block of 256 inputs: its scales (_k_scales), then 128 bytes of 4-bit values (each 32
    # bytes: sub-block 2i low, 2i+1 high).
    b = blocks.reshape(n, k // 256, 144)
    qs = b[..., 16:].reshape(n, k // 256, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, k)
    return GroupedWeight(torch.from_numpy(np.ascontiguousarray(q)), *_k_scales(b, n, k), 4)


def _from_q5_k(blocks: np.ndarray, n: int, k: int) -> GroupedWeight:
    # A super-block of 256 inputs: its scales (_k_scales), 32 bytes of fifth bits (bit j of byte l for
    # input l of sub-block j), then Q4_K's 128 bytes of low nibbles; q in 0..31, held as 8 bits.
    b = blocks.reshape(n, k // 256, 176)
    low = b[..., 48:].reshape(n, k // 256, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(
        1, 1, 1, 2, 1
    )
    high = b[..., 16:48].reshape(n, k // 256, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = ((low & 0x0F).reshape(n, k // 256, 8, 32) | ((high & 0x01) << 4)).astype(np.int8).reshape(n, k)
    q8 = torch.from_numpy(np.ascontiguousarray(q)).view(torch.uint8)
    return GroupedWeight(q8, *_k_scales(b, n, k), 8)
