"""kernels/cpu's MLA decode against the torch path it replaces (gather the context, then two GEMMs), per query-head
count: where the kernel's one pass over the rows stops paying and the GEMMs' reuse across heads wins (it reads each
row once per group of 4 heads). This sets cpu_kernels.MLA_DECODE_MAX_HEADS.

DeepSeek's latent (512 + 64), 64-token blocks, batch 16 (and 1) with 129-191 context positions, float32, torch's
default threads; best of 20 x 10 calls each, the two alternating. Writes benchmarks/results/mla_cpu_heads.json.

    python benchmarks/mla_cpu_heads.py [--heads 4,8,16,32,64,128]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_step_cost import best_ms  # noqa: E402

RESULTS = Path(__file__).parent / "results"
LATENT, ROPE, PAGE, BLOCKS = 512, 64, 64, 512


def best_us(fn) -> float:
    return 1e3 * best_ms(fn, trials=20)


def torch_path(q, pool, table, lens):
    """What the model runs without the kernel (decode_context + _absorbed_batch's attention), eagerly."""
    ctx = pool.view(-1, PAGE, pool.shape[-1])[table].flatten(1, 2)
    valid = torch.arange(ctx.shape[1])[None] < lens[:, None]
    ctx = ctx.masked_fill(~valid[..., None], 0)
    scores = torch.matmul(q, ctx.transpose(1, 2)).masked_fill(~valid[:, None], float("-inf")).softmax(-1)
    return torch.matmul(scores, ctx[..., :LATENT])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=lambda v: [int(x) for x in v.split(",")], default=[4, 8, 16, 32, 64, 128])
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16])
    args = ap.parse_args()
    from deepinfer.bench.machine import machine_facts
    from deepinfer.kernels import cpu_kernels

    if not cpu_kernels.load():
        sys.exit("the CPU kernels could not be built here")
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(BLOCKS * PAGE, LATENT + ROPE, generator=gen)
    rows = []
    for batch in args.batches:
        table = torch.randint(0, BLOCKS, (batch, 3), generator=gen)
        lens = torch.randint(129, 192, (batch,), generator=gen)
        for heads in args.heads:
            inputs = (torch.randn(batch, heads, LATENT + ROPE, generator=gen), pool, table, lens)
            kernel = best_us(lambda x=inputs: cpu_kernels.mla_decode(*x, PAGE, LATENT, 1.0))
            gathered = best_us(lambda x=inputs: torch_path(*x))
            rows.append({"batch": batch, "heads": heads, "kernel_us": kernel, "torch_us": gathered,
                         "speedup": gathered / kernel})
            print(f"batch {batch:3d} heads {heads:4d}: kernel {kernel:8.0f} us, gather + GEMMs {gathered:8.0f} us, "
                  f"{gathered / kernel:.2f}x", flush=True)
    RESULTS.mkdir(exist_ok=True)
    doc = {"machine": machine_facts(), "latent": LATENT, "rope": ROPE, "block_size": PAGE,
           "max_heads_used": cpu_kernels.MLA_DECODE_MAX_HEADS, "rows": rows}
    (RESULTS / "mla_cpu_heads.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
