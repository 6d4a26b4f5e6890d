"""Weight quantisation, measured: AWQ int4 against round-to-nearest int4 and DeepSeek's native FP8 / FP4.

For the bundled model (trained, DeepSeek-V4 architecture) and a tiny DeepSeek-V3 (MLA, dims that split into
groups of 128) trained by this script with transformers for --train-minutes on the corpus' training split, in one
run:
  * `deepinfer quantize --method awq` and `--method rtn` (group 128, the same calibration text: 32 windows of
    256 tokens of the training corpus split), and a native FP8 checkpoint (128 x 128 blocks; V4's routed experts
    in MXFP4), each written to a temporary directory and reloaded by the engine;
  * held-out perplexity (16 windows of 256 tokens of the corpus' held-out split), teacher-forced top-1
    agreement with the unquantised model at every held-out position, greedy agreement over 64 new tokens for
    8 prompts (fraction of positions before the first divergence), mean KL(unquantised || quantised);
  * weight bytes: the quantised tensors against the same weights in bf16, and the loaded model's resident
    parameter + buffer bytes (int4 kept packed) against the unquantised model in bf16;
  * one-stream decode speed (eager, batch 1, 64 tokens): int4 kept packed (dequantised per call) against the
    same checkpoint dequantised at load (DEEPINFER_KEEP_QUANTIZED=0), FP8 and the unquantised model, all loaded
    at once and run in alternation, median of 5 rounds.

Writes benchmarks/results/quantization.json and quantization.png.

    python benchmarks/quantization.py [--quick] [--train-minutes 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer import LLM, SamplingParams
from deepinfer.bench.machine import machine_facts
from deepinfer.layers.mx_quant import encode
from deepinfer.layers.quant_linear import quantize_fp8_block
from deepinfer.llm import default_model_path
from deepinfer.models.loader import iter_checkpoint
from deepinfer.quantization.quantize import QuantizeOptions, quantize
from deepinfer.training.corpus import iter_documents

RESULTS = Path(__file__).parent / "results"
GROUP = 128
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():", "class Stack:\n    def push(self, item):",
           "# Parse the command line\nimport argparse\n", "The quick brown fox", "for i in range(10):",
           "Return the number of", "    def __init__(self, name):"]
V3_DIMS = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
               num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
               routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
               num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1)


def trained_v3(cache: Path, minutes: float, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3 trained here with transformers for `minutes` on the corpus' training split (AdamW,
    warm-up then cosine decay, batches of 8 x 256 tokens), with the bundled model's tokenizer: trained weights
    and activations have the uneven channels AWQ is about, which a random model lacks. Kept in `cache` (one per
    minutes and seed) so a rerun measures the same model."""
    out = cache / f"tiny-v3-{minutes:g}min-seed{seed}"
    if (out / "training.json").exists():
        return out
    import transformers as tf

    from deepinfer.tokenizer import Tokenizer

    torch.manual_seed(seed)
    model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**V3_DIMS)).train()
    ids = torch.tensor(Tokenizer.from_dir(default_model_path()).encode(
        "\n".join(iter_documents("train", max_bytes=6_000_000))))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen, start, step, losses = torch.Generator().manual_seed(seed), time.perf_counter(), 0, []
    while time.perf_counter() - start < 60 * minutes:
        frac = (time.perf_counter() - start) / (60 * minutes)
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = torch.randint(0, len(ids) - 257, (8,), generator=gen)
        batch = torch.stack([ids[i:i + 257] for i in starts.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step += 1
        if step % 100 == 0:
            print(f"  tiny-v3 training: step {step}, loss {sum(losses[-100:]) / 100:.3f}", file=sys.stderr)
    model.eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / name, out / name)
    (out / "training.json").write_text(json.dumps({"steps": step, "minutes": minutes,
                                                   "final_loss_100": sum(losses[-100:]) / len(losses[-100:])}))
    return out


def native_fp8(src: Path, out: Path, model_type: str, experts_fp4: bool) -> dict:
    """src with every 2-D layer weight FP8 (128 x 128 blocks, float32 scales); with experts_fp4, routed experts
    MXFP4 (E2M1 pairs + UE8M0 per 32) as V4 ships them. Returns the quantised weights' byte counts."""
    out.mkdir(parents=True)
    tensors, stored, bf16 = {}, 0, 0
    for name, t, _ in iter_checkpoint(src, model_type):
        if not _fp8_target(name, t):
            tensors[name] = t
            continue
        bf16 += 2 * t.numel()
        if experts_fp4 and ".experts." in name:
            codes, scale = encode(t.float().to(torch.bfloat16), "fp4")
            tensors[name], tensors[name[:-len("weight")] + "scale"] = codes, scale.view(torch.float8_e8m0fnu)
            stored += codes.numel() + scale.numel()
        else:
            codes, scale = quantize_fp8_block(t.float())
            tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = codes, scale
            stored += codes.numel() + 4 * scale.numel()
    save_file(tensors, str(out / "model.safetensors"))
    for item in src.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, out / item.name)
    return {"quantized_bf16_bytes": bf16, "quantized_bytes": stored}


