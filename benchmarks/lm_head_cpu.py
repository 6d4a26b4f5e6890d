"""The LM head of a CPU decode step: kernels/cpu's rows_linear (layers/lm_head.py) against F.linear (BLAS).

Two parts, in one run:
- `gemm`: the product alone, x [M, D] @ W [V, D]^T, float32, one intra-op thread (a served decode step's
  count, worker/threads.py), M = 1, 2, 4, 8. `hot`: back-to-back calls (W stays in cache). `cold`: a 64 MB
  read between calls, as a decode step finds its head after the rest of the step and the engine's Python have
  run (the in-engine time sits between the two). Mean microseconds over --calls calls; both arms alternate.
- `offline`: one stream through the offline `LLM` (a 128-token prompt, --max-tokens greedy tokens, EOS
  ignored), ms per output token, in one process whose engine switches the LM head's dispatch between rounds
  (cpu_kernels.ROWS_LINEAR_MAX_ROWS = 0: F.linear). Greedy tokens must match. Checkpoints: peers.py's v3-mla512
  and tiny-v3, and the bundled model (its compiled steps, cold compile on the first run).
Writes benchmarks/results/lm_head_cpu.{json,png}.

    python benchmarks/lm_head_cpu.py [--checkpoints v3-mla512 tiny-v3 bundled] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
SHAPES = {"v3-mla512": (128, 8192), "tiny-v3": (64, 8192), "bundled": (256, 8192)}  # (D, V) of each head
ROWS = (1, 2, 4, 8)
PROMPT = list(range(10, 138))


def mean_us(fn, calls: int, flush: torch.Tensor | None) -> float:
    total = 0.0
    for _ in range(calls):
        if flush is not None:
            flush.sum()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    return 1e6 * total / calls


def gemm(calls: int) -> list[dict]:
    """Both arms per head shape, row count and cache state (alternating)."""
    from deepinfer.kernels import cpu_kernels

    torch.set_num_threads(1)
    flush, rows = torch.randn(16 << 20), []
    for name, (dim, vocab) in SHAPES.items():
        w = torch.randn(vocab, dim)
        for m in ROWS:
            x = torch.randn(m, dim)
            torch.testing.assert_close(cpu_kernels.rows_linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
            row = {"head": name, "dim": dim, "vocab": vocab, "rows": m}
            for state, f in (("hot", None), ("cold", flush)):
                row[f"blas_{state}_us"] = mean_us(lambda x=x, w=w: F.linear(x, w), calls, f)
                row[f"kernel_{state}_us"] = mean_us(lambda x=x, w=w: cpu_kernels.rows_linear(x, w), calls, f)
            rows.append(row)
            print(f"{name} M={m}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k.endswith("_us")),
                  flush=True)
    return rows


def offline(path: str, rounds: int, max_tokens: int) -> dict:
    """ms per token of one stream with F.linear and with the kernel, alternating in one engine."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.kernels import cpu_kernels

    llm = LLM(path or None, enforce_eager=False, load_progress=False, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    arms = {"blas": 0, "kernel": cpu_kernels.ROWS_LINEAR_MAX_ROWS}
    times, tokens = {arm: [] for arm in arms}, {}
    for r in range(rounds + 1):  # round 0 warms both arms
        for arm, limit in arms.items():
            cpu_kernels.ROWS_LINEAR_MAX_ROWS = limit
            start = time.perf_counter()
            tokens[arm] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
            if r:
                times[arm].append(1e3 * (time.perf_counter() - start) / max_tokens)
    cpu_kernels.ROWS_LINEAR_MAX_ROWS = arms["kernel"]
    assert tokens["blas"] == tokens["kernel"], "greedy tokens differ between the two LM head paths"
    return {arm: {"median_ms_per_token": statistics.median(t), "min_ms_per_token": min(t), "rounds": t}
            for arm, t in times.items()}


def plot(result: dict, out: Path) -> None:
    from deepinfer.bench.plotting import grouped_bars, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    one = [r for r in result["gemm"] if r["rows"] == 1]
    groups = [f"{r['head']}\n{state}" for r in one for state in ("hot", "cold")]
    grouped_bars(axes[0], groups, {arm: [r[f"{arm}_{state}_us"] for r in one for state in ("hot", "cold")]
                                   for arm in ("blas", "kernel")})
    axes[0].set_ylabel("µs per LM head, 1 row, 1 thread (lower is better)")
    axes[0].legend()
    names = list(result["offline"])
    grouped_bars(axes[1], names, {arm: [result["offline"][n][arm]["median_ms_per_token"] for n in names]
                                  for arm in ("blas", "kernel")})
    axes[1].set_ylabel("offline one stream, ms per token (lower is better)")
    axes[1].legend()
    fig.suptitle("CPU decode: the LM head, BLAS vs rows_linear")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", nargs="+", default=["v3-mla512", "tiny-v3", "bundled"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200, help="calls per gemm measurement")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for lm_head_cpu.json / .png")
    args = parser.parse_args()
    from deepinfer.bench.machine import machine_facts
    from deepinfer.kernels import cpu_kernels

    if not cpu_kernels.load():
        sys.exit("the CPU kernels could not be built here")
    result = {"machine": machine_facts(), "rows_linear_max_rows": cpu_kernels.ROWS_LINEAR_MAX_ROWS,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "gemm": gemm(args.calls), "offline": {}}
    sys.path.insert(0, str(Path(__file__).parent))
    import peers

    work = Path(tempfile.mkdtemp(prefix="deepinfer-lm-head-"))
    for name in args.checkpoints:
        path = "" if name == "bundled" else str(peers.build_v3(name, work / name))
        result["offline"][name] = offline(path, args.rounds, args.max_tokens)
        print(name, {a: round(v["median_ms_per_token"], 3) for a, v in result["offline"][name].items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lm_head_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "lm_head_cpu.png")


if __name__ == "__main__":
    main()
