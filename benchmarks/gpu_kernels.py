"""The Triton kernels and CUDA graphs on one GPU, at DeepSeek-V4-Flash / V3 shapes, in one time-boxed run.

Sections (each guarded: an exception becomes an error entry and the run goes on; each has a time budget, past
which its remaining points are recorded as skipped):
  device     name, versions, the measured device-to-device copy bandwidth (bytes read + written)
  attention  V4 sparse attention decode (window 128 + CSA top-512 / HCA all entries + sink), batch x context
  mla        V3 absorbed MLA paged decode (128 heads, latent 512 + rope 64, block 64)
  indexer    V4 Lightning Indexer scores + exact top-512 (64 heads x 128, entries = context / 4)
  moe        fused routed MoE (256 experts, top-6, D 4096, I 2048): bf16, fp8 (128x128 blocks), mxfp4, int4,
             against the torch bf16 path of layers.moe.routed_experts (DEEPINFER_TRITON=0)
  fp8_gemm   block-scaled FP8 (W8A16) and packed int4 (W4A16) GEMMs against a bf16 torch matmul, V4 projection shapes
  graphs     decode step time eager vs CUDA graphs (worker/cuda_graphs.py) on a 3-layer full-width V4-Flash model,
             and the bundled model's offline throughput with enforce_eager True / False
Times are CUDA-event medians after warm-up (L2 flushed before each timed kernel call); bandwidth is the unique
bytes a call must move over its time, against the HBM peak of a table keyed by device name (default: the measured
copy bandwidth). `--smoke`: tiny shapes on CPU under the Triton interpreter (perf_counter timings), every section
exercised but the CUDA-only parts (the CPU test). Writes the JSON after every point, and a plot beside it.

    python benchmarks/gpu_kernels.py --out results/gpu/gpu_kernels.json [--budget 240]
    python benchmarks/gpu_kernels.py --smoke --out /tmp/x.json
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before anything imports triton: the kernels run under its interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

Entry = dict[str, Any]

# Datasheet peaks (dense tensor-core FLOP/s, HBM bytes/s), keyed by a substring of the device name; first match.
PEAKS: dict[str, dict[str, float]] = {
    "H200": {"hbm": 4.8e12, "bf16": 989e12, "fp8": 1979e12},
    "H100": {"hbm": 3.35e12, "bf16": 989e12, "fp8": 1979e12},
    "H800": {"hbm": 3.35e12, "bf16": 989e12, "fp8": 1979e12},
    "H20": {"hbm": 4.0e12, "bf16": 148e12, "fp8": 296e12},
    "B200": {"hbm": 8.0e12, "bf16": 2250e12, "fp8": 4500e12},
    "A100": {"hbm": 2.0e12, "bf16": 312e12},
}
REFERENCE_LIMIT_BYTES = 20e9  # torch references whose gathers would need more are skipped
FLUSH_BYTES = 256 << 20  # written before each timed CUDA call so the L2 (60 MB on H200) starts cold
SECTION_SHARE = {"device": 10, "attention": 40, "mla": 25, "indexer": 20, "moe": 55, "fp8_gemm": 20, "graphs": 150}


# ------------------------------------------------------------------------------------------------ shapes


@dataclasses.dataclass(frozen=True)
class Shapes:
    dtype: torch.dtype
    # V4 attention: heads, head_dim, window, CSA / HCA ratios, CSA top-k, page (tokens per block)
    heads: int
    head_dim: int
    window: int
    csa_ratio: int
    hca_ratio: int
    topk: int
    page: int
    attn_batches: tuple[int, ...]
    attn_contexts: tuple[int, ...]
    # V3 MLA decode
    mla_heads: int
    mla_latent: int
    mla_rope: int
    mla_page: int
    mla_batches: tuple[int, ...]
    mla_contexts: tuple[int, ...]
    # V4 indexer
    idx_heads: int
    idx_dim: int
    idx_batches: tuple[int, ...]
    idx_contexts: tuple[int, ...]
    # MoE
    hidden: int
    experts: int
    experts_per_token: int
    inter: int
    moe_tokens: tuple[int, ...]
    # FP8 GEMM: (name, N, K) weight shapes and the M (tokens) swept
    gemm_shapes: tuple[tuple[str, int, int], ...]
    gemm_m: tuple[int, ...]
    # graphs: decode batches and the prefill length before them
    graph_batches: tuple[int, ...]
    graph_prefill: int
    llm_prompts: int
    llm_tokens: int


FULL = Shapes(
    dtype=torch.bfloat16, heads=64, head_dim=512, window=128, csa_ratio=4, hca_ratio=128, topk=512, page=128,
    attn_batches=(1, 16, 64, 128), attn_contexts=(8192, 32768, 131072),
    mla_heads=128, mla_latent=512, mla_rope=64, mla_page=64, mla_batches=(1, 32, 64), mla_contexts=(4096, 16384, 32768),
    idx_heads=64, idx_dim=128, idx_batches=(1, 32), idx_contexts=(8192, 32768, 131072),
    hidden=4096, experts=256, experts_per_token=6, inter=2048, moe_tokens=(1, 8, 32, 128, 512),
    gemm_shapes=(("wq_a", 1024, 4096), ("wkv", 512, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192),
                 ("shared_w13", 4096, 4096), ("shared_w2", 4096, 2048)),
    gemm_m=(1, 16, 128, 1024),
    graph_batches=(1, 8, 32), graph_prefill=256, llm_prompts=64, llm_tokens=128,
)

SMOKE = Shapes(
    dtype=torch.float32, heads=4, head_dim=32, window=8, csa_ratio=4, hca_ratio=16, topk=8, page=16,
    attn_batches=(1, 2), attn_contexts=(64,),
    mla_heads=4, mla_latent=32, mla_rope=16, mla_page=16, mla_batches=(1, 2), mla_contexts=(40,),
    idx_heads=4, idx_dim=32, idx_batches=(1, 2), idx_contexts=(128,),
    hidden=64, experts=8, experts_per_token=2, inter=32, moe_tokens=(1, 4),
    gemm_shapes=(("proj", 64, 128),), gemm_m=(1, 5),
    graph_batches=(1, 2), graph_prefill=32, llm_prompts=2, llm_tokens=4,
)

V4_FLASH_3_LAYERS = dict(  # DeepSeek-V4-Flash widths, one layer of each attention kind, no MTP
    model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=3,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
    o_lora_rank=1024, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, norm_topk_prob=True,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=1048576, num_nextn_predict_layers=0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
)

V4_TINY_3_LAYERS = {**V4_FLASH_3_LAYERS, **dict(
    vocab_size=512, hidden_size=128, moe_intermediate_size=64, num_attention_heads=4, head_dim=64,
    qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}, sliding_window=16,
    index_n_heads=4, index_head_dim=32, index_topk=4,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=4096)}


# ------------------------------------------------------------------------------------------------ timing


class Timer:
    """Median of `iters` timed calls after `warmup` untimed ones: CUDA events on a GPU (the L2 flushed before
    each call unless flush=False), perf_counter on CPU. Slow calls get fewer iterations (about max_s each)."""

    def __init__(self, device: torch.device, warmup: int, iters: int, max_s: float) -> None:
        self.cuda = device.type == "cuda"
        self.warmup, self.iters, self.max_s = warmup, iters, max_s
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _iterations(self, fn: Callable[[], object]) -> int:
        elapsed = 0.0
        for _ in range(self.warmup):
            start = time.perf_counter()
            fn()
            self.sync()
            elapsed = time.perf_counter() - start
        return max(2, min(self.iters, int(self.max_s / max(elapsed, 1e-6))))

    def __call__(self, fn: Callable[[], object], flush: bool = True) -> Entry:
        n = self._iterations(fn)
        times = self._cuda_times(fn, n, flush) if self.cuda else self._cpu_times(fn, n)
        return {"ms": statistics.median(times), "ms_min": min(times), "iters": n}

    def _cuda_times(self, fn: Callable[[], object], n: int, flush: bool) -> list[float]:
        pairs = []
        for _ in range(n):
            if flush:
                self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in pairs]

    @staticmethod
    def _cpu_times(fn: Callable[[], object], n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times


# ------------------------------------------------------------------------------------------------ report


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _error(exc: BaseException) -> Entry:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": "".join(traceback.format_exception(exc)[-6:])[-4000:]}


class Report:
    """The results JSON: meta + sections, rewritten after every point (a killed run keeps what it measured)."""

    def __init__(self, path: Path, meta: Entry) -> None:
        self.path, self.meta, self.sections = path, meta, {}
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "sections": self.sections}, indent=1, default=str))
        tmp.replace(self.path)


@dataclasses.dataclass
class Ctx:
    """What a section sees: shapes, device, timer, peaks, its entries and its deadline."""

    shapes: Shapes
    device: torch.device
    timer: Timer
    peaks: dict[str, Any]
    report: Report
    smoke: bool
    section: str = ""
    deadline: float = math.inf

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def entries(self) -> list[Entry]:
        return self.report.sections[self.section]["entries"]

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.report.save()
        print(f"  [{self.section}] {_describe(entry)}", flush=True)

    def point(self, name: str, fn: Callable[[], Entry], **config: Any) -> None:
        """One guarded measurement: fn() -> fields; an exception -> an error entry; past the deadline -> skipped."""
        if time.monotonic() > self.deadline:
            self.add({"name": name, **config, "status": "skipped", "reason": "section time budget"})
            return
        start = time.monotonic()
        try:
            entry = {"name": name, **config, **fn()}
        except Exception as exc:  # noqa: BLE001 - every failure is a result here
            entry = {"name": name, **config, **_error(exc)}
        entry["wall_s"] = round(time.monotonic() - start, 2)
        _release(self.device)
        self.add(entry)

    def bandwidth(self, nbytes: float, ms: float) -> Entry:
        bps = nbytes / (ms * 1e-3)
        return {"bytes": int(nbytes), "GBps": bps / 1e9, "hbm_fraction": bps / self.peaks["hbm"]}

    def flops(self, flops: float, ms: float, dtype_key: str) -> Entry:
        rate = flops / (ms * 1e-3)
        peak = self.peaks.get(dtype_key)
        out = {"flops": flops, "TFLOPs": rate / 1e12, "peak_key": dtype_key,
               "peak_fraction": rate / peak if peak else None}
        if dtype_key != "bf16":  # the FP8 kernels are W8A16: their dots run in bf16
            out["bf16_peak_fraction"] = rate / self.peaks["bf16"] if self.peaks.get("bf16") else None
        return out


def _describe(entry: Entry) -> str:
    keys = ("ms", "ref_ms", "GBps", "hbm_fraction", "TFLOPs", "peak_fraction", "tokens_per_s", "max_abs_err")
    parts = [f"{k}={entry[k]:.4g}" for k in keys if isinstance(entry.get(k), float)]
    status = entry.get("error") or entry.get("status") or ""
    return f"{entry.get('name')}: {' '.join(parts)} {status}".strip()


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype).mul_(std)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ------------------------------------------------------------------------------------------------ device


def _triton_version() -> str:
    try:
        import triton
    except ImportError as exc:
        return f"missing ({exc})"
    return triton.__version__


def device_meta(device: torch.device) -> Entry:
    meta: Entry = {"timestamp": _now(), "torch": torch.__version__, "triton": _triton_version(),
                   "cuda": torch.version.cuda, "python": sys.version.split()[0], "device": "cpu"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_bytes=props.total_memory)
    return meta


def copy_bandwidth(timer: Timer, device: torch.device, nbytes: int) -> Entry:
    """Device-to-device copy of an nbytes tensor; bandwidth counts bytes read and written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    out = timer(lambda: dst.copy_(src), flush=False)
    return {**out, "bytes": 2 * nbytes, "copy_Bps": 2 * nbytes / (out["ms"] * 1e-3)}


