"""Grammar checks that must hold under hostile input: a compile past its time limit is killed (it never
blocks later requests or the exit), the limit is the flag's, external `$ref`s and empty languages are
400s, and every malformed `tool_choice` is a 400 naming it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import running_server

from deepinfer.llm import default_model_path
from deepinfer.server.errors import APIError
from deepinfer.structured.params import StructuredOutputsParams, check_json_schema

TIMEOUT_S = 2.0  # the test server's --grammar-compile-timeout-s
DRAIN_S = 5.0
HELPERS_EXIT_S = 10.0  # how long the helpers may take to exit after the API process
# An enum of 100,000 strings, the issue's case, compiles far past the limit (on the development machine
# 30,000 "value<i>" strings took 40 s); the check kills it, so its full cost is never paid.
SLOW_ENUM_VALUES = 100_000
EMPTY = {"regex": r"[^\s\S]", "grammar": "root ::= [^\\x00-\\U0010FFFF]",
         "structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "regex", "pattern": r"[^\s\S]"}})}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
BAD_TOOL_CHOICES = [{"type": "function", "function": "add"}, {"type": "function"}, {"function": {"name": "add"}},
                    {"type": "function", "function": {}}, {"type": "function", "function": {"name": 3}},
                    {"type": "function", "function": {"name": "nope"}}, ["add"], [], 3]


def slow_schema(tag: str, values: int = SLOW_ENUM_VALUES) -> dict:
    """Distinct per tag, so no cache answers it."""
    return {"enum": [f"value{i}-{tag}" for i in range(values)]}


@pytest.fixture(scope="module")
def compiler():
    from deepinfer.structured import backend
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_path())
    return backend.Compiler(backend.tokenizer_info(tok, tok.vocab_size, [tok.eos_token_id]))


# --- unit --------------------------------------------------------------------------------------------
def test_the_compile_timeout_flag_reaches_the_api_check(tmp_path):
    from deepinfer import cli
    from deepinfer.server import launch

    args = cli.build_parser().parse_args(["serve", str(tmp_path), "--grammar-compile-timeout-s", "2.5"])
    assert launch.settings_from(args, tmp_path, bundled=False).grammar_timeout_s == 2.5
    assert cli.engine_kwargs(args)["grammar_compile_timeout_s"] == 2.5  # the engine gets the same limit


@pytest.mark.parametrize("choice", BAD_TOOL_CHOICES[:6])
def test_malformed_tool_choice_is_a_400_naming_it(choice):
    from deepinfer.server.protocol import ChatCompletionRequest
    from deepinfer.server.tools import tool_setup

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=choice)
    with pytest.raises(APIError) as err:
        tool_setup(req)
    assert err.value.status == 400 and err.value.param == "tool_choice" and "tool_choice" in err.value.message


@pytest.mark.parametrize("ref", ["http://example.com/s.json", "file:///etc/passwd", "other.json#/x", "urn:x"])
def test_external_refs_are_rejected(ref):
    from deepinfer.structured import backend

    for schema in ({"$ref": ref}, {"type": "object", "properties": {"a": {"$ref": ref}}},
                   {"$defs": {"enum": {"items": {"$ref": ref}}}, "$ref": "#/$defs/enum"}):
        with pytest.raises(ValueError, match=f"refers to '{ref}'"):
            check_json_schema(schema)
        with pytest.raises(ValueError, match="only refs inside the schema"):  # the offline (engine) path
            backend.build_grammar(StructuredOutputsParams(json=schema))


def test_internal_refs_and_ref_lookalikes_still_work(compiler):
    from deepinfer.structured import backend

    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}, "$ref": {"type": "string"}},
              "$defs": {"A": {"type": "integer"}}, "default": {"$ref": "http://data.not/a-ref"}}
    compiler.compile(backend.build_grammar(StructuredOutputsParams(json=schema)))


@pytest.mark.parametrize("kind", sorted(EMPTY))
def test_a_constraint_no_output_can_match_fails_to_compile(compiler, kind):
    from deepinfer.structured import backend

    with pytest.raises(ValueError, match="no output can match"):
        compiler.compile(backend.build_grammar(StructuredOutputsParams(**{kind: EMPTY[kind]})))


def test_constraints_that_match_something_still_compile(compiler):
    """An empty string (EOS at once), one character, a choice: the check needs no first character."""
    from deepinfer.structured import backend

    for fields in ({"grammar": 'root ::= ""'}, {"regex": "a"}, {"choice": ["x"]}, {"json_object": True}):
        compiler.compile(backend.build_grammar(StructuredOutputsParams(**fields)))


def test_the_check_kills_a_compile_at_its_time_limit():
    """Direct use of the API's checker: a slow compile is a timeout at the limit (its worker is killed
    and replaced), the following checks answer at once, and close() leaves no worker behind."""
    from deepinfer.server.structured import GrammarChecker
    from deepinfer.tokenizer import Tokenizer

    async def scenario():
        tok = Tokenizer.from_dir(default_model_path())
        checker = GrammarChecker(tok, tok.vocab_size, [tok.eos_token_id])
        await checker.check(StructuredOutputsParams(regex="warm-up"), 60)
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await checker.check(StructuredOutputsParams(json=slow_schema("unit")), 1.0)
        assert time.monotonic() - started < 3
        started = time.monotonic()
        await checker.check(StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}}),
                            5.0)
        with pytest.raises(ValueError, match="no output can match"):
            await checker.check(StructuredOutputsParams(regex=r"[^\s\S]"), 5.0)
        assert time.monotonic() - started < 3
        workers = [w.proc for w in checker.pool._workers]
        checker.close()
        return workers

    workers = asyncio.run(scenario())
    assert workers and all(not p.is_alive() for p in workers)


def test_a_check_past_its_memory_cap_fails_in_its_worker_only():
    from deepinfer.server.grammar_workers import CompilePool
    from deepinfer.tokenizer import Tokenizer

    async def scenario():
        tok = Tokenizer.from_dir(default_model_path())
        pool = CompilePool(tok, tok.vocab_size, [tok.eos_token_id], size=1, memory_bytes=32 * 2**20)
        try:
            assert await pool.verdict({"regex": "a"}, 60) == (None, 2)  # "a", then the stop token
            reason, _ = await pool.verdict({"json": slow_schema("mem")}, 30)
            assert reason is not None and "bad_alloc" in reason
            assert await pool.verdict({"regex": "b"}, 30) == (None, 2)  # the same worker serves on
        finally:
            pool.close()

    asyncio.run(scenario())


# --- through a real server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("grammar-hardening") / "server.log"
    with running_server(default_model_path(), log, "--served-model-name", "m", "--grammar-compile-timeout-s",
                        str(TIMEOUT_S), "--drain-timeout", str(DRAIN_S)) as proc:
        yield proc


def _chat(server, timeout: float = 60, **extra) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=timeout)


BAD_OVER_HTTP = ([({"tools": TOOLS, "tool_choice": c}, "tool_choice") for c in BAD_TOOL_CHOICES]
                 + [({"response_format": {"type": "json_schema", "json_schema": {
                     "name": "x", "schema": {"properties": {"a": {"$ref": "http://example.com/a.json"}}}}}},
                     "http://example.com/a.json"),
                    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "file:///x"}}}],
                      "tool_choice": "required"}, "file:///x"),
                    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "no output can match"),
                    ({"guided_grammar": EMPTY["grammar"]}, "no output can match")])


@pytest.mark.parametrize("extra, reason", BAD_OVER_HTTP)
def test_bad_input_answers_400(server, extra, reason):
    r = _chat(server, **extra)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"] or reason == r.json()["error"]["param"]


def test_a_slow_compile_is_a_400_at_the_limit_and_blocks_nothing(server):
    """Eight slow schemas at once (the issue's case; four times the check workers): each is a 400 at
    about the flag's limit, and a constrained request right after them is served at once."""
    assert _chat(server, response_format={"type": "json_object"}).status_code == 200  # the workers are up
    responses, started = [None] * 8, time.monotonic()

    def send(i):
        fmt = {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow_schema(f"s{i}")}}
        responses[i] = _chat(server, response_format=fmt)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < TIMEOUT_S + 6
    for r in responses:
        assert r.status_code == 400 and f"did not compile within {TIMEOUT_S:g} s" in r.json()["error"]["message"]
    started = time.monotonic()
    fresh = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}}}
    r = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "fresh", "schema": fresh}})
    assert r.status_code == 200, r.text
    assert _chat(server, response_format={"type": "json_object"}).status_code == 200
    assert time.monotonic() - started < 10


