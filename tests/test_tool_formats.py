"""DeepSeek's DSML chat and tool-call formats (V3.2, V4, V4.1), without a server.

Golden prompts: the expected strings below were written by hand by following DeepSeek's own encoders step
by step (encoding/encoding_dsv32.py of deepseek-ai/DeepSeek-V3.2, encoding/encoding_dsv4.py of DeepSeek-V4,
V4.1-Flash's encoding.py as adapted in vLLM's vllm/tokenizers/deepseek_v41_encoding.py): their templates'
literal text, the order of the pieces, the thinking markers. They are data, not produced by this code.

Parsing: several calls, malformed output surfacing as text, the streaming invariant for every cut, the
round trip render(parse(text)) == text, and grammar-forced calls (xgrammar) accepting exactly the format.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.server.tool_formats import (
    FORMATS,
    MarkupDecoder,
    format_of,
    get_format,
    output_decoder,
    resolve_format,
    template_format,
    uses_builtin_renderer,
)
from deepinfer.server.tools import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, ToolSetup

V32, V4, V41 = FORMATS["deepseek_v32"], FORMATS["deepseek_v4"], FORMATS["deepseek_v41"]
DSML_FORMATS = [V32, V4, V41]
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
         {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]
SCHEMA_LINES = (
    '{"name": "add", "description": "Add two numbers", "parameters": {"type": "object", "properties": '
    '{"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}\n'
    '{"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}')

# The tools section of the system prompt, as the official templates format it with these two tools.
TOOLS_V32 = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your reply to the user:
<｜DSML｜function_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$FUNCTION_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<｜DSML｜function_calls>
...
</｜DSML｜function_calls>
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
""" + SCHEMA_LINES + """
</functions>
"""  # noqa: E501

TOOLS_V4 = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

""" + SCHEMA_LINES + """

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501

# V4.1's template is V4's with its tags renamed: `<｜DSML｜ calls>`, `<｜DSML｜ invoke`, `<｜DSML｜ parameter`.
TOOLS_V41 = (TOOLS_V4.replace("｜DSML｜tool_calls", "｜DSML｜ calls").replace("｜DSML｜invoke", "｜DSML｜ invoke")
             .replace("｜DSML｜parameter", "｜DSML｜ parameter"))

CALL_1 = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
CALL_2 = {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# a system prompt, two calls in one assistant turn, their results, an answer, a new question
CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Add 2 and 3, and the weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "R1", "tool_calls": [CALL_1, CALL_2]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "tool", "tool_call_id": "c2", "content": "Sunny"},
    {"role": "assistant", "content": "5, and sunny."},
    {"role": "user", "content": "Thanks!"},
]


def _block(block: str, space: str = "") -> str:
    """The two calls of CONVERSATION as DSML, preceded by the blank line that separates them from content."""
    inv, par = f"｜DSML｜{space}invoke", f"｜DSML｜{space}parameter"
    return (f'\n\n<｜DSML｜{block}>\n<{inv} name="add">\n<{par} name="a" string="false">2</{par}>\n'
            f'<{par} name="b" string="false">3</{par}>\n</{inv}>\n<{inv} name="get_weather">\n'
            f'<{par} name="city" string="true">Paris</{par}>\n</{inv}>\n</｜DSML｜{block}>')


# --- golden prompts --------------------------------------------------------------------------------------
def test_v32_prompt_with_tools_calls_and_results():
    expected = (BOS + "You are helpful.\n\n" + TOOLS_V32
                + "<｜User｜>Add 2 and 3, and the weather in Paris?<｜Assistant｜></think>"
                + "Let me check." + _block("function_calls") + EOS
                + "\n\n<function_results>\n<result>5</result>\n<result>Sunny</result>\n</function_results>\n\n</think>"
                + "5, and sunny." + EOS
                + "<｜User｜>Thanks!<｜Assistant｜></think>")
    assert V32.render(CONVERSATION, True, {"tools": TOOLS}) == expected
    # thinking: only the turn being generated thinks (earlier reasoning is not shown again)
    assert V32.render(CONVERSATION, True, {"tools": TOOLS, "thinking": True}) == expected.removesuffix(
        "</think>") + "<think>"


