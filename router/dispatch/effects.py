"""What ``core.RouterCore`` asks its driver to do: each call into it returns a list of these effects,
which the serving router (``dispatcher.Dispatcher``) carries out over its sockets and the simulator
(``pdfabric.bench.simulator``) in simulated time. ``deliver`` makes the ``Deliver`` effects of a
request's delta."""

from __future__ import annotations

from dataclasses import dataclass

from pdfabric.control import HandedOff, TokenDelta
from pdfabric.router.dispatch.request import RouterRequest
from pdfabric.router.routing.admission import Outcome
from pdfabric.router.routing.routes import Choice


@dataclass(frozen=True)
class Send:
    """Send ``msg`` to the worker."""

    worker_id: str
    msg: object


@dataclass(frozen=True)
class Started:
    """The request is on a route: ``choice`` (with its predicted latencies), ``route`` for logs."""

    request_id: str
    choice: Choice
    route: str
    waited_ms: float  # time spent waiting for admission


@dataclass(frozen=True)
class Refused:
    """The request never started: 429 (admission control turned it away; ``outcome`` says why) or
    503 (no worker could take it; ``message`` says why)."""

    request_id: str
    status: int
    message: str
    outcome: Outcome | None = None


@dataclass(frozen=True)
class Deliver:
    """The request's next delta in output order; one with a finish reason is its last."""

    request_id: str
    delta: TokenDelta


@dataclass(frozen=True)
class Transferred:
    """The prefill worker handed the request's KV to its decode worker."""

    request_id: str
    msg: HandedOff


@dataclass(frozen=True)
class FailedOver:
    """The request left a failed attempt (``cause``: ``worker_gone``, ``error``, or ``tokens_lost``:
    every worker let go with tokens never received; ``worker_id`` the worker that failed, or let go
    last) and resumes on other workers after ``resumed_at`` delivered tokens (over all its outputs)."""

    request_id: str
    cause: str
    worker_id: str
    message: str
    resumed_at: int


Effect = Send | Started | Refused | Deliver | Transferred | FailedOver


def deliver(req: RouterRequest, delta: TokenDelta, out: list[Effect]) -> None:
    """A delta of ``req`` in client output indices: appends a ``Deliver`` for each delta now due to the
    client (``RouterRequest.accept``), in order."""
    out += [Deliver(req.request_id, d) for d in req.accept(delta)]
