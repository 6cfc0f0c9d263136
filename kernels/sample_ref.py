"""Torch references for the sampler's noise and its batched draw: the path on every device without the
C kernel (``sample_cpu``) and its oracle, bit for bit.

``gumbel_noise_ref(key, ids)`` is standard Gumbel noise for each token id, ``-log(-log(u))`` with ``u``
the 53 high bits of splitmix64(id * golden + key): a function of the key and the token id alone. The
logarithm is ``log_ref``, the same double operations in the same order as ``csrc/sample_cpu.c``'s
``log_poly`` (torch's own ``log`` rounds differently from one vector library to another), so the C
kernel and this reference give the same bits.
"""

from __future__ import annotations

import torch

GOLDEN = 0x9E3779B97F4A7C15
_SQRT2 = 1.4142135623730951
_LN2 = 0.6931471805599453
_MANTISSA = (1 << 52) - 1
# log(m) = 2 atanh(s) = 2 s (1 + z / 3 + z^2 / 5 + ... + z^7 / 15), z = s^2, Horner from the top
_SERIES = (1 / 15, 1 / 13, 1 / 11, 1 / 9, 1 / 7, 1 / 5, 1 / 3, 1.0)


def log_ref(x: torch.Tensor) -> torch.Tensor:
    """The natural logarithm of positive normal float64 ``x`` (relative error below 1e-13)."""
    bits = x.view(torch.int64)
    mantissa = bits & _MANTISSA
    m = (mantissa | (1023 << 52)).view(torch.float64)
    big = (m > _SQRT2).to(torch.int64)  # m into (sqrt(1/2), sqrt(2)]
    m = (mantissa | ((1023 - big) << 52)).view(torch.float64)
    e = (bits >> 52) - 1023 + big
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    p = torch.full_like(z, _SERIES[0])
    for c in _SERIES[1:]:
        p = p * z + c
    return e.double() * _LN2 + (s * 2.0) * p


def gumbel_noise_ref(key: int, ids: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise for the token ids ``ids`` (any shape) under ``key`` (64 bits), on the CPU."""
    x = ids.to("cpu", torch.int64) * _signed(GOLDEN)
    x.add_(_signed(key & 0xFFFFFFFFFFFFFFFF))
    tmp = torch.empty_like(x)
    for bits, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x.bitwise_xor_(_shift(x, bits, tmp)).mul_(_signed(factor))
    x.bitwise_xor_(_shift(x, 31, tmp))
    uniform = _shift(x, 11, tmp).double().add_(0.5).div_(2.0**53)  # in (0, 1)
    return log_ref(log_ref(uniform).neg_()).neg_().float()


def gumbel_argmax_ref(scores: torch.Tensor, temps: list[float], keys: list[int]) -> list[int]:
    """Row r's draw from ``softmax(scores[r] / temps[r])`` (``scores`` float32 ``[rows, vocab]``), with
    the noise of ``keys[r]``: ``argmax(scores[r] / temperature + noise)``, the first maximum."""
    ids = torch.arange(scores.shape[-1])
    out = []
    for row, temperature, key in zip(scores, temps, keys, strict=True):
        noisy = row / torch.tensor(temperature, dtype=torch.float32) + gumbel_noise_ref(key, ids).to(
            row.device
        )
        out.append(int(noisy.argmax()))
    return out


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it (torch's int64 arithmetic wraps like uint64)."""
    return value - 2**64 if value >= 2**63 else value


def _shift(x: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A logical right shift of int64 ``x`` (``>>`` on int64 keeps the sign), into ``out`` if given."""
    shifted = torch.bitwise_right_shift(x, bits, out=out) if out is not None else x >> bits
    return shifted.bitwise_and_((1 << (64 - bits)) - 1)


_LOG2E = 1.44269504
# 2^f = sum (f ln 2)^k / k!, k = 7 down to 0 (Horner), as float32; f in [-1/2, 1/2]
_EXP2_SERIES = (1.52527338e-5, 1.54035304e-4, 1.33335581e-3, 9.61812911e-3, 5.55041087e-2, 2.40226507e-1,
                6.93147181e-1, 1.0)  # fmt: skip


def exp_ref(y: torch.Tensor) -> torch.Tensor:
    """exp(y) for float32 ``y <= 0`` (relative error below 1e-7 near 0, a few 1e-6 towards -87 from
    rounding ``y log2(e)``; 0 below -87), the operations of ``csrc/sample_cpu.c``'s ``exp_neg``."""
    f32 = torch.float32
    t = y * torch.tensor(_LOG2E, dtype=f32)
    n = torch.round(t)  # to the nearest, ties to even, as rintf
    f = t - n
    p = torch.full_like(f, _EXP2_SERIES[0])
    for c in _EXP2_SERIES[1:]:
        p = p * f + torch.tensor(c, dtype=f32)
    scale = ((n.clamp(min=-126.0).to(torch.int32) + 127) << 23).view(f32)
    return torch.where(y < -87.0, torch.zeros_like(p), p * scale)


def gumbel_top_ref(
    scores: torch.Tensor, temps: list[float], top_ks: list[int], top_ps: list[float], keys: list[int]
) -> list[int]:
    """Row r's draw among its candidates: the tokens whose ``x = scores[r] / temps[r]`` is at least the
    ``top_ks[r]``-th largest (ties kept; 0: every token), then, with ``top_ps[r] < 1``, the nucleus
    (by ``e = exp_ref(x - max)`` in descending order, ties by id, each token whose predecessors' mass is
    below ``top_p`` times the candidates' total; masses are ``e`` in integer units of 2^-36, so sums
    are exact, and a token of mass 0 is never kept);
    then ``argmax(x + gumbel_noise_ref(key, id))`` over what is kept, ties to the lower id. A row whose
    largest ``x`` is not finite draws as ``gumbel_argmax_ref``. The whole vocabulary is sorted: the
    oracle, not a fast path."""
    out = []
    vocab = scores.shape[-1]
    for row, temperature, k, top_p, key in zip(scores, temps, top_ks, top_ps, keys, strict=True):
        x = row.cpu() / torch.tensor(temperature, dtype=torch.float32)
        if not bool(x.max().isfinite()):  # a NaN, +inf, every token masked: the plain draw
            out += gumbel_argmax_ref(row[None], [temperature], [key])
            continue
        keep = torch.ones(vocab, dtype=torch.bool)
        if 0 < k < vocab:
            keep = x >= x.topk(k).values[-1]
        if top_p < 1.0:
            e = torch.where(keep, exp_ref(x - x.max()), torch.zeros_like(x))
            mass = (e * 2.0**36).to(torch.int64)  # exact integers: any order sums them the same
            total = int(mass.sum())
            limit = min(max(int(top_p * float(total)), 1), total)
            order = torch.sort(-e, stable=True).indices  # by e descending, ties by id
            before = mass[order].cumsum(0) - mass[order]
            nucleus = torch.zeros(vocab, dtype=torch.bool)
            nucleus[order] = before < limit
            keep &= nucleus & (mass > 0)
        noisy = torch.where(keep, x + gumbel_noise_ref(key, torch.arange(vocab)), float("-inf"))
        out.append(int(noisy.argmax()))
    return out
