"""What the router serves: models, their live versions and traffic weights, and each request's
version.

A request's ``model`` resolves here (``Catalog.resolve``):
- ``name@version`` pins that version (whatever its weight: a canary can be tried before it takes
  traffic);
- ``name`` picks one of its versions by traffic weight; with ``sticky`` (the default) a request that
  names a ``user`` (or sends ``X-Session-Id``) always lands on the same version for the same weights,
  by a hash of that key, else the pick is random.
The version's ``key`` is what its workers registered with (``Register.served``); the routing then
looks only at those workers, for the request's first attempt and every failover, so a request
finishes on the version it started on whatever the weights become meanwhile.

A deployment without ``[[models]]`` serves one model under its served name with one version whose
key is ``""`` (what workers started without a version register with).

Weights change at run time (the admin API, a rollout); nothing here reads a clock.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path

from pdfabric.config import ServeConfig
from pdfabric.control import KINDS
from pdfabric.engine.tokenizer import Tokenizer
from pdfabric.router.errors import ApiError, bad

WARMING, READY, FAILED, RETIRED = "warming", "ready", "failed", "retired"  # a version's states
SESSION_HEADER = "X-Session-Id"  # sticky assignment by this header when the body has no `user`
VERSION_HEADER = "X-Model-Version"  # the response header naming the version that served


@dataclass
class Version:
    """One live version: its workers' key, tokenizer and checkpoint, traffic weight and timings."""

    model: str
    name: str  # "" for a deployment's one model without versions
    checkpoint: str  # the preset or model directory its workers load
    tokenizer: Tokenizer
    weight: float = 1.0
    added_at: float = 0.0  # when it was added (the caller's clock, seconds)
    first_routed_at: float | None = None  # when its first client request was routed
    ready_at: float | None = None  # when its warm-up passed (None: warming, or it failed)
    state: str = READY  # warming (no traffic until its health check passes), ready, failed, retired
    reason: str = ""  # why it failed

    @property
    def retired(self) -> bool:
        return self.state == RETIRED

    @property
    def key(self) -> str:
        """What its workers register with: ``model@version``, or ``""`` for an unversioned model."""
        return f"{self.model}@{self.name}" if self.name else ""

    @property
    def label(self) -> str:
        """How responses, metrics and logs name it: ``model@version``, or the model's name."""
        return f"{self.model}@{self.name}" if self.name else self.model

    @property
    def cold_start_s(self) -> float | None:
        """From being added to its first routed request (None: none routed yet)."""
        return None if self.first_routed_at is None else self.first_routed_at - self.added_at


@dataclass
class Model:
    name: str
    sticky: bool = True
    versions: dict[str, Version] = field(default_factory=dict)

    def live(self) -> list[Version]:
        """Its versions not retired (ready, warming or failed)."""
        return [v for v in self.versions.values() if not v.retired]


class Catalog:
    """Every model and version the router serves, by name."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.models: dict[str, Model] = {}
        self._rng = rng or random.Random()

    def add(self, version: Version, sticky: bool = True) -> Version:
        """Adds a version (and its model, the first time); ``ValueError`` if it exists already."""
        model = self.models.setdefault(version.model, Model(version.model, sticky))
        old = model.versions.get(version.name)
        if old is not None and not old.retired:
            raise ValueError(f"{version.label} is served already")
        model.versions[version.name] = version
        return version

    def version(self, label: str) -> Version:
        """The version named ``model@version`` (or an unversioned model's name); ``KeyError``."""
        name, _, ver = label.partition("@")
        return self.models[name].versions[ver]

    def names(self) -> tuple[str, ...]:
        """Every name a request may use: models, and their live versions pinned."""
        out: list[str] = []
        for m in self.models.values():
            out.append(m.name)
            out += [v.label for v in m.live() if v.name]
        return tuple(out)

    def set_weights(self, model: str, weights: dict[str, float]) -> None:
        """Sets the traffic weights of a model's versions (those not named keep theirs); a
        ``ValueError`` when one is unknown or negative, or when no live version would have weight."""
        m = self.models.get(model)
        if m is None:
            raise ValueError(f"no model {model!r}")
        for name, w in weights.items():
            if name not in m.versions or m.versions[name].retired:
                raise ValueError(f"model {model!r} has no live version {name!r}")
            if isinstance(w, bool) or not isinstance(w, int | float) or not w >= 0:
                raise ValueError(f"weight of {name!r} must be a number >= 0, got {w!r}")
        if not any(weights.get(v.name, v.weight) > 0 for v in m.live() if v.state == READY):
            raise ValueError(f"model {model!r} would have no version with traffic")
        for name, w in weights.items():
            m.versions[name].weight = float(w)

    def resolve(self, requested: str, sticky_key: str = "") -> Version:
        """The version a request for ``requested`` runs on (400 naming ``model`` when there is none)."""
        name, at, ver = requested.partition("@")
        m = self.models.get(name)
        if m is None or (at and (ver not in m.versions or m.versions[ver].retired)):
            available = ", ".join(self.names())
            raise bad(f"model {requested!r} is not served here; available: {available}", "model")
        if at:
            return m.versions[ver]
        live = [v for v in m.live() if v.weight > 0 and v.state == READY]
        if not live:
            raise ApiError(503, f"model {name!r} has no version taking traffic", kind="server_error",
                           retry_after_s=1.0)  # fmt: skip
        total = sum(v.weight for v in live)
        if m.sticky and sticky_key:
            digest = hashlib.sha256(f"{name}\0{sticky_key}".encode()).digest()
            point = int.from_bytes(digest[:8], "big") / 2**64 * total
        else:
            point = self._rng.random() * total
        for v in live:
            point -= v.weight
            if point < 0:
                return v
        return live[-1]


def load_tokenizer(checkpoint: str) -> tuple[Path, Tokenizer]:
    """The model directory of a preset or path (a preset is built on first use) and its tokenizer."""
    from pdfabric.engine.default_model import resolve_model

    path = resolve_model(checkpoint)
    return path, Tokenizer.from_pretrained(path)


def from_config(cfg: ServeConfig, now: float) -> Catalog:
    """The catalog of a deployment: its ``[serve]`` model when it has workers of its own (or no
    ``[[models]]`` at all), then every ``[[models]]`` version. Builds presets and loads each
    checkpoint's tokenizer once."""
    catalog = Catalog()
    tokenizers: dict[str, Tokenizer] = {}

    def tokenizer(checkpoint: str) -> Tokenizer:
        if checkpoint not in tokenizers:
            tokenizers[checkpoint] = load_tokenizer(checkpoint)[1]
        return tokenizers[checkpoint]

    if sum(cfg.own_count(k) for k in KINDS) or not cfg.models:
        catalog.add(Version(cfg.model_name, "", cfg.model, tokenizer(cfg.model), added_at=now))
    for m in cfg.models:
        for v in m.versions:
            catalog.add(Version(m.name, v.name, v.model, tokenizer(v.model), v.weight, now), m.sticky)
    return catalog
