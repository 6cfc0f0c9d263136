"""A worker's latency profile: how long a step takes for its shape, fitted from measured steps.

One step of a worker runs prefill chunks, decode tokens, or both (colocated workers mix them). Its
time is modelled as the sum of two linear parts, each with its own fixed cost:

    prefill part = a_p + b_p * tokens + c_p * tokens * context     (when the step has prefill chunks)
    decode part  = a_d + b_d * batch  + c_d * context_tokens       (when the step has decode tokens)

``tokens`` is the number of prompt tokens in the step and ``context`` the mean number of tokens each
of them attends to, so ``tokens * context`` is the step's attention work; ``batch`` is the number of
decoding sequences and ``context_tokens`` the sum of their lengths. A worker's life with this module:

1. at start, it measures the points of ``profiling_plan`` (bounded) and feeds them to a
   ``ProfileBuilder``;
2. while serving, it feeds every step's ``StepShape`` and measured seconds to the same builder, which
   keeps a bounded window per step type and refits on demand (a 6-coefficient non-negative least squares);
3. it reports ``builder.profile()``, a ``WorkerProfile`` of plain floats and ints that travels in
   control messages, and the router predicts with it.

No clocks are read here and nothing but numpy is used, so the router and the simulator share it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

Coefs = tuple[float, float, float]
_ZERO: Coefs = (0.0, 0.0, 0.0)


@dataclass(frozen=True)
class StepShape:
    """What one step ran: prompt tokens (with their mean attended context) and decoding sequences."""

    prefill_tokens: int = 0
    prefill_context: float = 0.0  # mean number of tokens each prompt token in the step attends to
    batch: int = 0  # sequences that got a decode token
    context_tokens: int = 0  # sum of the decoding sequences' lengths

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]] = (), decode_lengths: Iterable[int] = ()) -> StepShape:
        """The shape of a step running prefill ``chunks`` given as (cached tokens, new tokens) and
        decode tokens for sequences of ``decode_lengths`` tokens. A new token at position j of a
        chunk after c cached tokens attends to c + j + 1 tokens."""
        tokens, work = 0, 0.0
        for cached, new in chunks:
            tokens += new
            work += new * (cached + (new + 1) / 2)
        lengths = list(decode_lengths)
        return cls(tokens, work / tokens if tokens else 0.0, len(lengths), sum(lengths))

    def features(self) -> tuple[float, float, float, float, float, float]:
        has_prefill, has_decode = float(self.prefill_tokens > 0), float(self.batch > 0)
        return (
            has_prefill,
            float(self.prefill_tokens),
            self.prefill_tokens * self.prefill_context,
            has_decode,
            float(self.batch),
            float(self.context_tokens),
        )


@dataclass(frozen=True)
class WorkerProfile:
    """Fitted step-time coefficients in seconds (see the module docstring); msgpack-friendly.

    ``prefill`` is (fixed, per token, per token x context token); ``decode`` is (fixed, per sequence,
    per context token). ``*_samples`` count the window's steps that had that part (0: the part is the
    prior, not a measurement); ``fit_error`` is the median relative error of the fit on its window.
    """

    prefill: Coefs = _ZERO
    decode: Coefs = _ZERO
    prefill_samples: int = 0
    decode_samples: int = 0
    fit_error: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            coefs = tuple(float(v) for v in getattr(self, name))
            if len(coefs) != 3 or not all(math.isfinite(v) and v >= 0 for v in coefs):
                raise ValueError(f"{name} must be three finite non-negative floats, got {coefs}")
            object.__setattr__(self, name, coefs)
        if self.prefill_samples < 0 or self.decode_samples < 0:
            raise ValueError("sample counts must be >= 0")
        if not (math.isfinite(self.fit_error) and self.fit_error >= 0):
            raise ValueError(f"fit_error must be finite and >= 0, got {self.fit_error}")
        object.__setattr__(self, "fit_error", float(self.fit_error))

    def step_seconds(self, shape: StepShape) -> float:
        """Predicted time of one step of ``shape``."""
        f = shape.features()
        return sum(c * x for c, x in zip((*self.prefill, *self.decode), f, strict=True))

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        """One decode step for ``batch`` sequences holding ``context_tokens`` tokens in all (what
        ``step_seconds`` gives for that shape, to the bit, without building it: the router asks this
        for every route of every request it ranks)."""
        fixed, per_seq, per_token = self.decode
        return (fixed if batch > 0 else 0.0) + per_seq * batch + per_token * context_tokens

    def decode_seconds_per_token(self, batch: int, context_each: float) -> float:
        """One sequence's share of a decode step of ``batch`` sequences holding ``context_each``
        tokens each: the decode time of one token when the batch is full."""
        return self.decode_step_seconds(batch, int(batch * context_each)) / batch

    def prefill_seconds(self, tokens: int, chunk_tokens: int, attention: float | None = None) -> float:
        """Prefill compute of ``tokens`` prompt tokens run in steps of at most ``chunk_tokens``.

        ``attention`` is their total attention work (sum over tokens of the tokens each attends to);
        by default that of one fresh prompt of ``tokens`` tokens, tokens * (tokens + 1) / 2, which
        does not depend on how the prompt is chunked.
        """
        if tokens <= 0:
            return 0.0
        if attention is None:
            attention = tokens * (tokens + 1) / 2
        a, b, c = self.prefill
        return a * math.ceil(tokens / max(1, chunk_tokens)) + b * tokens + c * attention

    def chunk_within(self, seconds: float, max_tokens: int, step: int = 16) -> int:
        """The largest prompt chunk (a multiple of ``step`` tokens, at least ``step``, at most
        ``max_tokens``) whose step this profile predicts within ``seconds``."""
        fits = [n for n in range(step, max_tokens + 1, step) if self.prefill_seconds(n, n) <= seconds]
        return min(max_tokens, max(fits, default=step))


def queued_attention(queued_tokens: int, queued_prompts: int) -> float:
    """Attention work of ``queued_tokens`` split evenly over ``queued_prompts`` fresh prompts (the
    least it can be for that many prompts: the router only hears the two totals)."""
    if queued_tokens <= 0:
        return 0.0
    n = max(1, queued_prompts)
    per = queued_tokens / n
    return n * per * (per + 1) / 2


class ProfileBuilder:
    """Fits a ``WorkerProfile`` online from measured steps, in bounded memory.

    Steps are kept in three windows of at most ``window`` steps (prefill only, decode only, mixed), so
    that a long run of one kind never pushes the other out. ``profile()`` refits when at least
    ``refit_every`` steps arrived since the last fit. Unmeasured directions stay at ``prior`` (by
    default the previous fit) through a light ridge term; steps past 4 robust deviations (and 2%) of
    the median residual are dropped and the fit made again (``_inliers``), twice at most.
    """

    def __init__(
        self,
        prior: WorkerProfile | None = None,
        window: int = 256,
        refit_every: int = 16,
        ridge: float = 1e-3,
    ) -> None:
        if window < 1 or refit_every < 1 or ridge <= 0:
            raise ValueError("window and refit_every must be >= 1 and ridge > 0")
        self._windows: dict[str, deque[tuple[StepShape, float]]] = {
            k: deque(maxlen=window) for k in ("prefill", "decode", "mixed")
        }
        self._profile = prior or WorkerProfile()
        self.refit_every = refit_every
        self.ridge = ridge
        self._new = 0
        self._fitted = False

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Records one measured step; empty shapes and non-finite or negative times are ignored."""
        if not (math.isfinite(seconds) and seconds >= 0) or (shape.prefill_tokens == 0 and shape.batch == 0):
            return
        if shape.prefill_tokens and shape.batch:
            kind = "mixed"
        else:
            kind = "prefill" if shape.prefill_tokens else "decode"
        self._windows[kind].append((shape, seconds))
        self._new += 1

    def observe_prefill(self, tokens: int, context: float, seconds: float) -> None:
        self.observe(StepShape(prefill_tokens=tokens, prefill_context=context), seconds)

    def observe_decode(self, batch: int, context_tokens: int, seconds: float) -> None:
        self.observe(StepShape(batch=batch, context_tokens=context_tokens), seconds)

    def __len__(self) -> int:
        return sum(len(w) for w in self._windows.values())

    def profile(self, force: bool = False) -> WorkerProfile:
        """The current fit (refitted first if enough new steps arrived, or if ``force``)."""
        if self._new and (force or self._new >= self.refit_every or not self._fitted):
            self._profile = self._fit()
            self._new, self._fitted = 0, True
        return self._profile

    def _fit(self) -> WorkerProfile:
        rows = [s for w in self._windows.values() for s in w]
        x = np.array([shape.features() for shape, _ in rows], dtype=np.float64)  # [n, 6]
        y = np.array([t for _, t in rows], dtype=np.float64)  # [n]
        prior = np.array((*self._profile.prefill, *self._profile.decode))
        coefs = _ridge_nnls(x, y, prior, self.ridge)
        samples = int((x[:, 1] > 0).sum()), int((x[:, 4] > 0).sum())
        for _ in range(2):  # an outlier pulls the first fit towards it: look again after dropping
            keep = _inliers(y - x @ coefs, y)
            if not 3 <= keep.sum() < len(y):
                break
            x, y = x[keep], y[keep]
            coefs = _ridge_nnls(x, y, prior, self.ridge)
        pred = x @ coefs
        err = float(np.median(np.abs(y - pred) / np.maximum(y, 1e-9)))
        c = [float(v) for v in coefs]
        return WorkerProfile(
            prefill=(c[0], c[1], c[2]),
            decode=(c[3], c[4], c[5]),
            prefill_samples=samples[0],
            decode_samples=samples[1],
            fit_error=err,
        )


