"""EPLB in the engine at EP 4: how evenly the expert-parallel ranks' experts are loaded with the contiguous
placement, with live rebalancing, and with live rebalancing plus redundant experts, and whether the tokens change.

Workload: a V4 model of the training default shape with 32 routed experts (top-4) whose routing is skewed
the way hot experts are in real traffic: zipf(1) popularity over the expert ids, as a router bias on the learned
MoE layers and as the draw of the hash layer's token -> expert table. 96 requests of 48 random prompt tokens
and 32 greedy tokens warm up (EPLB rebalances during them, every --interval steps), then 96 more are measured
(30,336 routed rows per layer).

Measured: the rows every rank's expert slots actually received in each MoE layer during the measured requests
(RankStats.rows_served, counted in the dispatch), as mean / max over the ranks per layer, averaged over the
layers; plus the engine's own window-based metric, the rebalances, expert weights moved and the move time,
and whether greedy tokens equal the contiguous engine's. Writes benchmarks/results/eplb.json and eplb.png.

    python benchmarks/eplb.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
EXPERTS, TOPK, EP, VOCAB = 32, 4, 4, 2048
BIAS_SCALE, GATE_STD = 2.0, 1.0
PROMPT_TOKENS, MAX_TOKENS = 48, 32
LAYOUT = dict(data_parallel_size=EP, enable_expert_parallel=True, moe_comm="alltoall")
CONFIGS = {
    "static (contiguous)": {},
    "EPLB": dict(enable_eplb=True),
    "EPLB + 4 redundant": dict(enable_eplb=True, num_redundant_experts=4),
}


def build_checkpoint(out: Path) -> Path:
    import torch

    from deepinfer.config import ModelConfig
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer.training.export import init_weights, save_checkpoint
    from deepinfer.training.train import DEFAULT_MODEL

    hf = {**DEFAULT_MODEL, "n_routed_experts": EXPERTS, "num_experts_per_tok": TOPK, "vocab_size": VOCAB}
    model = DeepseekV4ForCausalLM(ModelConfig.from_dict(hf))
    init_weights(model, seed=0)
    g = torch.Generator().manual_seed(1)
    popularity = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float32)  # zipf(1): expert 0 hottest
    with torch.no_grad():
        for layer in model.layers:
            gate = layer.ffn.gate
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * GATE_STD)
            if gate.is_hash:
                draw = torch.multinomial(popularity.expand(VOCAB, EXPERTS), TOPK, replacement=False, generator=g)
                gate.tid2eid.copy_(draw)
            else:
                gate.bias.copy_(popularity / popularity.max() * BIAS_SCALE)
    return save_checkpoint(model, hf, out, torch.float32)


def prompts(seed: int, count: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(count)]


def measure(ckpt: str, options: dict, requests: int) -> dict:
    """One engine: warm-up requests, then measured ones; the ranks' served rows over the measured ones."""
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(ckpt, load_progress=False, kv_cache_memory_bytes=128 * 2**20, block_size=16,
             enable_prefix_caching=False, **LAYOUT, **options) as llm:
        warm = llm.generate(prompts(1, requests), params, use_tqdm=False)
        before = llm.engine.executor.rank_stats()
        start = time.perf_counter()
        measured = llm.generate(prompts(2, requests), params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = llm.engine.executor.rank_stats()
        engine_metric = llm.engine.executor.expert_balancedness(after)
    served = [[a - b for a, b in zip(x.rows_served, y.rows_served)] for x, y in zip(after, before)]
    per_layer = [_balance([rank[layer] for rank in served]) for layer in range(len(served[0]))]
    moe_layers = [b for b, rows in zip(per_layer, zip(*served)) if sum(rows) > 0]  # the idle MTP layer: none
    return {"balancedness": sum(moe_layers) / len(moe_layers), "balancedness_per_layer": moe_layers,
            "rows_served_per_rank": served, "engine_window_balancedness": engine_metric,
            "eplb": after[0].eplb, "measured_seconds": seconds,
            "tokens": [o.outputs[0].token_ids for o in warm + measured]}


def _balance(rows: list[int]) -> float:
    return (sum(rows) / len(rows)) / max(rows) if max(rows) else 1.0


def plot(results: dict, path: Path) -> None:
    from deepinfer.bench.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results)
    for i, name in enumerate(names):
        layers = results[name]["balancedness_per_layer"]
        ax.scatter([i] * len(layers), layers, color="grey", s=14, zorder=3, label="per MoE layer" if i == 0 else None)
        ax.bar(i, results[name]["balancedness"], color="tab:blue", alpha=0.7)
    ax.axhline(0.95, color="tab:green", ls="--", lw=1, label="0.95")
    ax.axhline(0.8, color="tab:red", ls=":", lw=1, label="0.8")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("mean / max rows per EP rank (measured)")
    ax.set_title(f"EP {EP}, {EXPERTS} experts top-{TOPK}, zipf-skewed routing")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="16 requests per phase instead of 96")
    parser.add_argument("--interval", type=int, default=8, help="eplb_step_interval (default: 8)")
    parser.add_argument("--one", nargs=3, metavar=("CKPT", "OPTIONS", "REQUESTS"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.one:
        print(json.dumps(measure(ns.one[0], json.loads(ns.one[1]), int(ns.one[2]))))
        return
    requests, results = 16 if ns.quick else 96, {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(build_checkpoint(Path(tmp) / "model"))
        for i, (name, options) in enumerate(CONFIGS.items()):
            print(f"[{i + 1}/{len(CONFIGS)}] {name} ...", flush=True)
            if options.get("enable_eplb"):
                options = {**options, "eplb_step_interval": ns.interval, "eplb_layers_per_step": 8}
            done = subprocess.run([sys.executable, __file__, "--one", ckpt, json.dumps(options), str(requests)],
                                  capture_output=True, text=True, check=True)
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
            results[name]["options"] = options
            _print_row(name, results[name])
    reference = results["static (contiguous)"]["tokens"]
    for r in results.values():
        r["greedy_tokens_equal_static"] = r.pop("tokens") == reference
    RESULTS.mkdir(exist_ok=True)
    out = {"workload": {"experts": EXPERTS, "topk": TOPK, "ep": EP, "requests_per_phase": requests,
                        "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS, "bias_scale": BIAS_SCALE,
                        "gate_std": GATE_STD},
           "results": results}
    (RESULTS / "eplb.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(results, RESULTS / "eplb.png")


def _print_row(name: str, r: dict) -> None:
    e = r["eplb"] or {}
    print(f"  {name:20s} balancedness {r['balancedness']:.3f} (per layer "
          f"{', '.join(f'{b:.2f}' for b in r['balancedness_per_layer'])})  rebalances {e.get('rebalances', 0)}  "
          f"experts moved {e.get('experts_moved', 0)}  move {1000 * e.get('move_seconds', 0):.1f} ms  "
          f"measured phase {r['measured_seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
