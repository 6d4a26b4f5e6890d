"""`deepinfer bench serve`: load-test a running OpenAI-compatible server (vLLM-style serving benchmark).

Each request is sent at its arrival offset (``datasets.arrival_times``), at most ``max_concurrency`` at a time,
as a streaming request with temperature 0 and (unless ``--no-ignore-eos``) ``ignore_eos``, so every request
generates exactly its ``output_len`` tokens. Timing follows ``deepinfer.bench.metrics``: TTFT is the first
chunk carrying output, every later output chunk adds one ITL gap (a chunk may carry several tokens, so a
request can have fewer than ``output_tokens - 1`` gaps), and token counts come from the final ``usage`` chunk.

Random and shared-prefix prompts are token ids drawn from ``[0, --vocab-size)``; the server's vocabulary
size is not exposed by the API, so the default 256 is deliberately small (safe for any model, including
the tiny test models) and should be raised to the real vocabulary for realistic prompts.
The chat endpoint needs text, so it (and ``--dataset sharegpt`` and ``--prompt-format text``, which sends
completions prompts as text for servers that take no token ids) needs ``--tokenizer``. When the server exports
vLLM-named speculative-decoding counters at ``/metrics``, the run's accepted length is reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import httpx
from tqdm import tqdm

from deepinfer.bench.datasets import (
    BenchRequest,
    arrival_times,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)
from deepinfer.bench.machine import machine_facts
from deepinfer.bench.metrics import (
    SLO_KEYS,
    SPEC_COUNTERS,
    SPEC_PER_POSITION,
    BenchSummary,
    RequestRecord,
    spec_decode_delta,
    summarize,
    tpot,
)
from deepinfer.bench.plotting import pyplot

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DEFAULT_BASE_URL = "http://127.0.0.1:8000"


# --- one request ---------------------------------------------------------------------------------
def build_payload(model: str, endpoint: str, request: BenchRequest, text: str | None, ignore_eos: bool = True) -> dict:
    """The JSON body of one streaming, greedy request (fixed-length with ``ignore_eos``, a vLLM extension that
    some servers reject). A completions prompt is sent as ``text`` when given, else as token ids."""
    body = {"model": model, "max_tokens": request.output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text if text is not None else list(request.prompt_token_ids)
    return body


def _has_output(chunk: dict) -> bool:
    """True when a chunk carries generated output (chat's opening role-only chunk does not)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def _sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line, or None for any other line."""
    return line[5:].strip() if line.startswith("data:") else None


class _StreamState:
    """Times of the output chunks of one stream and its usage, relative to ``perf_counter``."""

    def __init__(self, sent: float):
        self.sent, self.chunk_times, self.usage = sent, [], None

    def feed(self, chunk: dict) -> None:
        if "error" in chunk:
            raise RuntimeError(f"server error: {chunk['error']}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if _has_output(chunk):
            self.chunk_times.append(time.perf_counter())

    def record(self, start: float) -> RequestRecord:
        if not self.chunk_times:
            raise RuntimeError("the stream ended without output")
        times, usage = self.chunk_times, self.usage or {}
        return RequestRecord(start=start, ttft=times[0] - self.sent,
                             itl=[b - a for a, b in zip(times, times[1:])], latency=times[-1] - self.sent,
                             prompt_tokens=int(usage.get("prompt_tokens", 0)),
                             output_tokens=int(usage.get("completion_tokens", len(times))))


async def _stream(client: httpx.AsyncClient, url: str, payload: dict, state: _StreamState) -> None:
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code}: {body[:500]}")
        async for line in response.aiter_lines():
            data = _sse_data(line)
            if data == "[DONE]":
                break
            if data:
                state.feed(json.loads(data))


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, bench_start: float) -> RequestRecord:
    """One streamed request; any failure becomes a record with ``success=False`` and the message."""
    sent = time.perf_counter()
    state = _StreamState(sent)
    try:
        await _stream(client, url, payload, state)
        return state.record(sent - bench_start)
    except Exception as e:  # noqa: BLE001 - every failure is a benchmark result, never a crash
        return RequestRecord(start=sent - bench_start, ttft=None, latency=time.perf_counter() - sent,
                             success=False, error=f"{type(e).__name__}: {e}")