def test_v32_thinking_after_tool_results():
    messages = [{"role": "user", "content": "Add 2 and 3"},
                {"role": "assistant", "content": None, "reasoning_content": "Need add.", "tool_calls": [CALL_1]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    block = ('\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="add">\n'
             '<｜DSML｜parameter name="a" string="false">2</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="b" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '</｜DSML｜function_calls>')
    expected = (BOS + "\n\n" + TOOLS_V32 + "<｜User｜>Add 2 and 3<｜Assistant｜><think>Need add.</think>" + block + EOS
                + "\n\n<function_results>\n<result>5</result>\n</function_results>\n\n<think>")
    assert V32.render(messages, True, {"tools": TOOLS, "enable_thinking": True}) == expected


def test_v4_prompt_with_tools_calls_and_results():
    expected = (BOS + "You are helpful.\n\n" + TOOLS_V4
                + "<｜User｜>Add 2 and 3, and the weather in Paris?<｜Assistant｜></think>"
                + "Let me check." + _block("tool_calls") + EOS
                + "<｜User｜><tool_result>5</tool_result>\n\n<tool_result>Sunny</tool_result><｜Assistant｜></think>"
                + "5, and sunny." + EOS
                + "<｜User｜>Thanks!<｜Assistant｜></think>")
    assert V4.render(CONVERSATION, True, {"tools": TOOLS}) == expected


def test_v4_thinking_with_tools_keeps_every_turns_reasoning():
    expected = (BOS + "You are helpful.\n\n" + TOOLS_V4
                + "<｜User｜>Add 2 and 3, and the weather in Paris?<｜Assistant｜><think>"
                + "R1</think>Let me check." + _block("tool_calls") + EOS
                + "<｜User｜><tool_result>5</tool_result>\n\n<tool_result>Sunny</tool_result><｜Assistant｜><think>"
                + "</think>5, and sunny." + EOS
                + "<｜User｜>Thanks!<｜Assistant｜><think>")
    assert V4.render(CONVERSATION, True, {"tools": TOOLS, "thinking": True}) == expected


def test_v4_results_follow_the_call_order_and_thinking_without_tools_drops_old_reasoning():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [CALL_1, CALL_2]},
                {"role": "tool", "tool_call_id": "c2", "content": "Sunny"},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    assert V4.render(messages, True, {}).endswith(
        "<｜User｜><tool_result>5</tool_result>\n\n<tool_result>Sunny</tool_result><｜Assistant｜></think>")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
            {"role": "user", "content": "Bye"}]
    assert V4.render(chat, True, {"thinking": True}) == (
        BOS + "<｜User｜>Hi<｜Assistant｜></think>Hello!" + EOS + "<｜User｜>Bye<｜Assistant｜><think>")
    max_effort = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
                  "thinking and comprehensively decompose the problem to resolve the root cause, rigorously "
                  "stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
                  "Explicitly write out your entire deliberation process, documenting every intermediate step, "
                  "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
                  "unchecked.\n\n")
    assert V4.render(chat[:1], True, {"thinking": True, "reasoning_effort": "max"}) == (
        BOS + max_effort + "<｜User｜>Hi<｜Assistant｜><think>")
    assert V4.render(chat[:1], False, {}) == BOS + "<｜User｜>Hi"  # no generation prompt, no assistant header


