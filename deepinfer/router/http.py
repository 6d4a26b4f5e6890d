"""`deepinfer router --workers URL [URL ...]`: one OpenAI-compatible endpoint in front of separate
`deepinfer serve` instances (other machines), routed by the same policy as --data-parallel-replicas.

A generation request is rendered and tokenised here as its server will (router/prompts.py), its block hashes
routed by RouterState over what the workers' /router/state polls reported (router/workers.py), and its body
forwarded unchanged, with the client's Authorization header, to the chosen worker; the worker's answer (JSON,
SSE stream or error) comes back as it is. Everything a server does with a request (streaming, n, tools,
structured outputs, API keys, limits) is therefore exactly one server's behaviour.

Invariants:
- A request whose worker is lost (refused, dropped connection, out of rotation, or a 503 saying its engine is
  gone) before anything reached the client is sent once more, to another worker; lost after that, the stream
  ends with a 503 `replica_lost` error event (and [DONE]). Other workers' requests are not affected.
- A client that goes away closes the worker connection, so the worker aborts the request.
- Every routed request's estimated load is released exactly once, however its response ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from deepinfer import __version__
from deepinfer.engine.kv_cache import chain_hashes
from deepinfer.router.metrics import RouterCollector, RouterStats
from deepinfer.router.policy import NoReplica, RouterConfig
from deepinfer.router.prompts import cache_salt, prompt_tokens
from deepinfer.router.workers import Worker, WorkerPool
from deepinfer.server.app import Gate
from deepinfer.server.errors import APIError, install_error_handlers
from deepinfer.server.serving import GuardedStream, run_until_disconnect, sse

logger = logging.getLogger("deepinfer.router")

_FORWARDED = ("authorization", "content-type", "accept", "x-request-id")
_RETURNED = ("content-type", "retry-after", "www-authenticate", "cache-control")
_ENGINE_GONE = ("engine_dead", "replica_lost")  # a worker's 503 codes that mean "try another worker"
ENGINE_HEADER = "x-deepinfer-engine"  # which worker (index in --workers) answered


class _Lost(Exception):
    """The worker was lost before the request's answer (or its first event) arrived."""


