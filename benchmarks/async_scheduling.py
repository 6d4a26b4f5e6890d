"""Async scheduling on vs off: decode throughput and the step time spent outside the forward.

The bundled model decodes `--max-tokens` greedy tokens for a batch of short random prompts through the
offline `LLM` (so scheduling, output processing and detokenisation all count). The forward time is what
ModelRunner.execute takes (inputs, model, sampling), timed around it; the time outside the forward is
(wall - total execute time) / steps, i.e. how long per step the model sits idle waiting for the engine.
Synchronous and async runs alternate, `--repeats` times each, in the same process; medians are reported.
Writes benchmarks/results/async_scheduling.{json,png}.

    python benchmarks/async_scheduling.py [--batches 1 16 64] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from deepinfer import LLM, SamplingParams
from deepinfer.bench.machine import machine_facts

RESULTS = Path(__file__).parent / "results"


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(20, vocab, (length,), generator=g).tolist() for _ in range(batch)]


class Timed:
    """Wraps a runner's execute: total seconds inside it and the number of calls."""

    def __init__(self, runner):
        self.execute, self.seconds, self.calls = runner.execute, 0.0, 0
        runner.execute = self

    def __call__(self, out):
        start = time.perf_counter()
        try:
            return self.execute(out)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run_once(llm: LLM, batch_prompts: list[list[int]], params: SamplingParams) -> dict:
    timer = Timed(llm.engine.runner)
    start = time.perf_counter()
    outs = llm.generate(batch_prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.engine.runner.execute = timer.execute
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "steps": timer.calls,
            "forward_ms_per_step": 1e3 * timer.seconds / timer.calls,
            "outside_forward_ms_per_step": 1e3 * max(wall - timer.seconds, 0.0) / timer.calls}


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = result["batches"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    xs = range(len(batches))
    for offset, mode, color in ((-width / 2, "sync", "#999"), (width / 2, "async", "#2a7")):
        rows = [result["results"][str(bs)][mode] for bs in batches]
        a.bar([x + offset for x in xs], [r["tokens_per_s"] for r in rows], width, label=mode, color=color)
        b.bar([x + offset for x in xs], [r["outside_forward_ms_per_step"] for r in rows], width, label=mode,
              color=color)
    for ax, label in ((a, "decode tokens/s"), (b, "ms per step outside the forward")):
        ax.set_xticks(list(xs), [f"batch {bs}" for bs in batches])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("async scheduling on vs off, bundled model, same run (medians)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    options = dict(load_progress=False, kv_cache_memory_bytes=256 * 2**20, max_num_seqs=max(args.batches))
    engines = {"sync": LLM(**options), "async": LLM(async_scheduling=True, **options)}
    vocab = engines["sync"].engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    with tqdm(total=len(args.batches) * args.repeats * 2, desc="async scheduling") as bar:
        for bs in args.batches:
            batch_prompts = prompts(bs, args.prompt_tokens, vocab)
            for llm in engines.values():  # warm-up
                llm.generate(batch_prompts[:2], params.clone(max_tokens=4), use_tqdm=False)
            runs = {"sync": [], "async": []}
            for _ in range(args.repeats):
                for mode, llm in engines.items():
                    runs[mode].append(run_once(llm, batch_prompts, params))
                    bar.update(1)
            same = [o.outputs[0].token_ids for o in engines["sync"].generate(batch_prompts, params, use_tqdm=False)] \
                == [o.outputs[0].token_ids for o in engines["async"].generate(batch_prompts, params, use_tqdm=False)]
            sync, asy = median_of(runs["sync"]), median_of(runs["async"])
            results[str(bs)] = {"sync": sync, "async": asy, "tokens_identical": same,
                                "throughput_gain": asy["tokens_per_s"] / sync["tokens_per_s"],
                                "outside_forward_reduction": 1 - asy["outside_forward_ms_per_step"]
                                / sync["outside_forward_ms_per_step"]}
    engines["async"].engine.shutdown()
    result = {"machine": machine_facts(), "model": "bundled default (DeepSeek-V4 architecture, 10M params)",
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "batches": args.batches, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "async_scheduling.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "async_scheduling.png")
    for bs, r in results.items():
        print(f"batch {bs:>3}: sync {r['sync']['tokens_per_s']:8.1f} tok/s, async {r['async']['tokens_per_s']:8.1f} "
              f"tok/s (x{r['throughput_gain']:.2f}); outside the forward {r['sync']['outside_forward_ms_per_step']:.2f}"
              f" -> {r['async']['outside_forward_ms_per_step']:.2f} ms/step "
              f"(-{100 * r['outside_forward_reduction']:.0f}%); forward {r['sync']['forward_ms_per_step']:.2f} / "
              f"{r['async']['forward_ms_per_step']:.2f} ms; identical tokens: {r['tokens_identical']}")


if __name__ == "__main__":
    main()
