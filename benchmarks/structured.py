"""Structured-output overhead: decode tokens/s of JSON-schema-constrained vs unconstrained generation on
the bundled model, at batch 1 and batch 32, measured in the same run. Runs alternate; the slowdown is the
median over repeats of (constrained tok/s / the unconstrained tok/s of the run just before it).

Both sides generate exactly `--max-tokens` tokens per request: the unconstrained side ignores EOS, the
constrained side uses a schema that cannot close within that budget (an array of at least 1,000 small
objects), so the comparison is per-token cost at steady state: bitmask fill (overlapped with the
forward on a worker thread), mask application on the constrained rows, and matcher advance. Grammar
compile time (first request vs cache hit) is reported separately. Writes
benchmarks/results/structured.{json,png}.

    python benchmarks/structured.py [--max-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm.auto import tqdm

from deepinfer import LLM, SamplingParams
from deepinfer.bench.machine import machine_facts
from deepinfer.structured import StructuredOutputsParams

RESULTS = Path(__file__).parent / "results"
ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                         "tag": {"enum": ["alpha", "beta", "gamma"]},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "tag", "ok"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 1000}


def prompts(llm: LLM, n: int) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": f"List records as JSON, batch {i}."}])
            for i in range(n)]


def run(llm: LLM, batch: list[str], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def measure(llm: LLM, batch_size: int, max_tokens: int, repeats: int, bar) -> dict:
    batch = prompts(llm, batch_size)
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    run(llm, batch, free), run(llm, batch, constrained)  # warm-up (the grammar compiles here)
    rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for _ in range(repeats):
        for name, params in (("unconstrained", free), ("constrained", constrained)):
            elapsed, tokens = run(llm, batch, params)
            assert tokens == batch_size * max_tokens, f"{name}: {tokens} tokens"
            rates[name].append(tokens / elapsed)
            bar.update(1)
    free_rate, con_rate = (statistics.median(rates[k]) for k in ("unconstrained", "constrained"))
    # Each constrained run is compared with the unconstrained run just before it, so load changes on a
    # shared machine cancel out in the ratio; the slowdown is the median of those paired ratios.
    paired = [c / f for f, c in zip(rates["unconstrained"], rates["constrained"])]
    return {"batch": batch_size, "tokens_per_request": max_tokens, "unconstrained_tok_s": free_rate,
            "constrained_tok_s": con_rate, "slowdown": 1 - statistics.median(paired), "paired_ratios": paired,
            "runs_tok_s": rates}


def compile_times(llm: LLM) -> dict:
    """First request with a new schema (compile) vs the same schema again (cache hit), one token each."""
    fresh = dict(SCHEMA, description=f"fresh {time.time()}")  # a spec the cache has not seen
    params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=fresh))
    batch = prompts(llm, 1)
    first, _ = run(llm, batch, params)
    again, _ = run(llm, batch, params)
    return {"first_request_s": first, "cached_request_s": again}


def _change(slowdown: float) -> str:
    return f"{100 * abs(slowdown):.1f}% {'slower' if slowdown >= 0 else 'faster'}"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["batches"]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["unconstrained_tok_s"] for r in rows], 0.4, label="unconstrained", color="#999")
    ax.bar([x + 0.2 for x in xs], [r["constrained_tok_s"] for r in rows], 0.4, label="JSON schema", color="#2a7")
    ax.set_xticks(list(xs), [f"batch {r['batch']}\n{_change(r['slowdown'])}" for r in rows])
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title("Structured-output overhead, bundled model, same run", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    llm = LLM(load_progress=False, max_num_seqs=max(args.batches), kv_cache_memory_bytes=256 * 2**20)
    result = {"machine": machine_facts(), "model": "bundled default (DeepSeek-V4 architecture, 10M params)",
              "schema": SCHEMA, "batches": []}
    with tqdm(total=2 * args.repeats * len(args.batches), desc="runs") as bar:
        for b in args.batches:
            result["batches"].append(measure(llm, b, args.max_tokens, args.repeats, bar))
    result["compile"] = compile_times(llm)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "structured.png")
    for r in result["batches"]:
        print(f"batch {r['batch']}: unconstrained {r['unconstrained_tok_s']:.0f} tok/s, constrained "
              f"{r['constrained_tok_s']:.0f} tok/s ({_change(r['slowdown'])})")
    print("compile:", result["compile"])


if __name__ == "__main__":
    main()
