"""Server hardening against hostile or careless clients: large inputs never stall the event loop, the
queue counts sequences and one request cannot take it all, a full queue answers 429 cheaply, empty
prompts and wrongly typed fields are 400s, the model-work routes need the key, disconnects and the
drain timeout end choices with "abort".

One real server per module (API key, --max-queue 4, --max-request-seqs 2, --drain-timeout 1, and one
running sequence, so requests holding the queue barely load a small shared machine); the last test
stops it (SIGTERM drain). The unit tests at the top use the ASGI app with a fake engine client.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from test_server import _assert_error, _sse_events, _wait_for, running_server, tiny_checkpoint

from deepinfer.server.app import build_app
from deepinfer.server.metrics import Metrics
from deepinfer.server.serving import Admission, ServerSettings, Serving, chars_per_token
from deepinfer.tokenizer import Tokenizer

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}  # cannot end by itself during a test
BIG_TEXT = "hello world " * 1_300_000  # 15.6 MB, under the default --max-body-bytes
# A chat stream's first event (the role chunk) comes at admission, even while the engine keeps it waiting.
HOLD = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True, **LONG}


# --- units: admission rule and the app with a fake engine ------------------------------------------
def test_admission_counts_sequences_and_caps_one_request():
    adm = Admission(limit=8, retry_after_s=1)
    assert adm.per_request == 2  # a quarter of the queue
    with pytest.raises(Exception, match="sequences") as bad:
        adm.acquire(3, 1)  # three prompts: over the share
    assert bad.value.status == 400 and bad.value.param == "prompt"
    assert [adm.acquire(1, 2) for _ in range(4)] == [2, 2, 2, 2] and adm.full
    with pytest.raises(Exception) as busy:
        adm.acquire(1, 1)
    assert busy.value.status == 429
    adm.release(2)
    assert not adm.full and adm.count == 6
    assert Admission(limit=1, retry_after_s=1).per_request == 1
    assert Admission(limit=4, retry_after_s=1, per_request=99).per_request == 4  # never over the queue


def test_max_request_seqs_flag(tmp_path):
    from deepinfer import cli
    from deepinfer.server import launch

    def settings(*flags):
        return launch.settings_from(cli.build_parser().parse_args(["serve", str(tmp_path), *flags]), tmp_path, False)

    assert settings("--max-queue", "8").max_request_seqs is None  # the Admission default: a quarter
    assert settings("--max-request-seqs", "3").max_request_seqs == 3
    with pytest.raises(ValueError, match="--max-request-seqs"):
        settings("--max-request-seqs", "0")


def _fake_app(dead: bool = False):
    client = SimpleNamespace(dead=dead, dead_reason="the engine process exited", closed=False,
                             ready=SimpleNamespace(max_model_len=64, vocab_size=100), stats=lambda: None)
    serving = Serving(client, None, ServerSettings(model_name="m", max_queue=2), Metrics(dict))
    return serving, httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(serving)), base_url="http://t")


def test_health_503_says_engine_dead():
    async def check():
        _, http = _fake_app(dead=True)
        async with http:
            return await http.get("/health")

    error = _assert_error(asyncio.run(check()), 503)
    assert (error["type"], error["code"]) == ("server_error", "engine_dead")


def test_full_queue_answers_429_before_parsing_the_body():
    async def check():
        serving, http = _fake_app()
        serving.admission.count = serving.admission.limit
        async with http:
            return await http.post("/v1/completions", content=b"{not json", headers={"content-type": "x"})

    resp = asyncio.run(check())
    assert _assert_error(resp, 429)["code"] == "queue_full" and resp.headers["Retry-After"] == "1"


def test_tokenising_runs_off_the_event_loop():
    """A tokenisation that takes 0.6 s (under the size bound) leaves /health answering meanwhile."""
    from deepinfer.llm import default_model_path

    class SlowTokenizer(Tokenizer):
        def encode(self, text, add_special_tokens=True):
            time.sleep(0.6)  # holds its thread, not the event loop
            return super().encode(text, add_special_tokens)

    async def check():
        serving, http = _fake_app()
        serving.tokenizer = SlowTokenizer.from_dir(default_model_path())
        async with http:
            started = time.monotonic()
            slow = asyncio.create_task(http.post("/tokenize", json={"prompt": "def f(): pass"}))
            await asyncio.sleep(0.1)  # the tokenisation is under way
            health = await http.get("/health")
            return health.status_code, time.monotonic() - started, (await slow).status_code

    health, waited, tokenized = asyncio.run(check())
    assert (health, tokenized) == (200, 200) and waited < 0.4  # 0.6 s or more if it blocked the loop


# --- the real server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    with running_server(ckpt, log, "--api-key", KEY, "--max-queue", "4", "--max-request-seqs", "2",
                        "--drain-timeout", "1", "--max-num-seqs", "1") as proc:  # one running: light on the CPU
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def text_bound(ckpt):
    return 1024 * chars_per_token(Tokenizer.from_dir(ckpt))  # --max-model-len 1024 (BASE_FLAGS)


class _Probe(threading.Thread):
    """Polls /health until stopped; `worst` is the slowest answer (seconds), `statuses` what came back."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.worst, self.stop, self.statuses = url, 0.0, threading.Event(), set()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                t0 = time.monotonic()
                self.statuses.add(client.get(self.url + "/health").status_code)
                self.worst = max(self.worst, time.monotonic() - t0)
                time.sleep(0.02)


