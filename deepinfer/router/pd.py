"""`deepinfer router --prefill URL ... --decode URL ...`: prefill/decode disaggregation behind one endpoint.

Each generation request goes to a prefill instance first (cache- and load-aware over the prefill pool), as a
non-streamed request with `kv_transfer_params: {"do_remote_decode": true}`: it computes the prompt and the first
token and answers with the kv_transfer_params that name its held cache. The client's own body, plus those
params, then goes to a decode instance (cache-aware too: a decode-side prefix hit shrinks the transfer), whose
answer (JSON or SSE stream) comes back to the client as it is, as with `--workers`.

Invariants:
- A prefill instance lost before its answer is retried once on another; its 4xx answers pass through.
- A decode instance lost before its answer gets the client a 503 `replica_lost` (the prefill instance frees
  its held cache by lease); lost mid-stream, the stream ends with that error event.
- Both pools' estimated loads are released exactly once per request.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepinfer.router.http import Proxy, _json_object, _Lost
from deepinfer.router.prompts import prompt_tokens
from deepinfer.server.errors import APIError

logger = logging.getLogger("deepinfer.router")


class DisaggregatedProxy:
    def __init__(self, prefill: Proxy, decode: Proxy):
        self.prefill, self.decode = prefill, decode
        self.pool, self.stats, self.tokenizer = decode.pool, decode.stats, decode.tokenizer  # health and metrics

    async def generation(self, request: Request) -> Response:
        parsed = _json_object(await request.body())
        if parsed is None:
            return await self.decode.forward(request)  # the decode instance answers the 400
        tokens = await asyncio.to_thread(prompt_tokens, self.tokenizer, request.url.path, parsed)
        worker, cost = self.decode._route(request, parsed, tokens)  # first: no prefill without a decode worker
        params = None
        try:
            params = await self._prefill(request, parsed, tokens)
        finally:
            if not isinstance(params, dict):  # no decode request follows: its estimated load is released
                self.decode.pool.finished(worker, cost)
        if isinstance(params, Response):
            return params
        body = json.dumps({**parsed, "kv_transfer_params": params}).encode()
        try:
            if parsed.get("stream") is True:
                return await self.decode._stream(request, worker, cost, body)
            return await self.decode._unary(request, worker, cost, body)
        except _Lost as e:
            self.decode.pool.leave(worker, str(e))
            self.stats.rejections["engine_lost"] += 1
            return APIError(503, f"decode worker {worker.index} ({worker.url}) was lost: {e}",
                            code="replica_lost").response()

    async def _prefill(self, request: Request, parsed: dict, tokens: list[int] | None) -> dict | Response:
        """The prefill instance's kv_transfer_params, or the response to give the client instead."""
        body = {k: v for k, v in parsed.items() if k != "stream_options"}
        body = json.dumps({**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}).encode()
        routed = {**parsed, "max_tokens": 1, "max_completion_tokens": None, "n": 1}  # its cost: prompt + 1
        for attempt in (0, 1):
            worker, cost = self.prefill._route(request, routed, tokens)
            try:
                response = await self.prefill._unary(request, worker, cost, body)
            except _Lost as e:
                self.prefill.pool.leave(worker, str(e))
                if attempt == 1:
                    self.stats.rejections["engine_lost"] += 1
                    return APIError(503, f"prefill worker {worker.index} ({worker.url}) was lost: {e}",
                                    code="replica_lost").response()
                self.stats.retries += 1
                continue
            if response.status_code != 200:
                return response
            params = (_json_object(response.body) or {}).get("kv_transfer_params")
            if not isinstance(params, dict):
                return APIError(502, f"prefill worker {worker.index} ({worker.url}) answered without "
                                "kv_transfer_params: is it serving with --disaggregation-mode prefill?").response()
            return params
        raise AssertionError("unreachable")

    async def forward(self, request: Request) -> Response:
        return await self.decode.forward(request)

    async def reset_prefix_cache(self, request: Request) -> Response:
        answers = [await self.prefill.reset_prefix_cache(request), await self.decode.reset_prefix_cache(request)]
        bad = next((a for a in answers if a.status_code != 200), None)
        return bad if bad is not None else JSONResponse({"status": "ok"})