def peaks_for(name: str, copy_bps: float) -> dict[str, Any]:
    for key, peaks in PEAKS.items():
        if key.lower() in name.lower():
            return {**peaks, "source": key}
    return {"hbm": copy_bps, "source": "measured copy"}


def matmul_rate(ctx: Ctx) -> Entry:
    """A square matmul in the benchmark dtype: the dense rate this device reaches through torch."""
    n = 128 if ctx.smoke else 8192
    a, b = (_randn(n, n, dtype=ctx.shapes.dtype, device=ctx.device) for _ in range(2))
    out = ctx.timer(lambda: a @ b, flush=False)
    return {**out, **ctx.flops(2 * n ** 3, out["ms"], "bf16"), "n": n, "dtype": str(ctx.shapes.dtype)}


def run_device(ctx: Ctx) -> None:
    ctx.point("copy_bandwidth", lambda: {"copy_Bps": ctx.report.meta["copy_Bps"]})
    ctx.point("peaks", lambda: dict(ctx.peaks))
    ctx.point("matmul", partial(matmul_rate, ctx))


# ------------------------------------------------------------------------------------------------ attention


def _attention_case(sh: Shapes, kind: str, context: int, batch: int, device: torch.device):
    """Decode step of `batch` requests at position context - 1: window ring + this step's row, and the entries."""
    from deepinfer.kernels.sparse_attention import EntrySource, WindowSource

    ratio = sh.csa_ratio if kind == "csa" else sh.hca_ratio
    per_block, blocks = sh.page // ratio, -(-context // sh.page)
    d, dt = sh.head_dim, sh.dtype
    reqs = torch.arange(batch, device=device)
    last = torch.full((batch,), context - 1, device=device)
    window = WindowSource(_randn(batch * sh.window, d, dtype=dt, device=device), sh.window, sh.window,
                          _randn(batch, d, dtype=dt, device=device), reqs, last, reqs, last)
    table = torch.randperm(batch * blocks, device=device).view(batch, blocks)
    pool = _randn(batch * blocks * per_block, d, dtype=dt, device=device)
    visible = context // ratio
    if kind == "csa":
        k = min(sh.topk, visible)
        ids = torch.rand(batch, visible, device=device).topk(k, dim=1).indices.sort(dim=1).values
        entries, attended, extra = EntrySource(pool, None, table, reqs, per_block, entry_ids=ids), k, ids.numel() * 8
    else:
        vis = torch.full((batch,), visible, device=device)
        entries, attended, extra = EntrySource(pool, None, table, reqs, per_block, visible=vis), visible, 0
    q = _randn(batch, sh.heads, d, dtype=dt, device=device)
    sinks = torch.randn(sh.heads, device=device)
    nbytes = batch * (2 * sh.heads * d + (sh.window + attended) * d) * dt.itemsize + extra
    return q, window, entries, sinks, nbytes, attended