def _stream_gaps(http: httpx.Client, body: dict, events: int) -> list[float]:
    """The times between the first `events` events of a stream (then it is closed: aborted)."""
    gaps, last = [], time.monotonic()
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        for _ in zip(range(events), _sse_events(resp)):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
    return gaps[1:]  # the first one includes the prefill


def test_hostile_inputs_keep_health_and_streams_responsive(server, http, text_bound):
    hostile = [("/tokenize", {"prompt": BIG_TEXT}), ("/v1/completions", {"prompt": BIG_TEXT, "max_tokens": 1}),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG_TEXT}]}),
               ("/tokenize", {"messages": [{"role": "user", "content": BIG_TEXT}]})]
    answers: list[httpx.Response] = []

    def send_all():
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
            answers.extend(client.post(path, json=body) for path, body in hostile)

    probe, sender = _Probe(server.url), threading.Thread(target=send_all)
    probe.start()
    sender.start()
    gaps = _stream_gaps(http, {"prompt": "hello", **LONG}, 60)
    sender.join()
    probe.stop.set()
    probe.join()
    assert [r.status_code for r in answers] == [400] * len(hostile), [r.text[:200] for r in answers]
    assert all("characters" in r.json()["error"]["message"] for r in answers)
    assert probe.statuses == {200} and probe.worst < 1.0 and max(gaps) < 1.0, (probe.worst, max(gaps))
    under = "x" * (text_bound - 1)
    assert http.post("/tokenize", json={"prompt": under}).json()["count"] >= 1  # at the bound: tokenised


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": [""]}),
    ("/v1/completions", {"prompt": ["hi", ""]}),
    ("/v1/completions", {"prompt": [[]]}),
])
def test_empty_prompts_are_400(http, path, body):
    error = _assert_error(http.post(path, json={**body, "max_tokens": 2}), 400)
    assert error["param"] == ("messages" if "messages" in body else "prompt")


@pytest.mark.parametrize("field, value", [
    ("stream", "yes"), ("n", "2"), ("n", True), ("max_tokens", 2.5), ("temperature", "1"), ("logprobs", True),
    ("echo", 1), ("stop", 5), ("seed", "7"), ("stream_options", {"include_usage": "yes"}),
])
def test_wrong_types_are_400_naming_the_field(http, field, value):
    body = {"prompt": "hi", "max_tokens": 2, field: value}
    assert _assert_error(http.post("/v1/completions", json=body), 400)["param"] == field


def test_valid_openai_inputs_still_work(server, http):
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 1, "presence_penalty": 0}
    assert http.post("/v1/completions", json=body).status_code == 200  # ints where floats are expected
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, temperature=0, seed=1, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2
    out = client.completions.create(model="model", prompt=[[5, 6], [7]], max_tokens=1, logprobs=1, echo=True)
    assert len(out.choices) == 2


