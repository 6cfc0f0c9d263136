"""A canary rollout: a new version's share of its model's traffic ramps up in steps while it is
compared with the versions already serving (the incumbents); a guardrail crossed rolls it back.

A rollout's life:
1. It starts at ``steps[0]`` percent of the model's traffic for the canary, the rest shared by the
   incumbents in their old proportions (``weights``).
2. Every finished request of the model is ``observe``d: whether it succeeded, its TTFT and mean
   inter-token latency. ``tick`` judges the current step's samples:
   - the canary's error rate over ``max_error_rate`` (once it has ``min_requests``), or its median
     TTFT or ITL over ``max_ttft_ratio`` / ``max_itl_ratio`` times the incumbents' (once both have
     ``min_requests`` successes), or its cost per generated token over ``max_cost_ratio`` times the
     incumbents' (once it has ``min_requests`` requests), rolls back: the canary gets no traffic, the
     incumbents their old weights;
   - after ``step_s`` with ``min_requests`` canary requests and no guardrail crossed, the next step;
     after the last (100%), the canary is promoted: it takes all traffic.
3. A rollout ends ``promoted``, ``rolled_back`` or ``stopped`` (by the operator, which also rolls
   back). Requests keep the version they started on whatever the weights become.

Cost per token is compared at one operating point for both sides, so that the canary's small share
of traffic (small batches) does not make it look dear: the caller computes it with ``token_cost``
from each side's fitted step-time profiles at the incumbents' current batch and context, times
their pool's relative cost, and hands both figures to ``observe_cost``.

Nothing here reads a clock or touches the catalog: the caller applies ``weights()`` after each
``tick`` that returns True.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from pdfabric.profile import WorkerProfile

RAMPING, PROMOTED, ROLLED_BACK, STOPPED = "ramping", "promoted", "rolled_back", "stopped"


@dataclass(frozen=True)
class Guardrails:
    max_error_rate: float = 0.05  # the canary's failed / finished requests in a step
    max_ttft_ratio: float = 2.0  # the canary's median TTFT over the incumbents'
    max_itl_ratio: float = 2.0  # the same for the mean inter-token latency of each request
    max_cost_ratio: float = 0.0  # the canary's cost per generated token over the incumbents' (0: off)
    min_requests: int = 10  # canary requests a step needs before it is judged or passed

    def __post_init__(self) -> None:
        for name in ("max_error_rate", "max_ttft_ratio", "max_itl_ratio", "max_cost_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"guardrails.{name} must be a number >= 0, got {value!r}")
        if (
            isinstance(self.min_requests, bool)
            or not isinstance(self.min_requests, int)
            or self.min_requests < 1
        ):
            raise ValueError(f"guardrails.min_requests must be an integer >= 1, got {self.min_requests!r}")


@dataclass(frozen=True)
class RolloutSpec:
    model: str
    canary: str  # the version ramped up
    steps: tuple[float, ...] = (5.0, 25.0, 50.0, 100.0)  # the canary's percent of traffic per step
    step_s: float = 60.0  # the least time spent at each step
    guardrails: Guardrails = field(default_factory=Guardrails)

    def __post_init__(self) -> None:
        steps = tuple(self.steps)
        ok = steps and all(isinstance(s, int | float) and not isinstance(s, bool) for s in steps)
        if not ok or any(not 0 < s <= 100 for s in steps) or list(steps) != sorted(steps) or steps[-1] != 100:
            raise ValueError(
                f"steps must be increasing percents in (0, 100] ending at 100, got {self.steps!r}"
            )
        object.__setattr__(self, "steps", tuple(float(s) for s in steps))
        if isinstance(self.step_s, bool) or not isinstance(self.step_s, int | float) or not self.step_s >= 0:
            raise ValueError(f"step_s must be a number of seconds >= 0, got {self.step_s!r}")

    @classmethod
    def from_body(cls, model: str, body: Any) -> RolloutSpec:
        """The admin API's body: ``canary``, optional ``steps``, ``step_s`` and ``guardrails``."""
        if not isinstance(body, dict) or not isinstance(body.get("canary"), str):
            raise ValueError("the body must be a JSON object naming its 'canary' version")
        unknown = set(body) - {"canary", "steps", "step_s", "guardrails"}
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
        guard = body.get("guardrails", {})
        if not isinstance(guard, dict) or set(guard) - set(Guardrails.__dataclass_fields__):
            raise ValueError(
                f"guardrails must be an object with keys among {', '.join(Guardrails.__dataclass_fields__)}"
            )
        steps = body.get("steps", cls.steps)
        if not isinstance(steps, list | tuple):
            raise ValueError("steps must be a list of percents")
        return cls(model, body["canary"], tuple(steps), body.get("step_s", 60.0), Guardrails(**guard))


@dataclass
class _Samples:
    requests: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


