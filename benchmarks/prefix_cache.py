"""Prefix caching on vs off on a shared-prefix workload, measured in the same run on the bundled model.

Requests share a system prompt and differ in a short question; each is timed from submission to its
first token (TTFT) while running alone, so the numbers isolate prefill work. A warm-up request sends the
system prompt alone first. With caching on, a V4 hit gets its bounded state either by `replay`
(recomputing num_layers * (W - 1) tokens before the hit, whatever the prefix length) or from a
`snapshot` kept when a step ended at that block boundary. Writes benchmarks/results/prefix_cache.{json,png}.

    python benchmarks/prefix_cache.py [--system-tokens 2048] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.bench.machine import machine_facts

RESULTS = Path(__file__).parent / "results"
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def workload(vocab: int, system_tokens: int, question_tokens: int, requests: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(20, vocab, (system_tokens,), generator=g).tolist()
    return [system + torch.randint(20, vocab, (question_tokens,), generator=g).tolist() for _ in range(requests)]


def ttfts(llm: LLM, prompts: list[list[int]]) -> list[float]:
    """Seconds from submission to first token for each prompt, run one at a time."""
    out = []
    for p in prompts:
        start = time.perf_counter()
        llm.generate([p], ONE_TOKEN, use_tqdm=False)
        out.append(time.perf_counter() - start)
    return out


def measure(caching: bool, restore: str, system: list[int], prompts: list[list[int]]) -> dict:
    llm = LLM(enable_prefix_caching=caching, swa_restore=restore, load_progress=False, max_num_batched_tokens=4096,
              kv_cache_memory_bytes=256 * 2**20)
    ttfts(llm, [system + prompts[0][len(system):len(system) + 1]])  # warm-up; with caching, caches the system prompt
    queries, hits = llm.engine.kv.prefix_queries, llm.engine.kv.prefix_hits
    times = ttfts(llm, prompts)
    tokens = sum(len(p) for p in prompts)
    return {"median_ttft_s": statistics.median(times), "p95_ttft_s": sorted(times)[int(0.95 * (len(times) - 1))],
            "prefill_tokens_per_s": tokens / sum(times), "ttft_s": times,
            "hit_rate": (llm.engine.kv.prefix_hits - hits) / max(llm.engine.kv.prefix_queries - queries, 1),
            "replay_tokens": llm.engine.scheduler.replay_tokens if caching and restore == "replay" else 0,
            "snapshot_restores": llm.engine.scheduler.num_snapshot_restores}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = ["caching off", "on: replay", "on: snapshot"]
    values = [1e3 * result[k]["median_ttft_s"] for k in ("off", "on", "snapshot")]
    ax.bar(names, values, color=["#999", "#2a7", "#185"])
    ax.set_ylabel("median TTFT (ms), one request at a time")
    ax.set_title(f"{result['system_tokens']}-token shared prefix: {result['speedup_median_ttft']:.1f}x lower "
                 f"median TTFT (replay), {result['speedup_median_ttft_snapshot']:.1f}x (snapshot)\n"
                 f"hit rate {result['on']['hit_rate']:.0%}; replay recomputes {result['on']['replay_tokens']} "
                 f"tokens per hit", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    probe = LLM(load_progress=False, kv_cache_memory_bytes=16 * 2**20)
    prompts = workload(probe.engine.model_config.vocab_size, args.system_tokens, args.question_tokens,
                       args.requests)
    system = prompts[0][: args.system_tokens]
    del probe
    result = {"machine": machine_facts(), "model": "bundled default (DeepSeek-V4 architecture, 10M params)",
              "system_tokens": args.system_tokens, "question_tokens": args.question_tokens,
              "requests": args.requests}
    for name, caching, restore in (("off", False, "replay"), ("on", True, "replay"), ("snapshot", True, "snapshot")):
        print(f"{name} ...", flush=True)
        result[name] = measure(caching, restore, system, prompts)
    result["speedup_median_ttft"] = result["off"]["median_ttft_s"] / result["on"]["median_ttft_s"]
    result["speedup_median_ttft_snapshot"] = result["off"]["median_ttft_s"] / result["snapshot"]["median_ttft_s"]
    result["replay_cost_per_hit_ms"] = 1e3 * (result["on"]["median_ttft_s"] - result["snapshot"]["median_ttft_s"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "prefix_cache.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("on", "off", "snapshot")}, indent=2))
    for k in ("off", "on", "snapshot"):
        print(k, {m: v for m, v in result[k].items() if m != "ttft_s"})


if __name__ == "__main__":
    main()
