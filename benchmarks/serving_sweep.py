"""Serving sweep: deepinfer vs `transformers serve` on the same checkpoint, same prompts, same machine, same run.

For the bundled model and a larger random DeepSeek-V4 checkpoint (the one of offline_throughput.py), each
engine is started as an OpenAI-compatible server in float32 on the CPU and loaded by `deepinfer bench sweep`
at max concurrency 1, 2, 4, ..., 64. Both get identical text prompts (random token ids decoded with the
model's tokenizer; `transformers serve` takes only text) and greedy decoding without `ignore_eos` (which
`transformers serve` rejects), so both generate the same continuations. `transformers serve` cannot batch
V4 (its continuous batching rejects V4's compressed attention layers), so it serves requests one by one;
that is the baseline a user has today. Writes benchmarks/results/serving_sweep.json (both sweeps of both
models and machine facts) and serving_sweep_<model>.png.

    python benchmarks/serving_sweep.py            # full run (about 15-25 minutes on 2 cores)
    python benchmarks/serving_sweep.py --quick    # concurrency 1 and 4, few tokens: a smoke test

Needs the bench extra (`pip install -e ".[test,bench]"`: transformers, accelerate, matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from deepinfer import cli
from deepinfer.bench.machine import machine_facts
from deepinfer.bench.sweep import plot_sweeps, run_sweep
from deepinfer.llm import default_model_path

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import BENCH_V4, build_checkpoint  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, path: Path, port: int) -> list[str]:
    if engine == "deepinfer":
        return [sys.executable, "-m", "deepinfer", "serve", str(path), "--port", str(port), "--dtype", "float32",
                "--served-model-name", str(path), "--no-load-progress", "--no-access-log", "--log-level", "warning"]
    return [shutil.which("transformers") or "transformers", "serve", str(path), "--device", "cpu",
            "--dtype", "float32", "--port", str(port), "--log-level", "warning"]


class Server:
    """One engine's server process; its output goes to a log file (quoted when it fails)."""

    def __init__(self, engine: str, path: Path, log: Path):
        self.port, self.log = free_port(), log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(server_command(engine, path, self.port), stdout=out,
                                         stderr=subprocess.STDOUT, env=dict(os.environ))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> Server:
        wait_ready(self.url, self.proc, timeout, self.tail)
        return self

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGINT)


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float, tail) -> None:
    """Until `url`/v1/models answers 200; RuntimeError (with `tail()`, the server's log) when `proc` exits or
    `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{tail()}")
        try:
            if httpx.get(url + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{tail()}")


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """`sig`, then a kill if it has not exited within 30 s."""
    proc.send_signal(sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sweep_args(url: str, path: Path, label: str, quick: bool) -> argparse.Namespace:
    concurrency, input_len, output_len = ("1,4", 32, 8) if quick else ("1,2,4,8,16,32,64", 64, 32)
    argv = ["bench", "sweep", "--base-url", url, "--model", str(path), "--tokenizer", str(path),
            "--prompt-format", "text", "--no-ignore-eos", "--concurrency", concurrency, "--num-prompts", "8",
            "--prompts-per-concurrency", "1", "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--vocab-size", str(BENCH_V4["vocab_size"]), "--warmup", "2", "--label", label,
            "--goodput", "ttft:2000", "tpot:100", "--no-progress"]
    return cli.build_parser(argv).parse_args(argv)


def run_engine(engine: str, name: str, path: Path, logs: Path, quick: bool) -> dict:
    print(f"=== {name}: {engine}", flush=True)
    server = Server(engine, path, logs / f"{name}_{engine}.log").wait_ready()
    try:
        return scrub_paths(run_sweep(sweep_args(server.url, path, engine, quick)), str(path), name)
    finally:
        server.stop()


def scrub_paths(value, path: str, name: str):
    """`value` with the checkpoint's local path replaced by its name (results name no local paths)."""
    if isinstance(value, dict):
        return {k: scrub_paths(v, path, name) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_paths(v, path, name) for v in value]
    return value.replace(path, name) if isinstance(value, str) else value


def checkpoints(tmp: Path) -> dict[str, Path]:
    """The bundled model, and the random 71M V4 given the bundled tokenizer (same 8192-token vocabulary)."""
    bundled = default_model_path()
    large = tmp / "v4-71m"
    build_checkpoint(large)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / name, large / name)
    return {"bundled": bundled, "v4-71m": large}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two concurrencies, few tokens: a smoke test")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--models", default="bundled,v4-71m", help="comma-separated subset (default: %(default)s)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so `finally` stops the servers
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_facts(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = checkpoints(Path(tmp))
        for name in args.models.split(","):
            sweeps = [run_engine(e, name, paths[name], Path(tmp), args.quick) for e in ("deepinfer", "transformers")]
            result["models"][name] = sweeps
            plot_sweeps(sweeps, args.out / f"serving_sweep_{name}.png",
                        title=f"{name}: deepinfer vs transformers serve (float32, {result['machine']['cpu']})")
    (args.out / "serving_sweep.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({n: [[p["summary"]["output_throughput"] for p in s["points"]] for s in sweeps]
                      for n, sweeps in result["models"].items()}, indent=2))


if __name__ == "__main__":
    main()
