"""DeepSeek's chat and tool-call formats, one per model family, chosen from the checkpoint.

| name | models | calls look like |
|---|---|---|
| `deepseek_v3` | V3 / R1 | `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a ```json fence |
| `deepseek_v31` | V3.1, bundled model | `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>` |
| `deepseek_v32` | V3.2 | DSML `<｜DSML｜function_calls>` blocks |
| `deepseek_v4` | V4 (Flash, Pro) | DSML `<｜DSML｜tool_calls>` blocks |
| `deepseek_v41` | V4.1 (Flash-0731) | DSML `<｜DSML｜ calls>` blocks (space-prefixed tags) |

The V3 / V3.1 formats are parsed by server/tools.py and rendered by the checkpoint's Jinja template. DSML
checkpoints ship DeepSeek's Python encoder (encoding/encoding_dsv32.py, encoding_dsv4.py, V4.1's encoding.py)
instead of a Jinja template; `DSMLFormat.render` produces the same text (system prompt with the tools,
user / assistant turns, thinking markers, assistant tool calls, tool results). A checkpoint whose own
template speaks the format keeps rendering with it.

A DSML block:

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A `string="true"` value is the raw text of a string argument; any other value is JSON. The OpenAI
`arguments` of a parsed call are `{"city": "Paris", "days": 3}` (the JSON values as the model wrote them).

Parsing invariants (tested):
- for every way of cutting a text into deltas, `DSMLStream`'s content deltas concatenate to the content
  of `DSMLFormat.parse(text)` and its calls equal the parse's calls;
- nothing the model wrote is lost: a block without any well-formed call (malformed, or cut off by
  max_tokens) is returned as content verbatim, as is any malformed invoke or stray text inside a block
  that has calls; only the block's own markup (and whitespace between its elements) is structure;
- `render_calls` of the parsed calls re-renders a canonically rendered block to the same text;
- streaming is linear: an undecided invoke is re-parsed only when a tag that can decide it arrives, and the
  stream keeps only the undecided tail of the text.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.server.reasoning import THINK_END, THINK_START, _partial_suffix
from deepinfer.server.tools import (
    ParsedCall,
    ToolCallStream,
    loads_strict,
    markers_constraint,
    message_tool_calls,
    new_call_id,
    openai_calls,
    parse_tool_calls,
)

DSML = "｜DSML｜"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, SYSTEM = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
AUTO = "auto"


# --- the V3 / V3.1 formats (server/tools.py) ---------------------------------------------------------
class MarkerFormat:
    """`<｜tool▁calls▁begin｜>` ... formats; `fenced`: forced calls are written V3 / R1's way."""

    renders = False  # the checkpoint's Jinja template renders tools, calls and results
    keep_tokens: tuple[str, ...] = ()

    def __init__(self, name: str, fenced: bool):
        self.name, self.fenced = name, fenced

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ParsedCall]]:
        return parse_tool_calls(text, final)

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return message_tool_calls(text)

    def stream(self) -> ToolCallStream:
        return ToolCallStream()

    def constraint(self, setup, tokenizer) -> dict[str, str] | None:
        return markers_constraint(setup, tokenizer, fenced=self.fenced)


# --- DSML markup ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Markup:
    block: str  # "function_calls" (V3.2), "tool_calls" (V4), " calls" (V4.1)
    space: str  # "" or " " (V4.1) between ｜DSML｜ and the invoke / parameter tag names

    @property
    def open(self) -> str:
        return f"<{DSML}{self.block}>"

    @property
    def close(self) -> str:
        return f"</{DSML}{self.block}>"

    @property
    def invoke(self) -> str:
        return f"<{DSML}{self.space}invoke"

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.space}invoke>"

    @property
    def param(self) -> str:
        return f"<{DSML}{self.space}parameter"

    @property
    def param_close(self) -> str:
        return f"</{DSML}{self.space}parameter>"


