"""Data-parallel routing: round-robin vs least-loaded vs cache-aware over 2 engine replicas of the bundled model,
on a shared-prefix multi-tenant workload, against one replica's prefix-cache hit rate.

Workload: 6 tenants, each with its own 1,024-token system prompt (64 blocks), and 8 users per tenant; each request
is its tenant's system prompt + a 24-token user turn, 16 greedy tokens. Requests arrive as a Poisson process
(--rate per second, seeded) in a random tenant order and run concurrently through ReplicatedEngineClient (the
client `deepinfer serve --data-parallel-replicas` uses). Per policy: output throughput, TTFT p50 / p99 (from
submission to the first token), the prefix-cache hit rate (cached prompt tokens / prompt tokens looked up, over
both replicas) and the router's decisions. Writes benchmarks/results/router.json and router.png.

    OMP_NUM_THREADS=1 python benchmarks/router.py [--quick] [--rate R]

(one intra-op thread per engine process, so the two replicas do not oversubscribe a 2-core machine)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TENANTS, USERS, SYSTEM_TOKENS, USER_TOKENS, MAX_TOKENS = 6, 8, 1024, 24, 16
ENGINE = dict(load_progress=False, kv_cache_memory_bytes=64 * 2**20, max_num_seqs=16)
POLICIES = ("round_robin", "least_loaded", "cache_aware")


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

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            t += rng.expovariate(rate)
        done = await asyncio.gather(*(one(i, p, d) for i, (p, d) in enumerate(zip(prompts, delays))))
        elapsed = time.perf_counter() - start
        stats = await _settled_stats(client, replicas, len(prompts) * (SYSTEM_TOKENS + USER_TOKENS))
        ttfts = sorted(d[0] for d in done)
        return {"replicas": replicas, "policy": policy, "requests": len(prompts),
                "output_tokens_per_s": sum(d[1] for d in done) / elapsed, "elapsed_s": elapsed,
                "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
                "hit_rate": stats.prefix_hits / stats.prefix_queries, "decisions": dict(client.decisions),
                "requests_per_replica": [client.routed[r] for r in range(replicas)]}
    finally:
        await client.shutdown()


async def _settled_stats(client, replicas: int, queried: int):
    """The replicas' stats once they all reported the whole run (they report when they go idle)."""
    for _ in range(200):
        stats = client.stats()
        if stats is not None and len(stats.replicas) == replicas and stats.prefix_queries >= queried:
            return stats
        await asyncio.sleep(0.05)
    raise RuntimeError("the replicas did not report their stats")


def _pct(values: list[float], p: int) -> float:
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def plot(results: list[dict], path: Path) -> None:
    from deepinfer.bench.plotting import pyplot

    plt = pyplot()
    runs = [r for r in results if r["replicas"] > 1]
    names = [r["policy"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
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
    runs = [(1, "cache_aware")] + [(2, p) for p in POLICIES]
    results = []
    for i, (replicas, policy) in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {replicas} replica(s), {policy} ...", flush=True)
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