def test_v41_prompt_chat_and_thinking():
    chat = (BOS + "<｜System｜>You are helpful.\n\n" + TOOLS_V41
            + "<｜User｜>Add 2 and 3, and the weather in Paris?<｜Assistant｜></think>"
            + "Let me check." + _block(" calls", " ") + EOS
            + "<｜User｜><tool_result>5</tool_result>\n\n<tool_result>Sunny</tool_result><｜Assistant｜></think>"
            + "5, and sunny." + EOS
            + "<｜User｜>Thanks!<｜Assistant｜></think>")
    assert V41.render(CONVERSATION, True, {"tools": TOOLS, "thinking": False}) == chat
    effort = "Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    thinking = (BOS + "<｜System｜>" + effort + "You are helpful.\n\n" + TOOLS_V41
                + "<｜User｜>Add 2 and 3, and the weather in Paris?<｜Assistant｜><think>"
                + "R1</think>Let me check." + _block(" calls", " ") + EOS
                + "<｜User｜><tool_result>5</tool_result>\n\n<tool_result>Sunny</tool_result><｜Assistant｜><think>"
                + "</think>5, and sunny." + EOS
                + "<｜User｜>Thanks!<｜Assistant｜><think>")
    assert V41.render(CONVERSATION, True, {"tools": TOOLS}) == thinking  # V4.1 thinks unless told not to
    assert V41.render([{"role": "user", "content": "Hi"}], True, {"reasoning_effort": "max"}) == (
        BOS + "<｜System｜>Reasoning Effort: 100 (range 1-100, the higher the value, the more thorough the "
        "reasoning)\n\n<｜User｜>Hi<｜Assistant｜><think>")
    mid_system = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                  {"role": "system", "content": "Be brief."}]
    assert V41.render(mid_system, True, {"thinking": False}) == (
        BOS + "<｜User｜>Hi<｜Assistant｜></think>Hello" + EOS + "<｜System｜>Be brief.<｜Assistant｜></think>")


def test_render_errors_are_value_errors():
    with pytest.raises(ValueError, match="tool result"):
        V32.render([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}], True, {})
    with pytest.raises(ValueError, match="role"):
        V4.render([{"role": "robot", "content": "q"}], True, {})
    with pytest.raises(ValueError, match="reasoning_effort"):
        V41.render([{"role": "user", "content": "q"}], True, {"reasoning_effort": "huge"})
    with pytest.raises(ValueError, match="boolean"):
        V4.render([{"role": "user", "content": "q"}], True, {"thinking": "yes"})
    for bad in ("get_weather", [1], [{"type": "function", "function": "f"}]):  # a 400, not a 500, in the server
        with pytest.raises(ValueError, match="chat_template_kwargs.tools"):
            V4.render([{"role": "user", "content": "q"}], True, {"tools": bad})


