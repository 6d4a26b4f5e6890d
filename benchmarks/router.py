"""Data-parallel routing: round-robin vs least-loaded vs cache-aware over 2 engine replicas of the bundled model,
on a shared-prefix multi-tenant workload, against one replica's prefix-cache hit rate.

Workload: 6 tenants, each with its own 1,024-token system prompt (64 blocks), and 8 users per tenant; each request
is its tenant's system prompt + a 24-token user turn, 16 greedy tokens. Requests arrive as a Poisson process
(--rate per second, seeded) in a random tenant order and run concurrently through ReplicatedEngineClient (the
client `deepinfer serve --data-parallel-replicas` uses); the cache-aware run is repeated through `deepinfer router`
in front of two `deepinfer serve --kv-events` processes (HTTP, streamed). Per policy: output throughput, TTFT
p50 / p99 (from submission to the first token), the prefix-cache hit rate (cached prompt tokens / prompt tokens
looked up, over both replicas) and the router's decisions. Writes benchmarks/results/router.json and router.png.

    OMP_NUM_THREADS=1 python benchmarks/router.py [--quick] [--rate R]

(one intra-op thread per engine process, so the two replicas do not oversubscribe a 2-core machine)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TENANTS, USERS, SYSTEM_TOKENS, USER_TOKENS, MAX_TOKENS = 6, 8, 1024, 24, 16
ENGINE = dict(load_progress=False, kv_cache_memory_bytes=64 * 2**20, max_num_seqs=16)
POLICIES = ("round_robin", "least_loaded", "cache_aware")
# A served engine builds its structured-output tables on a background thread once ready (about 1.6 s of CPU);
# the runs start after it, so they measure routing in steady state, not the first seconds of a start-up.
WARMUP_S = 3.0


def workload(users: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 4000) for _ in range(SYSTEM_TOKENS)] for _ in range(TENANTS)]
    requests = [systems[t] + [rng.randrange(3, 4000) for _ in range(USER_TOKENS)]
                for t in range(TENANTS) for _ in range(users)]
    rng.shuffle(requests)
    return requests


async def run_policy(replicas: int, policy: str, prompts: list[list[int]], rate: float, seed: int) -> dict:
    from deepinfer.router.policy import RouterConfig
    from deepinfer.router.replicas import ReplicatedEngineClient
    from deepinfer.sampling_params import SamplingParams

    client = await ReplicatedEngineClient.start(None, ENGINE, replicas, RouterConfig(policy))
    await asyncio.sleep(WARMUP_S)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rng = random.Random(seed)
    try:
        start = time.perf_counter()

        async def one(i: int, prompt: list[int], delay: float) -> tuple[float, int]:
            await asyncio.sleep(delay)
            sent, first, tokens = time.perf_counter(), None, 0
            async for out in client.generate(f"req{i}", prompt, params):
                first = first if first is not None else time.perf_counter()
                tokens += len(out.new_token_ids)
            return first - sent, tokens

        delays = _arrivals(rng, rate, len(prompts))
        done = await asyncio.gather(*(one(i, p, d) for i, (p, d) in enumerate(zip(prompts, delays))))
        elapsed = time.perf_counter() - start
        stats = await _settled_stats(client, replicas, len(prompts) * (SYSTEM_TOKENS + USER_TOKENS))
        ttfts = sorted(d[0] for d in done)
        return {"replicas": replicas, "policy": policy, "requests": len(prompts),
                "output_tokens_per_s": sum(d[1] for d in done) / elapsed, "elapsed_s": elapsed,
                "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
                "hit_rate": stats.prefix_hits / stats.prefix_queries, "decisions": dict(client.router_stats.decisions),
                "requests_per_replica": [client.router_stats.routed[r] for r in range(replicas)]}
    finally:
        await client.shutdown()


async def run_http(policy: str, prompts: list[list[int]], rate: float, seed: int) -> dict:
    """The same workload through `deepinfer router` in front of 2 `deepinfer serve --kv-events` processes
    (separate servers, as on separate machines): streamed /v1/completions with token-id prompts."""
    import httpx

    with _processes(policy) as (router, workers):
        async with httpx.AsyncClient(base_url=router, timeout=300, trust_env=False) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            rng = random.Random(seed)
            start = time.perf_counter()

            async def one(prompt: list[int], delay: float) -> float:
                await asyncio.sleep(delay)
                body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                sent, first = time.perf_counter(), None
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter()
                        assert '"error"' not in line, line
                return first - sent

            delays = _arrivals(rng, rate, len(prompts))
            ttfts = sorted(await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays))))
            elapsed = time.perf_counter() - start
            queried = len(prompts) * (SYSTEM_TOKENS + USER_TOKENS)
            hits, queries = await _http_hits(http, workers, queried)
            decisions = _samples((await http.get("/metrics")).text, "deepinfer:router_requests_total", "decision")
            per_worker = _samples((await http.get("/metrics")).text, "deepinfer:router_engine_requests_total",
                                  "engine")
    return {"replicas": 2, "policy": f"{policy} (HTTP router)", "requests": len(prompts),
            "output_tokens_per_s": len(prompts) * MAX_TOKENS / elapsed, "elapsed_s": elapsed,
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99), "hit_rate": hits / queries,
            "decisions": decisions, "requests_per_replica": [per_worker.get(str(i), 0) for i in range(2)]}


@contextlib.contextmanager
def _processes(policy: str):
    """(router URL, worker URLs): two servers and a router, stopped at the end however it ends."""
    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    quiet = ["--no-access-log", "--log-level", "warning"]
    ports = [_free_port() for _ in range(3)]
    workers = [f"http://127.0.0.1:{p}" for p in ports[1:]]
    engine = ["--no-load-progress", "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]),
              "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--kv-events"]
    procs = [subprocess.Popen([sys.executable, "-m", "deepinfer", "serve", "--port", str(p), *engine, *quiet],
                              env=env) for p in ports[1:]]
    procs.append(subprocess.Popen([sys.executable, "-m", "deepinfer", "router", "--workers", *workers, "--port",
                                   str(ports[0]), "--policy", policy, *quiet], env=env))
    try:
        deadline = time.monotonic() + 180
        for url in [*workers, f"http://127.0.0.1:{ports[0]}"]:
            while not _up(httpx, url + "/health"):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "start-up failed"
                time.sleep(0.2)
        time.sleep(WARMUP_S)
        yield f"http://127.0.0.1:{ports[0]}", workers
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def _up(httpx, url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _http_hits(http, workers: list[str], queried: int) -> tuple[float, float]:
    """(prefix-cache hits, queries) summed over the workers' /metrics once they reported the whole run."""
    for _ in range(200):
        texts = [(await http.get(url + "/metrics")).text for url in workers]
        hits = sum(sum(_samples(t, "deepinfer:prefix_cache_hits_total", "engine").values()) for t in texts)
        queries = sum(sum(_samples(t, "deepinfer:prefix_cache_queries_total", "engine").values()) for t in texts)
        if queries >= queried:
            return hits, queries
        await asyncio.sleep(0.05)
    raise RuntimeError("the workers did not report their stats")


