"""HTTP errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (CONTRIBUTING.md #5).

OpenAI SDKs map the status to an exception class and show ``message``; so every message names the
offending field and, where there is one, the fix. ``from_worker`` turns a worker's typed failure
(``backends.sglang.errors``) into what the gateway's client should see.
"""

from __future__ import annotations

import math

import msgspec

from backends.sglang.errors import WorkerError, WorkerHTTPError


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorEnvelope(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorBody


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
          499: "client_closed_request", 502: "upstream_error", 503: "service_unavailable",
          504: "upstream_timeout"}
_ENCODER = msgspec.json.Encoder()


class ApiError(Exception):
    """An answer other than 2xx. ``status_class`` is the telemetry status (RequestRecord.status)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | int | None = None, retry_after: float | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.error_type = error_type or _TYPES.get(status, "api_error")

    @property
    def status_class(self) -> str:
        if self.status == 429:
            return "rate_limited"
        if self.status == 503:
            return "unavailable"
        if self.status == 499:
            return "aborted"
        return "client_error" if self.status < 500 else "upstream_error"

    def body(self) -> bytes:
        return _ENCODER.encode(ErrorEnvelope(error=ErrorBody(
            message=self.message, type=self.error_type, param=self.param, code=self.code)))

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after)))}

    def stream_chunk(self) -> bytes:
        """The SSE error event that ends a stream after its first byte (then ``[DONE]``)."""
        return b"data: " + self.body() + b"\n\n"


def from_worker(exc: WorkerError) -> ApiError:
    """What the client sees when the last attempt failed with ``exc``."""
    if isinstance(exc, WorkerHTTPError):
        if exc.status in (400, 404, 413, 422):
            code = "context_length_exceeded" if "context" in exc.message.lower() else exc.status
            return ApiError(400 if exc.status != 404 else 404, exc.message, code=code,
                            param="messages" if code == "context_length_exceeded" else None)
        if exc.status == 429:
            return ApiError(429, f"every worker is overloaded ({exc.message}); retry later",
                            retry_after=exc.retry_after or 1.0, code="worker_overloaded")
        return ApiError(502, f"worker failed with HTTP {exc.status}: {exc.message}",
                        code="upstream_error")
    return ApiError(502, f"worker failed: {exc.message}", code="upstream_error")
