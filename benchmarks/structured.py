"""Structured-output overhead: decode tokens/s of JSON-schema-constrained vs unconstrained generation on
the bundled model, at batch 1 and batch 32, measured in the same run. Runs alternate; the slowdown is the
median over repeats of (constrained tok/s / the unconstrained tok/s of the run just before it).

Both sides generate exactly `--max-tokens` tokens per request: the unconstrained side ignores EOS, the
constrained side uses a schema that cannot close within that budget (an array of at least 1,000 small
objects), so the comparison is per-token cost at steady state: bitmask fill (overlapped with the
forward on a worker thread), mask application on the constrained rows, and matcher advance. Grammar
compile time (first request vs cache hit) is reported separately. Writes
benchmarks/results/structured.{json,png}.

Budget-aware closing (on by default) is measured twice: its own per-token cost on that steady state (an
engine with `grammar_closing_margin=-1` as a third arm, alternating with the others), and its effect on a
schema of unbounded numbers, strings and arrays at temperature 1 with small max_tokens: tokens/s and the
share of outputs that are valid and end with "stop", closing on vs off, runs alternating.

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


def measure(arms: dict[str, tuple[LLM, SamplingParams]], batch_size: int, max_tokens: int, repeats: int,
            bar) -> dict:
    """tok/s of each arm, runs alternating; each arm's slowdown is the median of its paired ratios to the
    first arm's run just before it, so load changes on a shared machine cancel out."""
    batch = prompts(next(iter(arms.values()))[0], batch_size)
    for llm, params in arms.values():
        run(llm, batch, params)  # warm-up (the grammar compiles here)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, (llm, params) in arms.items():
            elapsed, tokens = run(llm, batch, params)
            assert tokens == batch_size * max_tokens, f"{name}: {tokens} tokens"
            rates[name].append(tokens / elapsed)
            bar.update(1)
    base, *others = arms
    row = {"batch": batch_size, "tokens_per_request": max_tokens, "runs_tok_s": rates}
    for name in arms:
        row[f"{name}_tok_s"] = statistics.median(rates[name])
    for name in others:
        paired = [o / f for f, o in zip(rates[base], rates[name])]
        row[f"{name}_slowdown"], row[f"{name}_paired_ratios"] = 1 - statistics.median(paired), paired
    row["slowdown"], row["paired_ratios"] = row["constrained_slowdown"], row["constrained_paired_ratios"]
    return row


UNBOUNDED = {"type": "object", "properties": {"id": {"type": "integer"}, "score": {"type": "number"},
                                              "tags": {"type": "array", "items": {"type": "string"}}},
             "required": ["id", "score", "tags"]}


def _closing_run(llm: LLM, batch: list[str], max_tokens: int, seed: int) -> dict:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed,
                            structured_outputs=StructuredOutputsParams(json=UNBOUNDED))
    start = time.perf_counter()
    outs = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    return {"tok_s": sum(len(o.token_ids) for o in outs) / elapsed,
            "valid": sum(_valid(o.text) and o.finish_reason == "stop" for o in outs), "outputs": len(outs)}


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), UNBOUNDED)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def measure_closing(llms: dict[str, LLM], batch_size: int, budgets: list[int], repeats: int, bar) -> list[dict]:
    batch = prompts(llms["closing on"], batch_size)
    rows = []
    for budget in budgets:
        runs = {name: [] for name in llms}
        for r in range(repeats):
            for name, llm in llms.items():
                runs[name].append(_closing_run(llm, batch, budget, seed=r))
                bar.update(1)
        rows.append({"batch": batch_size, "max_tokens": budget, **{
            name: {"tok_s": statistics.median(x["tok_s"] for x in v),
                   "valid_and_stop": sum(x["valid"] for x in v) / sum(x["outputs"] for x in v), "runs": v}
            for name, v in runs.items()}})
    return rows


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
    from deepinfer.bench.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["batches"]
    xs = range(len(rows))
    ax.bar([x - 0.27 for x in xs], [r["unconstrained_tok_s"] for r in rows], 0.27, label="unconstrained", color="#999")
    ax.bar(list(xs), [r["constrained_tok_s"] for r in rows], 0.27, label="JSON schema", color="#2a7")
    ax.bar([x + 0.27 for x in xs], [r["closing off_tok_s"] for r in rows], 0.27, label="JSON schema, closing off",
           color="#8cd")
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
    ap.add_argument("--closing-budgets", type=int, nargs="+", default=[24, 48])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    engine = dict(load_progress=False, max_num_seqs=max(args.batches), kv_cache_memory_bytes=256 * 2**20)
    llm, llm_off = LLM(**engine), LLM(**engine, grammar_closing_margin=-1)
    result = {"machine": machine_facts(), "model": "bundled default (DeepSeek-V4 architecture, 10M params)",
              "schema": SCHEMA, "batches": [], "closing_schema": UNBOUNDED}
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    arms = {"unconstrained": (llm, free), "constrained": (llm, constrained), "closing off": (llm_off, constrained)}
    total = len(args.batches) * args.repeats * (len(arms) + 2 * len(args.closing_budgets))
    with tqdm(total=total, desc="runs") as bar:
        for b in args.batches:
            result["batches"].append(measure(arms, b, args.max_tokens, args.repeats, bar))
        result["closing"] = [row for b in args.batches for row in measure_closing(
            {"closing on": llm, "closing off": llm_off}, b, args.closing_budgets, args.repeats, bar)]
    result["compile"] = compile_times(llm)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "structured.png")
    for r in result["batches"]:
        print(f"batch {r['batch']}: unconstrained {r['unconstrained_tok_s']:.0f} tok/s, constrained "
              f"{r['constrained_tok_s']:.0f} tok/s ({_change(r['slowdown'])}), closing off "
              f"{r['closing off_tok_s']:.0f} tok/s ({_change(r['closing off_slowdown'])})")
    for r in result["closing"]:
        print(f"closing, batch {r['batch']}, max_tokens {r['max_tokens']}: " + ", ".join(
            f"{k} {r[k]['tok_s']:.0f} tok/s, {100 * r[k]['valid_and_stop']:.0f}% valid+stop"
            for k in ("closing on", "closing off")))
    print("compile:", result["compile"])


if __name__ == "__main__":
    main()
