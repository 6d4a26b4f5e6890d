"""Colocated vs 1P1D under a mixed load: long prompts arriving while short requests decode.

Both setups get the same two cores' worth of engines on this machine:
- colocated: one `deepinfer serve` with OMP_NUM_THREADS=2;
- 1P1D: a `--disaggregation-mode prefill` server and a `--disaggregation-mode decode` server with one thread
  each, behind `deepinfer router --prefill URL --decode URL`, over the given transfer backend.

The load: DECODERS short requests (SHORT_PROMPT tokens, SHORT_OUTPUT tokens each) start first; LONG requests of
LONG_PROMPT tokens (LONG_OUTPUT tokens out) then arrive every LONG_EVERY_S seconds while they decode. In a
colocated engine each long prefill runs in the same steps as the decodes and stalls them; split, the decode
engine only ever sees a finished prompt's cache arrive. Reported per class: TTFT, TPOT and ITL p50/p99, and for
1P1D the transfer time per request and per MB (from the decode server's counters). Rounds alternate the setups.

    python benchmarks/disaggregation.py [--backend mooncake|dlslime|local] [--rounds 2]

writes benchmarks/results/disaggregation.json and .png (quoted by docs/disaggregation.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DECODERS, SHORT_PROMPT, SHORT_OUTPUT = 6, 16, 160
LONG, LONG_PROMPT, LONG_OUTPUT, LONG_EVERY_S, LONG_START_S = 12, 768, 16, 0.4, 0.5
ENGINE = ["--no-load-progress", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "16",
          "--max-model-len", "1024", "--block-size", "16"]
QUIET = ["--no-access-log", "--log-level", "warning"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(httpx, url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _processes(setup: str, backend: str):
    """(URL clients use, decode-side metrics URL or None), processes stopped at the end however it ends."""
    import httpx

    ports = [_free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]

    def serve(port: int, threads: int, *flags: str) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        return subprocess.Popen([sys.executable, "-m", "deepinfer", "serve", "--port", str(port), *ENGINE, *QUIET,
                                 *flags], env=env)

    if setup == "colocated":
        procs, entry, metrics = [serve(ports[0], 2)], urls[0], None
    else:
        pd = ["--disaggregation-transfer-backend", backend]
        procs = [serve(ports[1], 1, *pd, "--disaggregation-mode", "prefill"),
                 serve(ports[2], 1, *pd, "--disaggregation-mode", "decode"),
                 subprocess.Popen([sys.executable, "-m", "deepinfer", "router", "--prefill", urls[1], "--decode",
                                   urls[2], "--port", str(ports[0]), *QUIET],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})]
        entry, metrics = urls[0], urls[2]
    try:
        deadline = time.monotonic() + 180
        for url in (urls if setup != "colocated" else urls[:1]):
            while not _up(httpx, url + "/health"):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "start-up failed"
                time.sleep(0.2)
        time.sleep(3)  # let the servers' background warm-up (structured-output tables) finish
        yield entry, metrics
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def workload(seed: int) -> list[tuple[str, float, list[int], int]]:
    """(class, arrival s, prompt token ids, max tokens) of every request."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    short = [("decode", 0.05 * i, tokens(SHORT_PROMPT), SHORT_OUTPUT) for i in range(DECODERS)]
    long = [("long", LONG_START_S + LONG_EVERY_S * i, tokens(LONG_PROMPT), LONG_OUTPUT) for i in range(LONG)]
    return short + long


async def _one(http, model: str, klass: str, delay: float, prompt: list[int], max_tokens: int) -> dict:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent, times = time.perf_counter(), []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, (await r.aread())[:300]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                assert '"error"' not in line, line
                times.append(time.perf_counter())
    ttft, end = times[0] - sent, times[-1] - sent
    return {"class": klass, "ttft": ttft, "tpot": (end - ttft) / max(len(times) - 1, 1),
            "itl": [b - a for a, b in zip(times, times[1:])]}


async def run(setup: str, backend: str, seed: int) -> dict:
    import httpx

    with _processes(setup, backend) as (entry, metrics):
        async with httpx.AsyncClient(base_url=entry, timeout=600, trust_env=False) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            started = time.perf_counter()
            records = await asyncio.gather(*(_one(http, model, *r) for r in workload(seed)))
            elapsed = time.perf_counter() - started
            transfer = _transfer(httpx.get(metrics + "/metrics", trust_env=False).text) if metrics else None
    return {"setup": setup if setup == "colocated" else f"1P1D ({backend})", "elapsed_s": elapsed,
            **{k: _summary([r for r in records if r["class"] == k]) for k in ("decode", "long")},
            "transfer": transfer}


def _pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def _summary(records: list[dict]) -> dict:
    itl = [x for r in records for x in r["itl"]]
    out = {}
    for name, values in (("ttft", [r["ttft"] for r in records]), ("tpot", [r["tpot"] for r in records]),
                         ("itl", itl)):
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = 1000 * _pct(values, 50), 1000 * _pct(values, 99)
    return out


def _transfer(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("deepinfer:kv_transfer"):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    n = sums.get("deepinfer:kv_transfers_received_total", 0.0)
    mb = sums.get("deepinfer:kv_transfer_bytes_total", 0.0) / 2**20
    seconds = sums.get("deepinfer:kv_transfer_seconds_total", 0.0)
    return {"requests": n, "mb": mb, "ms_per_request": 1000 * seconds / n if n else 0.0,
            "ms_per_mb": 1000 * seconds / mb if mb else 0.0, "mb_per_request": mb / n if n else 0.0}


def plot(rounds: list[list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("decode", "tpot"), ("decode", "itl"), ("long", "ttft")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 4))
    setups = [r["setup"] for r in rounds[0]]
    for ax, (klass, name) in zip(axes, metrics):
        for j, setup in enumerate(setups):
            p50 = statistics.median(r[j][klass][f"{name}_p50_ms"] for r in rounds)
            p99 = statistics.median(r[j][klass][f"{name}_p99_ms"] for r in rounds)
            ax.bar([j * 3, j * 3 + 1], [p50, p99], color=["C0", "C1"][j], alpha=0.6 + 0.4 * (j == 0))
            ax.text(j * 3 + 0.5, max(p50, p99), setup, ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0, 1, 3, 4], ["p50", "p99", "p50", "p99"])
        ax.set_title(f"{name.upper()} of the {'decoding' if klass == 'decode' else 'long-prompt'} requests (ms)")
    fig.suptitle("colocated vs 1P1D on the same two cores (median over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mooncake", choices=("mooncake", "dlslime", "local"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rounds = []
    for i in range(args.rounds):
        results = []
        for setup in ("colocated", "pd"):
            print(f"round {i + 1}/{args.rounds}: {setup} ...", flush=True)
            results.append(asyncio.run(run(setup, args.backend, seed=i)))
            print(json.dumps(results[-1], indent=1), flush=True)
        rounds.append(results)
    RESULTS.mkdir(exist_ok=True)
    config = {"decoders": DECODERS, "short_prompt": SHORT_PROMPT, "short_output": SHORT_OUTPUT, "long": LONG,
              "long_prompt": LONG_PROMPT, "long_output": LONG_OUTPUT, "long_every_s": LONG_EVERY_S,
              "engine": ENGINE, "cpu_count": os.cpu_count()}
    (RESULTS / "disaggregation.json").write_text(json.dumps({"config": config, "rounds": rounds}, indent=1) + "\n")
    plot(rounds, RESULTS / "disaggregation.png")
    print("wrote", RESULTS / "disaggregation.json")


if __name__ == "__main__":
    main()