# --- the run -------------------------------------------------------------------------------------
def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _check_inputs(endpoint, requests, arrivals, prompt_text) -> None:
    if endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {endpoint!r}")
    if len(arrivals) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    if endpoint == "chat" and (prompt_text is None or len(prompt_text) != len(requests)):
        raise ValueError("the chat endpoint needs prompt_text (one text per request); use --tokenizer")


async def run_benchmark(
    base_url: str,
    model: str,
    endpoint: str,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    max_concurrency: int | None = None,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    prompt_text: Sequence[str] | None = None,
    progress: bool = True,
    ignore_eos: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival offset; returns the records (in request order) and the duration (s)."""
    _check_inputs(endpoint, requests, arrivals, prompt_text)
    url = base_url.rstrip("/") + ENDPOINT_PATHS[endpoint]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=None)
    bar = tqdm(total=len(requests), desc="requests", disable=not progress)
    async with httpx.AsyncClient(headers=_headers(api_key), timeout=timeout_s, limits=limits,
                                 trust_env=False) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            text = prompt_text[i] if prompt_text else None
            payload = build_payload(model, endpoint, requests[i], text, ignore_eos)
            async with sem or contextlib.nullcontext():
                record = await send_request(client, url, payload, start)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


def scrape_spec_counters(base_url: str, api_key: str | None) -> dict[str, float]:
    """Speculative-decoding counters from the server's Prometheus ``/metrics`` ({} when it exports none)."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=_headers(api_key), timeout=10,
                             trust_env=False)
    except httpx.HTTPError:
        return {}
    return spec_counter_samples(response.text) if response.status_code == 200 else {}


