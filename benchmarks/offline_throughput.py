"""Offline throughput: deepinfer vs transformers on the same random DeepSeek-V4 checkpoint, same run.

The checkpoint is saved in bfloat16, as DeepSeek ships V4. Reports output tokens/s at batch 16
(equal-length prompts, so transformers' batched generate is valid) for deepinfer (dtype "auto",
which is float32 on a CPU without native bf16) and for transformers twice: as loaded by default
(the checkpoint's bf16) and forced to float32 (same arithmetic as deepinfer). Decode at batch 64
is reported as model-FLOP utilisation against a plain fp32 GEMM measured in the same run
(2 x active parameters per token), with the share of step time spent outside the model forward.
The bundled model is compared at batch 16 too (float32 in both engines).
Writes benchmarks/results/offline_throughput.{json,png}.

    python benchmarks/offline_throughput.py            # full run (a few minutes)
    python benchmarks/offline_throughput.py --quick    # smaller, for a smoke test
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.bench.machine import machine_facts
from deepinfer.llm import default_model_path

RESULTS = Path(__file__).parent / "results"

# ~65M parameters, ~33M active per token: 4 layers covering sliding, CSA and HCA attention.
BENCH_V4 = dict(
    vocab_size=8192, hidden_size=1024, moe_intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=1, head_dim=128, partial_rotary_factor=0.25, q_lora_rank=384, o_groups=4, o_lora_rank=256,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    sliding_window=64, index_n_heads=8, index_head_dim=64, index_topk=16, hc_mult=4, hc_sinkhorn_iters=20,
    swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=8192, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)


def build_checkpoint(path: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.DeepseekV4Config(**BENCH_V4)
    model = tf.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "tid2eid"):
                mod.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, mod.tid2eid.shape))
    model.to(torch.bfloat16).save_pretrained(path)


def load_transformers(path: Path, dtype: torch.dtype | None):
    """transformers as a user loads it: the checkpoint's dtype by default, or a forced one."""
    import transformers as tf

    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = tf.DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model


def active_parameters(model) -> int:
    """Parameters multiplied per token: everything but the embedding and the unrouted experts."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters()) - model.embed.weight.numel()
    per_expert = sum(p[0].numel() for p in (model.layers[0].ffn.experts.w13, model.layers[0].ffn.experts.w2))
    return total - cfg.num_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert


def gemm_flops(seconds: float = 3.0, n: int = 2048, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start)


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, BENCH_V4["vocab_size"], (length,), generator=g).tolist() for _ in range(batch)]


def transformers_tokens_per_s(path: Path, dtype: torch.dtype | None, batch: int, prompt_len: int, new: int) -> float:
    model = load_transformers(path, dtype)
    ids = torch.tensor(prompts(batch, prompt_len))
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return batch * new / (time.perf_counter() - start)


def deepinfer_tokens_per_s(llm: LLM, batch: int, prompt_len: int, new: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts(batch, prompt_len, seed=1), params, use_tqdm=False)
    return batch * new / (time.perf_counter() - start)


class ForwardTimer:
    """Accumulates wall time inside the model forward + logits, to split step time: the eager forward, the
    compiled step's (runner.graphs, which calls forward_static, not forward) and the logits projection."""

    def __init__(self, engine):
        self.seconds = 0.0
        model, graphs = engine.model, engine.runner.graphs
        model.forward = self._timed(model.forward)
        model.compute_logits = self._timed(model.compute_logits)
        if graphs is not None:
            graphs.run = self._timed(graphs.run)

    def _timed(self, fn):
        def run(*args):
            start = time.perf_counter()
            out = fn(*args)
            self.seconds += time.perf_counter() - start
            return out

        return run