def test_model_work_routes_need_the_key(server):
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})]:
        _assert_error(httpx.post(server.url + path, json=body), 401)
        assert httpx.post(server.url + path, json=body, headers=AUTH).status_code == 200
    for path in ("/health", "/metrics"):  # probes and scrapers stay open
        assert httpx.get(server.url + path).status_code == 200


def test_queue_counts_sequences_and_one_request_cannot_take_it(http):
    """--max-queue 4, --max-request-seqs 2: n=3, or three prompts, is a 400; two requests of 2 fill it."""
    assert _assert_error(http.post("/v1/completions", json={"prompt": "hi", "n": 3}), 400)["param"] == "n"
    assert _assert_error(http.post("/v1/completions", json={"prompt": ["a", "b", "c"]}), 400)["param"] == "prompt"
    with http.stream("POST", "/v1/chat/completions", json=HOLD) as first, \
            http.stream("POST", "/v1/chat/completions", json=HOLD) as second:
        held = [_sse_events(first), _sse_events(second)]  # kept referenced: a collected iterator closes
        for events in held:
            next(events)
        _assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 429)
    _wait_for(lambda: http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200, 5.0)


def _abort_count(url: str) -> float:
    name = 'deepinfer:request_success_total{finished_reason="abort"}'
    line = next((x for x in httpx.get(url + "/metrics", timeout=10).text.splitlines() if x.startswith(name)), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_disconnects_count_as_abort(server, http):
    before = _abort_count(server.url)
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "n": 2, "stream": True, **LONG}) as resp:
        events = _sse_events(resp)
        next(events)
        next(events)
    _wait_for(lambda: _abort_count(server.url) == before + 2, 3.0)
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"prompt": "hi", **LONG}, timeout=httpx.Timeout(10, read=0.5))
    _wait_for(lambda: _abort_count(server.url) == before + 3, 3.0)


async def _raw_post(port: int, request: bytes) -> tuple[int, float]:
    """One HTTP/1.1 request on its own connection, with almost no client-side work: (status, seconds)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    status = int((await reader.readline()).split()[1])
    await reader.read()  # Connection: close; the server ends it after the answer
    writer.close()
    return status, time.monotonic() - t0


def test_full_queue_429s_are_fast_under_a_burst(server, http):
    """With the queue held full, 200 concurrent requests with bodies that would be costly to template and
    tokenise (900 tokens each) all get their 429 within half a second (raw sockets: the client's own work
    does not count). Templating and tokenising them first took about twice that here."""
    body = json.dumps({"messages": [{"role": "user", "content": "hello world " * 300}], "max_tokens": 2}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
               ).encode() + body

    async def burst() -> list[tuple[int, float]]:
        return await asyncio.gather(*(_raw_post(server.port, request) for _ in range(200)))

    with http.stream("POST", "/v1/chat/completions", json=HOLD) as a, \
            http.stream("POST", "/v1/chat/completions", json=HOLD) as b:
        held = [_sse_events(a), _sse_events(b)]
        for events in held:
            next(events)
        results = asyncio.run(burst())
    assert {status for status, _ in results} == {429}
    assert max(seconds for _, seconds in results) < 0.5, sorted(s for _, s in results)[-5:]


def test_drain_timeout_ends_choices_with_abort(server, http):
    """Last test: SIGTERM with --drain-timeout 1 while a stream (n=2) and a plain request still run: both
    end with finish_reason "abort" (the stream: a last chunk per choice, then [DONE]); no traceback."""
    plain: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: plain.append(
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **LONG})))
    with http.stream("POST", "/v1/chat/completions", json=HOLD) as resp:
        events = _sse_events(resp)
        next(events)
        waiter.start()
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        rest = list(events)
    waiter.join()
    assert rest[-1] == "[DONE]"
    finals = [c for e in rest[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert sorted((c["index"], c["finish_reason"]) for c in finals) == [(0, "abort"), (1, "abort")]
    assert plain[0].status_code == 200 and plain[0].json()["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(20) == 0
    assert "Traceback" not in server.log() and "internal_error" not in server.log()
