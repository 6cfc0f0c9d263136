"""A deployment's ``[[models]]``: models that clients name, each with versions that run on workers of
their own (a checkpoint or preset, a dtype, worker counts and settings per version).

.. code-block:: toml

    [[models]]
    name = "chat"                 # what requests put in "model" ("chat", or "chat@v2" to pin one)
    sticky = true                 # one `user` (or X-Session-Id header) keeps getting one version

    [[models.versions]]
    name = "v1"
    model = "tiny"                # a preset or a Hugging Face model directory
    weight = 90                   # share of the model's traffic (relative to its other versions)
    colocated = 1                 # its workers: prefill, decode, colocated counts
    kv_memory_mb = 64             # any [worker] key: this version's workers only

A version's workers register with ``served = "chat@v1"``; the router sends a request only to workers
of the version it resolved (``router/platform/catalog.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from pdfabric.control import KINDS
from pdfabric.worker_config import WORKER_KEYS, WorkerConfig, worker_config

_VERSION_KEYS = frozenset({"name", "model", "dtype", "weight", *KINDS})


def check_name(what: str, name: object) -> str:
    """A model or version name: letters, digits, ``.``, ``_`` and ``-``, at most 64 characters."""
    ok = isinstance(name, str) and 0 < len(name) <= 64
    if not ok or not all(c.isalnum() or c in "._-" for c in name):
        raise ValueError(f"{what} name must be 1-64 letters, digits, '.', '_' or '-', got {name!r}")
    return name


@dataclass(frozen=True)
class VersionConfig:
    """One version of a model: its checkpoint, traffic weight and workers."""

    name: str
    model: str  # a preset or a Hugging Face model directory
    worker: WorkerConfig  # the settings its workers start with (kind set per worker)
    dtype: str | None = None
    weight: float = 1.0
    prefill: int = 0
    decode: int = 0
    colocated: int = 0

    def __post_init__(self) -> None:
        check_name("a version", self.name)
        if isinstance(self.weight, bool) or not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"version {self.name}: weight must be >= 0, got {self.weight!r}")
        counts = [self.prefill, self.decode, self.colocated]
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"version {self.name}: worker counts must be integers >= 0")
        if (self.prefill == 0) != (self.decode == 0):
            raise ValueError(f"version {self.name}: disaggregated serving needs prefill and decode workers")

    def count(self, kind: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[kind]


@dataclass(frozen=True)
class ServedModel:
    """A model clients name, and its versions."""

    name: str
    versions: tuple[VersionConfig, ...]
    sticky: bool = True  # requests with one `user` (or X-Session-Id) resolve to one version

    def __post_init__(self) -> None:
        check_name("a model", self.name)
        names = [v.name for v in self.versions]
        if not names:
            raise ValueError(f"model {self.name}: needs at least one [[models.versions]]")
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name}: duplicate version names in {names}")

    def served(self, version: VersionConfig) -> str:
        """The key its workers register with: ``name@version``."""
        return f"{self.name}@{version.name}"


def parse_version(table: Any, base: WorkerConfig, where: str) -> VersionConfig:
    """One ``[[models.versions]]`` table (also what the admin API's add-version body holds)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where} entries must be tables")
    for key in ("name", "model"):
        if key not in table:
            raise ValueError(f"{where} needs a {key}")
    settings = {k: v for k, v in table.items() if k not in _VERSION_KEYS}
    worker = worker_config(settings, base, WORKER_KEYS, where)
    dtype = table.get("dtype")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{where}: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if not isinstance(table["model"], str):
        raise ValueError(f"{where}: model must be a preset name or a directory, got {table['model']!r}")
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ValueError(f"{where}: weight must be a number, got {weight!r}")
    counts = {k: table.get(k, 0) for k in KINDS}
    return VersionConfig(table["name"], table["model"], worker, dtype, float(weight), **counts)


def parse_models(tables: Any, base: WorkerConfig) -> tuple[ServedModel, ...]:
    """The ``[[models]]`` array of a deployment config; errors name the table."""
    if not isinstance(tables, list):
        raise ValueError("[[models]] must be an array of tables")
    models = []
    for table in tables:
        if not isinstance(table, dict) or "name" not in table:
            raise ValueError("[[models]] entries must be tables with a name")
        bad = set(table) - {"name", "versions", "sticky"}
        if bad:
            raise ValueError(f"unknown key(s) in [[models]] {table['name']!r}: {', '.join(sorted(bad))}")
        sticky = table.get("sticky", True)
        if not isinstance(sticky, bool):
            raise ValueError(f"[[models]] {table['name']!r}: sticky must be true or false")
        where = f"[[models.versions]] of {table['name']!r}"
        versions = tuple(parse_version(v, base, where) for v in table.get("versions", ()))
        models.append(ServedModel(table["name"], versions, sticky))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate [[models]] names in {names}")
    return tuple(models)


def version_plan(model: ServedModel, version: VersionConfig) -> list[tuple[str, WorkerConfig]]:
    """(worker id, config) of each worker of one version, ids ``KIND-MODEL-VERSION-N``; each config
    whole but for ``join`` and ``threads`` when 0 (as ``ServeConfig.launch_plan``)."""
    out = []
    for kind in KINDS:
        for n in range(version.count(kind)):
            worker_id = f"{kind}-{model.name}-{version.name}-{n}"
            w = replace(
                version.worker, kind=kind, worker_id=worker_id, model=version.model, dtype=version.dtype,
                served=model.served(version),
            )  # fmt: skip
            out.append((worker_id, w))
    return out
