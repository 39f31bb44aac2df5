"""INSTANT WORKER: a stand-in that answers SGLang/OpenAI requests immediately with a fixed tiny answer.

It exists ONLY so ``bench/gateway.py`` can measure what a gateway itself costs (no model time hides
it). It is not a worker and nothing else may use it. It speaks the endpoints gateways call: /health,
/v1/models (owned_by sglang, as smg expects), /server_info, /model_info, /v1/loads (string timestamp),
/abort_request, /generate, and /v1/chat/completions + /v1/completions (JSON or SSE with usage and
``sglext``). A raw asyncio protocol keeps its own cost far below any gateway's.

    python -m bench.instant_worker --port 31000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

MODEL = "instant"
_CHAT = {"id": "instant-1", "object": "chat.completion", "created": 0, "model": MODEL,
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
         "sglext": {"spec_tokens_details": {"spec_verify_ct": 1, "spec_accept_length": 1.0}}}
_TEXT = {**_CHAT, "object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
_STREAM_CHAT = [
    {"id": "instant-1", "object": "chat.completion.chunk", "model": MODEL,
     # the ids a stream that may resume carries (gateway/resume.py), as the embedded worker sends them when asked
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": None,
                  "prompt_token_ids": [1, 2, 3, 4, 5], "token_ids": [1]}]},
    {"id": "instant-1", "object": "chat.completion.chunk", "model": MODEL,
     "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"id": "instant-1", "object": "chat.completion.chunk", "model": MODEL, "choices": [],
     "sglext": _CHAT["sglext"]},
    {"id": "instant-1", "object": "chat.completion.chunk", "model": MODEL, "choices": [],
     "usage": _CHAT["usage"]},
]
_STREAM_TEXT = [
    {"id": "instant-1", "object": "text_completion", "model": MODEL,
     "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]},
    {"id": "instant-1", "object": "text_completion", "model": MODEL, "choices": [], "usage": _CHAT["usage"]},
]
_GET = {
    b"/health": {}, b"/health_generate": {}, b"/ready": {},
    b"/v1/models": {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                 "owned_by": "sglang", "root": MODEL, "max_model_len": 8192}]},
    b"/server_info": {"model_path": MODEL, "served_model_name": MODEL, "context_length": 8192,
                      "max_total_num_tokens": 65536, "max_running_requests": 256, "version": "instant"},
    b"/model_info": {"model_path": MODEL, "served_model_name": MODEL, "is_generation": True},
}
_GET[b"/get_server_info"], _GET[b"/get_model_info"] = _GET[b"/server_info"], _GET[b"/model_info"]


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type +
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


_FIXED = {k: _response("200 OK", json.dumps(v).encode()) for k, v in _GET.items()}
_POST_JSON = {b"/v1/chat/completions": _response("200 OK", json.dumps(_CHAT).encode()),
              b"/v1/completions": _response("200 OK", json.dumps(_TEXT).encode()),
              b"/abort_request": _response("200 OK", b"{}"),
              b"/generate": _response("200 OK", json.dumps(
                  {"text": "ok", "output_ids": [1], "meta_info": {"id": "instant-1", "finish_reason": {"type": "stop"},
                                                                  "prompt_tokens": 5, "completion_tokens": 1}}).encode())}
_SSE = {path: _response("200 OK", b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
                        + b"data: [DONE]\n\n", b"text/event-stream")
        for path, chunks in ((b"/v1/chat/completions", _STREAM_CHAT), (b"/v1/completions", _STREAM_TEXT))}
_NOT_FOUND = _response("404 Not Found", b'{"error": {"message": "not found"}}')


class InstantHTTP(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and Content-Length bodies; enough for every gateway benchmarked."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            end = head_end + 4 + length
            if len(self.buffer) < end:
                return
            body, self.buffer = self.buffer[head_end + 4:end], self.buffer[end:]
            method, path = head.split(b" ", 2)[:2]
            self.transport.write(self._answer(method, path.split(b"?", 1)[0], body))

    @staticmethod
    def _answer(method: bytes, path: bytes, body: bytes) -> bytes:
        if method == b"GET":
            if path == b"/v1/loads":
                return _response("200 OK", json.dumps({
                    "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ"), "dp_rank_count": 1,
                    "loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
                               "max_total_num_tokens": 65536, "token_usage": 0.0}]}).encode())
            return _FIXED.get(path, _NOT_FOUND)
        if path in _SSE and (b'"stream":true' in body or b'"stream": true' in body):
            return _SSE[path]
        return _POST_JSON.get(path, _NOT_FOUND)


async def serve(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(InstantHTTP, host, port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=31000)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
