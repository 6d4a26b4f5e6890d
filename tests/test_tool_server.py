"""DSML tool calling end to end: the real `deepinfer serve` process on a tiny random DeepSeek-V4 checkpoint
saved the way DeepSeek ships V4 (model_type deepseek_v4, no Jinja chat template, `｜DSML｜` a special token),
and the official `openai` client. The format is chosen from the checkpoint; the prompt is rendered by
DeepSeek's encoder (reproduced in server/tool_formats.py); `tool_choice` required / named forces a DSML block
whose arguments validate, which the parser returns as `tool_calls`, streaming and not."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_server import running_server
from test_structured_server import _collect_stream
from tiny_models import ASSISTANT, BOS, EOS, USER, make_reference, save_reference

from deepinfer.server.tool_formats import FORMATS

V4 = FORMATS["deepseek_v4"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MAX_TOKENS = 200  # a forced call of these schemas takes well under this many tokens of the tiny tokenizer


def _write_dsml_tokenizer(path) -> None:
    """Byte-level BPE (vocab < the model's 512) trained on DSML prompts, so the tools prompt is short; `｜DSML｜`
    is special, as in DeepSeek's tokenizers, and there is no chat template, as in DeepSeek's V4 repo."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tools_prompt = V4.tools_prompt(TOOLS)
    calls = V4.render_calls([("get_weather", {"city": "Paris", "days": 3}), ("add", {"a": 2, "b": -3})])
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=[BOS, EOS, USER, ASSISTANT, "｜DSML｜"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([tools_prompt, calls, "What's the weather in Paris? Add 2 and 3."] * 5, trainer)
    tok.add_tokens(["<think>", "</think>", "<tool_result>", "</tool_result>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsml-ckpt") / "model"
    save_reference(make_reference("v4", seed=5), path)
    _write_dsml_tokenizer(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "deepseek_v4"
    return path


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("dsml-server") / "server.log"
    with running_server(ckpt, log, "--served-model-name", "m", "--max-model-len", "2048",
                        "--kv-cache-memory-bytes", str(32 * 2**20)) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, question: str, **kw):
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                          max_tokens=MAX_TOKENS, tools=TOOLS, **kw)


def _check(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_the_prompt_is_deepseeks_v4_encoding(server, ckpt):
    """No chat template: the chat is rendered with DeepSeek-V4's encoder (thinking passed through)."""
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ckpt)
    for kwargs in ({}, {"thinking": True}):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
        ids = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]
        want = BOS + USER + "hi" + ASSISTANT + ("<think>" if kwargs else "</think>")
        assert ids == tok.encode(want, add_special_tokens=False)


def test_offline_chat_renders_like_the_server(ckpt):
    """LLM.chat on the same template-less checkpoint: DeepSeek-V4's encoder too."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(ckpt), load_progress=False, max_model_len=256, kv_cache_memory_bytes=16 * 2**20)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt == BOS + USER + "hi" + ASSISTANT + "</think>"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_come_back_as_tool_calls(client, choice):
    allowed = {"add"} if isinstance(choice, dict) else set(SCHEMAS)
    for i, question in enumerate(("What's the weather in Paris?", "Add 2 and 3")):
        r = _chat(client, question, tool_choice=choice, parallel_tool_calls=False, temperature=0.9 if i else 0.0,
                  seed=i)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        assert c.message.content is None and len(c.message.tool_calls) == 1
        _check(c.message.tool_calls, allowed)


def test_forced_calls_stream(client):
    stream = _chat(client, "Forecast for Lima", tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False, stream=True, temperature=0.7, seed=3)
    content, calls, finish = _collect_stream(stream)
    assert finish == "tool_calls" and not content
    assert len(calls) == 1
    _check(calls, {"get_weather"})


def test_a_conversation_with_tool_results_renders(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [{"role": "user", "content": "Add 1 and 2"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=MAX_TOKENS, parallel_tool_calls=False, temperature=0.0,
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].finish_reason == "tool_calls"
    _check(r.choices[0].message.tool_calls, set(SCHEMAS))


@pytest.mark.parametrize("parser", ["deepseek_v32", pytest.param("deepseek_v41", marks=pytest.mark.slow)])
def test_the_tool_call_parser_flag_overrides_the_checkpoint(ckpt, tmp_path, parser):
    """--tool-call-parser: the same checkpoint served in another family's format, prompt to parsed calls
    (thinking off: V4.1 thinks by default, and the tiny model never closes its reasoning)."""
    fmt = FORMATS[parser]
    with running_server(ckpt, tmp_path / "server.log", "--served-model-name", "m", "--max-model-len", "2048",
                        "--kv-cache-memory-bytes", str(32 * 2**20), "--tool-call-parser", parser) as proc:
        assert f"tool calls: {parser} format" in proc.log()
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        body = {"model": "m", "messages": [{"role": "user", "content": "Add 2 and 3"}], "tools": TOOLS,
                "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "logprobs": True, "return_tokens_as_token_ids": True,
                "chat_template_kwargs": {"thinking": False}}
        r = httpx.post(proc.url + "/v1/chat/completions", json=body, timeout=120).json()
        ids = [int(t["token"].removeprefix("token_id:")) for t in r["choices"][0]["logprobs"]["content"]]
        from deepinfer.tokenizer import Tokenizer

        raw = Tokenizer.from_dir(ckpt).decode(ids, skip_special_tokens=False)
        assert raw.startswith("\n\n" + fmt.markup.open + "\n" + fmt.markup.invoke + ' name="'), raw
        assert r["choices"][0]["finish_reason"] == "tool_calls" and len(r["choices"][0]["message"]["tool_calls"]) == 1
        stream = _chat(client, "Weather?", tool_choice="required", parallel_tool_calls=False, stream=True, seed=1,
                       temperature=0.8, extra_body={"chat_template_kwargs": {"thinking": False}})
        content, calls, finish = _collect_stream(stream)
        assert finish == "tool_calls" and not content and len(calls) == 1
        _check(calls, set(SCHEMAS))