# --- parsing -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", DSML_FORMATS, ids=lambda f: f.name)
def test_several_calls_in_one_turn(fmt):
    text = "Checking." + fmt.render_calls([("add", {"a": 2, "b": 3}), ("get_weather", {"city": "Paris"}),
                                            ("noop", {})])
    content, calls = fmt.message(text)
    assert content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 2, "b": 3}), ("get_weather", {"city": "Paris"}), ("noop", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert fmt.message(fmt.render_calls([("add", {"a": 1, "b": 1})]))[0] is None  # calls only: content null


def test_values_are_typed_by_the_string_attribute():
    m = V4.markup
    text = (f'\n\n{m.open}\n{m.invoke} name="f">\n'
            f'{m.param} name="s" string="true">multi\nline "quoted" <b>&</b>{m.param_close}\n'
            f'{m.param} name="n" string="false"> 3.5 {m.param_close}\n'
            f'{m.param} name="o" string="false">{{"k": [1, null, true]}}{m.param_close}\n'
            f'{m.param} name="t" string="true">3{m.param_close}\n{m.invoke_close}\n{m.close}')
    _, [call] = V4.parse(text)
    assert json.loads(call.arguments) == {"s": 'multi\nline "quoted" <b>&</b>', "n": 3.5, "o": {"k": [1, None, True]},
                                          "t": "3"}
    assert call.arguments.startswith('{"s": "multi\\nline')  # DeepSeek's decoder: key: value, JSON values as written


def _invoke(fmt, name: str, body: str) -> str:
    m = fmt.markup
    return f'{m.invoke} name="{name}">\n{body}\n{m.invoke_close}'


@pytest.mark.parametrize("fmt", DSML_FORMATS, ids=lambda f: f.name)
def test_malformed_output_surfaces_as_text(fmt):
    m = fmt.markup
    good = _invoke(fmt, "add", f'{m.param} name="a" string="false">1{m.param_close}')
    bad_json = _invoke(fmt, "add", f'{m.param} name="a" string="false">one{m.param_close}')
    duplicate = _invoke(fmt, "add", f'{m.param} name="a" string="true">1{m.param_close}\n'
                                    f'{m.param} name="a" string="true">2{m.param_close}')
    # one bad invoke among good ones: the good ones are calls, the bad one is content, as written
    text = f"Hi\n\n{m.open}\n{good}\n{bad_json}\n{good}\n{m.close}"
    content, calls = fmt.parse(text)
    assert content == "Hi" + bad_json and len(calls) == 2
    # a block without any good call is content as a whole, byte for byte
    for block in (f"Hi\n\n{m.open}\n{duplicate}\n{m.close}", f"Hi\n\n{m.open}\nnot a call\n{m.close} after"):
        assert fmt.message(block) == (block, [])
    # stray text between calls is content; whitespace between calls is not
    content, calls = fmt.parse(f"\n\n{m.open}\n{good}\n  so  \n{good}\n{m.close}\n")
    assert content == "\n  so  \n" and len(calls) == 2
    # cut off by max_tokens: complete calls stay calls, the unfinished one is content; a lone block is content
    cut = f"\n\n{m.open}\n{good}\n{good[:-7]}"
    content, calls = fmt.parse(cut)
    assert content == good[:-7] and len(calls) == 1
    for end in range(len(cut) + 1):
        content, calls = fmt.message(cut[:end])
        if not calls:
            assert content == cut[:end]  # nothing lost
        else:
            assert m.open not in (content or "") and (content or "") in cut  # the rest is the model's own text
    assert fmt.message(f"\n\n{m.open}\n{good}")[0] is None
    assert fmt.message(f"\n\n{m.open}\n{good}\n{m.close[:5]}")[0] is None  # a cut-off closing tag is structure


@pytest.mark.parametrize("fmt", DSML_FORMATS, ids=lambda f: f.name)
def test_text_without_a_block_is_content_even_with_dsml_lookalikes(fmt):
    m = fmt.markup
    for text in ("plain", f"{m.invoke} name=\"x\">", "a <｜DSML｜ b", f"ends with {m.open[:6]}", "\n\n"):
        assert fmt.message(text) == (text, [])


def _pieces(stream, text: str, cuts) -> tuple[str, list]:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    content, calls = "", []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:] + [len(text)])):
        piece, deltas = stream.feed(text[a:b], final=i == len(bounds) - 1)
        content += piece
        calls += [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas]
    return content, calls


def _check_stream(fmt, text: str, cuts) -> None:
    content, calls = fmt.parse(text)
    got_content, got_calls = _pieces(fmt.stream(), text, cuts)
    assert got_content == content
    assert got_calls == [(i, c.name, c.arguments) for i, c in enumerate(calls)]


def _mixed_text(fmt) -> str:
    m = fmt.markup
    good = _invoke(fmt, "add", f'{m.param} name="a" string="false">[1, 2]{m.param_close}\n'
                               f'{m.param} name="b" string="true">x</｜DSML｜ y{m.param_close}')
    bad = _invoke(fmt, "add", f'{m.param} name="a" string="false">{{{m.param_close}')
    return (f"Hi\n\n\n{m.open}\n{good}\n{bad}\nzz{good}\n{m.close}\n\nmore\n\n{m.open}\n{bad}\n{m.close}"
            f"\n\n{m.open}\n{good}")


