"""The fixed cost around a compiled decode step's graph (worker/compiled_step.py, worker/verified_calls.py).

Arms, each in a fresh process:
- `guarded`: the compiled steps as they were. Dynamo checks every guard on every call. Float attributes (norm
  eps, scaling factors) are graph inputs, made into tensors on every call. Inductor's Python wrapper checks each
  buffer's size and strides.
- `verified`: guards checked once per input key (verified_calls.py); the rest as `guarded`.
- `shipped`: `verified` plus compiled_step.INDUCTOR_OPTIONS (no per-call size asserts) and DYNAMO_CONFIG
  (floats traced as constants).

Each arm measures, per checkpoint:
- `replay`: one batch-1 decode step of a running sequence (recorded from a generate), replayed back to back on
  one thread: the minimum and median over rounds of calls, in microseconds. This is the step alone.
- `offline`: one stream through the offline `LLM` (a 128-token prompt, --max-tokens greedy tokens, EOS ignored),
  in ms per output token. This includes scheduling, the logits, sampling and output processing.
Arms alternate --rounds times (this machine is noisy); the tables give medians of the rounds. Greedy tokens must
be the same in every arm. Checkpoints: the bundled V4 model, and peers.py's tiny-v3 and v3-mla512.
Writes benchmarks/results/step_overhead.{json,png}.

    python benchmarks/step_overhead.py [--checkpoints bundled tiny-v3 v3-mla512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ARMS = ("guarded", "verified", "shipped")
PROMPT = list(range(10, 138))


def configure(arm: str) -> None:
    """This process's compiled steps as `arm` has them."""
    from deepinfer.worker import compiled_step, verified_calls

    if arm != "shipped":
        compiled_step.INDUCTOR_OPTIONS, compiled_step.DYNAMO_CONFIG = {}, {}
    if arm == "guarded":
        verified_calls._cache_entries = None  # every call through torch.compile's guard check


def replay_us(steps, meta, calls: int, rounds: int = 7) -> dict:
    """Microseconds per call of one recorded step, min and median over `rounds` rounds of `calls` calls."""
    import torch

    per_call = []
    with torch.inference_mode():
        for _ in range(50):
            steps.run(meta)
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                steps.run(meta)
            per_call.append(1e6 * (time.perf_counter() - start) / calls)
    return {"min": min(per_call), "median": statistics.median(per_call)}


def measure(arm: str, path: str, max_tokens: int, calls: int) -> dict:
    """In this process: the arm's engine on `path`, its replayed step and its offline one-stream time."""
    configure(arm)
    import torch

    from deepinfer import LLM, SamplingParams

    llm = LLM(path or None, enforce_eager=False, load_progress=False, max_num_seqs=4)
    steps, seen = llm.engine.runner.graphs, []
    run = steps.run
    steps.run = lambda meta: (seen.append(meta) if meta.num_reqs == 1 else None) or run(meta)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPT}]
    llm.generate(prompt, params, use_tqdm=False)  # warm: the first generate also builds the sampler's state
    times, tokens = [], None
    for _ in range(3):
        start = time.perf_counter()
        tokens = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        times.append(1e3 * (time.perf_counter() - start) / max_tokens)
    steps.run = run
    torch.set_num_threads(1)  # as the engine runs a one-token step (worker/threads.py)
    return {"replay_us": replay_us(steps, seen[len(seen) // 2], calls),
            "offline_ms_per_token": statistics.median(times), "tokens": tokens}


def run_arm(arm: str, path: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", arm, path, "--max-tokens", str(args.max_tokens),
           "--calls", str(args.calls)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkpoint_path(name: str, work: Path) -> str:
    """'' for the bundled model, else peers.py's checkpoint built under `work`."""
    sys.path.insert(0, str(Path(__file__).parent))
    import peers

    return "" if name == "bundled" else str(peers.build_v3(name, work / name))


def summarise(runs: dict) -> dict:
    """checkpoint -> arm -> medians over rounds; checks that every arm gave the same greedy tokens."""
    table = {}
    for name, arms in runs.items():
        reference = arms["guarded"][0]["tokens"]
        table[name] = {}
        for arm, reps in arms.items():
            assert all(r["tokens"] == reference for r in reps), f"{name}/{arm}: greedy tokens differ"
            table[name][arm] = {
                "replay_us_min": statistics.median(r["replay_us"]["min"] for r in reps),
                "replay_us_median": statistics.median(r["replay_us"]["median"] for r in reps),
                "offline_ms_per_token": statistics.median(r["offline_ms_per_token"] for r in reps),
                "rounds": [{k: r[k] for k in ("replay_us", "offline_ms_per_token")} for r in reps]}
    return table


def plot(table: dict, out: Path) -> None:
    from deepinfer.bench.plotting import grouped_bars, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(table)
    for ax, key, label in ((axes[0], "replay_us_min", "µs per replayed batch-1 step"),
                           (axes[1], "offline_ms_per_token", "offline one stream, ms per token")):
        grouped_bars(ax, names, {arm: [table[n][arm][key] for n in names] for arm in ARMS})
        ax.set_ylabel(f"{label} (lower is better)")
        ax.legend()
    fig.suptitle("compiled decode step: the Python around the graph")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", nargs="+", default=["bundled", "tiny-v3", "v3-mla512"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=1000, help="replayed calls per round")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for step_overhead.json / .png")
    parser.add_argument("--child", nargs=2, metavar=("ARM", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child, args.max_tokens, args.calls)))
        return
    from tqdm import tqdm

    from deepinfer.bench.machine import machine_facts

    work = Path(tempfile.mkdtemp(prefix="deepinfer-step-overhead-"))
    paths = {name: checkpoint_path(name, work) for name in args.checkpoints}
    runs = {name: {arm: [] for arm in ARMS} for name in paths}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name, path in tqdm(paths.items(), desc="checkpoints", leave=False):
            for arm in ARMS:
                runs[name][arm].append(run_arm(arm, path, args))
    table = summarise(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_facts(), "max_tokens": args.max_tokens, "calls": args.calls,
              "rounds": args.rounds, "results": table}
    (args.out / "step_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(table, args.out / "step_overhead.png")
    print(json.dumps({n: {a: {k: round(v, 3) for k, v in r.items() if k != "rounds"} for a, r in arms.items()}
                      for n, arms in table.items()}, indent=2))


if __name__ == "__main__":
    main()