def decode_profile(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict:
    """Steady-state decode at `batch`: step time, forward share, tokens/s."""
    engine = llm.engine
    for i, p in enumerate(prompts(batch, prompt_len, seed=2)):
        engine.add_request(f"d{i}", p, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    timer = ForwardTimer(engine)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return {"step_ms": 1e3 * elapsed / steps, "forward_share": timer.seconds / elapsed,
            "tokens_per_s": batch * steps / elapsed}


def bundled_comparison(prompt_len: int, new: int) -> dict:
    """The bundled model at batch 16, float32 in both engines (the precision deepinfer runs on CPU)."""
    path = default_model_path()
    hf = transformers_tokens_per_s(path, torch.float32, 16, prompt_len, new)
    llm = LLM(load_progress=False)
    deepinfer_tokens_per_s(llm, 16, prompt_len, 4)  # warm-up
    ours = deepinfer_tokens_per_s(llm, 16, prompt_len, new)
    params = sum(p.numel() for p in llm.engine.model.parameters()) / 1e6
    return {"params_m": params, "transformers_fp32_bs16_tok_s": hf, "deepinfer_bs16_tok_s": ours,
            "speedup_vs_fp32": ours / hf}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    names = ["transformers\nbf16", "deepinfer\nbf16", "transformers\nfp32", "deepinfer\nfp32",
             "deepinfer bf16\nbatch 64 decode"]
    values = [result["transformers_default_bs16_tok_s"], result["deepinfer_bf16_bs16_tok_s"],
              result["transformers_fp32_bs16_tok_s"], result["deepinfer_bs16_tok_s"],
              result["decode_bs64_bf16"]["tokens_per_s"]]
    a.bar(names, values, color=["#bbb", "#2a7", "#888", "#2a7", "#185"])
    a.set_ylabel("output tokens / s (batch 16 unless noted)")
    a.tick_params(axis="x", labelsize=7)
    a.set_title(f"batch 16: {result['speedup_bf16_vs_default']:.2f}x (bf16), "
                f"{result['speedup_vs_fp32']:.2f}x (fp32) transformers", fontsize=9)
    decode, decode_bf16 = result["decode_bs64"], result["decode_bs64_bf16"]
    shares = [decode["mfu"], decode_bf16["mfu"], 1 - decode["forward_share"]]
    b.bar(["MFU fp32\n(vs fp32 GEMM)", "MFU bf16\n(vs bf16 GEMM)", "fp32 step time\noutside forward"], shares,
          color=["#27a", "#27a", "#a72"])
    b.axhline(0.30, ls="--", c="#27a", lw=1)
    b.axhline(0.15, ls=":", c="#a72", lw=1)
    b.set_ylim(0, 1)
    b.set_title("batch 64 decode (targets dashed)")
    bundled = result["bundled"]
    c.bar(["transformers\nfp32", "deepinfer\nfp32"],
          [bundled["transformers_fp32_bs16_tok_s"], bundled["deepinfer_bs16_tok_s"]], color=["#888", "#2a7"])
    c.set_ylabel("output tokens / s (batch 16)")
    c.set_title(f"bundled {bundled['params_m']:.0f}M model: {bundled['speedup_vs_fp32']:.2f}x transformers",
                fontsize=9)
    fig.suptitle(f"left two: {result['model']['params_m']:.0f}M-param V4 ({result['model']['active_m']:.0f}M active), "
                 f"{result['machine']['cpu']}, {result['machine']['torch_threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens, for a smoke test")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    new, prompt_len, steps = (8, 16, 8) if args.quick else (32, 32, 32)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print("building the random V4 checkpoint ...", flush=True)
        build_checkpoint(Path(tmp))
        llm = LLM(tmp, max_num_seqs=64, max_num_batched_tokens=4096, load_progress=False)
        model = llm.engine.model
        print("fp32 and bf16 GEMM FLOP/s ...", flush=True)
        peak, peak_bf16 = gemm_flops(), gemm_flops(dtype=torch.bfloat16)
        print("transformers (default dtype), batch 16 ...", flush=True)
        hf_default = transformers_tokens_per_s(Path(tmp), None, 16, prompt_len, new)
        print("transformers (float32), batch 16 ...", flush=True)
        hf_fp32 = transformers_tokens_per_s(Path(tmp), torch.float32, 16, prompt_len, new)
        print("deepinfer, batch 16 ...", flush=True)
        deepinfer_tokens_per_s(llm, 16, prompt_len, 4)  # warm-up
        ours = deepinfer_tokens_per_s(llm, 16, prompt_len, new)
        print("deepinfer, batch 64 decode ...", flush=True)
        decode = decode_profile(llm, 64, prompt_len, steps)
        del llm
        print("deepinfer bfloat16, batch 16 and batch 64 decode ...", flush=True)
        llm_bf16 = LLM(tmp, dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=4096, load_progress=False)
        deepinfer_tokens_per_s(llm_bf16, 16, prompt_len, 4)
        ours_bf16 = deepinfer_tokens_per_s(llm_bf16, 16, prompt_len, new)
        decode_bf16 = decode_profile(llm_bf16, 64, prompt_len, steps)
        del llm_bf16
    print("the bundled model: transformers and deepinfer (float32), batch 16 ...", flush=True)
    bundled = bundled_comparison(prompt_len, new)
    active = active_parameters(model)
    decode["mfu"] = decode["tokens_per_s"] * 2 * active / peak
    decode_bf16["mfu"] = decode_bf16["tokens_per_s"] * 2 * active / peak_bf16
    result = {
        "machine": machine_facts(), "gemm_gflops": peak / 1e9, "gemm_bf16_gflops": peak_bf16 / 1e9,
        "model": {"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "active_m": active / 1e6,
                  "config": BENCH_V4},
        "prompt_len": prompt_len, "new_tokens": new,
        "deepinfer_dtype": "float32 (auto on CPU)",
        "transformers_default_bs16_tok_s": hf_default, "transformers_fp32_bs16_tok_s": hf_fp32,
        "deepinfer_bs16_tok_s": ours, "speedup_vs_default": ours / hf_default, "speedup_vs_fp32": ours / hf_fp32,
        "decode_bs64": decode,
        "deepinfer_bf16_bs16_tok_s": ours_bf16, "speedup_bf16_vs_default": ours_bf16 / hf_default,
        "decode_bs64_bf16": decode_bf16, "bundled": bundled,
    }
    (args.out / "offline_throughput.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "offline_throughput.png")
    print(json.dumps({k: v for k, v in result.items() if k != "model"}, indent=2))


if __name__ == "__main__":
    main()
