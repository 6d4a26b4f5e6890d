"""The CPU decode step with and without its two per-step cost cuts, in one process, alternating:
- `kernel`: kernels/cpu's MLA decode (one pass over the paged context) against gather + two GEMMs;
- `threads`: worker/threads' policy (steps of at most 2 tokens on one thread) against every step on all threads.

For each checkpoint (peers.py's tiny-v3 and v3-mla512, and the bundled V4 model for the thread policy only; float32)
an engine is built per combination, with
compiled decode steps; each decodes a batch of 128-token random prompts, and the step it compiled for that batch is
then replayed on its own (the same ForwardMeta) in alternating rounds: the best of `--trials` timings of 10
replays, median over rounds. Step time only: the forward (compiled), without the sampler or the engine loop.
Writes benchmarks/results/cpu_step_cost.{json,png}.

    python benchmarks/cpu_step_cost.py [--checkpoints tiny-v3,v3-mla512,bundled] [--batches 1,16,64] [--rounds 3]
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
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from peers import checkpoint  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CONFIGS = [("kernel", "threads"), ("kernel", "all threads"), ("gather", "threads"), ("gather", "all threads")]


def best_ms(fn, trials: int, n: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e3


def build(path: Path, config: tuple[str, str], batches: list[int]):
    """An engine for one configuration and, per batch size, the ForwardMeta of one of its decode steps."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.kernels import cpu_kernels

    cpu_kernels._state["loaded"] = config[0] == "kernel" and cpu_kernels.load()
    llm = LLM(str(path), dtype="float32", load_progress=False, max_num_seqs=max(batches))
    runner = llm.engine.runner
    runner.threads.small = 2 if config[1] == "threads" else 0
    metas, run = {}, runner.graphs.run
    runner.graphs.run = lambda meta: metas.setdefault(meta.num_reqs, meta) and run(meta)
    for b in batches:
        gen = torch.Generator().manual_seed(b)
        prompts = [{"prompt_token_ids": torch.randint(20, 8000, (128,), generator=gen).tolist()} for _ in range(b)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    runner.graphs.run = run
    return llm, metas


def replay(llm, meta, config: tuple[str, str], trials: int) -> float:
    from deepinfer.kernels import cpu_kernels

    cpu_kernels._state["loaded"] = config[0] == "kernel"  # what the graph was traced with (a guard)
    runner = llm.engine.runner
    with torch.inference_mode():
        runner.threads.apply(meta.num_tokens)
        return best_ms(lambda: runner.graphs.run(meta), trials)


def measure(name: str, path: Path, args) -> dict:
    """V4 (`bundled`) has no MLA decode: only the thread policy is compared there."""
    torch._dynamo.reset()  # the previous checkpoint's graphs (each engine compiles its own)
    configs = [c for c in CONFIGS if c[0] == "gather"] if name == "bundled" else CONFIGS
    engines = {c: build(path, c, args.batches) for c in tqdm(configs, desc=f"{name}: compiling", leave=False)}
    times = {f"{k}/{t}": {b: [] for b in args.batches} for k, t in configs}
    for r in tqdm(range(args.rounds), desc=f"{name}: rounds", leave=False):
        for config in configs if r % 2 == 0 else configs[::-1]:
            llm, metas = engines[config]
            for b in args.batches:
                times["/".join(config)][b].append(replay(llm, metas[b], config, args.trials))
    return {key: {str(b): {"ms": statistics.median(v), "rounds": v} for b, v in per.items()}
            for key, per in times.items()}


def plot(results: dict, batches: list[int], out: Path) -> None:
    from deepinfer.bench.plotting import grouped_bars, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (name, table) in zip(axes[0], results.items()):
        grouped_bars(ax, [f"batch {b}" for b in batches],
                     {key: [per[str(b)]["ms"] for b in batches] for key, per in table.items()})
        ax.set(title=name, ylabel="ms per compiled decode step", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", default="tiny-v3,v3-mla512,bundled")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    from deepinfer.bench.machine import machine_facts

    torch._dynamo.config.recompile_limit = 64  # four engines' graphs of one function in one process
    work = Path(tempfile.mkdtemp(prefix="cpu-step-"))
    results = {name: measure(name, checkpoint(name, work), args) for name in args.checkpoints.split(",")}
    doc = {"machine": machine_facts(), "batches": args.batches, "rounds": args.rounds, "trials": args.trials,
           "prompt_tokens": 128, "results": results}
    args.out.mkdir(exist_ok=True)
    (args.out / "cpu_step_cost.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, args.batches, args.out / "cpu_step_cost.png")
    for name, table in results.items():
        for key, per in table.items():
            print(name, f"{key:22s}", "  ".join(f"b{b}: {per[str(b)]['ms']:.3f} ms" for b in args.batches))


if __name__ == "__main__":
    main()
