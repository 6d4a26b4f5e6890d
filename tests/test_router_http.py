"""`deepinfer router --workers URL ...` in front of separate `deepinfer serve --kv-events` processes (bundled model,
API keys on), through the official `openai` client: answers identical to one server's (streaming, n, tools,
structured outputs), the cache-aware policy keeping one server's prefix-cache hit rate where round-robin loses
it, cancellation reaching the worker, and a killed or hung worker losing only its own in-flight requests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_server import SERVER_ENV, ServerProcess, _engine_sums, _get_status, _wait_for, free_port

from deepinfer.llm import default_model_path

KEY = "sk-router-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WORKER_FLAGS = ("--kv-events", "--api-key", KEY, "--served-model-name", "m")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}]


class RouterProcess:
    """`python -m deepinfer router` in a subprocess, logging to a file."""

    def __init__(self, workers, log, *flags: str, pools: list[str] | None = None):
        self.port, self.log_path = free_port(), log
        pools = pools or ["--workers", *(w.url for w in workers)]  # or e.g. --prefill URL --decode URL
        cmd = [sys.executable, "-m", "deepinfer", "router", *pools, "--port", str(self.port),
               "--api-key", KEY, "--log-level", "warning", "--no-access-log", *flags]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> RouterProcess:
        deadline = time.monotonic() + timeout
        while _get_status(self.url + "/health") != 200:
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, self.log_path.read_text()
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def running_router(workers, log, *flags: str):
    router = RouterProcess(workers, log, *flags)
    try:
        yield router.wait_ready()
    finally:
        router.stop()


@contextlib.contextmanager
def running_workers(logs, count: int):
    workers = [ServerProcess(default_model_path(), logs / f"worker{i}.log", *WORKER_FLAGS) for i in range(count)]
    try:
        for w in workers:
            w.wait_ready()
        yield workers  # the caller may replace one (a restart): whatever is in the list is stopped
    finally:
        for w in workers:
            w.stop()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    with running_workers(tmp_path_factory.mktemp("router-workers"), 2) as started:
        yield started


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    with running_router(workers, tmp_path_factory.mktemp("router") / "router.log") as started:
        yield started


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _answers(url: str) -> list:
    """Completions and chats covering streaming, n, seeded sampling, forced tool calls and a JSON schema."""
    c = _client(url)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    chat = dict(model="m", max_tokens=48, temperature=0)
    return [
        c.completions.create(model="m", prompt="The capital of France is", max_tokens=12, temperature=0)
        .choices[0].text,
        "".join(e.choices[0].text for e in c.completions.create(model="m", prompt="Once upon a time", max_tokens=12,
                                                                temperature=0, stream=True)),
        [x.text for x in c.completions.create(model="m", prompt="Roses are", max_tokens=8, n=3, temperature=0.9,
                                              seed=11).choices],
        [t.function.model_dump() for t in c.chat.completions.create(
            messages=[{"role": "user", "content": "Add 2 and 3"}], tools=TOOLS, tool_choice="required",
            **chat).choices[0].message.tool_calls],
        c.chat.completions.create(messages=[{"role": "user", "content": "Answer in JSON"}], response_format=fmt,
                                  **chat).choices[0].message.content,
    ]


def test_router_answers_exactly_as_one_server(router, workers):
    got, want = _answers(router.url), _answers(workers[0].url)
    assert got == want
    assert json.loads(got[-1]) in ({"ok": True}, {"ok": False}) and got[3][0]["name"] == "add"
    assert [m.id for m in _client(router.url).models.list().data] == ["m"]
    no_key = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "hi"})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    bad = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "hi", "temperature": -1},
                     headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["message"]  # the worker's own 400, passed through


def _workload() -> list[tuple[str, str]]:
    """3 tenants (system prompts of ~10 blocks) x 4 users, tenants interleaved: (system, user)."""
    topics = ["astronomy", "cooking", "sailing"]
    systems = [f"You are an expert on {t}. " + " ".join(f"Rule {i}: always explain {t} step {i} clearly."
                                                       for i in range(12)) for t in topics]
    return [(systems[t], f"User {u} asks question {u * 7 + t}.") for u in range(4) for t in range(3)]


def _hit_rate(route_url: str, workers) -> float:
    """Prefix-cache hits / queries the workload adds over the workers, sent to `route_url` one at a time."""
    for w in workers:
        assert httpx.post(w.url + "/reset_prefix_cache", headers=AUTH).status_code == 200
    before = [_engine_sums(httpx.get(w.url + "/metrics").text) for w in workers]
    client = _client(route_url)
    for system, user in _workload():
        client.chat.completions.create(model="m", messages=[{"role": "system", "content": system},
                                                            {"role": "user", "content": user}],
                                       max_tokens=2, temperature=0)

    def delta(name: str) -> float:
        return sum(_engine_sums(httpx.get(w.url + "/metrics").text)[name] - b[name] for w, b in zip(workers, before))

    queries = "deepinfer:prefix_cache_queries_total"
    _wait_for(lambda: delta(queries) > 0 and all(_engine_sums(httpx.get(w.url + "/metrics").text)[
        "deepinfer:num_requests_running"] == 0 for w in workers), 5.0)
    time.sleep(0.5)  # the engines' idle stats report
    return delta("deepinfer:prefix_cache_hits_total") / delta(queries)


@pytest.mark.slow  # the default run measures the hit rates with --data-parallel-replicas (test_router_replicas)
def test_cache_aware_routing_keeps_one_servers_hit_rate(workers, tmp_path):
    single = _hit_rate(workers[0].url, workers[:1])
    rates = {}
    for policy in ("cache_aware", "round_robin"):
        with running_router(workers, tmp_path / f"{policy}.log", "--policy", policy) as router:
            rates[policy] = _hit_rate(router.url, workers)
            metrics = httpx.get(router.url + "/metrics").text
    assert rates["cache_aware"] >= 0.9 * single, (single, rates)
    assert rates["round_robin"] < rates["cache_aware"] - 0.1, (single, rates)
    assert 'deepinfer:router_requests_total{decision="round_robin"} 12.0' in metrics


def _idle(router, workers) -> bool:
    metrics = httpx.get(router.url + "/metrics").text
    return (all(httpx.get(w.url + "/router/state", headers=AUTH).json()["num_requests"] == 0 for w in workers)
            and all(f'deepinfer:router_engine_load_tokens{{engine="{e}"}} 0.0' in metrics for e in (0, 1)))


def test_a_client_that_leaves_aborts_the_request_on_its_worker(router, workers):
    """Streamed (closed after the first event) and not (the client times out): the worker aborts, the
    router releases the load, and no connection to the worker is left open."""
    body = {"model": "m", "prompt": "Count slowly:", "max_tokens": 1000, "ignore_eos": True}
    for _ in range(2):
        with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")
        _wait_for(lambda: _idle(router, workers), 3.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
    _wait_for(lambda: _idle(router, workers), 3.0)


def _stream(url: str, prompt: str, events: list, max_tokens: int = 300) -> tuple[int, str]:
    """(engine, how the stream ended: "length" | "replica_lost"); each event's arrival is appended to events."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        engine = int(r.headers["x-deepinfer-engine"])
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            events.append(engine)
            if "error" in event:
                return engine, event["error"]["code"]
            if event["choices"][0]["finish_reason"]:
                return engine, event["choices"][0]["finish_reason"]
    return engine, "cut"


