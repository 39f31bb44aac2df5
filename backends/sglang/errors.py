"""Typed failures of a call to a worker, each saying whether it is safe to retry elsewhere.

The gateway retries a request on another worker only before the first byte of the answer reached
its own client. So every error carries ``bytes_received``: True once any response content (a
streamed event, or part of a body) was delivered to the caller. ``retry_safe`` combines it with the
kind of failure:

- ``WorkerConnectError``: nothing was sent or nothing came back (refused, DNS, reset before the status
  line). Always safe.
- ``WorkerTimeout``: safe while ``bytes_received`` is False (the worker may still be computing; the
  gateway should ``abort`` the rid on it).
- ``WorkerHTTPError``: a 4xx/5xx status. Safe for 408/429/500/502/503/504 (overload, restart);
  other 4xx are the request's fault and would fail anywhere.
- ``WorkerStreamError``: an error chunk or a broken connection mid-stream. Safe only if nothing was
  delivered yet and the worker did not mark it ``retryable: false``.
- ``WorkerProtocolError``: the worker answered something that is not SGLang's protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

import httpx
import msgspec

from backends.sglang.wire import ErrorEnvelope

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class WorkerError(Exception):
    """Base class: a call to ``url`` failed."""

    def __init__(self, url: str, message: str, *, bytes_received: bool = False) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.message = message
        self.bytes_received = bytes_received

    @property
    def retry_safe(self) -> bool:
        return not self.bytes_received


class WorkerConnectError(WorkerError):
    """Could not reach the worker; no request reached it or no response came back."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(url, message, bytes_received=False)


class WorkerTimeout(WorkerError):
    """No answer (or no next chunk) within the configured time. ``phase``: connect|read|write|pool."""

    def __init__(self, url: str, phase: str, *, bytes_received: bool = False) -> None:
        super().__init__(url, f"timed out ({phase})", bytes_received=bytes_received)
        self.phase = phase


class WorkerHTTPError(WorkerError):
    """The worker answered with a 4xx/5xx status; ``message`` is the one SGLang put in its body."""

    def __init__(self, url: str, status: int, message: str, *, error_type: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(url, f"HTTP {status}: {message}", bytes_received=False)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.retry_after = retry_after

    @property
    def retry_safe(self) -> bool:
        return self.status in RETRYABLE_STATUSES


class WorkerStreamError(WorkerError):
    """The stream failed after it started: an ``{"error": ...}`` chunk, or the connection broke."""

    def __init__(self, url: str, message: str, *, bytes_received: bool,
                 error_type: str | None = None, code: int | str | None = None,
                 retryable: bool | None = None) -> None:
        super().__init__(url, message, bytes_received=bytes_received)
        self.message = message
        self.error_type = error_type
        self.code = code
        self.retryable = retryable

    @property
    def retry_safe(self) -> bool:
        return not self.bytes_received and self.retryable is not False


class WorkerProtocolError(WorkerError):
    """The body does not decode as the SGLang shape we expected."""

    @property
    def retry_safe(self) -> bool:
        return False


# How a worker's failure becomes one of the errors above (``backends.sglang.client``)

_ERROR_DECODER = msgspec.json.Decoder(ErrorEnvelope)


def error_in(payload: bytes) -> ErrorEnvelope | None:
    """The error object if ``payload`` is one of SGLang's error shapes, else None (cheap check)."""
    if b'"error"' not in payload:
        return None
    try:
        envelope = _ERROR_DECODER.decode(payload)
    except msgspec.DecodeError:
        return None
    return envelope if envelope.detail_or_none() is not None else None


def phrase(status: int) -> str:
    """The standard reason phrase of an HTTP status ("" for an unknown one)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def http_error(base_url: str, status: int, reason: str, body: bytes, headers: Mapping[str, str]) -> WorkerHTTPError:
    """A 4xx/5xx answer: the message and type from SGLang's error shapes (or FastAPI's ``detail``), else the body."""
    envelope = error_in(body)
    detail = envelope.detail_or_none() if envelope else None
    if detail is None and body:
        try:  # {"detail": ...} from FastAPI, or any JSON
            detail = _ERROR_DECODER.decode(body).detail_or_none()
        except msgspec.DecodeError:
            detail = None
    message = detail.message if detail else body.decode(errors="replace")[:500]
    return WorkerHTTPError(base_url, status, message or reason, error_type=detail.type if detail else None,
                           retry_after=_retry_after(headers))


def from_httpx(base_url: str, exc: httpx.HTTPError, *, bytes_received: bool) -> WorkerError:
    """An httpx failure as the error it is: a timeout (by phase), a stream broken mid-answer, or no answer."""
    if isinstance(exc, httpx.ConnectTimeout):
        return WorkerTimeout(base_url, "connect")
    if isinstance(exc, httpx.TimeoutException):
        phase = {httpx.ReadTimeout: "read", httpx.WriteTimeout: "write",
                 httpx.PoolTimeout: "pool"}.get(type(exc), "read")
        return WorkerTimeout(base_url, phase, bytes_received=bytes_received)
    if bytes_received:
        return WorkerStreamError(base_url, f"connection broke mid-stream: {exc!r}", bytes_received=True)
    return WorkerConnectError(base_url, f"{type(exc).__name__}: {exc}")