def _attention_point(ctx: Ctx, kind: str, context: int, batch: int) -> Entry:
    from deepinfer.kernels.sparse_attention import sparse_attention, sparse_attention_reference

    sh = ctx.shapes
    q, window, entries, sinks, nbytes, attended = _attention_case(sh, kind, context, batch, ctx.device)
    scale = sh.head_dim ** -0.5
    out = ctx.timer(lambda: sparse_attention(q, window, entries, sinks, scale))
    result = {**out, **ctx.bandwidth(nbytes, out["ms"]), "keys": sh.window + attended}
    keys = sh.window + attended
    ref_bytes = batch * keys * sh.head_dim * (sh.dtype.itemsize + 8) + 12 * batch * sh.heads * keys
    if ref_bytes > REFERENCE_LIMIT_BYTES:
        return {**result, "ref_skipped": f"reference would need ~{ref_bytes / 1e9:.0f} GB"}
    ref = ctx.timer(lambda: sparse_attention_reference(q, window, entries, sinks, scale))
    err = _max_err(sparse_attention(q, window, entries, sinks, scale),
                   sparse_attention_reference(q, window, entries, sinks, scale))
    return {**result, "ref_ms": ref["ms"], "speedup_vs_ref": ref["ms"] / out["ms"], "max_abs_err": err}


