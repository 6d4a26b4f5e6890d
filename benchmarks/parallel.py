"""Multi-rank engine on a tiny V4 (CPU, gloo): per-rank weight bytes, peak resident memory, and the bytes the
expert-parallel collectives deliver per decode step, for world 1 / 2 / 4, both MoE comm kinds.

Each layout runs in a fresh driver process (so peak RSS is that layout's alone), on one tiny V4 checkpoint with
more and larger experts than the test models (routed experts are most of its bytes, as in the real models).
Bytes per decode step = (MoE payload after a 1 + N token run - after a 1-token run) / N, summed over ranks,
next to the closed form moe_comm.bytes_moved(...) x MoE layers. Step times are printed, not compared: with world
4 on a 2-core machine the ranks share cores. Writes benchmarks/results/parallel.json and parallel.png.

    python benchmarks/parallel.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LAYOUTS = {
    "world1": {},
    "tp2": {"tensor_parallel_size": 2},
    "dp2+ep allgather": {"data_parallel_size": 2, "enable_expert_parallel": True, "moe_comm": "allgather"},
    "dp2+ep alltoall": {"data_parallel_size": 2, "enable_expert_parallel": True, "moe_comm": "alltoall"},
    "dp4+ep allgather": {"data_parallel_size": 4, "enable_expert_parallel": True, "moe_comm": "allgather"},
    "dp4+ep alltoall": {"data_parallel_size": 4, "enable_expert_parallel": True, "moe_comm": "alltoall"},
    "dp2xtp2+ep allgather": {"data_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True},
    "dp2+ep alltoall tbo": {"data_parallel_size": 2, "enable_expert_parallel": True, "moe_comm": "alltoall",
                            "two_batch_overlap": True},
}
BATCH, PROMPT, DECODE = 8, 8, 16


def build_checkpoint(out: Path) -> Path:
    """The training default V4 shape with 32 routed experts of width 256 (experts ~3/4 of the weights)."""
    import torch

    from deepinfer.config import ModelConfig
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer.training.export import init_weights, save_checkpoint
    from deepinfer.training.train import DEFAULT_MODEL

    hf = {**DEFAULT_MODEL, "n_routed_experts": 32, "moe_intermediate_size": 256, "vocab_size": 2048}
    model = DeepseekV4ForCausalLM(ModelConfig.from_dict(hf))
    init_weights(model, seed=0)
    return save_checkpoint(model, hf, out, torch.float32)


def measure(ckpt: str, options: dict) -> dict:
    """In a fresh process: run the layout, return its per-rank numbers."""
    import torch

    from deepinfer import LLM, SamplingParams
    from deepinfer.bench.machine import peak_rss_bytes

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2048, (PROMPT,), generator=g).tolist() for _ in range(BATCH)]
    llm = LLM(ckpt, load_progress=False, kv_cache_memory_bytes=32 * 2**20, max_num_seqs=BATCH, **options)
    run = lambda n: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),  # noqa: E731
                                 use_tqdm=False)
    run(1)  # warm-up
    before = _moe_bytes(llm)
    run(1)
    middle = _moe_bytes(llm)
    started = time.perf_counter()
    run(1 + DECODE)
    seconds = time.perf_counter() - started
    after = _moe_bytes(llm)
    per_step = ((after - middle) - (middle - before)) / DECODE
    ranks = _ranks(llm, peak_rss_bytes())
    llm.shutdown()
    return {"options": options, "ranks": ranks, "moe_bytes_per_decode_step": per_step,
            "seconds_per_decode_step": seconds / (1 + DECODE)}


def _moe_bytes(llm) -> int:
    executor = llm.engine.executor
    return 0 if executor is None else sum(s.moe_payload_bytes for s in executor.rank_stats())


def _ranks(llm, own_rss: int) -> list[dict]:
    executor = llm.engine.executor
    if executor is None:
        model = llm.engine.model
        experts = [p for n, p in model.named_parameters() if n.endswith((".experts.w13", ".experts.w2"))]
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return [{"rank": 0, "param_bytes": nbytes(list(model.parameters()) + list(model.buffers())),
                 "expert_param_bytes": nbytes(experts), "peak_rss_bytes": own_rss}]
    return [{"rank": s.rank, "param_bytes": s.param_bytes, "expert_param_bytes": s.expert_param_bytes,
             "peak_rss_bytes": s.peak_rss_bytes} for s in executor.rank_stats()]


def closed_form(ckpt: str, options: dict) -> int | None:
    """bytes_moved for one decode step: every replica's BATCH / D tokens, split over its TP ranks."""
    from deepinfer.config import ModelConfig
    from deepinfer.distributed.moe_comm import HEADER_BYTES, bytes_moved

    if not options.get("enable_expert_parallel"):
        return None
    cfg = ModelConfig.from_hf(ckpt)
    d, t = options.get("data_parallel_size", 1), options.get("tensor_parallel_size", 1)
    per_replica = BATCH // d
    tokens = [len(range(r * -(-per_replica // t), min((r + 1) * -(-per_replica // t), per_replica)))
              for _ in range(d) for r in range(t)]
    kind, world = options.get("moe_comm", "allgather"), d * t
    lanes = [tokens]
    if options.get("two_batch_overlap"):  # a replica's requests split into two micro-batches
        lanes = [[n // 2 for n in tokens], [n - n // 2 for n in tokens]]
    per_layer = sum(bytes_moved(kind, lane, cfg.hidden_size, cfg.num_experts_per_tok, world, 4, cfg.n_routed_experts)
                    for lane in lanes)
    # every rank ends a step with one more header round (all drain), per lane
    header = world * world * (HEADER_BYTES if kind == "allgather" else 8 * (cfg.n_routed_experts + 1))
    return per_layer * cfg.num_layers + header * len(lanes)


def plot(results: dict, path: Path) -> None:
    from deepinfer.bench.plotting import pyplot

    plt = pyplot()
    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    experts = [max(r["expert_param_bytes"] for r in results[n]["ranks"]) / 2**20 for n in names]
    dense = [max(r["param_bytes"] - r["expert_param_bytes"] for r in results[n]["ranks"]) / 2**20 for n in names]
    left.barh(names, experts, label="routed experts")
    left.barh(names, dense, left=experts, label="everything else")
    left.set_xlabel("weights per rank (MiB, largest rank)")
    left.legend()
    moved = [results[n]["moe_bytes_per_decode_step"] / 2**10 for n in names]
    right.barh(names, moved)
    right.set_xlabel(f"MoE bytes delivered per decode step, all ranks (KiB, batch {BATCH})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="world 1 and 2 only")
    parser.add_argument("--one", nargs=2, metavar=("CKPT", "OPTIONS"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.one:
        print(json.dumps(measure(ns.one[0], json.loads(ns.one[1]))))
        return
    layouts = {k: v for k, v in LAYOUTS.items() if not ns.quick or "4" not in k and "tp2+" not in k}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(build_checkpoint(Path(tmp) / "model"))
        for i, (name, options) in enumerate(layouts.items()):
            print(f"[{i + 1}/{len(layouts)}] {name} ...", flush=True)
            done = subprocess.run([sys.executable, __file__, "--one", ckpt, json.dumps(options)],
                                  capture_output=True, text=True, check=True)
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
            results[name]["closed_form_bytes_per_decode_step"] = closed_form(ckpt, options)
            _print_row(name, results[name])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parallel.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "parallel.png")


def _print_row(name: str, r: dict) -> None:
    ranks = r["ranks"]
    print(f"  {name:22s} ranks {len(ranks)}  experts/rank {max(x['expert_param_bytes'] for x in ranks) / 2**20:6.2f}"
          f" MiB  params/rank {max(x['param_bytes'] for x in ranks) / 2**20:6.2f} MiB  peak RSS/rank "
          f"{max(x['peak_rss_bytes'] for x in ranks) / 2**20:7.1f} MiB  MoE bytes/decode step "
          f"{r['moe_bytes_per_decode_step']:10.0f} (closed form {r['closed_form_bytes_per_decode_step']})  "
          f"{1000 * r['seconds_per_decode_step']:.1f} ms/step", flush=True)


if __name__ == "__main__":
    main()
