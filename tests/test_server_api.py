"""API details against the real server: prefix-cache isolation (`cache_salt`, one namespace per API key),
`add_special_tokens`, and the OpenAPI document (checked by schemathesis).

Two servers, started together: `plain` (no API key, a 128-token context so any generation is short) and
`tenants` (two API keys, --prefix-cache-isolation key). Cache hits are read from /metrics, as in
tests/test_server.py; every test uses prompts of its own so the cache state of another cannot leak in.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from test_server import ServerProcess, _wait_for, metrics, tiny_checkpoint

from deepinfer import LLM, SamplingParams

CONTEXT = 128
ALICE, BOB = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
HITS, QUERIES = "deepinfer:prefix_cache_hits_total", "deepinfer:prefix_cache_queries_total"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    """Both start together (their start-up overlaps); each test waits for the one it uses."""
    logs = tmp_path_factory.mktemp("api-logs")
    context = ("--max-model-len", str(CONTEXT), "--max-n", "2")
    started = {"plain": ServerProcess(ckpt, logs / "plain.log", *context),
               "tenants": ServerProcess(ckpt, logs / "tenants.log", *context, "--api-key", "alice",
                                        "--api-key", "bob", "--prefix-cache-isolation", "key")}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def plain(servers):
    return servers["plain"].wait_ready()


@pytest.fixture(scope="module")
def tenants(servers):
    return servers["tenants"].wait_ready()


def _post(server: ServerProcess, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def hits_of(server: ServerProcess, path: str, body: dict, headers: dict | None = None) -> float:
    """Prefix-cache hits (prompt tokens) that one greedy 1-token request adds to /metrics. The engine counts a
    request's lookup and its hits together, so once the lookup shows (stats come every 0.25 s while busy and
    when it becomes idle), so do the hits."""
    before = metrics(server.url)
    resp = _post(server, path, {**body, "max_tokens": 1, "temperature": 0}, headers)
    assert resp.status_code == 200, resp.text
    _wait_for(lambda: metrics(server.url)[QUERIES] > before[QUERIES], 5.0)
    return metrics(server.url)[HITS] - before[HITS]


def _completion(prompt: list[int], salt: str | None = None) -> dict:
    return {"prompt": prompt, **({"cache_salt": salt} if salt is not None else {})}


# --- cache_salt ------------------------------------------------------------------------------------
def test_cache_salt_separates_cached_prefixes(plain):
    """Only requests with the same salt share cached blocks; no salt is a namespace of its own."""
    prompt = list(range(100, 180))  # five full 16-token blocks
    assert hits_of(plain, "/v1/completions", _completion(prompt, "tenant-a")) == 0
    assert hits_of(plain, "/v1/completions", _completion(prompt, "tenant-b")) == 0
    assert hits_of(plain, "/v1/completions", _completion(prompt)) == 0
    assert hits_of(plain, "/v1/completions", _completion(prompt, "tenant-a")) >= 64
    assert hits_of(plain, "/v1/completions", _completion(prompt, "tenant-b")) >= 64
    assert hits_of(plain, "/v1/completions", _completion(prompt)) >= 64


def test_cache_salt_on_chat(plain):
    messages = [{"role": "user", "content": "a salted conversation, long enough for a few blocks " * 2}]
    assert httpx.post(plain.url + "/tokenize", json={"messages": messages}).json()["count"] >= 48
    assert hits_of(plain, "/v1/chat/completions", {"messages": messages, "cache_salt": "x"}) == 0
    assert hits_of(plain, "/v1/chat/completions", {"messages": messages, "cache_salt": "y"}) == 0
    assert hits_of(plain, "/v1/chat/completions", {"messages": messages, "cache_salt": "x"}) >= 32


@pytest.mark.parametrize("salt", ["", 7])
def test_cache_salt_must_be_a_non_empty_string(plain, salt):
    resp = _post(plain, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text


# --- one prefix namespace per API key --------------------------------------------------------------
def test_api_keys_do_not_share_cached_prefixes(tenants):
    prompt = list(range(200, 280))
    assert hits_of(tenants, "/v1/completions", _completion(prompt), ALICE) == 0
    assert hits_of(tenants, "/v1/completions", _completion(prompt), BOB) == 0
    assert hits_of(tenants, "/v1/completions", _completion(prompt), ALICE) >= 64
    assert hits_of(tenants, "/v1/completions", _completion(prompt), BOB) >= 64


def test_a_salt_stays_inside_its_key(tenants):
    """Under isolation a request's own salt subdivides its key's namespace; equal salts of two keys stay apart."""
    prompt = list(range(300, 380))
    assert hits_of(tenants, "/v1/completions", _completion(prompt, "s"), ALICE) == 0
    assert hits_of(tenants, "/v1/completions", _completion(prompt, "s"), BOB) == 0
    assert hits_of(tenants, "/v1/completions", _completion(prompt, "t"), ALICE) == 0
    assert hits_of(tenants, "/v1/completions", _completion(prompt, "s"), ALICE) >= 64


def test_every_key_is_accepted_and_others_are_not(tenants):
    body = {"prompt": "hi", "max_tokens": 1}
    assert _post(tenants, "/v1/completions", body, ALICE).status_code == 200
    assert _post(tenants, "/v1/completions", body, BOB).status_code == 200
    assert _post(tenants, "/v1/completions", body, {"Authorization": "Bearer carol"}).status_code == 401
    assert _post(tenants, "/v1/completions", body).status_code == 401


def test_isolation_flags(monkeypatch, tmp_path):
    from deepinfer import cli
    from deepinfer.server import launch

    monkeypatch.delenv("DEEPINFER_API_KEY", raising=False)
    args = cli.build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b",
                                          "--prefix-cache-isolation", "key"])
    settings = launch.settings_from(args, tmp_path, bundled=False)
    assert (settings.api_keys, settings.prefix_cache_isolation) == (("a", "b"), "key")
    assert launch.settings_from(cli.build_parser().parse_args(["serve"]), tmp_path, False).api_keys == ()
    with pytest.raises(ValueError, match="needs at least one --api-key"):
        launch.settings_from(cli.build_parser().parse_args(["serve", "--prefix-cache-isolation", "key"]),
                             tmp_path, bundled=False)


# --- add_special_tokens ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, block_size=16, max_model_len=CONTEXT, kv_cache_memory_bytes=16 * 2**20, load_progress=False)


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.parametrize("bos", [True, False])
def test_echo_prompt_logprobs_equal_offline_prompt_logprobs(plain, offline, bos):
    """lm-eval's log-likelihood request: echo + logprobs + max_tokens 1 scores the prompt exactly as the
    offline API does for the same token ids, with BOS and (add_special_tokens false) without it."""
    text = "The answer is: blue"
    body = {"prompt": text, "echo": True, "logprobs": 3, "max_tokens": 1, "temperature": 0,
            "return_tokens_as_token_ids": True, **({} if bos else {"add_special_tokens": False})}
    resp = _post(plain, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    ids = _ids(lp["tokens"])[:-1]  # the prompt's tokens; the last one was generated
    tokenizer = offline.get_tokenizer()
    assert ids == tokenizer.encode(text, add_special_tokens=bos)
    assert (ids[0] == tokenizer.bos_token_id) == bos
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)
    ref = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3),
                           use_tqdm=False)[0].prompt_logprobs
    assert lp["token_logprobs"][0] is None and ref[0] is None and len(ref) == len(ids)
    for got, top, want, token in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], ref[1:], ids[1:]):
        assert got == pytest.approx(want[token].logprob, abs=1e-4)
        assert dict(zip(_ids(list(top)), top.values())) == pytest.approx(
            {t: entry.logprob for t, entry in want.items()}, abs=1e-4)


def test_add_special_tokens_on_chat(plain):
    """Chat prompts get BOS from the chat template; add_special_tokens (default false) adds the tokenizer's too."""
    messages = [{"role": "user", "content": "hello"}]
    templated = httpx.post(plain.url + "/tokenize", json={"messages": messages}).json()["count"]

    def prompt_tokens(**extra) -> int:
        resp = _post(plain, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens"]

    assert prompt_tokens() == prompt_tokens(add_special_tokens=False) == templated
    assert prompt_tokens(add_special_tokens=True) == templated + 1


def test_add_special_tokens_leaves_token_id_prompts_alone(plain):
    for flag in (True, False):
        resp = _post(plain, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1, "add_special_tokens": flag})
        assert resp.json()["usage"]["prompt_tokens"] == 3, resp.text


