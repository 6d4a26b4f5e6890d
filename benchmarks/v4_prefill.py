"""DeepSeek-V4 prompt steps on CPU: tiled prompt attention and the host allocator setting, each on and off.

The checkpoint is peers.py's `v4-hd512` (V4's head dim 512, window 128, CSA ratio 4 with top-16, HCA ratio 128;
random weights in DeepSeek's layout, v4_official.py). Each arm runs in its own process (the allocator setting
cannot be undone in a process) through the offline `LLM`, eager (prompt steps are never compiled), and times
`generate` of one output token for batches of random prompts (prefix caching off: every call computes the whole
prompts): the prompt steps, plus one sample each. Arms:
- `rows`: every query over its own gathered window and entries (models/v4_plan.MIN_TILED_QUERIES set out of
  reach), glibc's default allocator thresholds (DEEPINFER_HOST_MALLOC=0);
- `rows+malloc`: the same with worker/host_memory.py's thresholds;
- `tiles`: tiled prompt attention (TilePlan), default thresholds;
- `tiles+malloc`: both (the shipped default).
The gathers of every arm are index_select (layers/gather.py), so `rows` is faster than the code before the tiles.
Arms alternate per round; medians of rounds are reported, with each arm's first tokens (which must agree).
Writes benchmarks/results/v4_prefill.{json,png}.

    python benchmarks/v4_prefill.py [--shapes 1x128 16x128 64x128 1x1024 1x2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import v4_official  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ARMS = ("rows", "rows+malloc", "tiles", "tiles+malloc")


def measure(arm: str, checkpoint: Path, shapes: list[str], repeats: int) -> dict:
    """In this process: ms per generate() of each shape (batch x prompt tokens), median of `repeats`."""
    import torch

    import deepinfer.models.v4_plan as v4_plan
    from deepinfer import LLM, SamplingParams

    if arm.startswith("rows"):
        v4_plan.MIN_TILED_QUERIES = 1 << 30
    llm = LLM(str(checkpoint), enforce_eager=True, max_num_seqs=64, enable_prefix_caching=False, load_progress=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = {}
    for shape in shapes:
        batch, length = map(int, shape.split("x"))
        g = torch.Generator().manual_seed(length)
        prompts = [{"prompt_token_ids": torch.randint(10, 8000, (length,), generator=g).tolist()}
                   for _ in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: first-call allocations
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(1e3 * (time.perf_counter() - start))
        out[shape] = {"ms": statistics.median(times), "tokens": [o.outputs[0].token_ids[0] for o in outs]}
    return out


def run_arm(arm: str, checkpoint: Path, args) -> dict:
    env = {**os.environ, "DEEPINFER_HOST_MALLOC": "1" if arm.endswith("+malloc") else "0"}
    cmd = [sys.executable, __file__, "--child", arm, str(checkpoint), "--shapes", *args.shapes,
           "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: dict[str, list[dict]], shapes: list[str]) -> dict:
    table = {}
    for shape in shapes:
        ms = {arm: statistics.median(r[shape]["ms"] for r in reps) for arm, reps in runs.items()}
        batch, length = map(int, shape.split("x"))
        table[shape] = {
            "ms": ms,
            "prompt_tokens_per_s": {arm: 1e3 * batch * length / v for arm, v in ms.items()},
            "speedup_vs_rows": {arm: ms["rows"] / v for arm, v in ms.items()},
            "first_tokens_agree": len({tuple(reps[0][shape]["tokens"]) for reps in runs.values()}) == 1,
        }
    return table


def plot(table: dict, path: Path) -> None:
    from deepinfer.bench.plotting import grouped_bars, pyplot

    plt = pyplot()
    shapes = list(table)
    fig, ax = plt.subplots(figsize=(8, 4))
    grouped_bars(ax, [f"{s} tokens" for s in shapes],
                 {arm: [table[s]["prompt_tokens_per_s"][arm] for s in shapes] for arm in ARMS})
    ax.set_ylabel("prompt tokens/s (higher is better)")
    ax.set_title("V4 (head dim 512) prompt steps on CPU, eager")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x128", "16x128", "64x128", "1x1024", "1x2000"],
                        help="BATCHxPROMPT_TOKENS")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed generate() calls per shape and round")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path(tempfile.gettempdir()) / "deepinfer-v4-hd512")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for v4_prefill.json / .png")
    parser.add_argument("--child", nargs=2, metavar=("ARM", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], Path(args.child[1]), args.shapes, args.repeats)))
        return
    from tqdm import tqdm

    from deepinfer.bench.machine import machine_facts
    from deepinfer.llm import default_model_path

    checkpoint = v4_official.build(args.checkpoint_dir, default_model_path())
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for arm in tqdm(ARMS, desc="arms", leave=False):
            runs[arm].append(run_arm(arm, checkpoint, args))
    table = summarise(runs, args.shapes)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_facts(), "checkpoint": "v4-hd512", "config": v4_official.V4_HD512,
              "rounds": args.rounds, "repeats": args.repeats, "results": table}
    (args.out / "v4_prefill.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(table, args.out / "v4_prefill.png")
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