@pytest.mark.parametrize("fmt", DSML_FORMATS, ids=lambda f: f.name)
def test_streaming_cut_at_every_position(fmt):
    text = _mixed_text(fmt)
    content, calls = fmt.parse(text)
    assert len(calls) == 3 and content.startswith("Hi\n") and "more" in content
    _check_stream(fmt, text, range(len(text)))  # one character per delta
    for cut in range(len(text) + 1):  # two deltas, cut anywhere
        _check_stream(fmt, text, [cut])


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)
_ARGS = st.dictionaries(st.text(st.characters(blacklist_characters='"\n', blacklist_categories=("Cs",)),
                                min_size=1, max_size=8), _VALUES, max_size=4)
_CALLS = st.lists(st.tuples(st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True), _ARGS), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(DSML_FORMATS), st.text(max_size=12), _CALLS, st.lists(st.integers(0, 400), max_size=6))
def test_render_parse_round_trip_and_stream(fmt, content, calls, cuts):
    """Any parsed call re-renders to the same text, and any streaming of it gives the same parse. (DSML has
    no escaping: a value holding the parameter's closing tag cannot be written, so none is generated.)"""
    if fmt.markup.open in content or not all(fmt.markup.param_close not in json.dumps(a, ensure_ascii=False)
                                             and all(fmt.markup.param_close not in k for k in a)
                                             for _, a in calls):
        return
    text = content + fmt.render_calls(calls)
    parsed_content, parsed = fmt.parse(text)
    assert [c.name for c in parsed] == [name for name, _ in calls]
    assert parsed_content + fmt.render_calls([(c.name, json.loads(c.arguments)) for c in parsed]) == text
    _check_stream(fmt, text, cuts)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(DSML_FORMATS), st.integers(0, 10**4), st.lists(st.integers(0, 400), max_size=6))
def test_any_truncation_streams_like_the_whole_parse(fmt, cut, cuts):
    text = _mixed_text(fmt)[:cut % (len(_mixed_text(fmt)) + 1)]
    _check_stream(fmt, text, cuts)
    content, calls = fmt.parse(text)
    assert len(content) + sum(len(c.arguments) for c in calls) > 0 or not text.strip()



def _soup_pieces(fmt) -> list[str]:
    m = fmt.markup
    return ["\n\n" + m.open, m.open, m.close, f'{m.invoke} name="f">', f'{m.invoke} name="g" >', m.invoke_close,
            f'{m.param} name="a" string="true">', f'{m.param} name="b" string="false">', m.param_close,
            "\n", " ", "\t", "\r\n", " 3 ", "x y", '{"k": 1}', "<", "</think>", m.open[:5]]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(DSML_FORMATS), st.data())
def test_any_markup_soup_streams_like_the_whole_parse(fmt, data):
    """Texts of random DSML pieces (tags in any order, whitespace, half tags) stream to the one-shot parse
    for any cuts; e.g. whitespace after a block, then a next block's opening tag cut in two, is structure
    both ways."""
    text = "".join(data.draw(st.lists(st.sampled_from(_soup_pieces(fmt)), max_size=16)))
    _check_stream(fmt, text, data.draw(st.lists(st.integers(0, len(text)), max_size=8)))


@pytest.mark.parametrize("fmt", DSML_FORMATS, ids=lambda f: f.name)
def test_whitespace_then_a_split_opening_tag_after_a_block_is_structure(fmt):
    m = fmt.markup
    text = f"{m.open}{_invoke(fmt, 'f', '')}{m.close}\n\n{m.open}"
    content, calls = fmt.parse(text)
    assert content == m.open and [c.name for c in calls] == ["f"]
    for cut in range(len(text) + 1):
        _check_stream(fmt, text, [cut])


