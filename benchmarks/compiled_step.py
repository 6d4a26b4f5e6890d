"""Eager vs compiled decode steps (worker/compiled_step.py), float32 vs bfloat16, on the bundled model.

Each configuration (mode x dtype) runs in its own process (a fresh engine; the compile happens at start-up
and its time is recorded: cold on the first run of a machine, from the on-disk cache after). Each one
decodes `--max-tokens` greedy tokens (EOS ignored) for batches of short random prompts through the offline
`LLM`, so scheduling, sampling and output processing count; the time per step is wall time / tokens per
request. Configurations alternate `--repeats` times; medians are reported. Greedy tokens are compared with
the float32 eager run: compiled float32 must match exactly; bfloat16 reports its agreement rate (the share
of positions, up to each request's first divergence, where it chose float32's token).
Writes benchmarks/results/compiled_step.{json,png}.

    python benchmarks/compiled_step.py [--batches 1 16] [--max-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CONFIGS = [("eager", "float32"), ("compiled", "float32"), ("eager", "bfloat16"), ("compiled", "bfloat16")]


def measure(mode: str, dtype: str, batches: list[int], max_tokens: int) -> dict:
    """In this process: load (compiling unless eager), then per batch the ms per step and the tokens."""
    os.environ["DEEPINFER_ENFORCE_EAGER"] = "1" if mode == "eager" else "0"
    import torch

    from deepinfer import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(dtype=dtype, load_progress=False)
    out = {"load_s": time.perf_counter() - start, "batches": {}}
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        prompts = [{"prompt_token_ids": torch.randint(20, vocab, (16,), generator=g).tolist()} for _ in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        out["batches"][str(batch)] = {"ms_per_step": 1e3 * wall / max_tokens, "tokens_per_s": batch * max_tokens / wall,
                                      "tokens": [o.outputs[0].token_ids for o in outs]}
    return out


def agreement(want: list[list[int]], got: list[list[int]]) -> float:
    """Share of positions before each request's first divergence from `want`."""
    same = total = 0
    for w, g in zip(want, got):
        first = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w))
        same, total = same + first, total + len(w)
    return same / total


def run_config(mode: str, dtype: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, dtype, "--batches", *map(str, args.batches),
           "--max-tokens", str(args.max_tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: dict, batches: list[int]) -> dict:
    ref = runs["eager/float32"][0]["batches"]
    table = {}
    for key, reps in runs.items():
        row = {"load_s": statistics.median(r["load_s"] for r in reps)}
        for b in map(str, batches):
            row[f"ms_per_step_b{b}"] = statistics.median(r["batches"][b]["ms_per_step"] for r in reps)
            row[f"tokens_per_s_b{b}"] = statistics.median(r["batches"][b]["tokens_per_s"] for r in reps)
            row[f"greedy_agreement_vs_fp32_b{b}"] = agreement(ref[b]["tokens"], reps[0]["batches"][b]["tokens"])
        table[key] = row
    return table


def plot(table: dict, batches: list[int], path: Path) -> None:
    from deepinfer.bench.plotting import grouped_bars, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    grouped_bars(ax, [f"batch {b}" for b in batches],
                 {key: [row[f"ms_per_step_b{b}"] for b in batches] for key, row in table.items()})
    ax.set_ylabel("ms per decode step (lower is better)")
    ax.set_title("bundled model: eager vs compiled decode steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for compiled_step.json / .png")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child, args.batches, args.max_tokens)))
        return
    from tqdm import tqdm

    from deepinfer.bench.machine import machine_facts

    runs: dict[str, list[dict]] = {f"{m}/{d}": [] for m, d in CONFIGS}
    for _ in tqdm(range(args.repeats), desc="rounds"):
        for mode, dtype in tqdm(CONFIGS, desc="configurations", leave=False):
            runs[f"{mode}/{dtype}"].append(run_config(mode, dtype, args))
    table = summarise(runs, args.batches)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_facts(), "max_tokens": args.max_tokens, "repeats": args.repeats,
              "threads": os.environ.get("OMP_NUM_THREADS"), "results": table}
    (args.out / "compiled_step.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(table, args.batches, args.out / "compiled_step.png")
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
