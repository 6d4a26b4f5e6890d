"""The FastAPI application: routes, the request gate (API key, body size) and error handlers.

Invariant: /v1/*, /tokenize, /detokenize and /reset_prefix_cache are reachable only with
`Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) for one of the keys, when keys are set,
and such a request carries its key's namespace in `request.state.tenant`; no request body larger than
max_body_bytes reaches a route (413 before any parsing); while the queue is full, a generation request gets
its 429 (529 on /v1/messages) before its body is parsed, templated or tokenised.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from deepinfer import __version__
from deepinfer.server import anthropic_api, schemas
from deepinfer.server.errors import APIError, install_error_handlers
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from deepinfer.server.responses import add_routes as add_responses_routes
from deepinfer.server.router_state import RouterStateView
from deepinfer.server.serving import Serving

# Paths that need the API key when one is set: everything that does model work, and /router/state (block
# hashes of cached prompts). /health stays open for probes, /metrics for scrapers, /version (no model work) as a
# documented choice.
_GUARDED = ("/v1", "/tokenize", "/detokenize", "/reset_prefix_cache", "/router")
_GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/responses",
               anthropic_api.PATH)  # routes that need a queue slot


def key_namespace(api_key: str) -> str:
    """A fixed-length name for an API key's prefix-cache namespace (the key itself never leaves the Gate)."""
    return hashlib.sha256(b"deepinfer-prefix-cache\0" + api_key.encode()).hexdigest()[:32]


class Gate:
    """Pure ASGI middleware (keeps `receive` intact for disconnect detection): API key on guarded paths,
    then the body is read up to the size limit and replayed to the application; a generation request
    that finds the queue full is answered 429 here, before any parsing (cheap under a burst)."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body_bytes: int, admission=None):
        self.app, self.max_body_bytes, self.admission = app, max_body_bytes, admission
        self.tenants = {b"Bearer " + key.encode(): key_namespace(key) for key in api_keys}  # header -> namespace
        self.x_api_keys = {key.encode(): key_namespace(key) for key in api_keys}  # Anthropic clients' x-api-key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self._check_headers(scope)
        if error is None:
            body, error = await self._read_body(receive)
        if error is None and self._queue_full(scope):
            error = self.admission.busy()
        if error is not None:
            anthropic = scope["path"].startswith(anthropic_api.PATH)  # Anthropic's error body there
            return await (anthropic_api.error_response(error) if anthropic else error.response())(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        if self.tenants and scope["path"].startswith(_GUARDED):
            tenant = self._tenant(headers)
            if tenant is None:
                return APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>` (or "
                                     "`x-api-key: <key>`)",
                                headers={"WWW-Authenticate": "Bearer"})
            scope.setdefault("state", {})["tenant"] = tenant
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _tenant(self, headers: dict[bytes, bytes]) -> str | None:
        """The namespace of the key presented, or None; every key is compared, each in constant time."""
        given, found = headers.get(b"authorization", b""), None
        for expected, tenant in self.tenants.items():
            if hmac.compare_digest(given, expected):
                found = tenant
        given = headers.get(b"x-api-key")
        for expected, tenant in self.x_api_keys.items() if found is None and given is not None else ():
            if hmac.compare_digest(given, expected):
                found = tenant
        return found

    def _queue_full(self, scope) -> bool:
        """A pre-check only: the route still admits by the request's own size (prompts x n)."""
        return self.admission is not None and scope["path"] in _GENERATING and self.admission.full

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


def build_app(serving: Serving, router_view: RouterStateView | None = None) -> FastAPI:
    app = FastAPI(title="deepinfer", version=__version__, description="OpenAI-compatible API for DeepSeek models")
    app.state.serving = serving
    app.state.started = int(time.time())
    install_error_handlers(app)
    schemas.install_openapi(app)
    app.add_middleware(Gate, api_keys=serving.settings.api_keys, max_body_bytes=serving.settings.max_body_bytes,
                       admission=serving.admission)
    _add_openai_routes(app, serving)
    anthropic_api.add_routes(app, serving)  # POST /v1/messages
    _add_service_routes(app, serving)
    if router_view is not None:
        _add_router_state_route(app, router_view)
    return app


def _add_openai_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/chat/completions", **schemas.route(schemas.ChatCompletionResponse, *schemas.GENERATION_ERRORS,
                                                      stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/v1/completions", **schemas.route(schemas.CompletionResponse, *schemas.GENERATION_ERRORS, stream=True))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    add_responses_routes(app, serving)  # POST /v1/responses, GET / DELETE /v1/responses/{id}

    @app.get("/v1/models", **schemas.route(schemas.ModelList, 401, 500))
    async def models() -> dict:
        card = {"id": serving.settings.model_name, "object": "model", "created": app.state.started,
                "owned_by": "deepinfer", "root": serving.settings.model_name,
                "max_model_len": serving.max_model_len}
        return {"object": "list", "data": [card]}


def _add_service_routes(app: FastAPI, serving: Serving) -> None:
    @app.get("/health", **schemas.route(schemas.StatusResponse, 500, 503))
    async def health() -> Response:
        client = serving.client
        if client.dead:
            return APIError(503, f"unhealthy: {client.dead_reason or 'the engine died'}").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse, responses=schemas.METRICS_RESPONSES)
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", **schemas.route(schemas.TokenizeResponse, *schemas.TOKENIZER_ERRORS))
    async def tokenize(body: TokenizeRequest) -> dict:
        return await serving.tokenize(body)

    @app.post("/detokenize", **schemas.route(schemas.DetokenizeResponse, *schemas.TOKENIZER_ERRORS))
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await serving.detokenize(body)

    @app.post("/reset_prefix_cache", **schemas.route(schemas.StatusResponse, 401, 413, 500, 503))
    async def reset_prefix_cache() -> dict:
        """Forget every cached prefix block in the engine (requests in flight keep their blocks)."""
        if serving.client.dead:
            return APIError(503, "the engine died").response()
        serving.client.reset_prefix_cache()
        return {"status": "ok"}

    @app.get("/version", **schemas.route(schemas.VersionResponse, 500))
    async def version() -> dict:
        process = getattr(serving.client, "process", None)
        return {"version": __version__, "server_pid": os.getpid(), "engine_pid": getattr(process, "pid", None)}


def _add_router_state_route(app: FastAPI, view: RouterStateView) -> None:
    @app.get("/router/state", **schemas.route(schemas.RouterStateResponse, 401, 500))
    async def router_state(since: int = 0) -> dict:
        """Load, liveness and the prefix-cache events after number `since`, for `deepinfer router`."""
        return view.state(since)