def run_attention(ctx: Ctx) -> None:
    sh = ctx.shapes
    for kind in ("csa", "hca"):
        for context in sh.attn_contexts:
            for batch in sh.attn_batches:
                ctx.point(f"{kind} b{batch} ctx{context}", partial(_attention_point, ctx, kind, context, batch),
                          kind=kind, batch=batch, context=context)


# ------------------------------------------------------------------------------------------------ MLA


def _mla_point(ctx: Ctx, context: int, batch: int) -> Entry:
    from deepinfer.kernels.mla_decode import mla_decode, mla_decode_reference

    sh, dev = ctx.shapes, ctx.device
    width = sh.mla_latent + sh.mla_rope
    blocks = -(-context // sh.mla_page)
    table = torch.randperm(batch * blocks, device=dev).view(batch, blocks)
    cache = _randn(batch * blocks * sh.mla_page, width, dtype=sh.dtype, device=dev)
    q = _randn(batch, sh.mla_heads, width, dtype=sh.dtype, device=dev)
    lens = torch.full((batch,), context, device=dev)
    scale = (128 + sh.mla_rope) ** -0.5  # V3: qk_nope 128 + rope 64

    def kernel() -> torch.Tensor:
        return mla_decode(q, cache, None, table, lens, sh.mla_latent, scale, block_size=sh.mla_page)

    def reference() -> torch.Tensor:
        return mla_decode_reference(q, cache, None, table, lens, sh.mla_latent, scale, block_size=sh.mla_page)

    out = ctx.timer(kernel)
    item = sh.dtype.itemsize
    nbytes = batch * (context * width + sh.mla_heads * (width + sh.mla_latent)) * item + table.numel() * 8
    result = {**out, **ctx.bandwidth(nbytes, out["ms"])}
    ref_bytes = batch * context * (width * 8 + sh.mla_heads * 12)
    if ref_bytes > REFERENCE_LIMIT_BYTES:
        return {**result, "ref_skipped": f"reference would need ~{ref_bytes / 1e9:.0f} GB"}
    ref = ctx.timer(reference)
    return {**result, "ref_ms": ref["ms"], "speedup_vs_ref": ref["ms"] / out["ms"],
            "max_abs_err": _max_err(kernel(), reference())}


def run_mla(ctx: Ctx) -> None:
    for context in ctx.shapes.mla_contexts:
        for batch in ctx.shapes.mla_batches:
            ctx.point(f"mla b{batch} ctx{context}", partial(_mla_point, ctx, context, batch),
                      batch=batch, context=context)


# ------------------------------------------------------------------------------------------------ indexer


def _indexer_point(ctx: Ctx, context: int, batch: int) -> Entry:
    from deepinfer.kernels import indexer as ix

    sh, dev = ctx.shapes, ctx.device
    per_block, blocks, n = sh.page // sh.csa_ratio, -(-context // sh.page), context // sh.csa_ratio
    table = torch.randperm(batch * blocks, device=dev).view(batch, blocks)
    keys = _randn(batch * blocks * per_block, sh.idx_dim, dtype=sh.dtype, device=dev)
    q = _randn(batch, sh.idx_heads, sh.idx_dim, dtype=sh.dtype, device=dev)
    weights = torch.rand(batch, sh.idx_heads, device=dev) * sh.idx_heads ** -0.5
    reqs, visible = torch.arange(batch, device=dev), torch.full((batch,), n, device=dev)
    args = (q, weights, keys, None, table, reqs, visible, per_block)
    out = ctx.timer(lambda: ix.indexer_topk(*args, sh.topk, max_entries=n))
    scores = ix.indexer_scores(*args, max_entries=n)
    score_ms = ctx.timer(lambda: ix.indexer_scores(*args, max_entries=n))["ms"]
    topk_ms = ctx.timer(lambda: ix.select_topk(scores, visible, sh.topk))["ms"]
    item = sh.dtype.itemsize
    nbytes = batch * (sh.idx_heads * sh.idx_dim * item + sh.idx_heads * 4 + n * sh.idx_dim * item + sh.topk * 8)
    result = {**out, **ctx.bandwidth(nbytes, out["ms"]), "scores_ms": score_ms, "select_topk_ms": topk_ms,
              "entries": n}
    ref_bytes = batch * n * (sh.idx_dim * 4 + sh.idx_heads * 8)
    if ref_bytes > REFERENCE_LIMIT_BYTES:
        return {**result, "ref_skipped": f"reference would need ~{ref_bytes / 1e9:.0f} GB"}
    ref = ctx.timer(lambda: ix.indexer_topk_reference(*args, sh.topk, max_entries=n))
    got, want = ix.indexer_topk(*args, sh.topk, max_entries=n)[0], ix.indexer_topk_reference(*args, sh.topk,
                                                                                              max_entries=n)[0]
    return {**result, "ref_ms": ref["ms"], "speedup_vs_ref": ref["ms"] / out["ms"],
            "topk_mismatch_fraction": (got != want).float().mean().item()}


def run_indexer(ctx: Ctx) -> None:
    for context in ctx.shapes.idx_contexts:
        for batch in ctx.shapes.idx_batches:
            ctx.point(f"indexer b{batch} ctx{context}", partial(_indexer_point, ctx, context, batch),
                      batch=batch, context=context)


# ------------------------------------------------------------------------------------------------ MoE


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None
    s2: torch.Tensor | None
    quant: str | None

    def bytes_per_expert(self) -> int:
        tensors = [self.w13[0], self.w2[0]] + [s[0] for s in (self.s13, self.s2) if s is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def _fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from deepinfer.layers.quant_linear import quantize_fp8_block

    pairs = [quantize_fp8_block(w[e], (128, 128)) for e in range(w.shape[0])]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _mxfp4_experts(e: int, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 codes two per byte ([e, n, k/2] uint8) and UE8M0 scales per 32 inputs (2^-9 .. 2^-4)."""
    from deepinfer.models.loader import FP4_GROUP

    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(118, 124, (e, n, -(-k // FP4_GROUP)), dtype=torch.uint8, device=device)
    return codes, scales.view(torch.float8_e8m0fnu)


def int4_group(k: int) -> int:
    """AWQ's group of 128 inputs, or 16 for the smoke run's narrower matrices."""
    return 128 if k % 128 == 0 else 16


def _int4_experts(e: int, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int4 codes two per byte ([e, n, k/2] uint8) and float16 (scale, zero) pairs per int4_group(k)."""
    g = k // int4_group(k)
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.rand(e, n, g, device=device) * 0.01 + 0.001
    zero = torch.randint(0, 16, (e, n, g), device=device).float()
    return codes, torch.stack([scale, zero], -1).half()


def moe_weights(sh: Shapes, device: torch.device) -> dict[str, ExpertWeights]:
    e, d, i = sh.experts, sh.hidden, sh.inter
    w13 = _randn(e, 2 * i, d, dtype=sh.dtype, device=device, std=d ** -0.5)
    w2 = _randn(e, d, i, dtype=sh.dtype, device=device, std=i ** -0.5)
    (q13, s13), (q2, s2) = _fp8_experts(w13), _fp8_experts(w2)
    (c13, m13), (c2, m2) = _mxfp4_experts(e, 2 * i, d, device), _mxfp4_experts(e, d, i, device)
    (i13, p13), (i2, p2) = _int4_experts(e, 2 * i, d, device), _int4_experts(e, d, i, device)
    return {"bf16": ExpertWeights(w13, w2, None, None, None), "fp8": ExpertWeights(q13, q2, s13, s2, "fp8"),
            "mxfp4": ExpertWeights(c13, c2, m13, m2, "mxfp4"), "int4": ExpertWeights(i13, i2, p13, p2, "int4")}


def _routing(sh: Shapes, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(tokens, sh.experts, device=device).topk(sh.experts_per_token, dim=1).indices
    return ids, torch.rand(tokens, sh.experts_per_token, device=device).softmax(dim=1)


def _moe_point(ctx: Ctx, weights: ExpertWeights, quant: str, tokens: int) -> Entry:
    from deepinfer.kernels.fused_moe import fused_moe
    from deepinfer.layers.moe import routed_experts

    sh, dev = ctx.shapes, ctx.device
    x = _randn(tokens, sh.hidden, dtype=sh.dtype, device=dev)
    ids, route = _routing(sh, tokens, dev)
    w = weights

    block = (1, int4_group(sh.hidden)) if w.quant == "int4" else (128, 128)

    def kernel() -> torch.Tensor:
        return fused_moe(x, ids, route, w.w13, w.w2, 10.0, w.s13, w.s2, w.quant, block)

    out = ctx.timer(kernel)
    touched = int(ids.unique().numel())
    nbytes = touched * w.bytes_per_expert() + 2 * x.numel() * x.element_size()
    flops = 2 * tokens * sh.experts_per_token * 3 * sh.inter * sh.hidden
    result = {**out, **ctx.bandwidth(nbytes, out["ms"]), **ctx.flops(flops, out["ms"], "fp8" if quant == "fp8" else
                                                                      "bf16"), "experts_touched": touched}
    if quant != "bf16":
        return result
    with _env("DEEPINFER_TRITON", "0"):  # layers.moe's torch path (sorted_expert_outputs)
        ref = ctx.timer(lambda: routed_experts(x, ids, route, w.w13, w.w2, 10.0))
        err = _max_err(kernel(), routed_experts(x, ids, route, w.w13, w.w2, 10.0))
    return {**result, "torch_ms": ref["ms"], "speedup_vs_torch": ref["ms"] / out["ms"], "max_abs_err": err}


def run_moe(ctx: Ctx) -> None:
    weights: dict[str, ExpertWeights] = {}
    ctx.point("build weights", lambda: _build_moe(ctx, weights))
    for quant, w in weights.items():
        for tokens in ctx.shapes.moe_tokens:
            ctx.point(f"moe {quant} T{tokens}", partial(_moe_point, ctx, w, quant, tokens), quant=quant,
                      tokens=tokens)
    weights.clear()


def _build_moe(ctx: Ctx, into: dict[str, ExpertWeights]) -> Entry:
    into.update(moe_weights(ctx.shapes, ctx.device))
    return {"bytes": {k: w.bytes_per_expert() * ctx.shapes.experts for k, w in into.items()}}


# ------------------------------------------------------------------------------------------------ FP8 GEMM


def _gemm_point(ctx: Ctx, weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor], m: int) -> Entry:
    from deepinfer.kernels.fp8_gemm import fp8_block_linear

    dense, codes, scale = weight
    n, k = dense.shape
    x = _randn(m, k, dtype=ctx.shapes.dtype, device=ctx.device)
    out = ctx.timer(lambda: fp8_block_linear(x, codes, scale, (128, 128)))
    ref = ctx.timer(lambda: torch.nn.functional.linear(x, dense))
    flops = 2 * m * n * k
    nbytes = codes.numel() + scale.numel() * 4 + (m * k + m * n) * x.element_size()
    dense_bytes = dense.numel() * dense.element_size() + (m * k + m * n) * x.element_size()
    return {**out, **ctx.bandwidth(nbytes, out["ms"]), **ctx.flops(flops, out["ms"], "fp8"),
            "torch_bf16_ms": ref["ms"], "torch_bf16_TFLOPs": flops / (ref["ms"] * 1e9),
            "torch_bf16_GBps": dense_bytes / (ref["ms"] * 1e6), "speedup_vs_bf16": ref["ms"] / out["ms"]}


def _int4_gemm_point(ctx: Ctx, dense: torch.Tensor, m: int) -> Entry:
    """The W4A16 GEMM on random packed codes of `dense`'s shape, against bf16 F.linear on `dense`."""
    from deepinfer.kernels.int4_gemm import int4_linear, int4_linear_reference

    n, k = dense.shape
    codes, params = (t[0] for t in _int4_experts(1, n, k, ctx.device))
    x = _randn(m, k, dtype=ctx.shapes.dtype, device=ctx.device)
    out = ctx.timer(lambda: int4_linear(x, codes, params, int4_group(k)))
    err = _max_err(int4_linear(x, codes, params, int4_group(k)), int4_linear_reference(x, codes, params, int4_group(k)))
    ref = ctx.timer(lambda: torch.nn.functional.linear(x, dense))
    nbytes = codes.numel() + params.numel() * 2 + (m * k + m * n) * x.element_size()
    return {**out, **ctx.bandwidth(nbytes, out["ms"]), **ctx.flops(2 * m * n * k, out["ms"], "bf16"),
            "torch_bf16_ms": ref["ms"], "speedup_vs_bf16": ref["ms"] / out["ms"], "max_abs_err": err}


def run_fp8_gemm(ctx: Ctx) -> None:
    from deepinfer.layers.quant_linear import quantize_fp8_block

    for name, n, k in ctx.shapes.gemm_shapes:
        dense = _randn(n, k, dtype=ctx.shapes.dtype, device=ctx.device, std=k ** -0.5)
        codes, scale = quantize_fp8_block(dense, (128, 128))
        for m in ctx.shapes.gemm_m:
            ctx.point(f"{name} {n}x{k} M{m}", partial(_gemm_point, ctx, (dense, codes, scale), m), weight=name,
                      n=n, k=k, m=m)
            ctx.point(f"int4 {name} {n}x{k} M{m}", partial(_int4_gemm_point, ctx, dense, m), weight=name,
                      n=n, k=k, m=m, quant="int4")


# ------------------------------------------------------------------------------------------------ graphs


@dataclasses.dataclass
class DecodeState:
    """Requests prefilled to `length` tokens: their block table, and the scratch block / state slot past the
    requests' own that graph padding rows may write."""

    table: torch.Tensor
    length: int
    page: int
    vocab: int
    scratch_block: int
    scratch_slot: int


def build_v4(raw: dict, device: torch.device, dtype: torch.dtype):
    """DeepseekV4ForCausalLM built on `device` (not on the host), random weights of unit-variance outputs."""
    from deepinfer.config import ModelConfig
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    cfg = ModelConfig.from_dict(raw)
    with device:
        model = DeepseekV4ForCausalLM(cfg, dtype=dtype, device=device).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        for mod in model.modules():
            if hasattr(mod, "tid2eid"):  # hash routing: distinct experts per token id
                picks = torch.rand(mod.tid2eid.shape[0], cfg.n_routed_experts, device=device)
                mod.tid2eid.copy_(picks.topk(mod.tid2eid.shape[1], dim=1).indices)
    return model


def _meta(state: DecodeState, rows: int, start: int, count: int, device: torch.device):
    """ForwardMeta of `rows` requests each computing positions [start, start + count) (as tests/v4_runs.Run)."""
    from deepinfer.layers.metadata import ForwardMeta

    pos = torch.arange(start, start + count, device=device).repeat(rows)
    qs = [r * count for r in range(rows + 1)]
    return ForwardMeta(
        input_ids=torch.randint(0, state.vocab, (rows * count,), device=device), positions=pos,
        token_req=torch.arange(rows, device=device).repeat_interleave(count), block_table=state.table[:rows],
        state_slots=torch.arange(rows, device=device), logits_indices=torch.tensor(qs[1:], device=device) - 1,
        query_start=qs, seq_starts=[start] * rows, seq_lens=[start + count] * rows, block_size=state.page)


def prefill(model, rows: int, length: int, page: int, device: torch.device) -> DecodeState:
    """Fresh zeroed caches for `rows` requests (block 0 unused, the last block and state slot scratch), each
    prefilled with `length` random tokens in one step."""
    blocks = -(-(length + 1) // page)
    num_blocks = rows * blocks + 2
    specs = model.kv_cache_spec(page)
    model.bind_kv_cache({s.name: torch.zeros((num_blocks if s.kind == "paged" else rows + 1, *s.shape),
                                             dtype=s.dtype, device=device) for s in specs})
    table = 1 + torch.randperm(rows * blocks, device=device).view(rows, blocks)
    state = DecodeState(table, length, page, model.config.vocab_size, num_blocks - 1, rows)
    with torch.no_grad():
        model(_meta(state, rows, 0, length, device))
    return state


def _eager_step(model, meta) -> torch.Tensor:
    with torch.no_grad():
        return model(dataclasses.replace(meta, scratch={}))


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def make_graphs(module: Any, model, state: DecodeState, batches: tuple[int, ...],
                device: torch.device) -> tuple[Callable[[Any], torch.Tensor], str]:
    """(step function, API name) over worker/cuda_graphs: StepGraphs (captured now), else DecodeGraphs."""
    if hasattr(module, "StepGraphs"):
        graphs = module.StepGraphs(model, list(batches), state.length + 1, state.page, state.scratch_block,
                                   state.scratch_slot, device)
        if hasattr(graphs, "capture_all"):
            graphs.capture_all(progress=False)
        return lambda meta: _first(graphs.run(meta)), "StepGraphs"
    if hasattr(module, "DecodeGraphs"):
        graphs = module.DecodeGraphs(model, buckets=list(batches), device=device)
        return lambda meta: _first(graphs.run(meta)), "DecodeGraphs"
    raise ImportError("deepinfer.worker.cuda_graphs has neither StepGraphs nor DecodeGraphs")


def _graph_points(ctx: Ctx, model, state: DecodeState, module: Any) -> None:
    batches = ctx.shapes.graph_batches
    holder: dict[str, Any] = {}

    def capture() -> Entry:
        start = time.perf_counter()
        with torch.no_grad():
            holder["run"], api = make_graphs(module, model, state, batches, ctx.device)
        return {"api": api, "capture_s": time.perf_counter() - start,
                "replay": "CUDA graphs" if ctx.cuda else "eager replay (no CUDA)"}

    if module is not None:
        ctx.point("graphs capture", capture, sizes=list(batches))
        last = ctx.entries[-1]
        if not ctx.cuda and "error" in last:  # V4's fixed-shape forward runs on the Triton kernels only
            last.update(status="needs CUDA", reason=last.pop("error"), traceback=None)
            ctx.report.save()
    for b in batches:
        meta = _meta(state, b, state.length, 1, ctx.device)
        ctx.point(f"v4 eager b{b}", lambda m=meta: ctx.timer(lambda: _eager_step(model, m), flush=False),
                  mode="eager", batch=b)
        if "run" not in holder:
            ctx.add({"name": f"v4 graphs b{b}", "mode": "graphs", "batch": b, "status": "skipped",
                     "reason": "no graphs (see the capture / import entries)"})
            continue
        mode = "graphs" if ctx.cuda else "graphs (eager replay)"
        ctx.point(f"v4 graphs b{b}", partial(_graph_replay, ctx, model, holder["run"], meta), mode=mode, batch=b)


def _graph_replay(ctx: Ctx, model, run: Callable[[Any], torch.Tensor], meta) -> Entry:
    with torch.no_grad():
        out = ctx.timer(lambda: run(dataclasses.replace(meta, scratch={})), flush=False)
        err = _max_err(run(dataclasses.replace(meta, scratch={})), _eager_step(model, meta))
    return {**out, "max_abs_err": err}


def _v4_graphs(ctx: Ctx, module: Any) -> None:
    raw = V4_TINY_3_LAYERS if ctx.smoke else V4_FLASH_3_LAYERS
    page = 16 if ctx.smoke else 128
    holder: dict[str, Any] = {}

    def build() -> Entry:
        holder["model"] = model = build_v4(raw, ctx.device, ctx.shapes.dtype)
        params = sum(p.numel() for p in model.parameters())
        holder["state"] = prefill(model, max(ctx.shapes.graph_batches), ctx.shapes.graph_prefill, page, ctx.device)
        return {"parameters": params, "prefill_tokens": ctx.shapes.graph_prefill}

    ctx.point("v4 build + prefill", build, layers=raw["num_hidden_layers"], hidden=raw["hidden_size"],
              experts=raw["n_routed_experts"])
    if "state" in holder:
        _graph_points(ctx, holder["model"], holder["state"], module)
    holder.clear()


def _llm_point(ctx: Ctx, eager: bool | None) -> Entry:
    from deepinfer import LLM, SamplingParams

    options: dict[str, Any] = {"device": ctx.device.type}
    if eager is not None:
        options["enforce_eager"] = eager
    sh = ctx.shapes
    prompts = [f"Question {i}: tell me something about the number {i * 7 % 101}." for i in range(sh.llm_prompts)]
    params = SamplingParams(max_tokens=sh.llm_tokens, ignore_eos=True, temperature=0.0)
    with LLM(**options) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}


def _llm_points(ctx: Ctx) -> None:
    for eager in (True, False):
        name = f"llm enforce_eager={eager}"
        if not eager and not ctx.cuda:  # off CUDA that compiles the steps (a minute): compiled_step.py's job
            ctx.add({"name": name, "status": "skipped", "reason": "no CUDA: no graphs to capture"})
            continue
        try:
            from deepinfer.config import EngineArgs

            accepted = "enforce_eager" in EngineArgs.__dataclass_fields__
        except Exception as exc:  # noqa: BLE001
            ctx.add({"name": name, **_error(exc)})
            return
        if not accepted:
            ctx.add({"name": name, "status": "not accepted", "reason": "EngineArgs has no enforce_eager"})
            if eager:
                ctx.point("llm default", partial(_llm_point, ctx, None), enforce_eager=None)
            continue
        ctx.point(name, partial(_llm_point, ctx, eager), enforce_eager=eager)


def run_graphs(ctx: Ctx) -> None:
    module = None
    try:
        import deepinfer.worker.cuda_graphs as module
    except Exception as exc:  # noqa: BLE001 - being written; record what happened
        ctx.add({"name": "import deepinfer.worker.cuda_graphs", "status": "not available",
                 "reason": f"{type(exc).__name__}: {exc}"})
    _llm_points(ctx)  # first: small and robust
    _release(ctx.device)
    _v4_graphs(ctx, module)


# ------------------------------------------------------------------------------------------------ plot


def _lines(ax, entries: list[Entry], x: str, y: str, group: Callable[[Entry], str], title: str, ylabel: str,
           logx: bool = True) -> None:
    series: dict[str, list[tuple[float, float]]] = {}
    for e in entries:
        if isinstance(e.get(y), (int, float)) and isinstance(e.get(x), (int, float)):
            series.setdefault(group(e), []).append((e[x], e[y]))
    for label, points in series.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel=x, ylabel=ylabel)
    if series:
        ax.legend(fontsize=6)
    ax.grid(alpha=0.3)


def plot(report: Report, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable"
    sec = {k: v["entries"] for k, v in report.sections.items()}
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    _lines(axes[0, 0], sec.get("attention", []), "batch", "hbm_fraction", lambda e: f"{e['kind']} ctx{e['context']}",
           "V4 sparse attention decode", "fraction of HBM peak")
    _lines(axes[0, 1], sec.get("mla", []), "batch", "hbm_fraction", lambda e: f"ctx{e['context']}",
           "V3 MLA decode", "fraction of HBM peak")
    _lines(axes[0, 2], sec.get("indexer", []), "context", "ms", lambda e: f"batch {e['batch']}",
           "V4 indexer top-k", "ms")
    _lines(axes[1, 0], sec.get("moe", []), "tokens", "hbm_fraction", lambda e: str(e.get("quant")),
           "fused MoE (weights touched / time)", "fraction of HBM peak")
    _lines(axes[1, 1], sec.get("fp8_gemm", []), "m", "TFLOPs", lambda e: str(e.get("weight")),
           "FP8 block GEMM", "TFLOP/s")
    _lines(axes[1, 2], sec.get("graphs", []), "batch", "ms", lambda e: str(e.get("mode")),
           "V4-Flash 3-layer decode step", "ms")
    fig.suptitle(f"{report.meta.get('device')} - torch {report.meta.get('torch')}, triton {report.meta.get('triton')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------------------ main

SECTIONS: dict[str, Callable[[Ctx], None]] = {
    "device": run_device, "attention": run_attention, "mla": run_mla, "indexer": run_indexer, "moe": run_moe,
    "fp8_gemm": run_fp8_gemm, "graphs": run_graphs,
}


def run_section(ctx: Ctx, name: str, seconds: float) -> None:
    ctx.section, ctx.deadline = name, time.monotonic() + seconds
    entry = ctx.report.sections[name] = {"status": "running", "budget_s": round(seconds, 1), "entries": []}
    print(f"[{name}] budget {seconds:.0f} s", flush=True)
    start = time.monotonic()
    try:
        SECTIONS[name](ctx)
        entry["status"] = "ok"
    except Exception as exc:  # noqa: BLE001
        entry.update(status="error", **_error(exc))
        ctx.add({"name": f"{name} (section)", **_error(exc)})
    entry["seconds"] = round(time.monotonic() - start, 1)
    _release(ctx.device)
    ctx.report.save()
    print(f"[{name}] {entry['status']} in {entry['seconds']} s", flush=True)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/gpu")) / "gpu_kernels.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for all sections together")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    ap.add_argument("--iters", type=int, default=20)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: running the --smoke shapes on CPU under the Triton interpreter", flush=True)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # triton is imported only below
        args.smoke = True
    device = torch.device("cpu" if args.smoke else "cuda")
    torch.manual_seed(0)
    shapes = SMOKE if args.smoke else FULL
    timer = Timer(device, warmup=1 if args.smoke else 3, iters=2 if args.smoke else args.iters,
                  max_s=0.5 if args.smoke else 1.0)
    meta = {**device_meta(device), "smoke": args.smoke, "shapes": "smoke" if args.smoke else "V4-Flash / V3"}
    report = Report(args.out, meta)
    try:
        copy = copy_bandwidth(timer, device, (1 << 22) if args.smoke else (2 << 30))
    except Exception as exc:  # noqa: BLE001 - the peaks table still applies
        copy = {"copy_Bps": float("nan"), **_error(exc)}
    meta["copy_Bps"] = copy["copy_Bps"]
    meta["peaks"] = peaks_for(meta["device"], copy["copy_Bps"])
    ctx = Ctx(shapes, device, timer, meta["peaks"], report, args.smoke)
    print(f"{meta['device']}: torch {meta['torch']}, triton {meta['triton']}, copy {copy['copy_Bps'] / 1e12:.2f} TB/s,"
          f" peaks {meta['peaks']}", flush=True)
    names = [s for s in args.sections.split(",") if s]
    end = time.monotonic() + args.budget
    for i, name in enumerate(names):  # the time left, shared by the sections still to run
        later = sum(SECTION_SHARE[n] for n in names[i + 1:])
        run_section(ctx, name, max((end - time.monotonic()) * SECTION_SHARE[name] / (SECTION_SHARE[name] + later), 1))
    meta["finished"] = _now()
    problem = plot(report, args.out.with_name(args.out.stem + ".png"))
    meta["plot"] = problem or args.out.with_name(args.out.stem + ".png").name
    report.save()
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