def to_json(value: Any) -> str:
    """JSON as DeepSeek's encoders write it (json.dumps defaults, non-ASCII kept)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def _arguments_json(params: list[tuple[str, str]]) -> str:
    """OpenAI `arguments` of parsed parameters, each value already JSON text."""
    return "{" + ", ".join(f"{to_json(k)}: {v}" for k, v in params) + "}"


# --- parsing -------------------------------------------------------------------------------------------
class _Undecided(Exception):
    """The text so far ends before a decision (more text may change it)."""


class DSMLScanner:
    """Incremental DSML parse (see the module docstring). `advance(text, final)` returns the items decided
    since the last call, in order: content strings and ParsedCalls; `text` must extend the previous one.
    Not final, nothing is decided that later text could change (partial markers are held back)."""

    def __init__(self, markup: Markup):
        self.m = markup
        self._open_variants = ("\n\n" + markup.open, "\n" + markup.open, markup.open)
        self.pos = 0  # text[:pos] is decided
        self.in_block = False
        self.after_block = False  # the previous block had calls: whitespace up to the next block is structure
        self.spaces: list[str] = []  # whitespace since that block, undecided (not in text[pos:])
        self.raw_start = 0  # the current block's raw text starts here (its leading newlines included)
        self.block_calls = 0
        self.pending: list[str] = []  # content of the current block before its first call
        # A block step undecided at pos stays undecided until a tag that ends an invoke or the block (or
        # starts an invoke) appears: text[:scanned] holds none after pos (scanned > pos while stalled).
        self.scanned = 0
        self._tags = (markup.invoke, markup.invoke_close, markup.close)

    def advance(self, text: str, final: bool = False) -> list[str | ParsedCall]:
        out: list[str | ParsedCall] = []
        while True:
            try:
                step = self._block_step(text, final) if self.in_block else self._outside_step(text, final)
            except _Undecided:
                step = None
            if step is None:
                self.scanned = len(text) if self.in_block else 0
                return out
            self.scanned = 0  # progress: the next step parses afresh
            out.extend(step)

    # outside a block: content, up to the next block
    def _outside_step(self, text: str, final: bool) -> list | None:
        if self.after_block:
            return self._after_block(text, final)
        start = self.pos
        if start >= len(text):
            return None
        j = text.find(self.m.open, start)
        if j < 0:
            tail = text[max(start, len(text) - 64):]
            keep = 0 if final else max(_partial_suffix(tail, v) for v in self._open_variants)
            end = len(text) - keep
            if end <= start:
                return None
            self.pos = end
            return [text[start:end]]
        head = text[start:j]
        newlines = min(2, len(head) - len(head.rstrip("\n")))  # the block's own "\n\n"
        self._enter_block(j - newlines, j)
        return [head[:len(head) - newlines]] if len(head) > newlines else []

    def _after_block(self, text: str, final: bool) -> list | None:
        """After a block with calls: whitespace up to the next block, or to the end, is structure; before
        other text it is content. Whitespace is moved out of the text as it comes (`spaces`), so a run of it
        is read once."""
        start = self.pos
        k = len(text) - len(text[start:].lstrip())
        if k > start:
            self.spaces.append(text[start:k])
            self.pos = k
        if k == len(text):
            return None
        if text.startswith(self.m.open, k):
            self.spaces, self.after_block = [], False
            self._enter_block(k, k)
            return []
        if not final and _prefix_of(text, k, self.m.open):
            return None  # what may yet be the next block's opening tag
        spaces, self.spaces, self.after_block = "".join(self.spaces), [], False
        return [spaces] if spaces else []

    def _enter_block(self, raw_start: int, j: int) -> None:
        self.in_block, self.raw_start, self.pos = True, raw_start, j + len(self.m.open)
        self.block_calls, self.pending = 0, []

    # inside a block: invokes, separated by whitespace, up to the closing marker
    def _block_step(self, text: str, final: bool) -> list | None:
        m, cur = self.m, self.pos
        if not final and self.scanned > cur and not self._new_tag(text):
            return None  # nothing that could decide it arrived since the last try: no re-parse
        found = [k for k in (text.find(m.invoke, cur), text.find(m.close, cur)) if k >= 0]
        if not found:
            if not final:
                return None
            gap = text[cur:]  # the output ended inside the block (a cut-off closing tag is structure)
            return self._end_block(text, len(text), [gap] if not m.close.startswith(gap.strip()) else [])
        k = min(found)
        gap = [text[cur:k]] if text[cur:k].strip() else []
        if text.startswith(m.close, k):
            return self._end_block(text, k + len(m.close), gap)
        end, call = self._invoke(text, k, final)
        if call is None:  # malformed: its text is content
            return self._add(gap + [text[k:end]], end)
        return self._add(gap, end, call)

    def _new_tag(self, text: str) -> bool:
        since = max(self.pos, self.scanned - max(map(len, self._tags)) + 1)
        return any(text.find(t, since) >= 0 for t in self._tags)

    def decided(self) -> int:
        """text[:decided()] is never read again (a block without calls yet keeps its raw text)."""
        return self.raw_start if self.in_block and self.block_calls == 0 else self.pos

    def shift(self, n: int) -> None:
        """The caller dropped text[:n] (n <= decided()): positions move with it."""
        self.pos, self.raw_start, self.scanned = self.pos - n, self.raw_start - n, max(0, self.scanned - n)

    def _add(self, items: list[str], end: int, call: ParsedCall | None = None) -> list:
        self.pos = end
        if call is None:
            if self.block_calls == 0:  # the block may yet turn out to have no call: keep its text raw
                self.pending += items
                return []
            return items
        self.block_calls += 1
        out = [*self.pending, *items, call]
        self.pending = []
        return out

    def _end_block(self, text: str, end: int, items: list[str]) -> list:
        self.in_block, self.pos = False, end
        if self.block_calls == 0:  # no call in it: the whole block is content, as written
            self.after_block = False
            return [text[self.raw_start:end]]
        self.after_block = True
        return items

    # one invoke
    def _invoke(self, text: str, k: int, final: bool) -> tuple[int, ParsedCall | None]:
        """(end, call) of the invoke at k; call None when malformed. _Undecided when the text ends first
        (not final)."""
        m = self.m
        i = k + len(m.invoke)
        if not _expect(text, i, ' name="', final):
            return self._malformed(text, i, final)
        name, i = _quoted(text, i + len(' name="'), final)
        if name is None or not _expect(text, i, ">", final):
            return self._malformed(text, i, final)
        i += 1
        params: list[tuple[str, str]] = []
        while True:
            j = _skip_space(text, i, final)
            if text.startswith(m.invoke_close, j):
                return j + len(m.invoke_close), ParsedCall(name, _arguments_json(params), True)
            if not text.startswith(m.param, j):
                if not final and (_prefix_of(text, j, m.invoke_close) or _prefix_of(text, j, m.param)):
                    raise _Undecided
                return self._malformed(text, j, final)
            parsed = self._param(text, j + len(m.param), final)
            if parsed is None or parsed[0] in (p for p, _ in params):
                return self._malformed(text, j + len(m.param), final)
            key, value, i = parsed
            params.append((key, value))

    def _param(self, text: str, i: int, final: bool) -> tuple[str, str, int] | None:
        """(key, value as JSON text, end) of the parameter whose attributes start at i; None: malformed."""
        if not _expect(text, i, ' name="', final):
            return None
        key, i = _quoted(text, i + len(' name="'), final)
        if key is None or not _expect(text, i, ' string="', final):
            return None
        i += len(' string="')
        kind = next((w for w in ('true">', 'false">') if _expect(text, i, w, final)), None)
        if kind is None:
            return None
        i += len(kind)
        close = text.find(self.m.param_close, i)
        if close < 0:
            if final:
                return None
            raise _Undecided
        raw = text[i:close]
        if kind == 'true">':
            return key, to_json(raw), close + len(self.m.param_close)
        try:
            loads_strict(raw)
        except ValueError:
            return None
        return key, raw.strip(), close + len(self.m.param_close)

    def _malformed(self, text: str, p: int, final: bool) -> tuple[int, None]:
        """A malformed invoke runs to its closing tag, or up to the next invoke or the block's closing tag
        (whichever comes first), or to the end of the text."""
        m = self.m
        found = [(k, k + len(m.invoke_close)) for k in [text.find(m.invoke_close, p)] if k >= 0]
        found += [(k, k) for k in (text.find(m.close, p), text.find(m.invoke, p)) if k >= 0]
        if found:
            return min(found)[1], None
        if not final:
            raise _Undecided
        return len(text), None


def _prefix_of(text: str, i: int, literal: str) -> bool:
    """text[i:] is a proper prefix of `literal` (it may still become it)."""
    rest = text[i:i + len(literal)]
    return len(rest) < len(literal) and literal.startswith(rest)


def _expect(text: str, i: int, literal: str, final: bool) -> bool:
    """text[i:] starts with `literal`; _Undecided while it may still (not final)."""
    if text.startswith(literal, i):
        return True
    if not final and _prefix_of(text, i, literal):
        raise _Undecided
    return False


def _quoted(text: str, i: int, final: bool) -> tuple[str | None, int]:
    """(name, index of its closing quote) of a non-empty one-line attribute value starting at i."""
    q = text.find('"', i)
    line_end = text.find("\n", i)
    if q < 0 and line_end < 0 and not final:
        raise _Undecided
    if q < 0 or (0 <= line_end < q) or q == i:
        return None, i
    return text[i:q], q + 1


def _skip_space(text: str, i: int, final: bool) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i == len(text) and not final:
        raise _Undecided
    return i


class DSMLStream:
    """Streaming parse: content deltas, and one OpenAI tool-call delta per call, sent whole (id, name,
    arguments) once its invoke closed."""

    def __init__(self, markup: Markup):
        self.scanner = DSMLScanner(markup)
        self.text = ""
        self.sent = 0

    @property
    def num_calls(self) -> int:
        return self.sent

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        content, deltas = [], []
        items = self.scanner.advance(self.text, final)
        cut = self.scanner.decided()  # the held text stays the undecided tail: each delta costs its own size
        self.text = self.text[cut:]
        self.scanner.shift(cut)
        for item in items:
            if isinstance(item, str):
                content.append(item)
                continue
            deltas.append({"index": self.sent, "id": new_call_id(), "type": "function",
                           "function": {"name": item.name, "arguments": item.arguments}})
            self.sent += 1
        return "".join(content), deltas


# --- rendering -----------------------------------------------------------------------------------------
_V32_TOOLS = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "{open}" block like the following as part of your reply to the user:
{open}
{invoke} name="$FUNCTION_NAME">
{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{param_close}
...
{invoke_close}
{invoke} name="$FUNCTION_NAME2">
...
{invoke_close}
{close}
String and scalar parameters should be specified as is without any escaping or quotes, while lists and \
objects should use JSON format. The "string" attribute should be set to "true" for string type parameters \
and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a \
thinking block. Here is an example:
{open}
...
{close}
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""

_V4_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{open}" block like the following:

{open}
{invoke} name="$TOOL_NAME">
{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{param_close}
...
{invoke_close}
{invoke} name="$TOOL_NAME2">
...
{invoke_close}
{close}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, \
booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

V4_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
V41_EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
V41_EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _call_arguments(call: dict) -> tuple[str, dict]:
    """(name, arguments dict) of an OpenAI tool call in a request's history. Arguments that are not a JSON
    object (or a JSON text of one, even twice encoded) become one `arguments` parameter, as DeepSeek's
    V4 encoder does."""
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name, raw = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool call needs a function name, got {call!r}")
    args = raw
    for _ in range(2):
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                break
    if not isinstance(args, dict):
        args = {"arguments": raw if isinstance(raw, str) else to_json(raw)}
    return name, args


class DSMLFormat:
    """One DSML family: its markup, parser, renderer and forced-call grammar."""

    renders = True
    keep_tokens = (DSML,)  # special in DeepSeek's tokenizers, and needed in the text to parse calls

    def __init__(self, name: str, markup: Markup, style: str, family: str):
        self.name, self.markup, self.style, self.family = name, markup, style, family

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"

    # parsing
    def parse(self, text: str, final: bool = True) -> tuple[str, list[ParsedCall]]:
        items = DSMLScanner(self.markup).advance(text, final)
        return "".join(i for i in items if isinstance(i, str)), [i for i in items if isinstance(i, ParsedCall)]

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A finished message's (content, OpenAI tool_calls); without calls the content is the text."""
        content, calls = self.parse(text)
        return (content or None, openai_calls(calls)) if calls else (content, [])

    def stream(self) -> DSMLStream:
        return DSMLStream(self.markup)

    # calls as text
    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        """The canonical block of (name, arguments) calls, with the "\\n\\n" that separates it from content."""
        m = self.markup
        invokes = [f'{m.invoke} name="{name}">\n' + "\n".join(
            f'{m.param} name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else to_json(v)}{m.param_close}' for k, v in args.items())
                   + f"\n{m.invoke_close}" for name, args in calls]
        return f"\n\n{m.open}\n" + "\n".join(invokes) + f"\n{m.close}"

    def tools_prompt(self, tools: list[dict]) -> str:
        m = self.markup
        schemas = "\n".join(to_json(t.get("function", t)) for t in tools)
        template = _V32_TOOLS if self.family == "v32" else _V4_TOOLS
        return template.format(open=m.open, close=m.close, invoke=m.invoke, invoke_close=m.invoke_close,
                               param=m.param, param_close=m.param_close, schemas=schemas)

    # the forced-call grammar
    def constraint(self, setup, tokenizer) -> dict[str, str] | None:
        """`required` / a named function: the block, with each function's parameters in DSML following its
        schema (xgrammar's DeepSeek XML style: string values raw, others JSON), at most one whitespace
        character between elements so a model cannot pad its way to max_tokens."""
        if not setup.forced:
            return None
        m = self.markup
        named = setup.choice["function"]["name"] if isinstance(setup.choice, dict) else None
        calls = [{"type": "sequence", "elements": [
            {"type": "const_string", "value": f'{m.invoke} name="{t["function"]["name"]}">\n'},
            {"type": "json_schema", "json_schema": t["function"].get("parameters") or {"type": "object"},
             "style": self.style, "max_whitespace_cnt": 1},
            {"type": "const_string", "value": f"{m.invoke_close}\n"}]}
            for t in setup.tools if named in (None, t["function"]["name"])]
        body = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        if setup.parallel and named is None:
            body = {"type": "plus", "content": body}
        tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "const_string", "value": f"\n\n{m.open}\n"}, body,
            {"type": "const_string", "value": m.close}]}}
        return {"structural_tag": json.dumps(tag, ensure_ascii=False)}

    # the prompt
    def render(self, messages: list[dict], add_generation_prompt: bool = True, kwargs: dict | None = None,
               bos: str = BOS, eos: str = EOS) -> str:
        """The prompt DeepSeek's encoder gives `messages` (OpenAI dicts), with kwargs["tools"] in the system
        prompt. Chat template kwargs: `thinking` (or `enable_thinking`), `reasoning_effort`, `drop_thinking`.
        Without a generation prompt the assistant header after the last message is left out. ValueError for
        what the format cannot express."""
        kwargs = kwargs or {}
        tools = _template_tools(kwargs.get("tools") or [])
        msgs = _normalize(messages)
        if tools:
            if msgs[0]["role"] != "system":
                msgs.insert(0, {"role": "system", "content": ""})
            msgs[0]["tools"] = tools
        thinking = _flag(kwargs, "thinking", kwargs.get("enable_thinking", self.family == "v41"))
        if self.family == "v32":
            return bos + self._render_v32(msgs, thinking, add_generation_prompt, eos)
        return bos + self._render_v4(msgs, thinking, add_generation_prompt, kwargs, eos)

    def _calls_text(self, msg: dict) -> str:
        calls = msg.get("tool_calls") or []
        return self.render_calls([_call_arguments(c) for c in calls]) if calls else ""

    def _render_v32(self, msgs: list[dict], thinking: bool, generation: bool, eos: str) -> str:
        last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
        out = []
        for i, msg in enumerate(msgs):
            role, content = msg["role"], msg.get("content") or ""
            header = generation or i < len(msgs) - 1
            if role == "system":
                out.append(content + ("\n\n" + self.tools_prompt(msg["tools"]) if msg.get("tools") else ""))
            elif role == "user":
                out.append(USER + content)
                if header:
                    out.append(ASSISTANT + (THINK_START if thinking and i == last_user else THINK_END))
            elif role == "tool":
                order, calls = _tool_order(msgs, i)
                out.append(("\n\n<function_results>" if order == 1 else "") + f"\n<result>{content}</result>")
                if order == calls:
                    out.append("\n</function_results>")
                    if header:
                        out.append("\n\n" + (THINK_START if thinking and i >= last_user else THINK_END))
            else:  # assistant
                reasoning = (msg.get("reasoning_content") or "") + THINK_END if thinking and i > last_user else ""
                out.append(reasoning + content + self._calls_text(msg) + eos)
        return "".join(out)

    def _render_v4(self, msgs: list[dict], thinking: bool, generation: bool, kwargs: dict, eos: str) -> str:
        v41 = self.family == "v41"
        effort = kwargs.get("reasoning_effort")
        if v41 and effort == "none":
            thinking, effort = False, None
        effort_text = self._effort_text(effort) if thinking else ""
        msgs = _sort_tool_results(_merge_tool_messages(msgs))
        drop = _flag(kwargs, "drop_thinking", True) and not any(m.get("tools") for m in msgs)

        def user_like(i: int) -> bool:
            return msgs[i]["role"] == "user" or (v41 and msgs[i]["role"] == "system" and i > 0)

        last_user = max((i for i in range(len(msgs)) if user_like(i)), default=-1)
        out = []
        for i, msg in enumerate(msgs):
            role, content = msg["role"], msg.get("content") or ""
            if i == 0 and (effort_text or (v41 and role == "system")):
                out.append(SYSTEM if v41 else "")
            if i == 0:
                out.append(effort_text)
            if role == "system":
                out.append((SYSTEM if v41 and i > 0 else "") + content
                           + ("\n\n" + self.tools_prompt(msg["tools"]) if msg.get("tools") else ""))
            elif role == "user":
                out.append(USER + "\n\n".join(
                    f"<tool_result>{b['content']}</tool_result>" if b["type"] == "tool_result" else b["text"]
                    for b in msg["blocks"]))
            else:  # assistant
                reasoning = ""
                if thinking and (not drop or i > last_user):
                    reasoning = (msg.get("reasoning_content") or "") + THINK_END
                out.append(reasoning + content + self._calls_text(msg) + eos)
            last = i == len(msgs) - 1
            if (not last and msgs[i + 1]["role"] != "assistant") or (last and not generation):
                continue
            if user_like(i) or (v41 and last and role in ("system", "assistant")):
                think = thinking and (not drop or i >= last_user)
                out.append(ASSISTANT + (THINK_START if think else THINK_END))
        return "".join(out)

    def _effort_text(self, effort) -> str:
        if self.family != "v41":
            return V4_MAX_EFFORT if effort == "max" else ""
        effort = "high" if effort is None else effort
        if isinstance(effort, str) and effort in V41_EFFORTS:
            effort = V41_EFFORTS[effort]
        if type(effort) is not int or not 1 <= effort <= 100:
            raise ValueError(f"reasoning_effort must be one of {', '.join(V41_EFFORTS)}, none or an integer in "
                             f"[1, 100], got {effort!r}")
        return V41_EFFORT.format(effort)


