"""A request's budgets and class, by ``resolve``, from the ``[routing]`` settings
(``pdfabric/routing_config.py``: classes, tenants, pools).

A request's budgets come from its body's ``slo`` extension, else its tenant's, else its class's, else
the config's, field by field; its class is its tenant's, else the default class. Shared by the router
and the simulator in ``bench/``; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pdfabric.router.routing.routes import Budgets
from pdfabric.routing_config import MAX_BUDGET_MS, AdmissionConfig, SloClass, Tenant


class BudgetError(ValueError):
    """An invalid budget in a request; ``param`` names the field (e.g. ``slo.ttft_ms``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# --- budgets ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    budgets: Budgets
    slo_class: SloClass
    tenant: Tenant


def resolve(config: AdmissionConfig, slo: object, tenant: str = "", slo_class: str = "") -> Resolved:
    """A request's budgets and class. ``slo`` is the request body's ``slo`` value (None if absent):
    an object with optional ``ttft_ms`` and ``itl_ms``; anything else is a ``BudgetError``.
    ``slo_class``: its class when not its tenant's (a batch's line)."""
    t = config.tenant(tenant)
    cls = config.slo_class(slo_class or t.slo_class or config.default_class)
    given: dict[str, float] = {}
    if slo is not None:
        if not isinstance(slo, Mapping):
            raise BudgetError("slo must be an object with ttft_ms and/or itl_ms", "slo")
        for key, value in slo.items():
            if key not in ("ttft_ms", "itl_ms"):
                raise BudgetError(f"unknown field slo.{key}; expected ttft_ms or itl_ms", f"slo.{key}")
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not (math.isfinite(value) and 0 < value <= MAX_BUDGET_MS):
                raise BudgetError(
                    f"slo.{key} must be a number of milliseconds in (0, {MAX_BUDGET_MS:.0f}], got {value!r}",
                    f"slo.{key}",
                )
            given[key] = float(value)
    ttft = given.get("ttft_ms") or t.ttft_ms or cls.ttft_ms or config.ttft_ms
    itl = given.get("itl_ms") or t.itl_ms or cls.itl_ms or config.itl_ms
    return Resolved(Budgets(ttft, itl), cls, t)
