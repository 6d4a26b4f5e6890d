"""KV-cache quantisation on the bundled model: memory per token and accuracy vs unquantised storage.

For each kv_cache_dtype (fp8, int8) against "auto" (float32 on CPU), in the same run: cache bytes per
token, greedy agreement over 256 generated tokens for several code prompts (fraction of positions up to
the first divergence, and overall), and the max absolute drift of the full logit vector along the
unquantised greedy path (teacher forcing: every position scored once, with prefix caching off).
Writes benchmarks/results/kv_quant.json.

    python benchmarks/kv_quant.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.bench.machine import machine_facts

RESULTS = Path(__file__).parent / "results"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():", "class Stack:\n    def push(self, item):",
           "# Parse the command line\nimport argparse\n"]
NEW = 256


def run(kv_dtype: str, prompts: list[list[int]], forced: list[list[int]] | None = None):
    """Greedy tokens per prompt, and the full logits at every position of prompt + `forced` continuation."""
    llm = LLM(kv_cache_dtype=kv_dtype, load_progress=False, kv_cache_memory_bytes=64 * 2**20,
              enable_prefix_caching=False)
    greedy = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)]
    if forced is None:
        return llm.engine.layout.bytes_per_token, greedy, None
    return llm.engine.layout.bytes_per_token, greedy, [_forced_logits(llm, p + f) for p, f in zip(prompts, forced)]


def _forced_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """One prefill of `tokens` asking for prompt logprobs, so every position's logits are computed."""
    rows = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]
    try:
        llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.engine.model.compute_logits = compute
    return torch.cat(rows)


def agreement(a: list[int], b: list[int]) -> tuple[float, float]:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return first / len(a), sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    tok = LLM(load_progress=False, kv_cache_memory_bytes=16 * 2**20).get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    base_bytes, base, _ = run("auto", prompts)
    _, _, base_lp = run("auto", prompts, forced=base)
    result = {"machine": machine_facts(), "new_tokens": NEW, "prompts": PROMPTS,
              "auto": {"bytes_per_token": base_bytes, "storage": "float32 (model dtype on CPU)"}}
    for kv in ("fp8", "int8"):
        nbytes, greedy, _ = run(kv, prompts)
        _, _, lp = run(kv, prompts, forced=base)
        until, overall = zip(*(agreement(b, g) for b, g in zip(base, greedy)))
        drift = max((x - y).abs().max().item() for x, y in zip(base_lp, lp))
        scale = max(x.abs().max().item() for x in base_lp)
        result[kv] = {"bytes_per_token": nbytes, "greedy_agreement_until_first_divergence": list(until),
                      "greedy_agreement_overall": list(overall), "max_logit_drift_on_reference_path": drift,
                      "max_abs_logit_on_reference_path": scale}
        print(kv, json.dumps(result[kv]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_quant.json").write_text(json.dumps(result, indent=2))
    print("auto bytes/token", base_bytes)


if __name__ == "__main__":
    main()
