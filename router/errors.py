"""The router's one error type: what a client is answered with when a request cannot be served
(an HTTP status and an OpenAI-style body). It sits below the router's rooms, which all raise it; the
front answers it (``front/responses.error_response``)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        }


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)
