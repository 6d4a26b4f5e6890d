"""DeepSeek-V4.1 prefill truncation (`prefill_truncation_tokens` K): prefill time and logit drift against the full
computation, on the tiny V4.1 goldens (tests/golden/v41/a: 6 layers, the last 3 truncated -- V4.1-Flash truncates
20 of 40; b: 8 layers, the last 3), their context raised so prompts can be long.

Truncation keeps the last prompt token's logits exact when K >= (late layers - 1) x (W - 1) + 1 (its window
chain through the truncated layers), so K sweeps W, 2W and DeepSeek's default 140. For each K and prompt length,
in one sitting and alternating full / truncated runs: prefill time (one 1-token
generation, best of --repeats), the largest |log-prob difference| over the vocabulary at the first sampled position,
and how many of --tokens greedy tokens agree before the first difference. Writes
benchmarks/results/prefill_truncation.json and prefill_truncation.png.

    python benchmarks/prefill_truncation.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"


def long_context_copy(name: str, out: Path, context: int) -> Path:
    dst = out / name
    shutil.copytree(ROOT / "tests" / "golden" / "v41" / name, dst, ignore=shutil.ignore_patterns("golden*"))
    raw = json.loads((dst / "config.json").read_text())
    raw["text_config"]["max_position_embeddings"] = context
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def first_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    captured = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    llm.engine.model.compute_logits = compute
    return captured[0][0].log_softmax(-1)


def prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - start


def agreeing_tokens(full: list[int], cut: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(full, cut)) if a != b), len(full))


def measure(path: Path, lengths: list[int], keeps: list[int], repeats: int, tokens: int) -> list[dict]:
    common = dict(load_progress=False, enable_prefix_caching=False, max_num_batched_tokens=max(lengths))
    full = LLM(str(path), **common)
    window = full.engine.model_config.sliding_window
    rows = []
    for keep in sorted({k or w for k, w in zip(keeps, (window, 2 * window, 0))}):
        cut = LLM(str(path), prefill_truncation_tokens=keep, **common)
        rows += _sweep(full, cut, keep, lengths, repeats, tokens, path.name)
    return rows


def _sweep(full: LLM, cut: LLM, keep: int, lengths: list[int], repeats: int, tokens: int, name: str) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lengths:
        prompt = torch.randint(3, 510, (n,), generator=gen).tolist()
        times = {"full": [], "truncated": []}
        for _ in range(repeats):  # alternate, so machine noise hits both alike
            times["full"].append(prefill_seconds(full, prompt))
            times["truncated"].append(prefill_seconds(cut, prompt))
        drift = (first_logprobs(full, prompt) - first_logprobs(cut, prompt)).abs().max().item()
        greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        a, b = (llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
                for llm in (full, cut))
        row = {"keep_tokens": keep, "prompt_tokens": n, "full_s": min(times["full"]),
               "truncated_s": min(times["truncated"]), "max_logprob_drift": drift,
               "greedy_agree": agreeing_tokens(a, b), "greedy_tokens": tokens}
        row["speedup"] = row["full_s"] / row["truncated_s"]
        print(f"  {name} K={keep} n={n}: full {row['full_s'] * 1e3:.0f} ms, "
              f"truncated {row['truncated_s'] * 1e3:.0f} ms (x{row['speedup']:.2f}), drift {drift:.3g}, "
              f"greedy agree {row['greedy_agree']}/{tokens}",
              flush=True)
        rows.append(row)
    return rows


def _late_layers(path: Path) -> dict:
    from deepinfer.config import ModelConfig

    cfg = ModelConfig.from_hf(path)
    start = cfg.compress_ratios.index(1)
    late, window = cfg.num_layers - start, cfg.sliding_window
    return {"layers": cfg.num_layers, "truncated_from": start, "window": window,
            "exact_from_keep": (late - 1) * (window - 1) + 1}


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results["configs"].items():
        for keep in sorted({r["keep_tokens"] for r in rows}):
            sel = [r for r in rows if r["keep_tokens"] == keep]
            n = [r["prompt_tokens"] for r in sel]
            ax1.plot(n, [r["speedup"] for r in sel], marker="o", label=f"{name}, K={keep}")
            ax2.plot(n, [max(r["max_logprob_drift"], 1e-6) for r in sel], marker="o", label=f"{name}, K={keep}")
    ax1.set(xlabel="prompt tokens", ylabel="prefill speed-up (full / truncated)", xscale="log")
    ax2.set(xlabel="prompt tokens", ylabel="max |log-prob drift|, first token (1e-6 = exact)", xscale="log",
            yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two lengths, one repeat")
    ap.add_argument("--keep", type=int, nargs="*", default=[0, 0, 140],
                    help="K values; 0 stands for W and 2 W of each config (DeepSeek's engine default: 140)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    lengths = [256, 1024] if args.quick else [128, 256, 512, 1024, 2048]
    repeats = 1 if args.quick else args.repeats
    results = {"keep_tokens": args.keep, "threads": torch.get_num_threads(), "configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("a", "b"):
            print(f"config {name}", flush=True)
            path = long_context_copy(name, Path(tmp), 2 * max(lengths))
            results["configs"][name] = measure(path, lengths, args.keep, repeats, args.tokens)
            results.setdefault("late_layers", {})[name] = _late_layers(path)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefill_truncation.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "prefill_truncation.png")
    print(f"wrote {RESULTS / 'prefill_truncation.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
