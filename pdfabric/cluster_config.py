"""The deployment's ``[ray]`` and ``[autoscale]`` tables: where workers run, and how many.

``[ray]`` (``pdfabric serve --ray [ADDRESS]``) places each worker on a Ray cluster by its resource
request; ``[autoscale]`` lets the router resize the prefill, decode and colocated pools within bounds
(``pdfabric.router.platform.scaler``). Both are off by default: workers are local processes, as many as the
config names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pdfabric.control import KINDS


def _table(data: Any, where: str, cls: type) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a table")
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {', '.join(sorted(unknown))}")
    return dict(data)


@dataclass(frozen=True)
class RayConfig:
    """Workers as processes that Ray actors supervise. ``resources`` maps a pool name or a worker
    kind (the pool's entry wins) to the actor's resource request: ``CPU`` and ``GPU`` as Ray counts
    them, any other key a custom resource of the nodes meant for that pool."""

    address: str = ""  # "": not on Ray; "auto": the cluster this host is part of; else HOST:PORT
    namespace: str = "pdfabric"
    control_host: str = ""  # the router's control address that workers join ("": [serve] host)
    kv_host: str = ""  # "node": each worker binds its KV endpoint on its node's IP; "": [worker] kv_host
    resources: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.resources, Mapping):
            raise ValueError("[ray] resources must be a table of tables")
        for name, request in self.resources.items():
            if not isinstance(request, Mapping):
                raise ValueError(f"[ray.resources.{name}] must be a table")
            for key, amount in request.items():
                if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
                    raise ValueError(f"[ray.resources.{name}] {key} must be a number >= 0, got {amount!r}")
        if self.kv_host not in ("", "node"):
            raise ValueError(f'[ray] kv_host must be "" or "node", got {self.kv_host!r}')

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def request(self, kind: str, pool: str) -> dict[str, float]:
        """The resources one worker of ``kind`` in ``pool`` asks for (default: one CPU)."""
        request = dict(self.resources.get(pool) or self.resources.get(kind) or {})
        request.setdefault("CPU", 1)
        return request

    @classmethod
    def from_mapping(cls, data: Any) -> RayConfig:
        return cls(**_table(data, "[ray]", cls))


@dataclass(frozen=True)
class AutoscaleConfig:
    """Bounds and pace of the router's pool scaler. A kind's pool is scaled only when its ``max_``
    is above its ``min_``; ``min_`` 0 for a kind the deployment has means "as configured"."""

    enabled: bool = False
    interval_s: float = 2.0  # how often signals are read and a decision made
    window_s: float = 30.0  # requests finished this recently make the signals
    min_prefill: int = 0
    max_prefill: int = 0
    min_decode: int = 0
    max_decode: int = 0
    min_colocated: int = 0
    max_colocated: int = 0
    target_utilization: float = 0.7  # busy fraction the planner's model sizes each pool for
    min_attainment: float = 0.9  # below this share of requests within their TTFT (ITL) budget: too few
    max_queue_ms: float = 500.0  # median wait in the router's queue above this: too few
    max_kv_use: float = 0.85  # a pool's KV blocks in use above this: too few
    up_after_s: float = 4.0  # "too few" held this long: add one worker
    down_after_s: float = 30.0  # "too many" held this long: drain one
    cooldown_s: float = 10.0  # after a change to a pool, no other change to it for this long

    def __post_init__(self) -> None:
        for name in ("interval_s", "window_s", "up_after_s", "down_after_s", "cooldown_s", "max_queue_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0) or (
                name in ("interval_s", "window_s") and value == 0
            ):
                raise ValueError(
                    f"[autoscale] {name} must be a number >= 0 (> 0 for intervals), got {value!r}"
                )
        for name in ("target_utilization", "min_attainment", "max_kv_use"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"[autoscale] {name} must be in (0, 1], got {getattr(self, name)!r}")
        for kind in KINDS:
            lo, hi = self.bounds(kind)
            if lo < 0 or hi < 0 or (hi and hi < lo):
                raise ValueError(f"[autoscale] need 0 <= min_{kind} <= max_{kind}, got {lo} and {hi}")

    def bounds(self, kind: str) -> tuple[int, int]:
        return getattr(self, f"min_{kind}"), getattr(self, f"max_{kind}")

    @classmethod
    def from_mapping(cls, data: Any) -> AutoscaleConfig:
        return cls(**_table(data, "[autoscale]", cls))
