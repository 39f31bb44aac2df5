"""Errors a handler turns into HTTP answers, in the OpenAI error shape (CONTRIBUTING.md #5).

``{"error": {"message", "type", "param", "code"}}`` is what OpenAI SDKs and SGLang clients parse; the
message names the offending field and, where there is one, the fix.
"""

from __future__ import annotations

import msgspec

from backends.sglang.wire import ErrorDetail, ErrorEnvelope


class WorkerRequestError(Exception):
    """A request the worker refuses; ``status`` is the HTTP status to answer with."""

    status = 400
    error_type = "BadRequestError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> ErrorEnvelope:
        return error_body(self.message, self.error_type, self.status, self.param)


class BadRequest(WorkerRequestError):
    pass


class Overloaded(WorkerRequestError):
    """The waiting queue is full: 429, which smg retries elsewhere without tripping its breaker."""

    status = 429
    error_type = "TooManyRequests"


class NotFound(WorkerRequestError):
    status = 404
    error_type = "NotFoundError"


class NotReady(WorkerRequestError):
    status = 503
    error_type = "ServiceUnavailable"


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> ErrorEnvelope:
    return ErrorEnvelope(error=ErrorDetail(message=message, type=error_type, param=param, code=code))


def from_decode_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> BadRequest:
    """msgspec says ``Object contains unknown field `foo` - at `$.sampling_params```: keep the path."""
    text = str(exc)
    param = None
    if " - at `" in text:
        param = text.rsplit(" - at `", 1)[1].rstrip("`").removeprefix("$.").removeprefix("$") or None
    if isinstance(exc, msgspec.ValidationError):
        return BadRequest(f"invalid request body: {text}", param)
    return BadRequest(f"request body is not valid JSON: {text}; send a JSON object", None)
