"""Request fields -> StructuredOutputsParams: OpenAI `response_format`, vLLM's `structured_outputs` and
its older `guided_*` names, and forced tool calls. Every problem is a 400 naming the field, found
before anything is queued (the grammar is built and compiled in a worker process, under a time limit)."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict

from deepinfer.server.errors import APIError, bad_request
from deepinfer.server.grammar_workers import CompilePool, Verdict, WorkerGone
from deepinfer.structured.params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _response_format(req) -> dict | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required for type json_schema",
                              param="response_format")
        return {"json": fmt.json_schema.schema_}
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}",
                      param="response_format")


def _constraints(req, tool_spec: dict | None) -> list[tuple[str, dict]]:
    found = []
    if (fields := _response_format(req)) is not None:
        found.append(("response_format", fields))
    if req.structured_outputs is not None:
        fields = {k: v for k, v in req.structured_outputs.model_dump().items() if v is not None}
        found.append(("structured_outputs", {("json" if k == "json_" else k): v for k, v in fields.items()}))
    found += [(name, {kind: getattr(req, name)}) for name, kind in _GUIDED.items() if getattr(req, name) is not None]
    if tool_spec is not None:
        found.append(("tool_choice", tool_spec))
    return found


def request_spec(req, thinking: bool, tool_spec: dict | None = None) -> StructuredOutputsParams | None:
    """The request's one constraint (None without any); with thinking on it applies after `</think>`."""
    found = _constraints(req, tool_spec)
    if len(found) > 1:
        raise bad_request(f"give at most one output constraint; got {', '.join(name for name, _ in found)}",
                          param=found[1][0])
    if not found:
        return None
    name, fields = found[0]
    if isinstance(fields.get("json"), bool):
        raise bad_request("a JSON schema must be an object", param=name)
    try:
        return StructuredOutputsParams(**fields, after_reasoning=thinking)
    except ValueError as e:
        raise bad_request(str(e), param=name) from None


class GrammarChecker:
    """Builds and compiles constraints against the served tokenizer, as the engine will, in killable worker
    processes (server/grammar_workers.py), so a grammar that fails or is too slow to compile is the
    client's 400 rather than a failed request later, and a slow one costs nothing past its time limit.
    Verdicts are remembered per spec (a repeated schema is answered without a worker); a time-out is
    not, since load may have caused it. Invariant: the engine's compile of a spec that passed here
    normally finishes within the same limit (engine and check compile the same grammar the same way)."""

    CACHE_ENTRIES = 4096

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], workers: int = 2):
        self.pool = CompilePool(tokenizer, vocab_size, stop_token_ids, size=workers)
        self._verdicts: OrderedDict[bytes, Verdict] = OrderedDict()  # spec key digest -> verdict

    async def check(self, spec: StructuredOutputsParams, timeout_s: float) -> int | None:
        """The tokens the closing search needs from the grammar's start (stop token included; None: not
        known); ValueError with the reason when the spec does not build or compile; TimeoutError past
        timeout_s."""
        key = hashlib.sha256(repr(spec.key()).encode()).digest()
        if key not in self._verdicts:
            self._remember(key, await self._verdict(spec, timeout_s))
        self._verdicts.move_to_end(key)
        reason, need = self._verdicts[key]
        if reason is not None:
            raise ValueError(reason)
        return need

    async def _verdict(self, spec: StructuredOutputsParams, timeout_s: float) -> Verdict:
        try:
            return await self.pool.verdict(spec.to_dict(), timeout_s)
        except WorkerGone as e:  # not remembered: the crash may have been the machine's, not the spec's
            raise ValueError(f"the {spec.kind} constraint failed to compile: {e}") from None

    def _remember(self, key: bytes, verdict: Verdict) -> None:
        self._verdicts[key] = verdict
        while len(self._verdicts) > self.CACHE_ENTRIES:
            self._verdicts.popitem(last=False)

    def close(self) -> None:
        self.pool.close()


async def check_spec(spec: StructuredOutputsParams | None, check: GrammarChecker, timeout_s: float,
                     param: str | None = None, max_tokens: int | None = None,
                     budget_param: str = "max_tokens") -> None:
    """A bad schema / regex / grammar, or one that does not compile within `timeout_s`, is a 400 with the
    reason (the compile is killed at the limit); so is a `max_tokens` below what finishing the constraint
    needs from its start (the closing search's count: deepinfer/structured/closing.py)."""
    if spec is None:
        return
    try:
        need = await check.check(spec, timeout_s)
    except ValueError as e:
        raise bad_request(str(e), param=param) from None
    except asyncio.TimeoutError:
        raise bad_request(f"the {spec.kind} constraint did not compile within {timeout_s:g} s", param=param) from None
    except RuntimeError as e:  # the compiler processes could not start: the server's fault, not the request's
        raise APIError(503, f"structured outputs are unavailable: {e}") from None
    if need is not None and max_tokens is not None and max_tokens < need:
        raise bad_request(f"{budget_param} {max_tokens} cannot hold an output of the {spec.kind} constraint: the "
                          f"shortest one found needs {need} tokens (the stop token included)", param=budget_param)