def _fp8_target(name: str, t: torch.Tensor) -> bool:
    """A layer's 2-D projection weight, not a router (`gate.weight`): what DeepSeek's checkpoints store in FP8."""
    parts = name.split(".")
    return t.dim() == 2 and parts[-1] == "weight" and parts[-2] != "gate" and "layers" in parts


def heldout_windows(tok, count: int, length: int) -> list[list[int]]:
    ids = tok.encode("\n".join(iter_documents("heldout", max_bytes=400_000)))
    return [ids[i:i + length] for i in range(0, len(ids) - length, length)][:count]


def forced_logprobs(llm: LLM, windows: list[list[int]]) -> list[torch.Tensor]:
    """log-softmax rows [len - 1, V] of each window, row i predicting token i + 1 (prefix caching off, so every
    position is scored once). The step's logits come as [sampled row, positions 0 .. n - 2]; the rows used are
    checked against the engine's own prompt logprobs."""
    rows, compute = [], llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]
    out = []
    try:
        for w in windows:
            rows.clear()
            got = llm.generate([w], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            lp = torch.cat(rows)[1: len(w)].float().log_softmax(-1)
            engine = torch.tensor([got.prompt_logprobs[i][t].logprob for i, t in enumerate(w) if i])
            if not torch.allclose(lp.gather(1, torch.tensor(w[1:])[:, None])[:, 0], engine, atol=1e-3):
                raise RuntimeError("logit rows do not line up with the engine's prompt logprobs")
            out.append(lp)
    finally:
        llm.engine.model.compute_logits = compute
    return out


def resident_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _load(path: Path, keep: str) -> LLM:
    os.environ["DEEPINFER_KEEP_QUANTIZED"] = keep
    try:
        return LLM(model=path, dtype="float32", enforce_eager=True, enable_prefix_caching=False, load_progress=False,
                   kv_cache_memory_bytes=64 * 2**20)
    finally:
        os.environ.pop("DEEPINFER_KEEP_QUANTIZED", None)


def decode_speeds(variants: dict[str, tuple[Path, str]], prompt: list[int], new: int = 64,
                  rounds: int = 5) -> dict[str, dict]:
    """One-stream decode tok/s of every variant (path, DEEPINFER_KEEP_QUANTIZED), all loaded at once and run in
    alternation, `rounds` times each: the median and every round (the machine's speed drifts)."""
    llms = {name: _load(path, keep) for name, (path, keep) in variants.items()}
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in llms}
    try:
        for llm in llms.values():
            llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
        for _ in range(rounds):
            for name, llm in llms.items():
                start = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                times[name].append(new / (time.perf_counter() - start))
    finally:
        for llm in llms.values():
            llm.shutdown()
    return {n: {"decode_tok_s": sorted(t)[len(t) // 2], "decode_tok_s_rounds": t} for n, t in times.items()}


def evaluate(path: Path, windows, prompts, base=None, keep: str = "1", new: int = 64) -> dict:
    llm = _load(path, keep)
    try:
        lp = forced_logprobs(llm, windows)
        greedy = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)]
        row = {"perplexity": math.exp(-sum(float(r.gather(1, torch.tensor(w[1:])[:, None]).sum())
                                            for r, w in zip(lp, windows)) / sum(len(w) - 1 for w in windows)),
               "resident_weight_bytes": resident_bytes(llm.engine.model)}
    finally:
        llm.shutdown()
    if base is not None:
        row.update(_agreement(lp, greedy, base))
    return row | {"_lp": lp, "_greedy": greedy}


def _agreement(lp, greedy, base) -> dict:
    top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(lp, base["_lp"])]).float().mean()
    kl = torch.cat([(b.exp() * (b - a)).sum(-1) for a, b in zip(lp, base["_lp"])]).mean()
    first = [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(g)) / len(g)
             for g, r in zip(greedy, base["_greedy"])]
    return {"top1_agreement": float(top1), "kl_from_unquantized": float(kl),
            "greedy_agreement_until_divergence": sum(first) / len(first)}


