"""Deterministic mode: what it costs, and whether the default mode is batch-invariant without it.

1. Invariance report: the scenarios of tests/test_determinism.py (one seeded temperature-1 request alone,
   among 31 random others, at another batch position, with a 7-token prefill chunk, after a preemption)
   on the bundled model, a tiny V4 and a tiny V3, in default and deterministic mode. Records per scenario
   whether the target's logits are bitwise equal to its run alone, the largest logit difference, and
   whether its tokens are equal. Nothing is asserted here; the test asserts the deterministic side.
2. GEMM row invariance on this machine: which row counts change a row's bits, and whether a row's
   position inside a fixed-size tile does (groundwork for batched batch-invariant kernels).
3. Cost: the bundled model, default vs deterministic mode (batch-invariant kernels) vs its
   one-forward-per-token fallback, in the same process: prefill tokens/s (one 256-token prompt) and
   decode tokens/s at batch 1 and 16 (greedy, 32 tokens).

Writes benchmarks/results/determinism.{json,png}.

    python benchmarks/determinism.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from deepinfer import LLM, SamplingParams
from deepinfer.bench.machine import machine_facts

RESULTS = Path(__file__).parent / "results"
TESTS = Path(__file__).parent.parent / "tests"
SCENARIOS = ["batch", "position", "chunk", "preempt"]


def invariance(kinds: list[str]) -> dict:
    sys.path.insert(0, str(TESTS))
    from test_determinism import run_scenario  # the test's scenarios, not a copy
    from tiny_models import make_reference, save_reference

    from deepinfer.llm import default_model_path

    report = {}
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(kinds) * 2 * 5, desc="invariance") as bar:
        for kind in kinds:
            path = default_model_path() if kind == "default" else save_reference(
                make_reference(kind, seed=7), Path(tmp) / kind)
            for deterministic in (False, True):
                alone_tokens, alone_logits, _ = run_scenario(path, kind, "alone", deterministic)
                bar.update(1)
                rows = {}
                for scenario in SCENARIOS:
                    tokens, logits, preempted = run_scenario(path, kind, scenario, deterministic)
                    n = min(len(logits), len(alone_logits))
                    rows[scenario] = {"logits_bitwise_equal": bool(torch.equal(logits, alone_logits)),
                                      "max_abs_logit_diff": float((logits[:n] - alone_logits[:n]).abs().max()),
                                      "tokens_equal": tokens == alone_tokens,
                                      "generated_when_preempted": preempted}
                    bar.update(1)
                report[f"{kind}/{'deterministic' if deterministic else 'default'}"] = rows
    return report


def gemm_row_invariance(shapes: list[tuple[int, int]], max_rows: int = 64, tile: int = 16) -> list[dict]:
    """For F.linear at each (in, out) shape: the row counts M whose rows differ bitwise from the same rows
    computed with M = max_rows, and the positions in a fixed `tile`-row GEMM where one row's result
    differs from its result at position 0. The groundwork for batched batch-invariant kernels."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    out = []
    for k, n in shapes:
        w, x = torch.randn(n, k, generator=g), torch.randn(max_rows, k, generator=g)
        ref = F.linear(x, w)
        differ = [m for m in range(1, max_rows + 1) if not torch.equal(F.linear(x[:m], w), ref[:m])]
        row, others = x[-1:], x[:tile - 1]
        base = F.linear(torch.cat([row, others]), w)[0]
        moved = [p for p in range(tile)
                 if not torch.equal(F.linear(torch.cat([others[:p], row, others[p:]]), w)[p], base)]
        out.append({"in": k, "out": n, "row_counts_that_differ": differ, "tile_positions_that_differ": moved})
    return out


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def cost(repeats: int) -> dict:
    options = dict(load_progress=False, kv_cache_memory_bytes=128 * 2**20, max_num_batched_tokens=2048)
    engines = {"default": LLM(**options), "deterministic": LLM(deterministic=True, **options),
               "per_token": LLM(deterministic=True, **options)}
    engines["per_token"].engine.model.batch_invariant_kernels = False  # the one-token-forward fallback
    g = torch.Generator().manual_seed(0)
    vocab = engines["default"].engine.model_config.vocab_size
    long_prompt = [torch.randint(20, vocab, (256,), generator=g).tolist()]
    decode = {bs: [torch.randint(20, vocab, (16,), generator=g).tolist() for _ in range(bs)] for bs in (1, 16)}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = {mode: {"prefill_tokens_per_s": [], "decode_tokens_per_s_batch1": [], "decode_tokens_per_s_batch16": []}
           for mode in engines}
    for _ in tqdm(range(repeats), desc="cost"):
        for mode, llm in engines.items():
            start = time.perf_counter()
            llm.generate(long_prompt, one, use_tqdm=False)
            out[mode]["prefill_tokens_per_s"].append(256 / (time.perf_counter() - start))
            for bs, prompts in decode.items():
                out[mode][f"decode_tokens_per_s_batch{bs}"].append(timed(llm, prompts, many))
    medians = {mode: {k: sorted(v)[len(v) // 2] for k, v in m.items()} for mode, m in out.items()}
    medians["slowdown"] = {k: medians["default"][k] / medians["deterministic"][k] for k in medians["default"]}
    medians["slowdown_per_token"] = {k: medians["default"][k] / medians["per_token"][k] for k in medians["default"]}
    return medians


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["prefill_tokens_per_s", "decode_tokens_per_s_batch1", "decode_tokens_per_s_batch16"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(keys))
    modes = ((-0.27, "default", "#999"), (0.0, "deterministic", "#2a7"), (0.27, "per_token", "#c84"))
    for offset, mode, color in modes:
        label = "deterministic, one forward per token" if mode == "per_token" else mode
        ax.bar([x + offset for x in xs], [result["cost"][mode][k] for k in keys], 0.27, label=label, color=color)
    ax.set_xticks(list(xs), ["prefill (256 tokens)", "decode, batch 1", "decode, batch 16"])
    ax.set_ylabel("tokens/s (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("deterministic mode cost, bundled model, same run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["default", "v4", "v3"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    shapes = [(256, 128), (128, 256), (256, 64), (256, 8192)]  # bundled model: wq_a, wq_b, wkv, head
    result = {"machine": machine_facts(), "gemm_row_invariance": gemm_row_invariance(shapes),
              "invariance": invariance(args.kinds), "cost": cost(args.repeats)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "determinism.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "determinism.png")
    for name, rows in result["invariance"].items():
        print(name, {s: (r["logits_bitwise_equal"], f"{r['max_abs_logit_diff']:.2e}", r["tokens_equal"])
                     for s, r in rows.items()})
    print(json.dumps(result["cost"], indent=2))
    print(json.dumps(result["gemm_row_invariance"]))


if __name__ == "__main__":
    main()