# --- the OpenAPI document --------------------------------------------------------------------------
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
              ("GET", "/health"), ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("POST", "/reset_prefix_cache"), ("GET", "/version"), ("GET", "/router/state"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("DELETE", "/v1/responses/{response_id}"), ("POST", "/v1/messages")]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
EXAMPLES = 12
MAX_TOKENS = 4  # generated bodies are capped here, so every accepted generation is quick


@pytest.fixture(scope="module")
def document(plain):
    return httpx.get(plain.url + "/openapi.json", timeout=30).json()


def _responses(document: dict, method: str, path: str) -> dict:
    return document["paths"][path][method.lower()]["responses"]


def test_openapi_documents_the_statuses_the_server_answers(document):
    assert {(m.upper(), p) for p, item in document["paths"].items() for m in item} == set(OPERATIONS)
    for method, path in OPERATIONS:
        responses = _responses(document, method, path)
        assert "422" not in responses, path  # validation errors are answered 400
        assert "schema" in responses["200"]["content"].get("application/json", {"schema": 0}), path
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(_responses(document, "POST", path))
    assert "HTTPValidationError" not in document["components"]["schemas"]
    error = document["components"]["schemas"]["ErrorInfo"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_openapi_declares_metrics_as_prometheus_text(document, plain):
    assert set(_responses(document, "GET", "/metrics")["200"]["content"]) == {"text/plain"}
    assert httpx.get(plain.url + "/metrics").headers["content-type"].startswith("text/plain")


def _quick(case):
    """Caps the output length of a generated generation request (other fields stay as generated)."""
    if case.operation.path.startswith("/v1/") and isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value > MAX_TOKENS:
                case.body[key] = MAX_TOKENS
    return case


@pytest.fixture(scope="module")
def api_schema(plain, document):
    return schemathesis.openapi.from_dict(document)


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_responses_conform_to_the_openapi_document(api_schema, plain, method, path):
    """A bounded, derandomized schemathesis run per operation: schema-valid requests never get a 5xx, and every
    answer (status, content type, headers, body) is one the document describes."""

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=api_schema[path][method].as_strategy().map(_quick))
    def conforms(case):
        case.call_and_validate(base_url=plain.url, checks=CHECKS, timeout=30)

    conforms()


def test_error_answers_conform_to_the_openapi_document(api_schema, tenants):
    """401 (the tenants server has keys) and 404 bodies, validated against the document."""
    operation = api_schema["/v1/completions"]["POST"]
    for headers, body, status in [({}, {"prompt": "hi"}, 401), (ALICE, {"prompt": "hi", "model": "nope"}, 404)]:
        case = operation.Case(body={**body, "max_tokens": 1}, headers=headers)
        response = case.call(base_url=tenants.url, timeout=30)
        assert response.status_code == status
        case.validate_response(response, checks=CHECKS)