def _inliers(resid: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The steps whose residual lies within 4 robust deviations of the median residual, or within 2%
    of their time. Centred on the median, not on zero: a fit pulled by one very slow step misses
    every other step by about the same amount, and those are the steps to keep."""
    centred = np.abs(resid - np.median(resid))
    mad = float(np.median(centred))
    return centred <= np.maximum(4 * 1.4826 * mad, 0.02 * y)


def _ridge_nnls(x: np.ndarray, y: np.ndarray, prior: np.ndarray, ridge: float) -> np.ndarray:
    """argmin ||x c - y||^2 + ridge * ||s (c - prior)||^2 over c >= 0, where s scales each feature
    column to unit mean square (the ridge term keeps the problem well posed with few steps)."""
    scale = np.sqrt(np.mean(x * x, axis=0))
    scale[scale == 0] = 1.0
    xs = x / scale  # [n, f]
    gram = xs.T @ xs + ridge * np.eye(x.shape[1])  # [f, f]
    rhs = xs.T @ y + ridge * prior * scale  # [f]
    return nnls_normal(gram, rhs) / scale


def nnls_normal(gram: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """argmin c.gram.c - 2 c.rhs over c >= 0 for a positive definite ``gram`` (Lawson-Hanson on the
    normal equations)."""
    n = len(rhs)
    c = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(rhs).max(initial=0.0)))
    for _ in range(3 * n):
        grad = rhs - gram @ c
        if passive.all() or grad[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.solve(gram[np.ix_(passive, passive)], rhs[passive])
            if (z[passive] > 0).all():
                c = z
                break
            out = passive & (z <= 0)
            step = float(np.min(c[out] / (c[out] - z[out])))
            c = c + step * (z - c)
            passive &= c > tol
    return c


@dataclass(frozen=True)
class ProfilingPlan:
    """Steps a worker measures at start: ``prefill`` as (chunk tokens, cached tokens before the
    chunk), ``decode`` as (batch, tokens per sequence); each point ``repeats`` times, the first run of
    each discarded as warm-up by the caller if it likes."""

    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    repeats: int = 3

    def __len__(self) -> int:
        return (len(self.prefill) + len(self.decode)) * self.repeats


def profiling_plan(
    max_batch_tokens: int,
    max_running: int,
    max_model_len: int,
    kv_tokens: int,
    points_per_kind: int = 12,
    repeats: int = 3,
) -> ProfilingPlan:
    """A bounded grid covering the worker's limits: at most ``points_per_kind`` prefill points
    (chunk sizes x cached lengths) and as many decode points (batch sizes x sequence lengths), none
    needing more than ``kv_tokens`` of KV room or a sequence past ``max_model_len``."""
    for name, v in (
        ("max_batch_tokens", max_batch_tokens),
        ("max_running", max_running),
        ("max_model_len", max_model_len),
        ("kv_tokens", kv_tokens),
        ("points_per_kind", points_per_kind),
        ("repeats", repeats),
    ):
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")
    n_ctx = 3 if points_per_kind >= 6 else 1
    n_size = max(1, points_per_kind // n_ctx)
    room = min(max_model_len, kv_tokens)
    prefill: set[tuple[int, int]] = set()
    for tokens in _geometric(min(16, max_batch_tokens), min(max_batch_tokens, room), n_size):
        for cached in _spread(0, room - tokens, n_ctx):
            prefill.add((tokens, cached))
    decode: set[tuple[int, int]] = set()
    for batch in _geometric(1, min(max_running, kv_tokens), n_size):
        longest = min(max_model_len, kv_tokens // batch)
        for length in _spread(min(16, longest), longest, n_ctx):
            decode.add((batch, max(1, length)))
    return ProfilingPlan(tuple(sorted(prefill)), tuple(sorted(decode)), repeats)


def _geometric(lo: int, hi: int, n: int) -> list[int]:
    lo, hi = max(1, lo), max(1, hi)
    if n <= 1 or hi <= lo:
        return [hi]
    return sorted({round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)})


def _spread(lo: int, hi: int, n: int) -> list[int]:
    hi = max(lo, hi)
    if n <= 1:
        return [lo]
    return sorted({lo + (hi - lo) * i // (n - 1) for i in range(n)})
