"""The FastAPI application: routes, the request gate (API key, body size) and error handlers.

Invariant: /v1/*, /tokenize, /detokenize and /reset_prefix_cache are reachable only with the right
`Authorization: Bearer <key>` when a key is set; no request body larger than max_body_bytes reaches a
route (413 before any parsing); while the queue is full, a generation request gets its 429 before its
body is parsed, templated or tokenised.
"""

from __future__ import annotations

import hmac
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from deepinfer import __version__
from deepinfer.server.errors import APIError, install_error_handlers
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from deepinfer.server.serving import Serving

# Paths that need the API key when one is set: everything that does model work. /health stays open for
# probes, /metrics for scrapers, /version (no model work) as a documented choice.
_GUARDED = ("/v1", "/tokenize", "/detokenize", "/reset_prefix_cache")
_GENERATING = ("/v1/completions", "/v1/chat/completions")  # routes that need a queue slot


class Gate:
    """Pure ASGI middleware (keeps `receive` intact for disconnect detection): API key on guarded paths,
    then the body is read up to the size limit and replayed to the application; a generation request
    that finds the queue full is answered 429 here, before any parsing (cheap under a burst)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, admission=None):
        self.app, self.api_key, self.max_body_bytes, self.admission = app, api_key, max_body_bytes, admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self._check_headers(scope)
        if error is None:
            body, error = await self._read_body(receive)
        if error is None and self._queue_full(scope):
            error = self.admission.busy()
        if error is not None:
            return await error.response()(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"].startswith(_GUARDED) and not self._authorized(headers):
            return APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                            headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _queue_full(self, scope) -> bool:
        """A pre-check only: the route still admits by the request's own size (prompts x n)."""
        return self.admission is not None and scope["path"] in _GENERATING and self.admission.full

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"authorization", b"")
        return hmac.compare_digest(given, b"Bearer " + self.api_key.encode())

    async def _read_body(self, receive) -> tuple[bytes, APIError | None]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", None  # the client left; the route sees an empty body and its disconnect
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return b"", self._too_large()
            if not message.get("more_body", False):
                return b"".join(chunks), None

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds the limit of {self.max_body_bytes} bytes")


def _replay(body: bytes, receive):
    """A receive() that yields the buffered body once, then defers to the real one."""
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def build_app(serving: Serving) -> FastAPI:
    app = FastAPI(title="deepinfer", version=__version__, description="OpenAI-compatible API for DeepSeek models")
    app.state.serving = serving
    app.state.started = int(time.time())
    install_error_handlers(app)
    app.add_middleware(Gate, api_key=serving.settings.api_key, max_body_bytes=serving.settings.max_body_bytes,
                       admission=serving.admission)
    _add_openai_routes(app, serving)
    _add_service_routes(app, serving)
    return app


def _add_openai_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": serving.settings.model_name, "object": "model", "created": app.state.started,
                "owned_by": "deepinfer", "root": serving.settings.model_name,
                "max_model_len": serving.max_model_len}
        return {"object": "list", "data": [card]}


def _add_service_routes(app: FastAPI, serving: Serving) -> None:
    @app.get("/health")
    async def health() -> Response:
        client = serving.client
        if client.dead:
            return APIError(503, f"unhealthy: {client.dead_reason or 'the engine died'}").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await serving.detokenize(body)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        """Forget every cached prefix block in the engine (requests in flight keep their blocks)."""
        if serving.client.dead:
            return APIError(503, "the engine died").response()
        serving.client.reset_prefix_cache()
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        process = getattr(serving.client, "process", None)
        return {"version": __version__, "server_pid": os.getpid(), "engine_pid": getattr(process, "pid", None)}