@pytest.mark.parametrize("fmt", DSML_FORMATS, ids=lambda f: f.name)
def test_streaming_work_grows_with_the_deltas_not_the_output(fmt, monkeypatch):
    """A long argument streamed a character at a time is parsed when a tag arrives, not on every delta, and
    the stream holds only the undecided tail of the text."""
    from deepinfer.server.tool_formats import DSMLScanner

    tries = []
    real = DSMLScanner._invoke
    monkeypatch.setattr(DSMLScanner, "_invoke", lambda self, *a: tries.append(1) or real(self, *a))
    m, value = fmt.markup, "word " * 2000
    call = f"\n\n{m.open}\n" + _invoke(fmt, "f", f'{m.param} name="a" string="true">{value}{m.param_close}')
    text = "x" * 5000 + call + f"\n{m.close}" + "y" * 5000
    stream, held = fmt.stream(), []
    content, calls = _pieces_with(stream, text, held)
    assert (content, calls) == ("x" * 5000 + "y" * 5000, [(0, "f", json.dumps({"a": value}))])
    assert len(tries) < 60  # once per tag of the invoke at most (10,000 deltas inside it)
    outside = held[:5000] + held[-4000:]  # deltas of plain content: nothing piles up
    assert max(outside) < 100


@pytest.mark.parametrize("fmt", DSML_FORMATS, ids=lambda f: f.name)
def test_whitespace_after_a_block_is_read_once(fmt):
    """A run of whitespace after a block with calls is held outside the text (it may still become content):
    the stream's text stays short, and the result is the one-shot parse's, for either ending."""
    m = fmt.markup
    block = f"{m.open}\n{_invoke(fmt, 'f', '')}\n{m.close}"
    for ending in ("", "done", f"{m.open}x{m.close}"):
        text = block + "\n" * 5000 + ending
        held: list[int] = []
        got_content, got_calls = _pieces_with(fmt.stream(), text, held)
        content, calls = fmt.parse(text)
        assert got_content == content and [c[1] for c in got_calls] == [c.name for c in calls] == ["f"]
        assert max(held[len(block):len(block) + 5000]) < 50


@pytest.mark.parametrize("fmt", DSML_FORMATS, ids=lambda f: f.name)
def test_non_json_numbers_are_malformed_values(fmt):
    """NaN / Infinity / 1e999 are not JSON (a strict client, or a JSON encoder, refuses them): the invoke
    comes back as content."""
    m = fmt.markup
    for value in ("NaN", "-Infinity", "1e999", "[1, NaN]"):
        text = "\n\n" + m.open + "\n" + _invoke(fmt, "f", f'{m.param} name="x" string="false">{value}{m.param_close}') \
            + "\n" + m.close
        content, calls = fmt.parse(text)
        assert calls == [] and content == text


@pytest.mark.parametrize("fmt", [*DSML_FORMATS, FORMATS["deepseek_v31"]], ids=lambda f: f.name)
def test_parallel_tool_calls_false_keeps_the_first_call(fmt):
    """OpenAI's parallel_tool_calls false: at most one call, streamed or not (tool_choice auto too)."""
    two = fmt.render_calls([("f", {"a": 1}), ("g", {})]) if hasattr(fmt, "render_calls") else (
        f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{}}{CALL_END}{CALL_BEGIN}g{SEP}{{}}{CALL_END}{CALLS_END}")
    one = ToolSetup(TOOLS, "auto", parallel=False, format=fmt)
    both = ToolSetup(TOOLS, "auto", parallel=True, format=fmt)
    assert [c["function"]["name"] for c in one.message(two)[1]] == ["f"]
    assert [c["function"]["name"] for c in both.message(two)[1]] == ["f", "g"]
    stream = one.new_stream()
    calls = [d for ch in two for d in stream.feed(ch)[1]] + stream.feed("", final=True)[1]
    assert [d["function"]["name"] for d in calls if d.get("function", {}).get("name")] == ["f"]
    assert stream.num_calls == 1


