"""Tool calling in DeepSeek's V3 / V3.1 format (V3.1 chat template, and the bundled model's); the newer DSML
formats (V3.2, V4, V4.1) and the choice among them are in tool_formats.py:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS-JSON<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

The parser also reads V3 / R1's variant of a call:

    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS-JSON\n```<｜tool▁call▁end｜>

`tool_setup` checks `tools` / `tool_choice` (400 on bad input) and, for `required` or a named function,
gives the structural-tag constraint that forces that format with arguments matching each function's
parameter schema. `parse_tool_calls` / `ToolCallStream` turn model output into OpenAI `tool_calls`.

Invariant (tested): for every way of cutting a text into deltas, the ToolCallStream deltas concatenate to
the content and the calls of `parse_tool_calls(text)`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from deepinfer.server.errors import bad_request
from deepinfer.server.reasoning import _partial_suffix
from deepinfer.structured.params import check_json_schema

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass
class ToolSetup:
    tools: list[dict[str, Any]]  # OpenAI function tools
    choice: str | dict[str, Any]  # auto | none | required | {"type": "function", "function": {"name": ...}}
    parallel: bool = True
    format: Any = None  # the served tool format (server/tool_formats.py); None: this module's (V3.1's)

    @property
    def active(self) -> bool:
        """Tools are shown to the model and its output is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"

    def constraint(self, tokenizer) -> dict[str, str] | None:
        """`required` / a named function: a structural tag forcing the served format's calls, with each
        function's arguments following its parameter schema."""
        if not self.forced:
            return None
        if self.format is not None:
            return self.format.constraint(self, tokenizer)
        return markers_constraint(self, tokenizer)

    def new_stream(self):
        """A streaming parser of one choice's output (the first call only without parallel calls)."""
        stream = self.format.stream() if self.format is not None else ToolCallStream()
        return stream if self.parallel else FirstCallOnly(stream)

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A finished output's (content, OpenAI tool_calls); parallel_tool_calls false: the first call only
        (OpenAI's "at most one call"; forced calls are held to one by their grammar)."""
        content, calls = self.format.message(text) if self.format is not None else message_tool_calls(text)
        return content, calls if self.parallel else calls[:1]


class FirstCallOnly:
    """A tool-call stream passing its content and its first call's deltas, as ToolSetup.message keeps."""

    def __init__(self, stream):
        self.stream = stream

    @property
    def num_calls(self) -> int:
        return min(1, self.stream.num_calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        content, deltas = self.stream.feed(delta, final)
        return content, [d for d in deltas if d.get("index") == 0]


def markers_constraint(setup: ToolSetup, tokenizer, fenced: bool = False) -> dict[str, str] | None:
    """The V3 / V3.1 forced-call structural tag: at most one whitespace character between JSON tokens, so a
    model cannot pad its way to max_tokens; markers are matched as their single tokens, never spelled out
    in text. `fenced`: V3 / R1's calls (`function<｜tool▁sep｜>NAME` and a ```json fence)."""
    if not setup.forced:
        return None
    ids = {m: tokenizer.token_to_id(m) for m in (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)}
    if None in ids.values():
        raise ValueError("this model's tokenizer has no DeepSeek tool-call tokens")
    token = lambda marker: {"type": "token", "token": ids[marker]}
    named = setup.choice["function"]["name"] if isinstance(setup.choice, dict) else None
    calls = [_call_format(t["function"], token, fenced) for t in setup.tools
             if named in (None, t["function"]["name"])]
    body = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if setup.parallel and named is None:
        body = {"type": "plus", "content": body}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        token(CALLS_BEGIN), body, token(CALLS_END)]}}
    return {"structural_tag": json.dumps(tag, ensure_ascii=False)}


def _call_format(function: dict[str, Any], token, fenced: bool = False) -> dict[str, Any]:
    schema = {"type": "json_schema", "json_schema": function.get("parameters") or {"type": "object"},
              "max_whitespace_cnt": 1}
    if fenced:
        return {"type": "sequence", "elements": [
            token(CALL_BEGIN), {"type": "const_string", "value": "function"}, token(SEP),
            {"type": "const_string", "value": function["name"] + "\n" + _FENCE_OPEN}, schema,
            {"type": "const_string", "value": _FENCE_CLOSE}, token(CALL_END)]}
    return {"type": "sequence", "elements": [
        token(CALL_BEGIN), {"type": "const_string", "value": function["name"]}, token(SEP), schema, token(CALL_END)]}


def _check_tool(i: int, tool) -> dict[str, Any]:
    if tool.type != "function":
        raise bad_request(f"tools[{i}].type must be 'function', got {tool.type!r}", param="tools")
    if not _NAME.match(tool.function.name):
        raise bad_request(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}, got {tool.function.name!r}",
                          param="tools")
    if tool.function.parameters is not None:
        try:
            check_json_schema(tool.function.parameters)
        except ValueError as e:
            raise bad_request(f"tools[{i}].function.parameters: {e}", param="tools") from None
    return tool.model_dump(exclude_none=True)