def test_sigterm_exits_promptly_with_a_slow_compile_in_flight(server):
    """Last test of `server`: the in-flight slow check ends at its limit, the workers are killed, and the
    process exits 0 well within the drain timeout, leaving no process behind."""
    fmt = {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow_schema("term")}}
    sender = threading.Thread(target=_chat, args=(server,), kwargs={"response_format": fmt}, daemon=True)
    sender.start()
    time.sleep(1.0)
    helpers = _descendants(server.proc.pid)  # the engine, the fork server and the check workers
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(DRAIN_S + 10) == 0, server.log()
    assert time.monotonic() - started < DRAIN_S + 5
    if Path("/proc").is_dir():  # nothing it started outlives it (each exits on its own once the API is gone:
        assert len(helpers) >= 3  # within seconds, later on a loaded machine)
        deadline = time.monotonic() + HELPERS_EXIT_S
        while (left := [pid for pid in helpers if _alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, [_cmdline(pid) for pid in left]


def _descendants(pid: int) -> list[int]:
    """Linux: the processes below `pid`, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return str(pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_engine_compiles_past_their_deadline_do_not_wedge_later_ones():
    """Engine side: compiles cannot be killed there, but one still queued at its deadline is cancelled
    (a later request for that spec compiles afresh), and once every thread runs an overrunning compile,
    new compiles get a fresh pool instead of queueing behind them.
    (20,000 values: the running compile, which holds its thread to the end, lasts a few seconds.)"""
    from deepinfer.structured.manager import StructuredOutputManager
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_path())
    manager = StructuredOutputManager(tok, tok.vocab_size, [tok.eos_token_id], timeout_s=0.3, max_workers=1)
    try:
        slow, queued = (manager.request_state(StructuredOutputsParams(json=slow_schema(f"e{i}", 20_000)))
                        for i in range(2))
        time.sleep(0.4)
        assert slow.ready() and queued.ready() and "did not compile within 0.3 s" in queued.error
        assert queued._compiled.cancelled() and not slow._compiled.cancelled()  # the first one is running
        small = manager.request_state(StructuredOutputsParams(regex="small"))  # a fresh pool: not wedged
        _wait(small.ready, 0.3)
        assert small.error is None and small.matcher is not None
        assert manager.request_state(queued.spec)._compiled is not queued._compiled
    finally:
        manager.shutdown()


def test_a_queued_compile_shared_by_requests_waits_for_the_last_deadline():
    """Requests for one spec share its compile: the first one's deadline fails only that request; the
    compile is cancelled only once no request still waits for it."""
    from deepinfer.structured.manager import StructuredOutputManager
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_path())
    manager = StructuredOutputManager(tok, tok.vocab_size, [tok.eos_token_id], timeout_s=0.3, max_workers=1)
    try:
        manager._compile_pool.submit(time.sleep, 1.0)  # the only thread is busy: the compile below stays queued
        first = manager.request_state(StructuredOutputsParams(regex="shared"))
        time.sleep(0.2)
        second = manager.request_state(StructuredOutputsParams(regex="shared"))
        assert second._compiled is first._compiled
        time.sleep(0.15)  # past the first request's deadline, not the second's
        assert first.ready() and "did not compile" in first.error
        assert not first._compiled.cancelled() and not second.ready()
        time.sleep(0.2)
        assert second.ready() and second.error is not None and second._compiled.cancelled()
    finally:
        manager.shutdown()


def _wait(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