def _pieces_with(stream, text: str, held: list) -> tuple[str, list]:
    content, calls = "", []
    for i, ch in enumerate(text):
        piece, deltas = stream.feed(ch, final=i == len(text) - 1)
        content += piece
        calls += [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas]
        held.append(len(stream.text))
    return content, calls

# --- forced calls: the grammar writes exactly the format ----------------------------------------------------
@pytest.fixture(scope="module")
def compiler():
    import xgrammar as xgr

    from deepinfer.llm import default_model_path
    from deepinfer.structured.backend import tokenizer_info
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_path())
    return xgr.GrammarCompiler(tokenizer_info(tok, tok.vocab_size, [tok.eos_token_id])), tok


def _accepts(compiler, constraint: dict, text: str) -> bool:
    """The grammar accepts `text` tokenised as the tokenizer does (marker tokens whole), then the stop token."""
    import xgrammar as xgr

    compiled, tok = compiler
    matcher = xgr.GrammarMatcher(compiled.compile_grammar(xgr.Grammar.from_structural_tag(
        constraint["structural_tag"])))
    return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
        matcher.accept_token(tok.eos_token_id)


@pytest.mark.parametrize("fmt", DSML_FORMATS, ids=lambda f: f.name)
def test_forced_calls_follow_the_format_and_the_schemas(compiler, fmt):
    required = ToolSetup([dict(t) for t in TOOLS], "required", True, fmt).constraint(compiler[1])
    one = ToolSetup([dict(t) for t in TOOLS], "required", False, fmt).constraint(compiler[1])
    named = ToolSetup([dict(t) for t in TOOLS], {"type": "function", "function": {"name": "get_weather"}}, True,
                      fmt).constraint(compiler[1])
    two = fmt.render_calls([("add", {"a": 2, "b": 3}), ("get_weather", {"city": "Paris"})])
    weather = fmt.render_calls([("get_weather", {"city": "Paris"})])
    assert _accepts(compiler, required, two) and _accepts(compiler, required, weather)
    assert not _accepts(compiler, one, two) and _accepts(compiler, one, weather)
    assert _accepts(compiler, named, weather) and not _accepts(compiler, named, fmt.render_calls([("add", {
        "a": 1, "b": 2})]))
    for bad in (fmt.render_calls([("add", {"a": "2", "b": 3})]),  # a string where the schema says integer
                fmt.render_calls([("add", {"a": 2})]),  # a required parameter missing
                "Sure." + weather, weather.removeprefix("\n\n")):  # no content before the block, and its "\n\n"
        assert not _accepts(compiler, required, bad), bad
    content, calls = fmt.parse(two)
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"a": 2, "b": 3}, {"city": "Paris"}]


def test_v3_forced_calls_use_the_json_fence(compiler):
    tools = [dict(TOOLS[0])]
    fenced = get_format("deepseek_v3").constraint(ToolSetup(tools, "required", False), compiler[1])
    plain = get_format("deepseek_v31").constraint(ToolSetup(tools, "required", False), compiler[1])
    v3 = f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}add\n```json\n{{"a": 1, "b": 2}}\n```{CALL_END}{CALLS_END}'
    v31 = f'{CALLS_BEGIN}{CALL_BEGIN}add{SEP}{{"a": 1, "b": 2}}{CALL_END}{CALLS_END}'
    assert _accepts(compiler, fenced, v3) and not _accepts(compiler, fenced, v31)
    assert _accepts(compiler, plain, v31) and not _accepts(compiler, plain, v3)
    assert get_format("deepseek_v3").parse(v3)[1][0].arguments == '{"a": 1, "b": 2}'


