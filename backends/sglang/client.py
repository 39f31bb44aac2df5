"""Async client for one SGLang-compatible worker (a real SGLang server or ``specgate worker``).

One ``SGLangClient`` per worker URL, opened and closed explicitly (the gateway does it in its
lifespan). Every failure surfaces as a ``backends.sglang.errors.WorkerError`` subclass that says
whether retrying elsewhere is safe. OpenAI bodies are forwarded as dicts (the gateway does not
re-model them) and come back parsed, together with the raw bytes for verbatim forwarding.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import msgspec

from backends.sglang.errors import (
    WorkerHTTPError,
    WorkerProtocolError,
    WorkerStreamError,
    WorkerTimeout,
    error_in,
    from_httpx,
    http_error,
    phrase,
)
from backends.sglang.h1 import H1Pool
from backends.sglang.openai_wire import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse
from backends.sglang.streaming import DONE, DeltaTracker, sse_data
from backends.sglang.wire import (
    AbortRequest,
    GenerateRequest,
    GenerateResponse,
    LoadsResponse,
    MetaInfo,
    ModelInfo,
    ServerInfo,
)

T = TypeVar("T")
LOADS_INCLUDE = "core,memory,spec,queues"


# A keep-alive connection the worker closes just as it is reused (uvicorn closes idle ones after 5 s; a pool
# that leaves connections idle for seconds hits that window) fails with one of these before any answer
# byte. Nothing was relayed, so the request is sent once more (on another connection: the pool discards the broken one), as
# safe as the gateway's retry on another worker; a second failure is the worker's.
_DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
KEEPALIVE_EXPIRY_S = 4.0  # below uvicorn's 5 s keep-alive timeout, so an idle connection expires here first


class _Unanswered(Exception):
    """A dropped connection before the status line (internal to the streaming retry)."""

    def __init__(self, cause: httpx.HTTPError) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass(frozen=True, slots=True)
class ClientTimeouts:
    """Seconds. ``read`` bounds the wait for the first byte AND for each next stream chunk."""

    connect: float = 2.0
    read: float = 120.0
    write: float = 10.0
    pool: float = 5.0
    control: float = 10.0  # health / loads / info / abort (health runs a one-token generation)


@dataclass(frozen=True, slots=True)
class GenerateDelta:
    """One /generate stream event: what this chunk added, plus the chunk's meta_info.

    ``finished`` is True on the final chunk (``meta_info.finish_reason`` set); its meta_info carries
    ``e2e_latency`` and the spec_* fields.
    """

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    finished: bool


@dataclass(frozen=True, slots=True)
class OpenAIResult(Generic[T]):
    """A parsed OpenAI-style body and its exact bytes (what the worker sent)."""

    raw: bytes
    parsed: T


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}
_JSON = msgspec.json.Encoder()


def _decoder(kind: type[T]) -> msgspec.json.Decoder[T]:
    if kind not in _DECODERS:
        _DECODERS[kind] = msgspec.json.Decoder(kind)
    return _DECODERS[kind]


class SGLangClient:
    """Talks SGLang's HTTP protocol to the worker at ``base_url``.

    ``incremental_output``: None detects the /generate streaming mode (see ``streaming.py``);
    True/False declares it. ``transport`` is for tests and unusual deployments. ``fast_json``: chat,
    completions and /generate, whole and streamed, go through ``h1.H1Pool`` (the gateway's hot path) instead of
    httpx.
    """

    def __init__(self, base_url: str, *, timeouts: ClientTimeouts = ClientTimeouts(),
                 incremental_output: bool | None = None,
                 headers: Mapping[str, str] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, fast_json: bool = False) -> None:
        self.base_url = base_url.rstrip("/")
        self._fast_json = fast_json and not headers
        self._h1: H1Pool | None = None
        self.timeouts = timeouts
        self.incremental_output = incremental_output
        self._headers = dict(headers or {})
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def open(self) -> None:
        if self._http is not None:
            return
        t = self.timeouts
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, transport=self._transport,
            timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )
        if self._fast_json:
            self._h1 = H1Pool(self.base_url, connect_s=t.connect, read_s=t.read)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._h1 is not None:
            self._h1.close()
            self._h1 = None

    async def __aenter__(self) -> SGLangClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError(f"SGLangClient({self.base_url}) is not open: call `await open()` first")
        return self._http

    # -- plumbing ----------------------------------------------------------------------------------

    async def _raise_for_status(self, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        body = await response.aread()
        raise http_error(self.base_url, response.status_code, response.reason_phrase, body, response.headers)

    def _decode(self, kind: type[T], payload: bytes, what: str,
                bytes_received: bool = False) -> T:
        try:
            return _decoder(kind).decode(payload)
        except msgspec.DecodeError as exc:
            raise WorkerProtocolError(self.base_url, f"bad {what} body: {exc}",
                                      bytes_received=bytes_received) from exc

    async def _request(self, method: str, path: str, *, json: Any = None,
                       params: Mapping[str, str] | None = None,
                       control: bool = False, headers: Mapping[str, str] | None = None) -> httpx.Response:
        timeout = (httpx.Timeout(self.timeouts.control, connect=self.timeouts.connect)
                   if control else httpx.USE_CLIENT_DEFAULT)
        for attempt in range(2):
            try:
                response = await self.http.request(method, path, json=json, params=params,
                                                   timeout=timeout, headers=headers)
                break
            except _DROPPED as exc:  # before any answer byte: once more, on another connection
                if attempt:
                    raise from_httpx(self.base_url, exc, bytes_received=False) from exc
            except httpx.HTTPError as exc:
                raise from_httpx(self.base_url, exc, bytes_received=False) from exc
        await self._raise_for_status(response)
        return response

    async def _post_json(self, path: str, body: Any, headers: Mapping[str, str] | None = None) -> bytes:
        """POST a JSON body, return the 2xx answer's bytes (``H1Pool`` when enabled, else httpx)."""
        if self._h1 is None:
            return (await self._request("POST", path, json=body, headers=headers)).content
        response = await self._h1.post(path, _JSON.encode(body), headers)
        if response.status >= 400:
            raise http_error(self.base_url, response.status, phrase(response.status), response.body,
                             response.headers)
        return response.body

    async def _stream_payloads(self, path: str, body: Any, headers: Mapping[str, str] | None = None
                               ) -> AsyncIterator[bytes]:
        """POST ``body`` and yield each SSE data payload; raise typed errors, incl. error chunks. A
        connection dropped before the answer's status line is retried once (:data:`_DROPPED`)."""
        for attempt in range(2):
            try:
                async with contextlib.aclosing(self._stream_once(path, body, headers)) as payloads:
                    async for payload in payloads:
                        yield payload
                return
            except _Unanswered as exc:  # raised before the first payload, so nothing was yielded
                if attempt:
                    raise from_httpx(self.base_url, exc.cause, bytes_received=False) from exc.cause

    async def _events(self, lines: AsyncIterator[str], received: list[bool]) -> AsyncIterator[bytes]:
        """The data payloads of an SSE body up to ``[DONE]``; error chunks raised typed. ``received[0]`` turns
        True once a payload was handed over."""
        async for payload in sse_data(lines):
            if payload == DONE:
                return
            envelope = error_in(payload)
            if envelope is not None:
                detail = envelope.detail_or_none()
                assert detail is not None
                raise WorkerStreamError(
                    self.base_url, detail.message, bytes_received=received[0],
                    error_type=detail.type, code=detail.code, retryable=detail.retryable)
            received[0] = True
            yield payload
        raise WorkerStreamError(self.base_url, "stream ended without data: [DONE]", bytes_received=received[0])

    async def _stream_once(self, path: str, body: Any, headers: Mapping[str, str] | None = None
                           ) -> AsyncIterator[bytes]:
        received = [False]
        if self._h1 is not None:
            async with self._h1.stream(path, _JSON.encode(body), headers) as response:
                if response.status >= 400:
                    raise http_error(self.base_url, response.status, phrase(response.status),
                                     await response.read(), response.headers)
                try:
                    async for payload in self._events(response.lines(), received):
                        yield payload
                except WorkerTimeout as exc:
                    raise WorkerTimeout(self.base_url, exc.phase, bytes_received=received[0]) from exc
                except WorkerStreamError as exc:
                    if exc.bytes_received == received[0]:
                        raise
                    raise WorkerStreamError(self.base_url, exc.message, bytes_received=received[0],
                                            error_type=exc.error_type, code=exc.code,
                                            retryable=exc.retryable) from exc
            return
        status_seen = False
        try:
            async with self.http.stream("POST", path, json=body, headers=headers) as response:
                status_seen = True
                await self._raise_for_status(response)
                async for payload in self._events(response.aiter_lines(), received):
                    yield payload
        except _DROPPED as exc:
            if not status_seen:
                raise _Unanswered(exc) from exc
            raise from_httpx(self.base_url, exc, bytes_received=received[0]) from exc
        except httpx.HTTPError as exc:
            raise from_httpx(self.base_url, exc, bytes_received=received[0]) from exc

    # -- native ------------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Non-streaming ``POST /generate`` (``stream`` is forced off)."""
        body = msgspec.to_builtins(msgspec.structs.replace(request, stream=False))
        response = await self._request("POST", "/generate", json=body)
        return self._decode(GenerateResponse, response.content, "/generate")

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Streaming ``POST /generate``: one ``GenerateDelta`` per chunk, text as deltas."""
        body = msgspec.to_builtins(msgspec.structs.replace(request, stream=True))
        tracker = DeltaTracker(self.incremental_output)
        async with contextlib.aclosing(self._stream_payloads("/generate", body)) as payloads:
            async for payload in payloads:
                chunk = self._decode(GenerateResponse, payload, "/generate chunk", bytes_received=True)
                try:
                    text, ids = tracker.push(chunk.text, chunk.output_ids, chunk.meta_info.completion_tokens)
                except ValueError as exc:
                    raise WorkerProtocolError(self.base_url, str(exc), bytes_received=True) from exc
                yield GenerateDelta(text=text, output_ids=ids, meta_info=chunk.meta_info,
                                    finished=chunk.meta_info.finish_reason is not None)

    async def abort(self, rid: str) -> None:
        """``POST /abort_request``: stop a running request (e.g. its client went away)."""
        await self._request("POST", "/abort_request", json=msgspec.to_builtins(AbortRequest(rid=rid)),
                            control=True)

    # -- OpenAI-compatible -------------------------------------------------------------------------

    @staticmethod
    def _openai_body(body: Mapping[str, Any], stream: bool, spec_details: bool,
                     include_usage: bool) -> dict[str, Any]:
        out = dict(body)
        out["stream"] = stream
        if spec_details:
            out["return_spec_tokens_details"] = True
        if stream and include_usage and "stream_options" not in out:
            out["stream_options"] = {"include_usage": True}
        return out

    async def chat_completions(self, body: Mapping[str, Any], *, spec_details: bool = True,
                               headers: Mapping[str, str] | None = None) -> OpenAIResult[ChatCompletionResponse]:
        """Non-streaming ``/v1/chat/completions``; adds ``return_spec_tokens_details: true``. ``headers``: extra
        request headers of this call (the gateway's ``traceparent``)."""
        content = await self._post_json("/v1/chat/completions",
                                        self._openai_body(body, False, spec_details, False), headers)
        return OpenAIResult(content, self._decode(ChatCompletionResponse, content, "/v1/chat/completions"))

    async def chat_completions_stream(self, body: Mapping[str, Any], *, spec_details: bool = True,
                                      include_usage: bool = True, headers: Mapping[str, str] | None = None
                                      ) -> AsyncIterator[OpenAIResult[ChatCompletionChunk]]:
        """Streaming chat: yields each chunk (raw data payload + parsed), the sglext and usage
        chunks included (``choices == []``). ``include_usage`` adds ``stream_options`` unless set."""
        body = self._openai_body(body, True, spec_details, include_usage)
        async with contextlib.aclosing(self._stream_payloads("/v1/chat/completions", body, headers)) as payloads:
            async for payload in payloads:
                yield OpenAIResult(payload, self._decode(ChatCompletionChunk, payload, "chat chunk",
                                                         bytes_received=True))

    async def completions(self, body: Mapping[str, Any], *, spec_details: bool = True,
                          headers: Mapping[str, str] | None = None) -> OpenAIResult[CompletionResponse]:
        """Non-streaming ``/v1/completions``."""
        content = await self._post_json("/v1/completions", self._openai_body(body, False, spec_details, False),
                                        headers)
        return OpenAIResult(content, self._decode(CompletionResponse, content, "/v1/completions"))

    async def completions_stream(self, body: Mapping[str, Any], *, spec_details: bool = True,
                                 include_usage: bool = True, headers: Mapping[str, str] | None = None
                                 ) -> AsyncIterator[OpenAIResult[CompletionResponse]]:
        """Streaming ``/v1/completions``; each chunk's ``choices[].text`` is a delta."""
        body = self._openai_body(body, True, spec_details, include_usage)
        async with contextlib.aclosing(self._stream_payloads("/v1/completions", body, headers)) as payloads:
            async for payload in payloads:
                yield OpenAIResult(payload, self._decode(CompletionResponse, payload,
                                                         "completion chunk", bytes_received=True))

    # -- control -----------------------------------------------------------------------------------

    async def health(self) -> None:
        """``GET /health``; returns on 2xx, raises a ``WorkerError`` otherwise (503 while starting)."""
        await self._request("GET", "/health", control=True)

    async def loads(self) -> LoadsResponse:
        response = await self._request("GET", "/v1/loads", params={"include": LOADS_INCLUDE},
                                       control=True)
        return self._decode(LoadsResponse, response.content, "/v1/loads")

    async def _info(self, kind: type[T], path: str, legacy_path: str) -> T:
        try:
            response = await self._request("GET", path, control=True)
        except WorkerHTTPError as exc:
            if exc.status != 404:
                raise
            response = await self._request("GET", legacy_path, control=True)
        return self._decode(kind, response.content, path)

    async def server_info(self) -> ServerInfo:
        """``GET /server_info``, falling back to the old ``/get_server_info`` on 404."""
        return await self._info(ServerInfo, "/server_info", "/get_server_info")

    async def model_info(self) -> ModelInfo:
        """``GET /model_info``, falling back to the old ``/get_model_info`` on 404."""
        return await self._info(ModelInfo, "/model_info", "/get_model_info")