def spec_counter_samples(text: str) -> dict[str, float]:
    """``name`` / ``SPEC_PER_POSITION:i`` -> value, summed over other labels; any name prefix (``vllm:``,
    ``deepinfer:``) and the ``_total`` suffix are ignored, so either engine's counters are read."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError:
        return {}
    for sample in samples:
        name = sample.name.rsplit(":", 1)[-1].removesuffix("_total")
        if name == SPEC_PER_POSITION:
            name = f"{name}:{sample.labels.get('position', '0')}"
        elif name not in SPEC_COUNTERS:
            continue
        out[name] = out.get(name, 0.0) + sample.value
    return out


# --- option parsing ------------------------------------------------------------------------------
def parse_goodput(items: Sequence[str] | None) -> dict[str, float] | None:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    if not items:
        return None
    slos = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput expects KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput value must be a number of ms, got {item!r}") from None
    return slos


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--percentiles expects comma-separated numbers, got {text!r}") from None
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--percentiles must be in [0, 100], got {text!r}")
    return values


def fetch_model(base_url: str, api_key: str | None) -> str:
    """The first model id the server lists at ``GET /v1/models``."""
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key), timeout=30,
                         trust_env=False)
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url} lists no models; give --model")
    return data[0]["id"]


# --- datasets ------------------------------------------------------------------------------------
def load_tokenizer(path: str | None):
    if path is None:
        return None
    from deepinfer.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)


def _shared_prefix(args: argparse.Namespace, n: int) -> list[BenchRequest]:
    per_group = math.ceil(n / args.num_groups)
    reqs = shared_prefix_requests(args.num_groups, per_group, args.prefix_len, args.random_input_len,
                                  args.random_output_len, vocab_size=args.vocab_size, seed=args.seed)
    return reqs[:n]


def build_requests(args: argparse.Namespace, n: int, tokenizer) -> list[BenchRequest]:
    """``n`` requests of the chosen dataset."""
    if args.dataset == "random":
        return random_requests(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                               vocab_size=args.vocab_size, seed=args.seed)
    if args.dataset == "shared-prefix":
        return _shared_prefix(args, n)
    if args.dataset_path is None or tokenizer is None:
        raise ValueError("--dataset sharegpt needs --dataset-path and --tokenizer")
    return sharegpt_requests(args.dataset_path, n, args.seed, tokenizer.encode)


def _texts(tokenizer, requests: Sequence[BenchRequest], args: argparse.Namespace) -> list[str] | None:
    """Prompt texts for the chat endpoint and for ``--prompt-format text``; None sends token ids."""
    if args.endpoint != "chat" and args.prompt_format != "text":
        return None
    if tokenizer is None:
        raise ValueError("--endpoint chat and --prompt-format text need --tokenizer (prompts are sent as text)")
    return [tokenizer.decode(r.prompt_token_ids) for r in requests]


# --- outputs -------------------------------------------------------------------------------------
def write_result_json(path: str, summary: BenchSummary, records: Sequence[RequestRecord], config: dict) -> None:
    out = {"config": config, "machine": machine_facts(), "summary": summary.to_dict(),
           "requests": [asdict(r) for r in records]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2), encoding="utf-8")


def _cdf(ax, values_ms: list[float], title: str) -> None:
    xs = sorted(values_ms)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
    ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(True, alpha=0.3)


def write_plots(directory: str, records: Sequence[RequestRecord]) -> list[Path]:
    """TTFT CDF, TPOT CDF and ITL histogram of the successful records, one PNG each."""
    plt = pyplot()

    ok = [r for r in records if r.success]
    series = {"ttft_cdf": [r.ttft * 1e3 for r in ok], "tpot_cdf": [t * 1e3 for t in map(tpot, ok) if t is not None],
              "itl_hist": [g * 1e3 for r in ok for g in r.itl]}
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, values in series.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw(ax, name, values)
        paths.append(out_dir / f"{name}.png")
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def _draw(ax, name: str, values: list[float]) -> None:
    title = {"ttft_cdf": "TTFT CDF", "tpot_cdf": "TPOT CDF", "itl_hist": "ITL histogram"}[name]
    if not values:
        ax.set_title(f"{title} (no data)")
    elif name == "itl_hist":
        ax.hist(values, bins=min(50, max(5, len(values) // 4)))
        ax.set(title=title, xlabel="ms", ylabel="gaps")
    else:
        _cdf(ax, values, title)


# --- entry point ---------------------------------------------------------------------------------
def _run(args, model, requests, arrivals, texts) -> tuple[list[RequestRecord], float]:
    return asyncio.run(run_benchmark(args.base_url, model, args.endpoint, requests, arrivals,
                                     args.max_concurrency, args.api_key, args.timeout, texts,
                                     progress=not args.no_progress, ignore_eos=args.ignore_eos))


def _warmup(args, model, requests, tokenizer) -> None:
    if args.warmup <= 0 or not requests:
        return
    warm = [requests[i % len(requests)] for i in range(args.warmup)]
    records, _ = _run(args, model, warm, [0.0] * len(warm), _texts(tokenizer, warm, args))
    failed = [r.error for r in records if not r.success]
    if failed:
        raise ValueError(f"{len(failed)} warm-up request(s) failed, first: {failed[0]}")


def check_serve_args(args: argparse.Namespace) -> None:
    """Option values argparse cannot check on its own; raises ValueError naming the bad one."""
    parse_goodput(args.goodput)
    parse_percentiles(args.percentiles)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.vocab_size < 1 or args.num_groups < 1 or args.warmup < 0:
        raise ValueError("--vocab-size and --num-groups must be >= 1, --warmup >= 0")


def run_serve_point(args: argparse.Namespace, model: str, tokenizer) -> tuple[BenchSummary, list[RequestRecord]]:
    """One benchmark run with the options in ``args`` (warm-up excluded); the summary and every record."""
    goodput, percentiles = parse_goodput(args.goodput), parse_percentiles(args.percentiles)
    requests = build_requests(args, args.num_prompts, tokenizer)
    if not requests:
        raise ValueError("the dataset produced no requests")
    arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, seed=args.seed)
    texts = _texts(tokenizer, requests, args)
    _warmup(args, model, requests, tokenizer)
    before = scrape_spec_counters(args.base_url, args.api_key)
    records, duration = _run(args, model, requests, arrivals, texts)
    spec = spec_decode_delta(before, scrape_spec_counters(args.base_url, args.api_key))
    summary = summarize(records, duration, percentiles, goodput, args.price_per_hour)
    return dataclasses.replace(summary, spec_decode=spec), records


def main_serve(args: argparse.Namespace) -> int:
    """`deepinfer bench serve`: run the benchmark, print the summary table, write the optional outputs."""
    check_serve_args(args)
    tokenizer = load_tokenizer(args.tokenizer)
    model = args.model or fetch_model(args.base_url, args.api_key)
    summary, records = run_serve_point(args, model, tokenizer)
    print(summary.format_table(), flush=True)
    if args.result_json:
        write_result_json(args.result_json, summary, records, run_config(args, model))
    if args.plot:
        write_plots(args.plot, records)
    return 0


def run_config(args: argparse.Namespace, model: str) -> dict:
    skip = {"handler", "api_key", "command", "bench_command"}
    config = {k: v for k, v in vars(args).items() if k not in skip}
    config["model"] = model
    config["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate
    return config


def add_serve_args(sub: argparse.ArgumentParser, run_outputs: bool = True) -> None:
    """The options of `deepinfer bench serve` (`run_outputs`: with --result-json and --plot)."""
    sub.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server root URL (default: %(default)s)")
    sub.add_argument("--model", help="model name to request (default: the first id of GET /v1/models)")
    sub.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions",
                     help="completions sends token ids; chat sends text and needs --tokenizer (default: %(default)s)")
    sub.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    sub.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory (for sharegpt and chat)")
    sub.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                     help="completions prompts as token ids or as text decoded with --tokenizer (for servers that "
                          "take only text, e.g. `transformers serve`; default: %(default)s)")
    sub.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                     help="ask for exactly --random-output-len tokens (a vLLM extension; default: on)")
    sub.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in s (default: %(default)s)")
    _add_dataset_args(sub)
    _add_load_args(sub)
    _add_report_args(sub, run_outputs)


def _add_dataset_args(sub: argparse.ArgumentParser) -> None:
    g = sub.add_argument_group("dataset")
    g.add_argument("--dataset", choices=("random", "shared-prefix", "sharegpt"), default="random")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to measure (default: %(default)s)")
    g.add_argument("--random-input-len", type=int, default=1024, help="prompt (suffix) length (default: %(default)s)")
    g.add_argument("--random-output-len", type=int, default=128, help="tokens to generate (default: %(default)s)")
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="length spread r in [0, 1) (random only)")
    g.add_argument("--prefix-len", type=int, default=256, help="shared prefix length (default: %(default)s)")
    g.add_argument("--num-groups", type=int, default=4, help="shared-prefix groups (default: %(default)s)")
    g.add_argument("--dataset-path", metavar="PATH", help="ShareGPT JSON file")
    g.add_argument("--vocab-size", type=int, default=256,
                   help="random token ids are drawn from [0, N); the API does not expose the model's vocabulary, "
                        "so the default is small enough for any model (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="dataset and arrival seed (default: %(default)s)")


def _add_load_args(sub: argparse.ArgumentParser) -> None:
    g = sub.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second; inf sends all at once (default: %(default)s)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, help="most requests in flight (default: unlimited)")
    g.add_argument("--warmup", type=int, default=0, help="requests sent first and left out of the results")


def _add_report_args(sub: argparse.ArgumentParser, run_outputs: bool) -> None:
    g = sub.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    g.add_argument("--price-per-hour", type=float, help="machine price; reports cost per 1M output tokens")
    g.add_argument("--percentiles", default="50,95,99", help="comma-separated (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    if run_outputs:
        g.add_argument("--result-json", metavar="PATH", help="write the summary and every request record here")
        g.add_argument("--plot", metavar="DIR", help="write TTFT/TPOT CDF and ITL histogram PNGs here")