class Proxy:
    def __init__(self, pool: WorkerPool, tokenizer, stats: RouterStats):
        self.pool, self.tokenizer, self.stats = pool, tokenizer, stats

    async def generation(self, request: Request) -> Response:
        body = await request.body()
        parsed = _json_object(body)
        if parsed is None:
            return await self.forward(request)  # the worker answers the 400
        tokens = await asyncio.to_thread(prompt_tokens, self.tokenizer, request.url.path, parsed)
        stream = parsed.get("stream") is True
        for attempt in (0, 1):
            worker, cost = self._route(request, parsed, tokens)
            try:
                if stream:
                    return await self._stream(request, worker, cost, body)
                return await self._unary(request, worker, cost, body)
            except _Lost as e:
                self.pool.leave(worker, str(e))
                if attempt == 1:
                    self.stats.rejections["engine_lost"] += 1
                    return APIError(503, f"worker {worker.index} ({worker.url}) was lost: {e}",
                                    code="replica_lost").response()
                self.stats.retries += 1
                logger.warning("worker %d was lost before answering (%s); routing the request again", worker.index, e)
        raise AssertionError("unreachable")

    def _route(self, request: Request, body: dict, tokens: list[int] | None) -> tuple[Worker, int]:
        block_size = self.pool.block_size
        salt = cache_salt(body, request.headers.get("authorization"), self.pool.isolation)
        hashes = chain_hashes(tokens, block_size, salt, []) if tokens and block_size else []
        cost = (len(tokens) if tokens else 0) + _output_budget(body)
        try:
            worker, decision = self.pool.choose(hashes, cost, salt)
        except NoReplica:
            self.stats.rejections["no_engine"] += 1
            raise APIError(503, f"no worker is in rotation ({self.pool.reasons()})", code="no_engine") from None
        self.stats.record(decision, len(hashes))
        return worker, cost

    async def _unary(self, request: Request, worker: Worker, cost: int, body: bytes) -> Response:
        answer: list[httpx.Response] = []

        async def post() -> None:
            send = self.pool.http.post(worker.url + request.url.path, content=body, headers=_forwarded(request))
            answer.append(await _race(send, worker.lost))

        try:
            if not await run_until_disconnect(request, post()):
                return Response(status_code=499)  # the client left: the cancelled post closed the connection
        except httpx.TransportError as e:
            raise _Lost(f"{type(e).__name__}: {e}") from None
        finally:
            self.pool.finished(worker, cost)
        response = answer[0]
        _raise_if_engine_gone(response.status_code, response.content)
        return Response(response.content, response.status_code, _returned(response, worker))

    async def _stream(self, request: Request, worker: Worker, cost: int, body: bytes) -> Response:
        """The first event is awaited before the client's response starts, so a worker lost until then is
        retried with nothing sent; the rest is relayed event by event."""
        upstream = self.pool.http.build_request("POST", worker.url + request.url.path, content=body,
                                                headers=_forwarded(request))
        response = None
        try:
            response = await _race(self.pool.http.send(upstream, stream=True), worker.lost)
            events = _sse_events(response.aiter_bytes())
            if response.status_code != 200:
                content = await _race(response.aread(), worker.lost)
                _raise_if_engine_gone(response.status_code, content)
                await response.aclose()
                self.pool.finished(worker, cost)
                return Response(content, response.status_code, _returned(response, worker))
            first = await _race(anext(events, b""), worker.lost)
        except BaseException as e:
            if response is not None:
                await _close(response)
            self.pool.finished(worker, cost)
            if isinstance(e, httpx.TransportError):
                raise _Lost(f"{type(e).__name__}: {e}") from None
            raise
        relay = self._relay(first, events, response, worker)
        return GuardedStream(relay, lambda: self.pool.finished(worker, cost), _returned(response, worker))

    async def _relay(self, first: bytes, events: AsyncIterator[bytes], response: httpx.Response,
                     worker: Worker) -> AsyncIterator[bytes]:
        try:
            yield first
            while event := await self._next_event(events, worker):
                yield event
        finally:
            await _close(response)

    async def _next_event(self, events: AsyncIterator[bytes], worker: Worker) -> bytes:
        """The next event of the worker's stream, b"" at its end; a worker lost mid-stream ends the client's
        stream with a 503 error event (its tokens so far stay delivered)."""
        try:
            return await _race(anext(events, b""), worker.lost)
        except (_Lost, httpx.TransportError) as e:
            self.pool.leave(worker, f"{type(e).__name__}: {e}")
            self.stats.rejections["engine_lost"] += 1
            error = APIError(503, f"worker {worker.index} ({worker.url}) was lost while the request ran",
                             code="replica_lost")
            return (sse(error.json()) + sse("[DONE]")).encode()

    async def forward(self, request: Request) -> Response:
        """A request that needs no routing (models, tokenize, an unreadable body) to the least loaded worker."""
        worker = self.pool.any_worker()
        if worker is None:
            return APIError(503, f"no worker is in rotation ({self.pool.reasons()})", code="no_engine").response()
        try:
            response = await self.pool.http.request(request.method, worker.url + request.url.path,
                                                    content=await request.body(), headers=_forwarded(request),
                                                    params=request.query_params)
        except httpx.TransportError as e:
            self.pool.leave(worker, f"{type(e).__name__}: {e}")
            return APIError(503, f"worker {worker.index} ({worker.url}) did not answer", code="replica_lost").response()
        return Response(response.content, response.status_code, _returned(response, worker))

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Every worker in rotation forgets its cached prefixes (their "cleared" events reach the router)."""
        workers = [self.pool.workers[i] for i in sorted(self.pool.state.healthy)]
        answers = await asyncio.gather(*(self.pool.http.post(w.url + "/reset_prefix_cache", headers=_forwarded(request))
                                         for w in workers), return_exceptions=True)
        failed = [w.index for w, a in zip(workers, answers, strict=True)
                  if isinstance(a, BaseException) or a.status_code != 200]
        if failed or not workers:
            return APIError(503, f"workers {failed or 'none in rotation'} did not reset").response()
        return JSONResponse({"status": "ok"})


async def _race(work, lost: asyncio.Event):
    """`work`'s result, or _Lost (work cancelled) if the worker leaves rotation first."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(lost.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):  # even when we are cancelled: the read must unwind first
                await asyncio.gather(task, return_exceptions=True)
    if task.done() and not task.cancelled():
        return task.result()
    raise _Lost("the worker left rotation")


async def _close(response: httpx.Response) -> None:
    """Close the worker connection, also from a cancelled stream (Starlette cancels it when the client
    leaves): unshielded, the close is cancelled half-way and the worker keeps generating for nobody."""
    with anyio.CancelScope(shield=True):
        await response.aclose()