def _template_tools(tools) -> list[dict]:
    """chat_template_kwargs.tools: a list of tool objects (OpenAI's {"type", "function"} or bare functions)."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"chat_template_kwargs.tools must be a list of tool objects, got {tools!r:.80}")
    if not all(isinstance(t.get("function", t), dict) for t in tools):
        raise ValueError("chat_template_kwargs.tools: each tool's function must be an object")
    return tools


def _flag(kwargs: dict, key: str, default) -> bool:
    value = kwargs.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"chat_template_kwargs.{key} must be a boolean, got {value!r}")
    return value


def _normalize(messages: list[dict]) -> list[dict]:
    """Copies of OpenAI messages with the fields the encoders read; OpenAI's `developer` role is a system
    message (DeepSeek's own developer turns are an agent feature with no OpenAI counterpart)."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}]: unsupported role {role!r}")
        msg = {"role": "system" if role == "developer" else role, "content": m.get("content") or ""}
        if role == "assistant":
            msg["reasoning_content"] = m.get("reasoning_content") or m.get("reasoning")
            msg["tool_calls"] = m.get("tool_calls") or []
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id") or ""
        out.append(msg)
    return out


def _tool_order(msgs: list[dict], i: int) -> tuple[int, int]:
    """V3.2: (position of tool message i among the results of the assistant turn before it, its calls)."""
    j = i - 1
    while j >= 0 and msgs[j]["role"] == "tool":
        j -= 1
    calls = msgs[j].get("tool_calls") if j >= 0 and msgs[j]["role"] == "assistant" else None
    if not calls or i - j > len(calls):
        raise ValueError(f"messages[{i}]: a tool result needs an earlier assistant tool call to answer")
    return i - j, len(calls)


def _merge_tool_messages(msgs: list[dict]) -> list[dict]:
    """V4: tool results are <tool_result> blocks of a user turn; consecutive user turns (and tool results)
    merge into one, their parts joined by a blank line."""
    merged: list[dict] = []
    for msg in msgs:
        if msg["role"] == "tool":
            block = {"type": "tool_result", "id": msg["tool_call_id"], "content": msg["content"]}
        elif msg["role"] == "user":
            block = {"type": "text", "text": msg["content"]}
        else:
            merged.append(msg)
            continue
        if merged and merged[-1]["role"] == "user":
            merged[-1]["blocks"].append(block)
        else:
            merged.append({"role": "user", "blocks": [block]})
    return merged


def _sort_tool_results(msgs: list[dict]) -> list[dict]:
    """V4: a user turn's tool results in the order of the calls of the assistant turn before it."""
    order: dict[str, int] = {}
    for msg in msgs:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {c.get("id"): n for n, c in enumerate(msg["tool_calls"]) if c.get("id")}
        elif msg["role"] == "user" and order:
            results = sorted((b for b in msg["blocks"] if b["type"] == "tool_result"),
                             key=lambda b: order.get(b["id"], 0))
            it = iter(results)
            msg["blocks"] = [next(it) if b["type"] == "tool_result" else b for b in msg["blocks"]]
    return msgs


# --- the registry --------------------------------------------------------------------------------------
FORMATS = {f.name: f for f in (
    MarkerFormat("deepseek_v3", fenced=True),
    MarkerFormat("deepseek_v31", fenced=False),
    DSMLFormat("deepseek_v32", Markup("function_calls", ""), "deepseek_xml", "v32"),
    DSMLFormat("deepseek_v4", Markup("tool_calls", ""), "deepseek_xml", "v4"),
    DSMLFormat("deepseek_v41", Markup(" calls", " "), "deepseek_v4_1_xml", "v41"),
)}
DEFAULT = "deepseek_v31"
_ALIASES = {"deepseekv3": "deepseek_v3", "deepseek_r1": "deepseek_v3", "deepseekv31": "deepseek_v31",
            "deepseekv32": "deepseek_v32", "deepseek_v3_2": "deepseek_v32", "deepseekv4": "deepseek_v4",
            "deepseekv41": "deepseek_v41", "deepseek_v4_1": "deepseek_v41"}
# model_type -> format, for checkpoints whose chat template does not show which one they speak
_BY_MODEL_TYPE = {"deepseek_v41": "deepseek_v41", "deepseek_v41_text": "deepseek_v41", "deepseek_v4": "deepseek_v4",
                  "deepseek_v32": "deepseek_v32", "deepseek_v3": "deepseek_v31", "deepseek_v2": "deepseek_v31"}
PARSER_CHOICES = (AUTO, *FORMATS)


def get_format(name: str):
    """The format called `name` (an alias, e.g. deepseekv32, works too); ValueError for unknown names."""
    key = _ALIASES.get(name.lower().replace("-", "_"), name.lower().replace("-", "_"))
    if key not in FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSER_CHOICES)}")
    return FORMATS[key]