def _samples(text: str, name: str, label: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels[label]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


async def _settled_stats(client, replicas: int, queried: int):
    """The replicas' stats once they all reported the whole run (they report when they go idle)."""
    for _ in range(200):
        stats = client.stats()
        if stats is not None and None not in client.engine_stats().values() and stats.prefix_queries >= queried:
            return stats
        await asyncio.sleep(0.05)
    raise RuntimeError("the replicas did not report their stats")


def _arrivals(rng: random.Random, rate: float, n: int) -> list[float]:
    """Poisson arrival times (s) of n requests, the first at 0."""
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _pct(values: list[float], p: int) -> float:
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def plot(results: list[dict], path: Path) -> None:
    from deepinfer.bench.plotting import pyplot

    plt = pyplot()
    runs = [r for r in results if r["replicas"] > 1]
    names = [r["policy"].replace("_", "_\n", 1).replace(" (", "\n(") for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    axes[0].bar(names, [r["hit_rate"] for r in runs])
    single = next(r for r in results if r["replicas"] == 1)["hit_rate"]
    axes[0].axhline(single, color="black", ls="--", lw=1, label="1 replica")
    axes[0].axhline(0.9 * single, color="tab:green", ls=":", lw=1, label="90 % of 1 replica")
    axes[0].set_ylabel("prefix-cache hit rate")
    axes[0].legend(loc="lower right")
    width = 0.38
    xs = range(len(runs))
    axes[1].bar([x - width / 2 for x in xs], [r["ttft_p50_s"] for r in runs], width, label="p50")
    axes[1].bar([x + width / 2 for x in xs], [r["ttft_p99_s"] for r in runs], width, label="p99")
    axes[1].set_xticks(list(xs), names)
    axes[1].set_ylabel("TTFT (s)")
    axes[1].legend()
    axes[2].bar(names, [r["output_tokens_per_s"] for r in runs])
    axes[2].set_ylabel("output tokens / s")
    fig.suptitle(f"2 replicas of the bundled model, {TENANTS} tenants x shared {SYSTEM_TOKENS}-token system prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="3 users per tenant instead of 8")
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second (default: 6)")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    prompts = workload(3 if ns.quick else USERS, ns.seed)
    runs = [(1, "cache_aware")] + [(2, p) for p in POLICIES] + [("http", "cache_aware")]
    results = []
    for i, (replicas, policy) in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {replicas} replica(s), {policy} ...", flush=True)
        if replicas == "http":
            r = asyncio.run(run_http(policy, prompts, ns.rate, ns.seed))
        else:
            r = asyncio.run(run_policy(replicas, policy, prompts, ns.rate, ns.seed))
        results.append(r)
        print(f"  hit rate {r['hit_rate']:.3f}  TTFT p50 {1000 * r['ttft_p50_s']:.0f} ms  p99 "
              f"{1000 * r['ttft_p99_s']:.0f} ms  {r['output_tokens_per_s']:.1f} tok/s  {r['decisions']}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = {"workload": {"tenants": TENANTS, "users_per_tenant": len(prompts) // TENANTS,
                        "system_tokens": SYSTEM_TOKENS, "user_tokens": USER_TOKENS, "max_tokens": MAX_TOKENS,
                        "rate_per_s": ns.rate, "seed": ns.seed, "engine": ENGINE}, "results": results}
    (RESULTS / "router.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(results, RESULTS / "router.png")


if __name__ == "__main__":
    main()
