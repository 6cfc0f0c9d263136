"""A read-only view of the router's workers and requests (``Fleet``): what the HTTP front, the admin
API, the metrics, the launcher and the pool scaler may know of the dispatcher's core, without a way
to change it. Changes go through the dispatcher's methods (``submit``, ``release``,
``drain_worker``, ``worker_gone``)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pdfabric.cluster_secret import Refusals
from pdfabric.router.dispatch.core import RouterCore
from pdfabric.router.routing.registry import WorkerInfo, has_route


class Fleet:
    """The registered workers, the requests they hold, the admission queue and the launcher's record
    of restarts, read at the moment of each call."""

    def __init__(
        self, core: RouterCore, restarts: Mapping[str, int], down: Mapping[str, str], refusals: Refusals
    ) -> None:
        self._core = core
        self._refusals = refusals
        self.restarts: Mapping[str, int] = MappingProxyType(restarts)  # worker -> times started again
        self.down: Mapping[str, str] = MappingProxyType(down)  # worker -> why its supervisor gave up

    @property
    def workers(self) -> Mapping[str, WorkerInfo]:
        """Every registered worker by its id (its registration, last load and liveness)."""
        return MappingProxyType(self._core.registry.workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._core.registry.workers

    def serving(self, served: str) -> list[WorkerInfo]:
        """The workers of one model version (``Register.served``)."""
        return self._core.registry.serving(served)

    def has_route(self, served: str | None = None) -> bool:
        """Whether any route exists for the version ``served`` (None: for any)."""
        return has_route(self._core.registry, served)

    def max_model_len(self, served: str = "") -> int:
        """The longest sequence every serving path of the version can hold (0 with no workers)."""
        return self._core.registry.max_model_len(served)

    def held_by(self, worker_id: str) -> int:
        """Requests the worker holds now."""
        return self._core.holders.count(worker_id)

    def holders_of(self, request_id: str) -> frozenset[str]:
        """The workers that hold the request now."""
        return self._core.holders.holders(request_id)

    @property
    def held(self) -> int:
        """Requests some worker holds."""
        return len(self._core.holders)

    @property
    def waiting(self) -> int:
        """Requests waiting in the admission queue for a route."""
        return len(self._core.routing.queue)

    @property
    def refused_peers(self) -> int:
        """Handshakes the control socket refused: peers without the cluster secret."""
        return self._refusals.count

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet ended (waiting, starting or streaming)."""
        return len(self._core)
