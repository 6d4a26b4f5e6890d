"""What `deepinfer router` needs of a request to route it: the prompt tokens and cache salt the server will use.

The router renders and tokenises a request exactly as the server does (server/serving.py's chat_prompt and
encode_text, with the same tokenizer), so its block hashes are the ones the server's prefix cache stores.
Anything the router cannot read (no tokenizer, a body the server will reject) routes without hashes, by load:
the server then answers its own error.
"""

from __future__ import annotations

import jinja2
from pydantic import ValidationError

from deepinfer.server.app import key_namespace
from deepinfer.server.errors import APIError
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.server.serving import chat_prompt, encode_text, prompt_list
from deepinfer.server.tools import tool_setup

_UNREADABLE = (APIError, ValidationError, ValueError, TypeError, jinja2.TemplateError)


def prompt_tokens(tokenizer, path: str, body: dict) -> list[int] | None:
    """The token ids of the request's (first) prompt as the server computes them; None if unknown."""
    try:
        if path == "/v1/chat/completions":
            if tokenizer is None:
                return None
            req = ChatCompletionRequest.model_validate(body)
            return encode_text(tokenizer, chat_prompt(tokenizer, req, tool_setup(req)), req.add_special_tokens)
        req = CompletionRequest.model_validate(body)
        first = prompt_list(req.prompt)[0]
        if not isinstance(first, str):
            return list(first)
        return encode_text(tokenizer, first, req.add_special_tokens) if tokenizer is not None else None
    except _UNREADABLE:
        return None


def cache_salt(body: dict, authorization: str | None, isolation: str) -> str | None:
    """The salt the server keys the request's prefix blocks by (Serving.cache_salt): under
    --prefix-cache-isolation key, inside the namespace of the API key presented."""
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    if isolation != "key":
        return salt
    scheme, _, key = (authorization or "").partition(" ")
    tenant = key_namespace(key) if scheme == "Bearer" and key else ""
    return f"{tenant}:{salt or ''}"
