"""`deepinfer bench throughput` (offline batch through the `LLM` API, no HTTP) and `deepinfer bench latency`
(one batch, prefill time and per-token decode time), each printing a table and writing an optional JSON.

Prompts are random token ids (seeded), generated with ``ignore_eos`` and temperature 0 so every request
produces exactly its output length. Each latency iteration uses fresh prompts, so the prefix cache never hits.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from deepinfer.bench.datasets import BenchRequest, random_requests
from deepinfer.bench.machine import machine_facts
from deepinfer.bench.metrics import latency_stats
from deepinfer.sampling_params import SamplingParams


def _load(args: argparse.Namespace):
    from deepinfer.cli import load_llm

    return load_llm(args)


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def generate_batch(llm, requests: Sequence[BenchRequest], progress: bool = False) -> tuple[float, int]:
    """Generate every request in one `LLM.generate` call; (seconds, output tokens)."""
    prompts = [list(r.prompt_token_ids) for r in requests]
    params = [_params(r.output_len) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(c.token_ids) for o in outputs for c in o.outputs)


def throughput_result(requests: Sequence[BenchRequest], elapsed: float, output_tokens: int) -> dict:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return {"num_requests": len(requests), "elapsed_s": elapsed, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed}


def main_throughput(args: argparse.Namespace) -> int:
    _check_lengths(args)
    llm = _load(args)
    if args.warmup:
        generate_batch(llm, _requests(args, min(args.num_prompts, 4), seed=args.dataset_seed + 1))
    requests = _requests(args, args.num_prompts, args.dataset_seed)
    result = throughput_result(requests, *generate_batch(llm, requests, progress=not args.no_progress))
    print(_table("Offline Throughput Result", [
        ("Requests", result["num_requests"]), ("Elapsed (s)", result["elapsed_s"]),
        ("Requests/s", result["requests_per_s"]), ("Output tokens/s", result["output_tokens_per_s"]),
        ("Total tokens/s", result["total_tokens_per_s"])]), flush=True)
    _write_json(args, result)
    return 0


def measure_latency(llm, args: argparse.Namespace, iteration: int) -> tuple[float, float]:
    """(prefill seconds, end-to-end seconds) of one batch; both runs use the same fresh prompts."""
    requests = _requests(args, args.batch_size, seed=args.dataset_seed + 1000 * (iteration + 1))
    prefill, _ = generate_batch(llm, [BenchRequest(r.prompt_token_ids, 1) for r in requests])
    llm.reset_prefix_cache()  # the full run must prefill again, not hit what the prefill run cached
    total, _ = generate_batch(llm, requests)
    llm.reset_prefix_cache()
    return prefill, total


def latency_result(samples: Sequence[tuple[float, float]], output_len: int, percentiles: Sequence[float]) -> dict:
    """Prefill and end-to-end stats; per-token decode time = (e2e - prefill) / (output_len - 1)."""
    prefill = [p for p, _ in samples]
    e2e = [t for _, t in samples]
    decode = [max(t - p, 0.0) / (output_len - 1) for p, t in samples] if output_len > 1 else []
    return {"iterations": len(samples), "prefill_ms": latency_stats(prefill, percentiles).to_dict(),
            "e2e_ms": latency_stats(e2e, percentiles).to_dict(),
            "decode_per_token_ms": latency_stats(decode, percentiles).to_dict()}


def main_latency(args: argparse.Namespace) -> int:
    _check_lengths(args)
    if args.num_iters < 1 or args.batch_size < 1:
        raise ValueError("--num-iters and --batch-size must be >= 1")
    llm = _load(args)
    for i in range(args.num_iters_warmup):
        measure_latency(llm, args, args.num_iters + i)
    samples = [measure_latency(llm, args, i) for i in tqdm(range(args.num_iters), desc="iterations",
                                                             disable=args.no_progress)]
    result = latency_result(samples, args.output_len, [50, 90, 99])
    rows = [(f"{label} {stat} (ms)", result[key][stat]) for key, label in
            (("prefill_ms", "Prefill"), ("decode_per_token_ms", "Decode per token"), ("e2e_ms", "End-to-end"))
            for stat in ("mean", "median")]
    print(_table(f"Latency Result (batch {args.batch_size})", rows), flush=True)
    _write_json(args, result)
    return 0


# --- shared --------------------------------------------------------------------------------------
def _requests(args: argparse.Namespace, n: int, seed: int) -> list[BenchRequest]:
    return random_requests(n, args.input_len, args.output_len, 0.0, vocab_size=args.vocab_size, seed=seed)


def _check_lengths(args: argparse.Namespace) -> None:
    if args.input_len < 1 or args.output_len < 1 or args.vocab_size < 1:
        raise ValueError("--input-len, --output-len and --vocab-size must be >= 1")
    if getattr(args, "num_prompts", 1) < 1:
        raise ValueError("--num-prompts must be >= 1")


def _table(title: str, rows: list[tuple[str, float | int]]) -> str:
    width = max(len(label) for label, _ in rows)
    bar = "=" * (width + 16)
    body = [f"{label:<{width}}  {value:>12.2f}" if isinstance(value, float) else f"{label:<{width}}  {value:>12}"
            for label, value in rows]
    return "\n".join([bar, f" {title} ".center(len(bar), "="), *body, bar])


def _write_json(args: argparse.Namespace, result: dict) -> None:
    if not args.result_json:
        return
    from deepinfer.cli import engine_kwargs

    config = {k: v for k, v in vars(args).items() if not k.startswith("engine_") and k != "handler"}
    doc = {"config": config, "engine": engine_kwargs(args), "machine": machine_facts(), "result": result}
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(doc, indent=2, default=str), encoding="utf-8")


def _add_common(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    sub.add_argument("--output-len", type=int, default=128, help="generated tokens (default: %(default)s)")
    sub.add_argument("--vocab-size", type=int, default=256, help="prompt ids drawn from [0, N) (default: 256)")
    sub.add_argument("--dataset-seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    sub.add_argument("--result-json", metavar="PATH", help="write config, machine facts and results here")
    sub.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_throughput_args(sub: argparse.ArgumentParser) -> None:
    _add_common(sub)
    sub.add_argument("--num-prompts", type=int, default=64, help="requests in the batch (default: %(default)s)")
    sub.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="run a few requests first (default: on)")


def add_latency_args(sub: argparse.ArgumentParser) -> None:
    _add_common(sub)
    sub.add_argument("--batch-size", type=int, default=1, help="requests per batch (default: %(default)s)")
    sub.add_argument("--num-iters", type=int, default=10, help="measured iterations (default: %(default)s)")
    sub.add_argument("--num-iters-warmup", type=int, default=2, help="unmeasured iterations (default: 2)")