def _signal_server(server: ServerProcess, sig: int) -> None:
    """The server and its engine process."""
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in [server.proc.pid, *map(int, children)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _healthy(router, engine: int) -> bool:
    return f'deepinfer:router_engine_healthy{{engine="{engine}"}} 1.0' in httpx.get(router.url + "/metrics").text


@pytest.mark.slow  # the in-process replicas' kill test (test_router_replicas.py) runs by default
def test_lost_workers_lose_only_their_own_requests_and_rejoin(tmp_path):
    """Kill worker 1 mid-load: its streams end with replica_lost, worker 0's complete, it leaves rotation
    within 2 s and rejoins when restarted. Hang it (SIGSTOP): a request routed to it before the router
    noticed is retried on worker 0; SIGCONT brings it back."""
    with running_workers(tmp_path, 2) as workers, running_router(workers, tmp_path / "router.log") as router:
        events: list[int] = []
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(_stream, router.url, f"Story number {i}:", events) for i in range(4)]
            _wait_for(lambda: set(events) == {0, 1}, 30.0)  # both workers are streaming
            _signal_server(workers[1], signal.SIGKILL)
            killed = time.monotonic()
            _wait_for(lambda: not _healthy(router, 1), 2.0)
            left = time.monotonic() - killed
            ends = [s.result() for s in streams]
        assert left < 2.0
        assert {end for engine, end in ends if engine == 1} == {"replica_lost"}
        assert {end for engine, end in ends if engine == 0} == {"length"}
        served = _client(router.url).completions.create(model="m", prompt="Still there?", max_tokens=4)
        assert served.choices[0].finish_reason == "length"

        workers[1] = ServerProcess(default_model_path(), tmp_path / "restarted.log", *WORKER_FLAGS,
                                   port=workers[1].port).wait_ready()
        _wait_for(lambda: _healthy(router, 1), 2.0)

        prompt = "A prompt cached on worker 1 only. " * 6
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(_stream, router.url, "Keep worker 0 busy:", events := [])
            _wait_for(lambda: events, 30.0)  # worker 0 (the lower index, both idle) streams: 1 is the least loaded
            r = httpx.post(router.url + "/v1/completions", headers=AUTH,
                           json={"model": "m", "prompt": prompt, "max_tokens": 1})
            assert events[0] == 0 and r.headers["x-deepinfer-engine"] == "1"
            assert busy.result() == (0, "length")
        time.sleep(0.2)  # its stored events reach the router
        _signal_server(workers[1], signal.SIGSTOP)
        try:
            start = time.monotonic()
            retried = httpx.post(router.url + "/v1/completions", headers=AUTH, timeout=30,
                                 json={"model": "m", "prompt": prompt + "and more", "max_tokens": 2})
            took = time.monotonic() - start
            assert retried.status_code == 200 and retried.headers["x-deepinfer-engine"] == "0"
            assert took < 2.5 and not _healthy(router, 1)
            assert "deepinfer:router_retries_total 1.0" in httpx.get(router.url + "/metrics").text
        finally:
            _signal_server(workers[1], signal.SIGCONT)
        _wait_for(lambda: _healthy(router, 1), 2.0)