_CHOICE_SHAPE = "tool_choice must be auto, none, required or {'type': 'function', 'function': {'name': ...}}"


def _check_choice(choice, names: list[str]) -> str | dict[str, Any]:
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        return _check_choice_word(choice, names)
    name = _choice_name(choice)
    if name not in names:
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", param="tool_choice")
    return {"type": "function", "function": {"name": name}}


def _check_choice_word(choice: str, names: list[str]) -> str:
    if choice not in ("auto", "none", "required"):
        raise bad_request(f"{_CHOICE_SHAPE}, got {choice!r}", param="tool_choice")
    if choice == "required" and not names:
        raise bad_request("tool_choice 'required' needs tools", param="tool_choice")
    return choice


def _choice_name(choice) -> str:
    """The function a tool_choice object names; any other shape (a list, `function` given as a string,
    no name, a type other than function) is a 400 naming tool_choice."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise bad_request(f"{_CHOICE_SHAPE}, got {choice!r}", param="tool_choice")
    function = choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{_CHOICE_SHAPE}, got function={function!r}", param="tool_choice")
    return function["name"]


def tool_setup(req, fmt=None) -> ToolSetup:
    """The request's checked tools; `fmt`: the served tool format (None: V3.1's)."""
    tools = [_check_tool(i, t) for i, t in enumerate(req.tools or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", param="tools")
    return ToolSetup(tools, _check_choice(req.tool_choice, names), req.parallel_tool_calls, fmt)


# --- parsing -------------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    name: str | None  # None while the name is still arriving
    arguments: str
    complete: bool  # its end marker came


def parse_tool_calls(text: str, final: bool = True) -> tuple[str, list[ParsedCall]]:
    """(content before the tool-call block, calls in it). Not final: text that may be the start of a
    marker is held back. Text after the block is not content (the format has none)."""
    head, found, rest = text.partition(CALLS_BEGIN)
    if not found:
        return head[: len(head) - (0 if final else _partial_suffix(head, CALLS_BEGIN))], []
    calls = []
    for chunk in rest.split(CALLS_END, 1)[0].split(CALL_BEGIN)[1:]:
        name, sep, args = chunk.partition(SEP)
        if not sep:
            calls.append(ParsedCall(None, "", False))
            continue
        args, end, _ = args.partition(CALL_END)
        if name.strip() == "function":
            calls.append(_fenced_call(args, bool(end), final))
            continue
        if not end and not final:
            args = args[: len(args) - _partial_suffix(args, CALL_END)]
        calls.append(ParsedCall(name.strip(), args, bool(end)))
    return head, calls


_FENCE_OPEN, _FENCE_CLOSE = "```json\n", "\n```"


def _fenced_call(body: str, complete: bool, final: bool) -> ParsedCall:
    """V3 / R1: NAME, a newline, then the arguments in a ```json fence. Not final: a partial fence or end
    marker is held back, so streamed arguments never include what the final parse drops."""
    name, newline, rest = body.partition("\n")
    if not newline and not (complete or final):
        return ParsedCall(None, "", False)
    if not (complete or final) and _FENCE_OPEN.startswith(rest):
        return ParsedCall(name.strip(), "", False)
    rest = rest.removeprefix(_FENCE_OPEN)
    if complete or final:
        return ParsedCall(name.strip(), rest.removesuffix(_FENCE_CLOSE), complete)
    return ParsedCall(name.strip(), rest[: len(rest) - _partial_suffix(rest, _FENCE_CLOSE + CALL_END)], False)


def loads_strict(text: str) -> Any:
    """json.loads of JSON proper: NaN, Infinity and numbers beyond float range (which Python's parser takes,
    and JSON encoders with allow_nan=False refuse) are a ValueError."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)


def _not_json(word: str) -> Any:
    raise ValueError(f"{word} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range")
    return value


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_calls(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """Complete calls in OpenAI's shape; arguments are the model's JSON text."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls if c.complete and c.name]


def message_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished message's (content, OpenAI tool_calls). Tool-call markup never reaches the content:
    a call cut off before its end marker (max_tokens) is dropped, not returned as text."""
    content, calls = parse_tool_calls(text)
    if CALLS_BEGIN not in text:
        return text, []
    return content or None, openai_calls(calls)


@dataclass
class ToolCallStream:
    """Incremental parse for streaming: content deltas, then one OpenAI tool-call delta per call, sent
    whole (id, name and arguments) once its end marker came, so a call cut off by max_tokens is never
    half-sent and streamed calls equal the non-streamed message's."""

    text: str = ""
    content_sent: int = 0
    sent: int = 0  # calls sent

    @property
    def num_calls(self) -> int:
        return self.sent

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        content, calls = parse_tool_calls(self.text, final)
        content_delta, self.content_sent = content[self.content_sent:], max(self.content_sent, len(content))
        deltas = []
        for call in calls[self.sent:]:
            if not (call.complete and call.name):
                break  # calls are sent in order, each once whole
            deltas.append({"index": self.sent, "id": new_call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})
            self.sent += 1
        return content_delta, deltas