class Rollout:
    """One model's canary rollout (see the module's docstring)."""

    def __init__(self, spec: RolloutSpec, incumbents: dict[str, float], now: float) -> None:
        if spec.canary in incumbents:
            raise ValueError(f"the canary {spec.canary!r} is also an incumbent")
        if not any(w > 0 for w in incumbents.values()):
            raise ValueError(f"model {spec.model!r} has no version with traffic to compare the canary with")
        self.spec = spec
        self.incumbents = dict(incumbents)  # their weights before the rollout
        self.state = RAMPING
        self.step = 0
        self.step_started = now
        self.reason = ""
        self.history: list[dict[str, Any]] = [{"at": now, "event": "start", "percent": spec.steps[0]}]
        self._samples: dict[str, _Samples] = {}
        self.cost: dict[str, float] = {}  # seconds of work per token: "canary", "incumbents"

    @property
    def done(self) -> bool:
        return self.state != RAMPING

    def weights(self) -> dict[str, float]:
        """Every version's traffic weight now (percent of the model's traffic)."""
        if self.state in (ROLLED_BACK, STOPPED):
            return {**self.incumbents, self.spec.canary: 0.0}
        share = 100.0 if self.state == PROMOTED else self.spec.steps[self.step]
        total = sum(self.incumbents.values())
        rest = {v: (100.0 - share) * w / total for v, w in self.incumbents.items()}
        return {**rest, self.spec.canary: share}

    def observe(self, version: str, ok: bool, ttft_s: float | None, itl_s: float | None) -> None:
        """A finished request of the model (on the canary, or on an incumbent)."""
        if self.done:
            return
        s = self._samples.setdefault(version if version == self.spec.canary else "", _Samples())
        s.requests += 1
        if not ok:
            s.errors += 1
            return
        if ttft_s is not None:
            s.ttft.append(ttft_s)
        if itl_s is not None:
            s.itl.append(itl_s)

    def observe_cost(self, canary: float | None, incumbents: float | None) -> None:
        """The latest cost per generated token of each side (``token_cost``; None: not known yet)."""
        self.cost = {k: v for k, v in (("canary", canary), ("incumbents", incumbents)) if v is not None}

    def tick(self, now: float) -> bool:
        """Judges the current step; True when the weights changed (the caller applies them)."""
        if self.done:
            return False
        g, canary, base = self.spec.guardrails, self._samples.get(self.spec.canary), self._samples.get("")
        canary, base = canary or _Samples(), base or _Samples()
        why = self._crossed(g, canary, base)
        if why:
            self._end(ROLLED_BACK, now, why)
            return True
        if now - self.step_started < self.spec.step_s or canary.requests < g.min_requests:
            return False
        if self.step + 1 == len(self.spec.steps):
            self._end(PROMOTED, now, f"every step passed ({self.spec.steps[-1]:g}% at the last)")
            return True
        self.step += 1
        self.step_started, self._samples = now, {}
        self.history.append({"at": now, "event": "step", "percent": self.spec.steps[self.step]})
        return True

    def stop(self, now: float, why: str) -> None:
        """The operator ends it: the incumbents get their weights back."""
        if not self.done:
            self._end(STOPPED, now, why)

    def report(self) -> dict[str, Any]:
        return {
            "model": self.spec.model, "canary": self.spec.canary, "state": self.state, "reason": self.reason,
            "step": self.step, "percent": self.weights()[self.spec.canary], "weights": self.weights(),
            "cost_per_token_s": dict(self.cost),
            "spec": {**asdict(self.spec)}, "history": self.history,
            "samples": {k or "incumbents": asdict(v) | {"ttft": len(v.ttft), "itl": len(v.itl)}
                        for k, v in self._samples.items()},
        }  # fmt: skip

    def _crossed(self, g: Guardrails, canary: _Samples, base: _Samples) -> str:
        """The first guardrail the canary crossed in this step ("" when none)."""
        if canary.requests >= g.min_requests and canary.errors / canary.requests > g.max_error_rate:
            return (
                f"error rate {canary.errors}/{canary.requests} = {canary.errors / canary.requests:.1%} "
                f"> {g.max_error_rate:.1%}"
            )
        for name, limit in (("ttft", g.max_ttft_ratio), ("itl", g.max_itl_ratio)):
            mine, theirs = getattr(canary, name), getattr(base, name)
            if len(mine) < g.min_requests or len(theirs) < g.min_requests:
                continue
            ratio = _ratio(statistics.median(mine), statistics.median(theirs))
            if ratio > limit:
                return f"median {name.upper()} {ratio:.2f}x the incumbents' > {limit:g}x"
        mine, theirs = self.cost.get("canary"), self.cost.get("incumbents")
        if g.max_cost_ratio and canary.requests >= g.min_requests and mine and theirs:
            ratio = mine / theirs
            if ratio > g.max_cost_ratio:
                return f"cost per token {ratio:.2f}x the incumbents' > {g.max_cost_ratio:g}x"
        return ""

    def _end(self, state: str, now: float, why: str) -> None:
        self.state, self.reason = state, why
        self.history.append({"at": now, "event": state, "reason": why})


def token_cost(profiles: list[tuple[WorkerProfile, float]], batch: int, context: int) -> float | None:
    """Seconds of work per generated token on these decoding workers, each a (fitted profile, its
    pool's relative cost): one decode step of ``batch`` sequences of ``context`` tokens each, over
    the batch, averaged over the workers (None: no worker has measured a decode step yet)."""
    b = max(1, batch)
    costs = [
        cost * p.decode_seconds_per_token(b, max(1, context)) for p, cost in profiles if p.decode_samples
    ]
    return sum(costs) / len(costs) if costs else None


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else 1.0)