async def _sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events ("...\\n\\n") from arbitrary chunks, so an error event never lands inside another."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            yield event + b"\n\n"
    if buffer:
        yield buffer


def _raise_if_engine_gone(status: int, content: bytes) -> None:
    if status == 503 and (_json_object(content) or {}).get("error", {}).get("code") in _ENGINE_GONE:
        raise _Lost(f"the worker answered 503: {_json_object(content)['error'].get('message')}")


def _json_object(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _output_budget(body: dict) -> int:
    """max_tokens (or max_completion_tokens) x n: the output part of the request's cost."""
    budget = body.get("max_completion_tokens") or body.get("max_tokens") or 0
    n = body.get("n") or 1
    return budget * n if isinstance(budget, int) and isinstance(n, int) else 0


def _forwarded(request: Request) -> dict[str, str]:
    return {k: v for k in _FORWARDED if (v := request.headers.get(k)) is not None}


def _returned(response: httpx.Response, worker: Worker) -> dict[str, str]:
    headers = {k: v for k in _RETURNED if (v := response.headers.get(k)) is not None}
    return {**headers, ENGINE_HEADER: str(worker.index)}


# --- the app -------------------------------------------------------------------------------------
def build_router_app(proxy, api_keys: tuple[str, ...], max_body_bytes: int) -> FastAPI:
    app = FastAPI(title="deepinfer router", version=__version__, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(Gate, api_keys=api_keys, max_body_bytes=max_body_bytes)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(proxy.stats, proxy.pool.state, {w.index: w.url for w in proxy.pool.workers}))
    for path in ("/v1/chat/completions", "/v1/completions"):
        app.add_api_route(path, proxy.generation, methods=["POST"])
    for path, method in (("/v1/models", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST")):
        app.add_api_route(path, proxy.forward, methods=[method])
    app.add_api_route("/reset_prefix_cache", proxy.reset_prefix_cache, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        if not proxy.pool.state.healthy:
            return APIError(503, f"unhealthy: no worker is in rotation ({proxy.pool.reasons()})",
                            code="no_engine").response()
        return JSONResponse({"status": "ok", "workers_in_rotation": len(proxy.pool.state.healthy)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_router(args: argparse.Namespace) -> int:
    """`deepinfer router`: serve until stopped; returns the exit status."""
    from deepinfer.server.launch import api_keys_from, bind_socket, load_tokenizer

    if bool(args.prefill) != bool(args.decode):
        print("deepinfer router: --prefill and --decode go together (a prefill and a decode pool)", file=sys.stderr)
        return 2
    config = RouterConfig(args.policy, args.balance_abs_tokens, args.balance_rel)
    tokenizer = load_tokenizer(_tokenizer_dir(args))
    keys = api_keys_from(args)
    worker_key = args.worker_api_key or (keys[0] if keys else None)
    with bind_socket(args.host, args.port) as sock:
        asyncio.run(_serve(args, sock, config, tokenizer, keys, worker_key))
    return 0


def _tokenizer_dir(args: argparse.Namespace) -> Path:
    from deepinfer.llm import resolve_model

    path, bundled = resolve_model(args.tokenizer)
    if bundled:
        print(f"deepinfer router: tokenizing with the bundled default model's tokenizer ({path.name})", flush=True)
    return path


async def _serve(args, sock, config: RouterConfig, tokenizer, keys: tuple[str, ...], worker_key: str | None) -> None:
    groups = [args.workers] if args.workers else [args.prefill, args.decode]
    pools = [WorkerPool(urls, config, worker_key, args.poll_interval_ms / 1000, args.health_timeout,
                        args.hang_timeout) for urls in groups]
    for pool in pools:
        pool.start()
    try:
        stats = RouterStats()
        proxies = [Proxy(pool, tokenizer, stats) for pool in pools]
        if len(proxies) == 1:
            proxy = proxies[0]
        else:
            from deepinfer.router.pd import DisaggregatedProxy

            proxy = DisaggregatedProxy(*proxies)
        app = build_router_app(proxy, keys, args.max_body_bytes)
        for pool in pools:
            if not await pool.wait_ready(args.startup_timeout):
                print(f"deepinfer router: no worker answered within {args.startup_timeout} s ({pool.reasons()}); "
                      "serving anyway, requests get 503 until one does", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, lifespan="off",
                                               access_log=args.access_log, log_level=args.log_level))
        await server.serve(sockets=[sock])
    finally:
        for pool in pools:
            await pool.close()