# --- choosing the format -------------------------------------------------------------------------------------
class _Tok:
    def __init__(self, template=None, special=(), vocab=None):
        self.chat_template, self.special_token_ids = template, frozenset(special)
        self.vocab, self.bos_token, self.eos_token = vocab or {}, BOS, EOS

    def token_to_id(self, token):
        return self.vocab.get(token)

    def decode(self, ids, skip_special_tokens=True):
        inverse = {i: t for t, i in self.vocab.items()}
        return "".join(inverse[i] for i in ids if not (skip_special_tokens and i in self.special_token_ids))


def test_the_format_comes_from_the_template_then_the_model_type(tmp_path):
    from deepinfer.llm import default_model_path
    from deepinfer.tokenizer import Tokenizer

    bundled = Tokenizer.from_dir(default_model_path())  # a deepseek_v4 checkpoint whose template speaks V3.1
    assert resolve_format(None, bundled, default_model_path()).name == "deepseek_v31"
    assert template_format("{{ '<｜DSML｜function_calls>' }}") == "deepseek_v32"
    assert template_format("<｜tool▁calls▁begin｜>function<｜tool▁sep｜>{{ n }}\n```json\n") == "deepseek_v3"
    for model_type, name in (("deepseek_v32", "deepseek_v32"), ("deepseek_v4", "deepseek_v4"),
                             ("deepseek_v41", "deepseek_v41"), ("deepseek_v3", "deepseek_v31")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert resolve_format("auto", _Tok(), tmp_path).name == name
    assert resolve_format("deepseekv32", bundled, default_model_path()).name == "deepseek_v32"  # the override wins
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_format("hermes")
    assert format_of(_Tok()).name == "deepseek_v31"


def test_builtin_renderer_only_where_the_template_cannot():
    tools_kwargs, chat = {"tools": TOOLS}, [{"role": "user", "content": "hi"}]
    assert uses_builtin_renderer(V4, _Tok(None), chat, {})  # no template at all (DeepSeek's V3.2 / V4 repos)
    assert not uses_builtin_renderer(V4, _Tok("plain chat template"), chat, {})  # plain chats keep the template
    assert uses_builtin_renderer(V4, _Tok("plain chat template"), chat, tools_kwargs)  # it cannot show tools
    assert not uses_builtin_renderer(V4, _Tok("... <｜DSML｜tool_calls> ..."), chat, tools_kwargs)  # it can
    assert not uses_builtin_renderer(FORMATS["deepseek_v31"], _Tok(None), chat, tools_kwargs)


def test_decoding_keeps_the_dsml_token_but_skips_other_special_tokens():
    tok = _Tok(special=(0, 1, 7), vocab={"<bos>": 0, "<eos>": 1, "｜DSML｜": 7, "<": 8, "tool_calls>": 9})
    decoder = output_decoder(tok, V4, tools=True, thinking=False)
    assert isinstance(decoder, MarkupDecoder)
    assert decoder.decode([0, 8, 7, 9, 1]) == "<｜DSML｜tool_calls>"
    assert decoder.decode([0, 8, 7, 9, 1], skip_special_tokens=False) == "<bos><｜DSML｜tool_calls><eos>"
    assert output_decoder(tok, V4, tools=False, thinking=False) is tok


def test_grammars_can_write_the_dsml_token_whole(tmp_path):
    """`｜DSML｜` is special in DeepSeek's tokenizers; xgrammar still sees its text (other special tokens stay
    out of constrained text)."""
    from test_tool_server import _write_dsml_tokenizer

    from deepinfer.structured.backend import tokenizer_info
    from deepinfer.tokenizer import Tokenizer

    _write_dsml_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    dsml = tok.token_to_id("｜DSML｜")
    assert dsml in tok.special_token_ids
    info = tokenizer_info(tok, 512, [tok.eos_token_id])
    assert info.decoded_vocab[dsml] == "｜DSML｜".encode() and info.decoded_vocab[tok.bos_token_id] == b""
    assert tok.encode("<｜DSML｜tool_calls>", add_special_tokens=False)[1] == dsml