def run_model(label: str, src: Path, model_type: str, work: Path, calib: Path, quick: bool) -> dict:
    tok = LLM(model=src, load_progress=False, kv_cache_memory_bytes=16 * 2**20, enforce_eager=True).get_tokenizer()
    windows, prompts = heldout_windows(tok, 4 if quick else 16, 256), [tok.encode(p) for p in PROMPTS]
    print(f"[{label}] unquantised", file=sys.stderr)
    base = evaluate(src, windows, prompts)
    rows = {"unquantized": base}
    for method in ("rtn", "awq"):
        print(f"[{label}] {method}: quantising", file=sys.stderr)
        opts = QuantizeOptions(method, GROUP, calib, 8 if quick else 32, 256, progress=False)
        report = quantize(src, work / f"{label}-{method}", opts)
        rows[method] = evaluate(work / f"{label}-{method}", windows, prompts, base) | {"report": report}
        if method == "awq":
            rows["awq_dequantized_at_load"] = evaluate(work / f"{label}-awq", windows, prompts, base, keep="0")
    print(f"[{label}] native FP8", file=sys.stderr)
    fp8 = native_fp8(src, work / f"{label}-fp8", model_type, experts_fp4=model_type == "deepseek_v4")
    fp8_name = "fp8" + ("+fp4" if model_type == "deepseek_v4" else "")
    rows[fp8_name] = evaluate(work / f"{label}-fp8", windows, prompts, base, keep="0") | {"bytes": fp8}
    base["bf16_resident_weight_bytes"] = base["resident_weight_bytes"] // 2  # loaded in float32 here
    print(f"[{label}] decode speed", file=sys.stderr)
    variants = {"unquantized": (src, "1"), "rtn": (work / f"{label}-rtn", "1"), "awq": (work / f"{label}-awq", "1"),
                "awq_dequantized_at_load": (work / f"{label}-awq", "0"), fp8_name: (work / f"{label}-fp8", "0")}
    for name, speed in decode_speeds(variants, prompts[0], rounds=2 if quick else 5).items():
        rows[name].update(speed)
    return {k: {n: v for n, v in r.items() if not n.startswith("_")} for k, r in rows.items()}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for i, (label, rows) in enumerate(results["models"].items()):
        names = [n for n in rows if n != "unquantized" and "top1_agreement" in rows[n]]
        x = [i * (len(names) + 1) + j for j in range(len(names))]
        axes[0].bar(x, [rows[n]["perplexity"] / rows["unquantized"]["perplexity"] - 1 for n in names])
        axes[1].bar(x, [1 - rows[n]["top1_agreement"] for n in names])
        axes[2].bar(x, [rows[n]["decode_tok_s"] for n in names])
        for ax in axes:
            for xi, n in zip(x, names):
                ax.annotate(f"{label}\n{n}", (xi, 0), ha="center", va="top", fontsize=6, rotation=90,
                            xytext=(0, -4), textcoords="offset points")
    axes[0].set_title("perplexity increase over unquantised")
    axes[1].set_title("teacher-forced top-1 disagreement")
    axes[2].set_title("one-stream decode tok/s (eager)")
    for ax in axes:
        ax.set_xticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer windows (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--train-minutes", type=float, default=8.0, help="training time of the tiny V3")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "deepinfer-bench",
                        help="where the trained tiny V3 is kept between runs")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        calib, v3 = work / "calib.txt", trained_v3(args.cache_dir, args.train_minutes)
        calib.write_text("\n".join(iter_documents("train", max_bytes=600_000)))
        results = {"machine": machine_facts(), "group_size": GROUP, "models": {
            "bundled-v4": run_model("bundled-v4", default_model_path(), "deepseek_v4", work, calib, args.quick),
            "tiny-v3-trained": run_model("tiny-v3-trained", v3, "deepseek_v3", work, calib, args.quick)}}
        results["tiny_v3_training"] = json.loads((v3 / "training.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quantization.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "quantization.png")
    print(json.dumps({m: {k: {n: v for n, v in r.items() if n != "report"} for k, r in rows.items()}
                      for m, rows in results["models"].items()}, indent=1))


if __name__ == "__main__":
    main()
