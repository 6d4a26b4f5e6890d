"""The few-row GEMMs of a compiled CPU decode step: BLAS (inductor's mm / addmm) against kernels/cpu's rows_linear,
which worker/rows_gemms.py's post-grad pass puts in their place.

Two parts, in one run:
- `gemm`: one projection alone, x [1, K] @ W [N, K]^T, float32, one intra-op thread (a served decode step's count),
  for the dense projections of a v3-mla512 layer. `hot`: back-to-back calls; `cold`: a 64 MB read between calls (a
  step's weights come from memory between tokens). Mean microseconds over --calls calls; arms alternate.
- `offline`: one stream through the offline `LLM` (a 128-token prompt, --max-tokens greedy tokens, EOS ignored),
  ms per output token, two engines in one process, compiled without the pass (DEEPINFER_ROWS_GEMMS=0) and with
  it, alternating rounds. Greedy tokens must match. Checkpoints: peers.py's v3-mla512 and tiny-v3, and the bundled
  model (the first run compiles each arm's steps cold).
Writes benchmarks/results/rows_gemms.{json,png}.

    python benchmarks/rows_gemms.py [--checkpoints v3-mla512 tiny-v3 bundled] [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from lm_head_cpu import PROMPT, mean_us  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# (name, K, N) of v3-mla512's dense projections at batch 1: q_a, q_b, kv_a, o_proj, MLP gate / up, down
SHAPES = [("q_a", 128, 64), ("q_b", 64, 384), ("kv_a", 128, 576), ("o_proj", 128, 128), ("gate_up", 128, 256),
          ("down", 256, 128)]
ARMS = {"blas": "0", "rows": "1"}  # DEEPINFER_ROWS_GEMMS while each engine compiles its steps


def gemm(calls: int) -> list[dict]:
    from deepinfer.kernels import cpu_kernels

    torch.set_num_threads(1)
    flush, rows = torch.randn(16 << 20), []
    for name, k, n in SHAPES:
        x, w = torch.randn(1, k), torch.randn(n, k)
        torch.testing.assert_close(cpu_kernels.rows_linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
        row = {"projection": name, "k": k, "n": n}
        for state, f in (("hot", None), ("cold", flush)):
            row[f"blas_{state}_us"] = mean_us(lambda x=x, w=w: F.linear(x, w), calls, f)
            row[f"rows_{state}_us"] = mean_us(lambda x=x, w=w: cpu_kernels.rows_linear(x, w), calls, f)
        rows.append(row)
        print(f"{name} {k}x{n}: " + ", ".join(f"{a} {v:.1f}" for a, v in row.items() if a.endswith("_us")), flush=True)
    return rows


def offline(path: str, rounds: int, max_tokens: int) -> dict:
    """ms per token of one stream, an engine per arm in this process, alternating."""
    from deepinfer import LLM, SamplingParams

    engines = {}
    for arm, env in ARMS.items():
        os.environ["DEEPINFER_ROWS_GEMMS"] = env
        engines[arm] = LLM(path or None, enforce_eager=False, load_progress=False, max_num_seqs=4)
    os.environ.pop("DEEPINFER_ROWS_GEMMS")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times, tokens = {arm: [] for arm in ARMS}, {}
    for r in range(rounds + 1):  # round 0 warms both arms
        for arm in (list(ARMS) if r % 2 else list(ARMS)[::-1]):
            start = time.perf_counter()
            out = engines[arm].generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
            tokens[arm] = out[0].outputs[0].token_ids
            if r:
                times[arm].append(1e3 * (time.perf_counter() - start) / max_tokens)
    assert tokens["blas"] == tokens["rows"], "greedy tokens differ between the two arms"
    ratios = [b / k for b, k in zip(times["blas"], times["rows"])]
    return {"ratio_median": statistics.median(ratios), "ratios": ratios,
            **{arm: {"median_ms_per_token": statistics.median(t), "min_ms_per_token": min(t), "rounds": t}
               for arm, t in times.items()}}


def plot(result: dict, out: Path) -> None:
    from deepinfer.bench.plotting import grouped_bars, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    groups = [f"{r['projection']}\n{state}" for r in result["gemm"] for state in ("hot", "cold")]
    grouped_bars(axes[0], groups, {arm: [r[f"{arm}_{state}_us"] for r in result["gemm"] for state in ("hot", "cold")]
                                   for arm in ARMS})
    axes[0].set_ylabel("µs per projection, 1 row, 1 thread (lower is better)")
    axes[0].tick_params(axis="x", labelsize=7)
    axes[0].legend()
    names = list(result["offline"])
    grouped_bars(axes[1], names, {arm: [result["offline"][n][arm]["median_ms_per_token"] for n in names]
                                  for arm in ARMS})
    axes[1].set_ylabel("offline one stream, ms per token (lower is better)")
    axes[1].legend()
    fig.suptitle("CPU decode: a compiled step's few-row GEMMs, BLAS vs rows_linear")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", nargs="+", default=["v3-mla512", "tiny-v3", "bundled"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=300, help="calls per gemm measurement")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for rows_gemms.json / .png")
    args = parser.parse_args()
    from deepinfer.bench.machine import machine_facts
    from deepinfer.kernels import cpu_kernels

    if not cpu_kernels.load():
        sys.exit("the CPU kernels could not be built here")
    result = {"machine": machine_facts(), "rows_linear_max_rows": cpu_kernels.ROWS_LINEAR_MAX_ROWS,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "gemm": gemm(args.calls), "offline": {}}
    import peers

    work = Path(tempfile.mkdtemp(prefix="deepinfer-rows-gemms-"))
    for name in args.checkpoints:
        path = "" if name == "bundled" else str(peers.build_v3(name, work / name))
        result["offline"][name] = offline(path, args.rounds, args.max_tokens)
        row = result["offline"][name]
        print(name, {a: round(row[a]["median_ms_per_token"], 3) for a in ARMS},
              f"blas / rows per round, median {row['ratio_median']:.2f}x", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rows_gemms.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "rows_gemms.png")


if __name__ == "__main__":
    main()