def template_format(template: str | None) -> str | None:
    """The format a Jinja chat template renders tool calls in, or None (no template / no tool calls)."""
    if not template:
        return None
    if f"{DSML} calls" in template or f"{DSML} invoke" in template:
        return "deepseek_v41"
    if f"{DSML}tool_calls" in template:
        return "deepseek_v4"
    if f"{DSML}function_calls" in template:
        return "deepseek_v32"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    return None


def model_type(model_dir: str | Path | None) -> str | None:
    """config.json's model_type (or its text_config's) in `model_dir`; None without one."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, TypeError, ValueError):
        return None
    mt = config.get("model_type")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return mt if mt in _BY_MODEL_TYPE else text.get("model_type", mt)


def resolve_format(choice: str | None, tokenizer, model_dir: str | Path | None = None):
    """--tool-call-parser `choice` (None / auto: from the checkpoint: the format its chat template renders,
    else its model_type, else deepseek_v31)."""
    if choice and choice != AUTO:
        return get_format(choice)
    found = template_format(getattr(tokenizer, "chat_template", None))
    if found is None:
        found = _BY_MODEL_TYPE.get(model_type(model_dir) or "", DEFAULT)
    return FORMATS[found]


def attach_format(tokenizer, choice: str | None = None, model_dir: str | Path | None = None):
    """Resolves the served format and keeps it on the tokenizer, which the server and `deepinfer router`
    render and parse with (so both render the same prompts)."""
    if tokenizer is None:
        return None
    tokenizer.tool_format = resolve_format(choice, tokenizer, model_dir)
    return tokenizer.tool_format


def format_of(tokenizer):
    """The tokenizer's attached format; one found from its chat template alone if none was attached."""
    fmt = getattr(tokenizer, "tool_format", None)
    return fmt if fmt is not None else resolve_format(None, tokenizer)


