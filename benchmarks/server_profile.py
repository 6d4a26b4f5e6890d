"""Where a served token's time goes: a sampling profile of `deepinfer serve` under load, by category.

Starts `deepinfer serve` on a checkpoint (its defaults: compiled decode steps), loads it with `deepinfer
bench`'s client (128 random prompt tokens, 64 output tokens, greedy, EOS ignored, streamed) at concurrency 1
and 16, and samples both of its processes with py-spy (`pip install py-spy`; it reads the processes'
stacks from outside, so the server runs unmodified) while the load runs. Each sample's stack is put in the
first category that matches from its innermost frame outwards:

| category | frames |
|---|---|
| forward | the model's code (deepinfer/models, deepinfer/layers) and the compiled step's (inductor / dynamo) |
| sampler | deepinfer/worker/sampler.py, rejection.py |
| runner | deepinfer/worker/model_runner.py: the step's inputs, outputs to the host |
| scheduler | deepinfer/engine/scheduler.py, kv_cache.py, kv_accounting.py |
| engine loop | deepinfer/engine/core.py, engine_proc.py (batching outputs, the loop itself) |
| IPC | ZeroMQ, msgpack / pickle between the processes |
| detokenize | deepinfer/engine/detokenizer.py, output_processor.py, `tokenizers` |
| API shaping | deepinfer/server (requests in, chunks out) |
| HTTP | uvicorn, starlette, fastapi, h11, httptools |
| event loop | asyncio |

Only samples of running threads count (py-spy's default: a thread waiting on a socket or a lock is not on
the CPU), so the table is the CPU time of each process by category; the per-token wall time is the load's
TPOT. Writes benchmarks/results/server_profile.json and server_profile.png.

    python benchmarks/server_profile.py                 # bundled model and tiny-v3, concurrency 1 and 16
    python benchmarks/server_profile.py --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from deepinfer.bench.datasets import random_requests
from deepinfer.bench.machine import machine_facts
from deepinfer.bench.metrics import summarize
from deepinfer.bench.serve import run_benchmark

sys.path.insert(0, str(Path(__file__).parent))
from peers import MODEL_NAME, OUTPUT_LEN, PROMPT_LEN, VOCAB, Running, checkpoint, deepinfer_engine  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# (category, substrings of a frame's "function (file:line)"), tried in this order on each frame
CATEGORIES = (
    ("sampler", ("deepinfer/worker/sampler.py", "deepinfer/worker/rejection.py")),
    ("forward", ("deepinfer/models/", "deepinfer/layers/", "torch/_inductor", "torch/_dynamo",
                 "deepinfer/worker/compiled_step.py", "deepinfer/worker/cuda_graphs.py", "torchinductor")),
    ("runner", ("deepinfer/worker/model_runner.py",)),
    ("scheduler", ("deepinfer/engine/scheduler.py", "deepinfer/engine/kv_cache.py",
                   "deepinfer/engine/kv_accounting.py")),
    ("detokenize", ("deepinfer/engine/detokenizer.py", "deepinfer/engine/output_processor.py", "tokenizers")),
    ("IPC", ("zmq/", "msgpack", "pickle", "deepinfer/engine/messages.py")),
    ("engine loop", ("deepinfer/engine/core.py", "deepinfer/engine/engine_proc.py")),
    ("API shaping", ("deepinfer/server/",)),
    ("HTTP", ("uvicorn/", "starlette/", "fastapi/", "h11/", "httptools")),
    ("event loop", ("asyncio/",)),
)


def category(frames: list[str]) -> str:
    """The category of a stack (outermost frame first): the first rule matching the innermost frame that
    matches any."""
    for frame in reversed(frames):
        for name, needles in CATEGORIES:
            if any(n in frame for n in needles):
                return name
    return "other"


def parse_collapsed(text: str, api_pid: int) -> dict[str, Counter]:
    """py-spy's raw (collapsed) output, `process PID:"cmd";[process CHILD:"cmd";]frame;... COUNT` lines, as
    process -> category -> samples. The process (the innermost `process` frame) is "api" (the server's own
    pid), "engine" (a stack through engine_proc.py) or "other" (grammar workers, multiprocessing's tracker)."""
    out: dict[str, Counter] = {"api": Counter(), "engine": Counter(), "other": Counter()}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        pid = procs[-1].removeprefix("process ").split(":", 1)[0] if procs else ""
        proc = "api" if pid == str(api_pid) else "engine" if "engine_proc" in stack else "other"
        out[proc][category(frames[len(procs):])] += int(count)
    return out


def record(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--subprocesses", "--format", "raw",
                             "--rate", "200", "--duration", str(int(seconds)), "--output", str(out),
                             "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def load_for(url: str, concurrency: int, seconds: float) -> list:
    """Closed-loop load at `concurrency` until `seconds` have passed; the summaries of each wave."""
    stop, summaries = time.monotonic() + seconds, []
    while time.monotonic() < stop:
        requests = random_requests(max(concurrency, 4), PROMPT_LEN, OUTPUT_LEN, 0.0, VOCAB, seed=len(summaries))
        records, duration = asyncio.run(run_benchmark(url, MODEL_NAME, "completions", requests,
                                                      [0.0] * len(requests), max_concurrency=concurrency,
                                                      progress=False))
        summaries.append(summarize(records, duration, percentiles=(50,)))
    return summaries


def profile(server: Running, concurrency: int, seconds: float, work: Path) -> dict:
    out = work / f"c{concurrency}.txt"
    spy = record(server.proc.pid, seconds, out)
    waves: list = []
    loader = threading.Thread(target=lambda: waves.extend(load_for(server.url, concurrency, seconds + 1)))
    loader.start()
    spy.wait(seconds + 60)
    loader.join()
    samples = parse_collapsed(out.read_text(), server.proc.pid) if out.exists() else {}
    tokens = sum(w.total_output_tokens for w in waves)
    return {"concurrency": concurrency, "seconds": seconds, "output_tokens": tokens,
            "tpot_p50_ms": sorted(w.tpot_ms.percentiles[50.0] for w in waves)[len(waves) // 2],
            "output_tok_s": tokens / sum(w.duration_s for w in waves),
            "cpu_ms_per_token": {p: {k: 1000 * v / 200 / max(1, tokens) for k, v in c.most_common()}
                                 for p, c in samples.items()}}


def plot(doc: dict, out: Path) -> None:
    from deepinfer.bench.plotting import pyplot

    plt = pyplot()
    rows = [(ckpt, p) for ckpt, points in doc["profiles"].items() for p in points]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 4.2), squeeze=False)
    names = [name for name, _ in CATEGORIES] + ["other"]
    colors = dict(zip(names, plt.cm.tab20.colors))
    for ax, (ckpt, point) in zip(axes[0], rows):
        bottom = {"api": 0.0, "engine": 0.0}
        for name in names:
            values = [point["cpu_ms_per_token"].get(p, {}).get(name, 0.0) for p in bottom]
            ax.bar(list(bottom), values, bottom=list(bottom.values()), color=colors[name], label=name)
            bottom = {p: b + v for (p, b), v in zip(bottom.items(), values)}
        ax.set(title=f"{ckpt}, c={point['concurrency']}\nTPOT p50 {point['tpot_p50_ms']:.2f} ms",
               ylabel="CPU ms per output token")
    axes[0][-1].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", default="bundled,tiny-v3")
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16])
    ap.add_argument("--seconds", type=float, default=8.0, help="sampled seconds per point")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("needs py-spy: pip install py-spy")
    work = Path(tempfile.mkdtemp(prefix="profile-"))
    doc = {"machine": machine_facts(), "categories": {k: list(v) for k, v in CATEGORIES}, "profiles": {}}
    engine = deepinfer_engine()
    doc["deepinfer"] = engine.version
    try:
        for name in args.checkpoints.split(","):
            server = Running(engine, name, checkpoint(name, work), work).wait_ready(1200)
            try:
                load_for(server.url, 2, 2)  # warm-up
                doc["profiles"][name] = [profile(server, c, args.seconds, work) for c in args.concurrency]
                for p in doc["profiles"][name]:
                    print(name, json.dumps(p, indent=1), flush=True)
            finally:
                server.stop()
    finally:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "server_profile.json").write_text(json.dumps(doc, indent=1))
        if doc["profiles"]:
            plot(doc, args.out / "server_profile.png")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
