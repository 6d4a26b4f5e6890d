"""OpenAI-shaped errors: every non-2xx answer of the server has the body
`{"error": {"message", "type", "param", "code"}}`, whatever raised it (our checks, pydantic,
Starlette's routing, or an unexpected exception)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("deepinfer")

_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}
_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
          429: "queue_full", 500: "internal_error", 503: "engine_dead"}  # every 503: the engine process is gone


class APIError(Exception):
    """An error answer; `headers` lets 429 carry Retry-After."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _CODES.get(status)
        self.headers = headers

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> str:
        """ASCII JSON: a message quoting client input may hold lone surrogates, which UTF-8 cannot encode."""
        return json.dumps(self.body(), ensure_ascii=True)

    def response(self) -> Response:
        return Response(self.json(), status_code=self.status, headers=self.headers, media_type="application/json")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, named by its field path (the `body` prefix dropped)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('ctx', {}).get('error', 'invalid JSON')}")
    path = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{path}: {first.get('msg')}" if path else str(first.get("msg"))
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(message + more, param=path.split(".")[0] or None)


async def _on_api_error(_: Request, exc: APIError) -> Response:
    return exc.response()


async def _on_validation_error(_: Request, exc: RequestValidationError) -> Response:
    return _validation_error(exc).response()


async def _on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
    return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()


async def _on_unexpected(_: Request, exc: Exception) -> Response:
    logger.exception("unexpected error while handling a request", exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__})").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