def uses_builtin_renderer(fmt, tokenizer, messages: list[dict], kwargs: dict) -> bool:
    """DSML prompts are rendered by DeepSeek's encoder (reproduced here) unless the checkpoint's own Jinja
    template renders this format; a template that renders no tool calls still renders plain chats."""
    if not getattr(fmt, "renders", False):
        return False
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return True
    if template_format(template) == fmt.name:
        return False
    return bool(kwargs.get("tools")) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def render_prompt(fmt, tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
    bos = getattr(tokenizer, "bos_token", None) or BOS
    eos = getattr(tokenizer, "eos_token", None) or EOS
    return fmt.render(copy.deepcopy(messages), add_generation_prompt, kwargs, bos, eos)


# --- decoding with the markup kept -----------------------------------------------------------------------
class MarkupDecoder:
    """Decodes like the tokenizer, except that skipping special tokens keeps `keep` (DeepSeek's tokenizers
    mark ｜DSML｜ special; the tool-call parser needs it, and the reasoning split needs <think> / </think>)."""

    def __init__(self, tokenizer, keep: frozenset[int]):
        self.tokenizer = tokenizer
        self.drop = frozenset(tokenizer.special_token_ids) - keep

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.drop]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@functools.lru_cache(maxsize=16)
def _markup_decoder(tokenizer, keep: tuple[str, ...]):
    ids = frozenset(i for i in (tokenizer.token_to_id(t) for t in keep) if i is not None)
    ids &= frozenset(tokenizer.special_token_ids)
    return MarkupDecoder(tokenizer, ids) if ids else tokenizer


def output_decoder(tokenizer, fmt, tools: bool, thinking: bool):
    """The decoder of a chat choice's output: markup tokens the parsers read are kept in the text."""
    keep = (*(getattr(fmt, "keep_tokens", ()) if tools else ()), *((THINK_START, THINK_END) if thinking else ()))
    if tokenizer is None or not keep or not hasattr(tokenizer, "special_token_ids"):
        return tokenizer
    return _markup_decoder(tokenizer, keep)

