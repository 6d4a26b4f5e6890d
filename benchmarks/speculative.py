"""Speculative decoding on the bundled model: output tokens/s and TPOT with and without each method at
batch 1, 8 and 32, measured in the same run, plus acceptance (mean accepted length including the
bonus token, acceptance rate by draft position).

Prompts are 96-token windows of the held-out split of the training corpus (Python standard-library files
the model never saw); each request greedily generates `--max-tokens` tokens (EOS ignored, so every method
produces the same number of tokens, and the same tokens). Configurations run interleaved, `--rounds`
times; the reported figures are the median round and, against no speculation, the median over rounds of
the ratio to the "none" run of the same round (configurations of one round run seconds apart, so a drift of
the machine hits both). Writes benchmarks/results/speculative.{json,png}.

    python benchmarks/speculative.py [--rounds 5] [--max-tokens 128] [--quick] [--methods none "mtp k=3" ...]
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
from deepinfer.training.corpus import iter_documents

RESULTS = Path(__file__).parent / "results"
METHODS = {
    "none": None,
    "none (again)": None,  # a control: the spread between two identical configurations of one round
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
    "mtp k=3 adaptive": {"method": "mtp", "num_speculative_tokens": 3, "verify_policy": "adaptive"},
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
    "dspark k=3": {"method": "dspark", "num_speculative_tokens": 3},
    "dspark k=3 adaptive": {"method": "dspark", "num_speculative_tokens": 3, "verify_policy": "adaptive"},
    "dspark k=4": {"method": "dspark", "num_speculative_tokens": 4},
}


def heldout_prompts(llm: LLM, count: int, length: int = 96) -> list[list[int]]:
    """`count` windows of `length` tokens, spread over the held-out files."""
    tok = llm.get_tokenizer()
    docs = [tok.encode(text) for text in iter_documents("heldout")]
    docs = [d for d in docs if len(d) >= 2 * length]
    prompts = []
    for i in range(count):
        doc = docs[i % len(docs)]
        start = (i // len(docs) * 3 * length + len(doc) // 3) % (len(doc) - length)
        prompts.append(doc[start:start + length])
    return prompts


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once; per-request TTFT and E2E from the engine's steps."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    reqs = [engine.add_request(f"b{i}", p, params)[0] for i, p in enumerate(prompts)]
    first, done = {}, {}
    while engine.has_unfinished:
        engine.step()
        now = time.perf_counter()
        for r in reqs:
            if r.output_token_ids and r.request_id not in first:
                first[r.request_id] = now
            if r.is_finished and r.request_id not in done:
                done[r.request_id] = now
    wall = time.perf_counter() - start
    n_out = sum(len(r.output_token_ids) for r in reqs)
    tpots = [(done[r.request_id] - first[r.request_id]) / (len(r.output_token_ids) - 1) for r in reqs]
    return {"output_tokens": n_out, "seconds": wall, "tok_per_s": n_out / wall,
            "tpot_ms": 1000 * statistics.median(tpots), "tokens": [r.output_token_ids for r in reqs]}


def run_config(spec, batch: int, prompts: list[list[int]], max_tokens: int) -> dict:
    llm = LLM(load_progress=False, kv_cache_memory_bytes=256 * 2**20, max_num_seqs=max(batch, 1),
              max_num_batched_tokens=4096, speculative_config=spec)
    run_batch(llm, prompts[:1], 8)  # warm-up
    llm.engine.scheduler.spec_stats.__init__()
    if batch == 1:  # several requests, one at a time
        parts = [run_batch(llm, [p], max_tokens) for p in prompts[:4]]
        out = {"output_tokens": sum(p["output_tokens"] for p in parts), "seconds": sum(p["seconds"] for p in parts),
               "tpot_ms": statistics.median(p["tpot_ms"] for p in parts), "tokens": [p["tokens"][0] for p in parts]}
        out["tok_per_s"] = out["output_tokens"] / out["seconds"]
    else:
        out = run_batch(llm, prompts[:batch], max_tokens)
    stats = llm.engine.scheduler.spec_stats
    out["mean_accepted_length"] = stats.mean_accepted_length
    out["acceptance_by_position"] = [a / d for a, d in zip(stats.accepted_per_pos, stats.drafted_per_pos)]
    out["num_drafts"], out["num_draft_tokens"], out["num_accepted_tokens"] = (
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--quick", action="store_true", help="one round, batches 1 and 8, 24 tokens")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for speculative.json / .png")
    args = ap.parse_args()
    methods = ["none"] + [m for m in args.methods if m != "none"]
    if args.quick:
        args.rounds, args.batches, args.max_tokens = 1, [1, 8], 24
    prompts = heldout_prompts(LLM(load_progress=False, kv_cache_memory_bytes=16 * 2**20), max(args.batches))
    runs: dict[str, dict[str, list[dict]]] = {}
    jobs = [(r, b, m) for r in range(args.rounds) for b in args.batches for m in methods]
    for _, batch, name in tqdm(jobs, desc="configurations"):
        runs.setdefault(str(batch), {}).setdefault(name, []).append(
            run_config(METHODS[name], batch, prompts, args.max_tokens))
    result = {"machine": machine_facts(), "max_tokens": args.max_tokens, "rounds": args.rounds,
              "prompt_tokens": 96, "batches": {}}
    for batch, by_method in runs.items():
        reference = by_method["none"][0]["tokens"]
        summary = {}
        for name, rounds in by_method.items():
            assert all(r["tokens"] == reference for r in rounds), f"{name} at batch {batch} changed the output"
            median = sorted(rounds, key=lambda r: r["tok_per_s"])[len(rounds) // 2]
            summary[name] = {k: v for k, v in median.items() if k != "tokens"}
            summary[name]["tok_per_s_rounds"] = [r["tok_per_s"] for r in rounds]
        base = summary["none"]["tok_per_s_rounds"]
        for name in summary:
            ratios = [r / b for r, b in zip(summary[name]["tok_per_s_rounds"], base)]
            summary[name]["speedup_rounds"] = ratios
            summary[name]["speedup"] = statistics.median(ratios)
        result["batches"][batch] = summary
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "speculative.png")
    for batch, summary in result["batches"].items():
        for name, s in summary.items():
            print(f"batch {batch:>2} {name:<18} {s['tok_per_s']:8.1f} tok/s  TPOT {s['tpot_ms']:6.2f} ms  "
                  f"x{s['speedup']:.2f}  accepted length {s['mean_accepted_length']:.2f}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    batches = list(result["batches"])
    names = list(result["batches"][batches[0]])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        a.bar([x + i * width for x in range(len(batches))],
              [result["batches"][bt][name]["speedup"] for bt in batches], width, label=name)
    a.axhline(1.0, color="black", lw=0.8)
    a.set_xticks([x + 0.4 - width / 2 for x in range(len(batches))], [f"batch {bt}" for bt in batches])
    a.set_ylabel("output tokens/s vs no speculation")
    a.set_title("decode speed-up (same run)")
    a.legend(fontsize=8)
    bt = "8" if "8" in result["batches"] else batches[0]
    for name in names[1:]:
        rates = result["batches"][bt][name]["acceptance_by_position"]
        b.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    b.set_xlabel("draft position")
    b.set_ylabel("fraction of verified drafts accepted")
    b.set_ylim(0, 1)
    b.set_title(f"acceptance by position (batch {bt}, held-out code)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
