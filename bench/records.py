"""The raw timings of one replayed request, as written to ``requests.jsonl`` (one JSON object a line).

Times are in seconds from the start of the run (``scheduled_s``, ``sent_s``) or in milliseconds from the
moment the request was sent (``ttft_ms``, ``e2e_ms``, ``chunk_ms``, ``itl_ms``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

OK = "ok"
REJECTED = "rejected"  # HTTP 429 (or 503 with Retry-After): the server refused it under load
ERROR = "error"  # any other HTTP error, broken stream, connection failure, error event or no tokens
TIMEOUT = "timeout"  # no complete answer within the request timeout
CANCELLED = "cancelled"  # in flight when the run was stopped (Ctrl-C or the run's time bound)
STATUSES = (OK, REJECTED, ERROR, TIMEOUT, CANCELLED)


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw for one request. Latencies are ``None`` when no token arrived."""

    index: int
    scheduled_s: float
    sent_s: float
    input_len: int
    output_len: int  # requested (max_tokens)
    status: str
    http_status: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    output_tokens: int = 0
    token_count_source: str = "chunks"  # "usage" when the server reported completion_tokens
    chunk_ms: list[float] = field(default_factory=list)  # arrival of each text-carrying chunk
    itl_ms: list[float] = field(default_factory=list)  # inter-token gaps, output_tokens - 1 of them
    finish_reason: str | None = None
    error: str | None = None
    terminal: bool | None = None  # a finish reason or an error event arrived (None: not recorded)
    text: str | None = None  # the output, when the client was asked to keep it
    token_ids: list[int] | None = None  # the output's token ids, when kept and the server sent them
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache (None: not said)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    @property
    def lateness_ms(self) -> float:
        """How late the client sent this request compared with its schedule."""
        return (self.sent_s - self.scheduled_s) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: mean of the inter-token gaps."""
        return sum(self.itl_ms) / len(self.itl_ms) if self.itl_ms else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("scheduled_s", "sent_s"):
            d[key] = round(d[key], 6)
        for key in ("ttft_ms", "e2e_ms"):
            if d[key] is not None:
                d[key] = round(d[key], 3)
        d["chunk_ms"] = [round(x, 3) for x in self.chunk_ms]
        d["itl_ms"] = [round(x, 3) for x in self.itl_ms]
        for key in ("text", "token_ids", "cached_tokens"):
            if d[key] is None:
                del d[key]
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(RequestRecord)}
        return RequestRecord(**{k: v for k, v in d.items() if k in known})


def write_jsonl(records: list[RequestRecord], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def read_jsonl(path: str | Path) -> list[RequestRecord]:
    with Path(path).open() as f:
        return [RequestRecord.from_json(json.loads(line)) for line in f if line.strip()]
