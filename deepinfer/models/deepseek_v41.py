"""DeepSeek-V4.1(-Flash): V4's MQA latent attention with a 128-token window on every layer, compressed KV
(ratio 1: a per-token latent, ratio 2: softmax pooling of pairs) produced only by `kv_source_layers` and read by
the later layers, Lightning Indexers only on `index_source_layers` (the others reuse their top-k), a two-level
indexer (candidate blocks, then top-k inside them), lagged mHC (each sublayer applies the `pre` mix of the
previous one; no hc head), Engram hash memory, sqrt-softplus routed MoE. Parameter names are DeepSeek's.

Numerics follow DeepSeek's reference exactly (bf16 activations): FP8 / MXFP4 GEMMs through
layers.mx_quant.block_scaled_linear, the window KV FP8-QDQ'd, compressed KV FP4-QDQ'd per 16 with E4M3 scales,
indexer q / k FP4-QDQ'd per 32, the kernel's blocked online softmax (layers.attention.blocked_sink_attention),
complex-multiply RoPE. Top-k ties go to the lower position. Each index source scores against the keys of its
own kv source (the reference, on decode steps that complete no ratio-2 group, reads another layer's keys).

Cache (per request): every layer a window ring (state, W + lookahead positions, FP8-QDQ'd bf16); every kv
source a paged pool of compressed entries and one of index keys (one entry per `ratio` tokens), and, at ratio 2,
a float32 ring of [wkv | wgate] projections; the model an int64 ring of compressed token ids for Engram.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.distributed.model_parallel import ModelParallel
from deepinfer.kernels import triton_enabled
from deepinfer.layers.attention import blocked_sink_attention
from deepinfer.layers.batch_invariant import batch_invariant_enabled
from deepinfer.layers.metadata import IMAGE_END, IMAGE_NEWLINE, IMAGE_START, IMAGE_TYPE, CacheTensorSpec, ForwardMeta
from deepinfer.layers.mx_quant import MXStore, block_scaled_linear, packed_shapes, qdq
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import complex_rotations, rotate_tail_complex
from deepinfer.models.engram import EngramTable, NgramHasher, compressed_token_map
from deepinfer.models.v4_plan import compress_plan, ring_source
from deepinfer.models.v41_plan import (
    WindowColumns,
    candidate_blocks,
    keep_rows,
    pack_columns,
    stable_topk,
    subset_columns,
    truncation_floor,
    window_columns,
)
from deepinfer.models.vision_v41 import Aligner, VisionTower
from deepinfer.models.weights import assign_weights


class QLinear(nn.Module):
    """A bias-free projection whose checkpoint weight is FP8 (or MXFP4): kept dequantised in float32 and run as
    the reference's block-scaled GEMM; a bf16 checkpoint's weight runs as a plain bf16 linear."""

    def __init__(self, in_features: int, out_features: int, quantized: bool):
        super().__init__()
        dtype = torch.float32 if quantized else torch.bfloat16
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype))
        self.quantized = quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_scaled_linear(x, self.weight) if self.quantized else F.linear(x, self.weight)


Segment = tuple[int, int, int, int]  # rows [a, b) of the step, computed as rows [offset, offset + b - a) of a call of n


def gemm_segments(meta: ForwardMeta) -> list[Segment]:
    """The float32 GEMM calls of a step (see per_request_linear), in the shapes DeepSeek's reference gives a
    request: its whole prompt in one call (a chunk's rows sit at their prompt positions in that call), one call
    per generated token -- whatever the batch, the chunking, a preemption's recompute or a verify step."""
    out = []
    for r in range(meta.num_reqs):
        start, end, first = meta.query_start[r], meta.query_start[r + 1], meta.seq_starts[r]
        prompt = meta.prompt_lens[r] if meta.prompt_lens is not None else meta.seq_lens[r]
        split = min(end, max(start, start + prompt - first))
        if split > start:
            out.append((start, split, prompt, first))
        out += [(row, row + 1, 1, 0) for row in range(split, end)]
    return out


def per_request_linear(x: torch.Tensor, weight: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """F.linear call by call. A float32 GEMM's rounding depends on its row count, a row's place in it and the
    thread count (BLAS picks kernels and splits by shape: one row is a GEMV), so a row's result must not depend
    on the rows batched with it. (The bf16 and block-scaled GEMMs here are row-independent already.)"""
    if len(segments) == 1 and segments[0] == (0, x.shape[0], x.shape[0], 0):
        return F.linear(x, weight)
    return torch.cat([_call(x[a:b], weight, rows, offset) for a, b, rows, offset in segments]) \
        if segments else F.linear(x, weight)


def _call(x: torch.Tensor, weight: torch.Tensor, rows: int, offset: int) -> torch.Tensor:
    """x's rows as rows [offset, offset + len(x)) of a `rows`-row GEMM (the others zero)."""
    if rows == x.shape[0]:
        return F.linear(x, weight)
    padded = x.new_zeros(rows, x.shape[1])
    padded[offset:offset + x.shape[0]] = x
    return F.linear(padded, weight)[offset:offset + x.shape[0]]


def _stored(name: str, kind: str, rows: int, width: int, fmt: str, packed: bool) -> list[CacheTensorSpec]:
    """Cache tensors of `rows` values of `width` after QDQ point `fmt`: bf16, or packed codes + scales."""
    if not packed:
        return [CacheTensorSpec(name, kind, (rows, width), torch.bfloat16)]
    codes, scales = packed_shapes(width, fmt)
    return [CacheTensorSpec(name, kind, (rows, codes), torch.uint8),
            CacheTensorSpec(f"{name}_scale", kind, (rows, scales), torch.uint8)]


def _linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype)


def _norm(dim: int, eps: float) -> RMSNorm:
    return RMSNorm(dim, eps)  # float32 weight holding the checkpoint's bf16 values: the same products


class Step:
    """Per-step values every layer shares: rotations, window layouts, Engram rows, and the compressed streams /
    index picks / candidate masks the source layers publish for the later ones (keyed by source layer)."""

    def __init__(self, model: DeepseekV41ForCausalLM, meta: ForwardMeta, floor: torch.Tensor | None = None,
                 engram_rows: dict | None = None, vl: torch.Tensor | None = None):
        """floor [R]: positions below it were not computed at the layers this step serves (prefill truncation).
        vl: bool [T] image-span tokens (default: from meta.images; None when the step has none)."""
        self.meta, self.model = meta, model
        self.vl = vl if vl is not None else meta.images.mask(meta.num_tokens) if meta.images is not None else None
        self.rot = {kind: model.rotations(kind, meta.positions) for kind in ("main", "compress")}
        self.window: WindowColumns = window_columns(meta, model.config.sliding_window, model.num_lookahead_tokens,
                                                    floor)
        self.picks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # index source -> (entries, valid) [T, K]
        self.candidates: dict[int, torch.Tensor] = {}  # request row -> bool [T_r, E_r] of the candidate source
        if engram_rows is None and model.hasher is not None:
            engram_rows = model.engram_rows(meta)
        self.engram_rows = engram_rows
        self.segments = gemm_segments(meta)
        self._plans: dict[int, object] = {}

    def compress(self, ratio: int):
        if ratio not in self._plans:
            self._plans[ratio] = compress_plan(self.meta, ratio, False, self.model.num_lookahead_tokens)
        return self._plans[ratio]

    def rows_of(self, r: int) -> slice:
        return slice(self.meta.query_start[r], self.meta.query_start[r + 1])


class Compressor(nn.Module):
    """A kv source's compressed latent: ratio 1 norm(wkv(x)) per token (bf16); ratio r > 1 float32 softmax pooling
    of the r tokens of each non-overlapping group (the latent takes the group's first position)."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio, self.head_dim = ratio, cfg.head_dim
        dtype = torch.float32 if ratio > 1 else torch.bfloat16
        self.wkv = _linear(cfg.hidden_size, cfg.head_dim, dtype)
        if ratio > 1:
            self.wgate = _linear(cfg.hidden_size, cfg.head_dim, dtype)
        self.norm = _norm(cfg.head_dim, cfg.rms_norm_eps)

    def new_latents(self, x: torch.Tensor, ctx: Step, ring: torch.Tensor | None):
        """(latents [N, d] bf16 before RoPE, their entry numbers [N], request rows [N]) of the groups completed
        this step outside any shared cached prefix; advances the ratio-r projection ring."""
        meta = ctx.meta
        if self.ratio == 1:
            start = torch.tensor(meta.paged_write_from or meta.seq_starts, dtype=torch.long, device=x.device)
            keep = meta.positions >= start[meta.token_req]
            return self.norm(self.wkv(x))[keep], meta.positions[keep], meta.token_req[keep]
        plan, starts = ctx.compress(self.ratio), ctx.segments
        xf = x.float()
        new = torch.cat([per_request_linear(xf, self.wkv.weight, starts),
                         per_request_linear(xf, self.wgate.weight, starts)], dim=-1)
        ring_flat = ring.view(-1, ring.shape[-1])
        slots = plan.source.gather(ring_flat, new, plan.slot_idx)  # [N, r, 2d]
        plan.source.write(ring_flat, new)
        kv, score = slots.chunk(2, dim=-1)
        pooled = (kv * score.softmax(dim=1)).sum(dim=1)
        return self.norm(pooled.to(x.dtype)), plan.entry_pos // self.ratio, plan.entry_req


class Indexer(nn.Module):
    """Lightning Indexer of an index source: relu(q . k) weighted per head, summed; keys are the kv source's."""

    def __init__(self, cfg: ModelConfig, owns_keys: bool):
        super().__init__()
        v41, q = cfg.v41, cfg.v41.quantized
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = QLinear(cfg.q_lora_rank, self.n_heads * self.head_dim, q)
        self.weights_proj = _linear(cfg.hidden_size, self.n_heads, torch.bfloat16)
        if owns_keys:
            self.wk = _linear(cfg.head_dim, self.head_dim, torch.bfloat16)
            self.k_norm = _norm(self.head_dim, cfg.rms_norm_eps)
        self.blocks = (v41.candidate_topk_blocks, v41.candidate_block_size)

    def keys(self, latents: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """Index keys of new latents (before their RoPE) before their FP4 QDQ point (the store applies it)."""
        return rotate_tail_complex(self.k_norm(self.wk(latents)), rot)

    def select(self, x: torch.Tensor, qr: torch.Tensor, ctx: Step, keys: MXStore, ratio: int,
               role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Picked entries [T, K] (entry order, invalid last) and validity; role: plain | candidate_source |
        uses_candidates (mask own scores to the candidate source's blocks)."""
        q = qdq(rotate_tail_complex(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), ctx.rot["compress"]), "fp4")
        weights = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        meta, picks = ctx.meta, []
        for r in range(meta.num_reqs):
            rows = ctx.rows_of(r)
            picks.append(self._request(q[rows], weights[rows], keys, meta, r, ratio, role, ctx))
        width = max((p[0].shape[1] for p in picks), default=0)
        entries = torch.cat([F.pad(e, (0, width - e.shape[1])) for e, _ in picks]) if picks else None
        valid = torch.cat([F.pad(v, (0, width - v.shape[1])) for _, v in picks]) if picks else None
        return entries, valid

    def _request(self, q, weights, keys: MXStore, meta: ForwardMeta, r: int, ratio: int, role: str, ctx: Step):
        n_entries = meta.seq_lens[r] // ratio
        positions = meta.positions[meta.query_start[r]:meta.query_start[r + 1]]
        visible = ((positions + 1) // ratio)[:, None]
        if n_entries == 0:
            empty = torch.zeros(len(positions), 0, dtype=torch.long, device=q.device)
            return empty, empty.bool()
        entry = torch.arange(n_entries, device=q.device)
        k = keys.read(meta.slots_of(torch.full_like(entry, r), entry, ratio=ratio))
        scores = torch.einsum("bshd,btd->bsht", q[None], k[None])
        scores = (scores.relu_() * weights[None, :, :, None]).sum(dim=2)[0]  # [T_r, E] bf16
        scores = scores.masked_fill(entry[None, :] >= visible, -torch.inf)
        if role == "candidate_source":
            ctx.candidates[r] = candidate_blocks(scores, visible, *self.blocks)
        elif role == "uses_candidates":
            scores = scores.masked_fill(~ctx.candidates[r], -torch.inf)
        values, picked = stable_topk(scores, min(self.topk, n_entries))
        ok = values > -torch.inf
        order = torch.sort(torch.where(ok, picked, n_entries), dim=-1).values
        return order.clamp(max=n_entries - 1), order < n_entries


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        v41, q, d = cfg.v41, cfg.v41.quantized, cfg.hidden_size
        self.layer, self.ratio = layer, cfg.compress_ratios[layer] if layer < cfg.num_layers else 0
        self.n_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.groups, self.o_rank = cfg.o_groups, cfg.o_lora_rank
        self.rope = "compress" if self.ratio else "main"
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.wq_a = QLinear(d, cfg.q_lora_rank, q)
        self.q_norm = _norm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = QLinear(cfg.q_lora_rank, self.n_heads * self.head_dim, q)
        self.wkv = QLinear(d, self.head_dim, q)
        self.kv_norm = _norm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = _linear(self.n_heads * self.head_dim // self.groups, self.groups * self.o_rank, torch.bfloat16)
        self.wo_b = QLinear(self.groups * self.o_rank, d, q)
        backbone = layer < cfg.num_layers
        self.is_kv_source = backbone and layer in v41.kv_source_layers
        self.is_index_source = backbone and layer in v41.index_source_layers
        if self.ratio:
            self.kv_source, self.index_source = v41.kv_source_of(layer), v41.index_source_of(layer)
        if self.is_kv_source:
            self.compressor = Compressor(cfg, self.ratio)
        if self.is_index_source:
            self.indexer = Indexer(cfg, owns_keys=self.is_kv_source)
            self.role = ("candidate_source" if layer == v41.candidate_source_layer else
                         "uses_candidates" if v41.uses_candidates(layer) else "plain")
        self.cache: dict[str, torch.Tensor] = {}

    def cache_spec(self, prefix: str, cfg: ModelConfig, block_size: int, lookahead: int,
                   packed: bool) -> list[CacheTensorSpec]:
        """The window ring, and at a kv source the paged entries / index keys (and the ratio > 1 projection
        ring); `packed` stores QDQ'd values as their codes and scales (mx_quant.MXStore), else as bf16."""
        specs = _stored(f"{prefix}.window", "state", cfg.sliding_window + lookahead, self.head_dim, "fp8", packed)
        if self.is_kv_source:
            per_block = block_size // self.ratio
            specs += _stored(f"{prefix}.compressor.entries", "paged", per_block, self.head_dim, "fp4_e4m3", packed)
            specs += _stored(f"{prefix}.indexer.keys", "paged", per_block, cfg.index_head_dim, "fp4", packed)
            if self.ratio > 1:
                specs.append(CacheTensorSpec(f"{prefix}.compressor.ring", "state",
                                             (self.ratio + lookahead, 2 * self.head_dim), torch.float32))
        return specs

    def forward(self, x: torch.Tensor, ctx: Step) -> torch.Tensor:
        if self._use_kernel(x):
            return self._kernel_forward(x, ctx, ctx, None)
        win_keys = self._window(x, ctx)
        if self.is_kv_source:
            self._publish(x, ctx)
        return self._attend(x, ctx, win_keys, ctx.window)

    def forward_truncated(self, x: torch.Tensor, ctx: Step, late: Step, keep: torch.Tensor) -> torch.Tensor:
        """Prefill truncation's first layer: window KV and compressed KV of every row (later layers read them),
        attention of the kept rows only (in the `late` sub-step)."""
        if self._use_kernel(x):
            return self._kernel_forward(x, ctx, late, keep)
        win_keys = self._window(x, ctx)[keep]
        if self.is_kv_source:
            self._publish(x, ctx)
        return self._attend(x[keep], late, win_keys, subset_columns(ctx.window, keep))

    def _window(self, x: torch.Tensor, ctx: Step) -> torch.Tensor:
        """This step's window keys [T, W, d] per query; writes the rows' FP8-QDQ'd KV into the ring."""
        ring, src = MXStore(self.cache, "window", self.head_dim, "fp8"), ctx.window.source
        stored, kv = ring.encode(rotate_tail_complex(self.kv_norm(self.wkv(x)), ctx.rot[self.rope]))
        keys = torch.cat([ring.read(src.ring_rows), kv])[ctx.window.rows]
        ring.write(src.write_dst, stored, src.write_src)
        return keys

    def _use_kernel(self, x: torch.Tensor) -> bool:
        """The Triton path (kernels/sparse_attention_v41.py): CUDA with Triton, outside batch-invariant mode."""
        return triton_enabled(x) and not batch_invariant_enabled()

    def _kernel_forward(self, x: torch.Tensor, ctx: Step, late: Step, keep: torch.Tensor | None) -> torch.Tensor:
        """forward (keep None, late = ctx) or forward_truncated on the kernel, which reads the window ring, this
        step's new rows and the kv source's pool itself: the ring is written after the attention has read it."""
        from deepinfer.kernels.sparse_attention_v41 import window_source

        ring, src = MXStore(self.cache, "window", self.head_dim, "fp8"), ctx.window.source
        stored, kv = ring.encode(rotate_tail_complex(self.kv_norm(self.wkv(x)), ctx.rot[self.rope]))
        if self.is_kv_source:
            self._publish(x, ctx)
        columns = ctx.window if keep is None else subset_columns(ctx.window, keep)
        out = self._attend(x if keep is None else x[keep], late, window_source(ring, src.ring_rows, kv, columns),
                           columns)
        ring.write(src.write_dst, stored, src.write_src)
        return out

    def _kernel_attention(self, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, ctx: Step, window) -> torch.Tensor:
        """blocked_sink_attention over pack_columns' columns, the keys read in the kernel (no [T, K, d] gather)."""
        from deepinfer.kernels import sparse_attention_v41 as kernel

        entries = None
        if self.ratio:
            pool, keys = self._pools(ctx)
            if self.is_index_source:
                ctx.picks[self.layer] = self.indexer.select(x, qr, ctx, keys, self.ratio, self.role)
            picked, valid = ctx.picks[self.index_source]
            entries = kernel.entry_source(pool, ctx.meta.block_table, ctx.meta.token_req,
                                          ctx.meta.block_size // self.ratio, picked, valid)
        return kernel.sparse_attention_v41(q, window, entries, self.attn_sink, self.head_dim**-0.5)

    def _attend(self, x: torch.Tensor, ctx: Step, win_keys, columns: WindowColumns) -> torch.Tensor:
        """win_keys: the gathered window keys [T, W, d] (torch path) or where they live (a V41Window: kernel)."""
        rot = ctx.rot[self.rope]
        qr = self.q_norm(self.wq_a(x))
        q = rotate_tail_complex(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), rot)
        if isinstance(win_keys, torch.Tensor):
            comp_keys = comp_valid = None
            if self.ratio:
                comp_keys, comp_valid = self._compressed(x, qr, ctx)
            keys, valid = pack_columns(win_keys, columns, comp_keys, comp_valid)
            out = blocked_sink_attention(q, keys, valid, self.attn_sink, self.head_dim**-0.5)
        else:
            out = self._kernel_attention(x, qr, q, ctx, win_keys)
        out = rotate_tail_complex(out, rot, inverse=True)
        grouped = out.view(1, -1, self.groups, self.n_heads * self.head_dim // self.groups)  # [b, s, G, H d / G]
        grouped = torch.einsum("bsgd,grd->bsgr", grouped, self.wo_a.weight.view(self.groups, self.o_rank, -1))
        return self.wo_b(grouped.flatten(2)[0])

    def _pools(self, ctx: Step) -> tuple[MXStore, MXStore]:
        """(compressed entries, index keys) of this layer's kv source."""
        src = ctx.model.layers[self.kv_source].attn
        return (MXStore(src.cache, "compressor.entries", self.head_dim, "fp4_e4m3"),
                MXStore(src.cache, "indexer.keys", src.indexer.head_dim, "fp4"))

    def _compressed(self, x: torch.Tensor, qr: torch.Tensor, ctx: Step):
        entries, keys = self._pools(ctx)
        if self.is_index_source:
            ctx.picks[self.layer] = self.indexer.select(x, qr, ctx, keys, self.ratio, self.role)
        picked, valid = ctx.picks[self.index_source]
        rows = ctx.meta.slots_of(ctx.meta.token_req[:, None].expand_as(picked), picked, ratio=self.ratio)
        return entries.read(rows), valid

    def _publish(self, x: torch.Tensor, ctx: Step) -> None:
        entries, keys = self._pools(ctx)
        latents, entry, req = self.compressor.new_latents(x, ctx, self.cache.get("compressor.ring"))
        if not entry.numel():
            return
        rot = ctx.model.rotations("compress", entry * self.ratio)
        rows = ctx.meta.slots_of(req, entry, ratio=self.ratio)
        keys.write(rows, keys.encode(self.indexer.keys(latents, rot))[0])
        entries.write(rows, entries.encode(rotate_tail_complex(latents, rot))[0])


class Gate(nn.Module):
    """sqrt-softplus scores; the bias picks experts only; weights renormalised (+1e-20) then route-scaled."""

    def __init__(self, cfg: ModelConfig, n_experts: int, topk: int):
        super().__init__()
        self.topk, self.scale, self.normalize = topk, cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(n_experts, cfg.hidden_size, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        # image-span tokens select with their own bias (a vision checkpoint's `bias_vl`)
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32)) if cfg.v41.has_vision else None

    def forward(self, x: torch.Tensor, starts: list[int], vl: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """vl: bool [T], True for tokens inside an image span (None: a text-only step)."""
        scores = F.softplus(per_request_linear(x.float(), self.weight, starts)).sqrt()
        bias = self.bias if vl is None or self.bias_vl is None else torch.where(vl[:, None], self.bias_vl, self.bias)
        ids = stable_topk(scores + bias, self.topk)[1]
        weights = scores.gather(1, ids)
        if self.normalize and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class Expert(nn.Module):
    """SwiGLU with the training clamps (up to +-limit, gate to <= limit); the routing weight scales the
    activation before w2. `w13` / `w2` rows may live in a stacked Experts module (views)."""

    def __init__(self, w1: QLinear, w3: QLinear, w2: QLinear, limit: float):
        super().__init__()
        self.w1, self.w3, self.w2, self.limit = w1, w3, w2, limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up, gate = up.clamp(-self.limit, self.limit), gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        return self.w2((h if weights is None else weights * h).to(x.dtype))


def _expert(dim: int, inter: int, limit: float, quantized: bool) -> Expert:
    return Expert(QLinear(dim, inter, quantized), QLinear(dim, inter, quantized), QLinear(inter, dim, quantized), limit)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, n_experts: int, topk: int):
        super().__init__()
        q, d, inter = cfg.v41.quantized, cfg.hidden_size, cfg.moe_intermediate_size
        self.n_experts = n_experts
        self.gate = Gate(cfg, n_experts, topk)
        self.experts = nn.ModuleList(_expert(d, inter, cfg.swiglu_limit, q) for _ in range(n_experts))
        self.shared_experts = _expert(d, inter, cfg.swiglu_limit, q)

    def forward(self, x: torch.Tensor, starts: list[int], vl: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.gate(x, starts, vl)
        out = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts).tolist()
        for e, count in enumerate(counts):
            if count:  # experts in index order, each adding into its tokens' rows (the reference's sum order)
                rows, slot = torch.where(ids == e)
                out[rows] += self.experts[e](x[rows], weights[rows, slot, None])
        out += self.shared_experts(x)
        return out.to(x.dtype)


class Engram(nn.Module):
    """Gated write of the hashed n-gram rows into every hc copy: wkv maps the rows to one key per copy and a
    shared value; gate = sigmoid(signed sqrt(<h q_w k_w, key> rstd_h rstd_k / sqrt(dim)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e = cfg.v41.engram
        self.dim, self.hc, self.eps = cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps
        self.wkv = QLinear(e.num_hash_columns * e.head_dim, self.dim * (self.hc + 1), cfg.v41.quantized)
        self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, vl: torch.Tensor | None = None) -> torch.Tensor:
        """vl: bool [T], True inside image spans: those tokens take no Engram write (their gate is shut)."""
        key, value = self.wkv(rows.flatten(-2)).split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        h = streams.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight * self.k_weight) * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if vl is not None:
            gate = gate.masked_fill(vl[:, None], 0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)


def hc_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, eps: float):
    """(pre [T, n], post [T, n], comb [T, n, n]) from the mixes [T, (2 + n) n]; comb Sinkhorn-normalised."""
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return torch.sum(pre.unsqueeze(-1) * streams.float(), dim=1).to(streams.dtype)


def hc_expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[k] = post_k out + sum_j comb[j, k] X[j]."""
    mixed = torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=1)
    return (post.unsqueeze(-1) * out.unsqueeze(-2) + mixed).type_as(out)


class Block(nn.Module):
    """Lagged mHC: attention collapses the streams with the `pre` the previous sublayer produced (the previous
    block's FFN; one-hot for the first block), the FFN with this block's attention `pre`; returns the FFN's."""

    def __init__(self, cfg: ModelConfig, layer: int, n_experts: int, topk: int):
        super().__init__()
        n, d = cfg.hc_mult, cfg.hidden_size
        self.n, self.iters, self.hc_eps, self.eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.attn = Attention(cfg, layer)
        self.ffn = MoE(cfg, n_experts, topk)
        engram = cfg.v41.engram
        self.engram = Engram(cfg) if engram is not None and layer in engram.layer_ids else None
        self.attn_norm, self.ffn_norm = _norm(d, cfg.rms_norm_eps), _norm(d, cfg.rms_norm_eps)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * d, dtype=torch.float32)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def mixes(self, streams: torch.Tensor, part: str, starts: list[int]):
        flat = streams.flatten(1).float()
        rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        mixes = per_request_linear(flat, getattr(self, f"hc_{part}_fn"), starts) * rsqrt
        return hc_split(mixes, getattr(self, f"hc_{part}_scale"), getattr(self, f"hc_{part}_base"), self.n, self.iters,
                        self.hc_eps)

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, ctx: Step) -> tuple[torch.Tensor, torch.Tensor]:
        starts = ctx.segments
        attn_pre, post, comb = self.mixes(streams, "attn", starts)
        out = self.attn(self.attn_norm(hc_collapse(streams, pre)), ctx)
        streams = hc_expand(out, streams, post, comb)
        return self._ffn(streams, attn_pre, starts, ctx.vl)

    def forward_truncated(self, streams: torch.Tensor, pre: torch.Tensor, ctx: Step, late: Step,
                          keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first truncated layer: every row feeds the KV this layer publishes; only the kept rows go on."""
        attn_pre, post, comb = self.mixes(streams[keep], "attn", late.segments)
        out = self.attn.forward_truncated(self.attn_norm(hc_collapse(streams, pre)), ctx, late, keep)
        return self._ffn(hc_expand(out, streams[keep], post, comb), attn_pre, late.segments, late.vl)

    def _ffn(self, streams: torch.Tensor, attn_pre: torch.Tensor, starts: list[int], vl: torch.Tensor | None = None):
        ffn_pre, post, comb = self.mixes(streams, "ffn", starts)
        out = self.ffn(self.ffn_norm(hc_collapse(streams, attn_pre)), starts, vl)
        return hc_expand(out, streams, post, comb), ffn_pre


_ROTATION_ROWS = 4096  # grown on demand


def _scatter(rows: torch.Tensor, keep: torch.Tensor | None, n: int) -> torch.Tensor:
    """Rows of the kept tokens back at their step rows; prompt rows prefill truncation dropped stay zero (they are
    never sampled, and what DSpark reads of them lies outside its window)."""
    if keep is None:
        return rows
    full = rows.new_zeros(n, rows.shape[-1])
    full[keep] = rows
    return full


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 parallel: ModelParallel | None = None):
        super().__init__()
        if dtype != torch.bfloat16:
            raise ValueError("DeepSeek-V4.1 runs in bfloat16 (its quantisation points are defined on bf16)")
        if parallel is not None and not parallel.is_single:
            raise ValueError("DeepSeek-V4.1 runs on one device for now (tensor / expert parallelism: not yet)")
        self.config, self.dtype, self.parallel = config, dtype, ModelParallel.single()
        self.kv_cache_dtype = "auto"
        self.batch_invariant_kernels = True
        self.num_lookahead_tokens = 0
        self.prefill_truncation_tokens, self.truncate_from = 0, -1  # enable_prefill_truncation
        v41, d = config.v41, config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, d, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(Block(config, i, config.n_routed_experts, config.num_experts_per_tok)
                                    for i in range(config.num_layers))
        self.norm = _norm(d, config.rms_norm_eps)
        self.head = _linear(d, config.vocab_size, torch.float32)
        from deepinfer.models.dspark_v41 import build_stages  # it builds on this module's blocks

        self.mtp = build_stages(config)  # the DSpark stages mtp.{K}.* (empty without config.v41.dspark)
        self.mtp_loaded = False
        if v41.vision is not None:  # the ViT, its aligner and the span delimiters' learned embeddings
            self.vision = VisionTower(v41.vision)
            self.aligner = Aligner(v41.vision, d)
            for name in ("image_start", "image_end", "image_newline"):
                setattr(self, name, nn.Parameter(torch.zeros(d, dtype=torch.bfloat16)))
        self.hasher: NgramHasher | None = None
        self.engram_tables: dict[int, EngramTable] = {}
        self._rot: dict[str, torch.Tensor] = {}
        self.to(device)
        self.has_engram = v41.engram is not None

    # --- rotations -----------------------------------------------------------------------------------
    def rotations(self, kind: str, positions: torch.Tensor) -> torch.Tensor:
        rope = self.config.rope_main if kind == "main" else self.config.rope_compress
        need = int(positions.max()) + 1 if positions.numel() else 1
        if kind not in self._rot or self._rot[kind].shape[0] < need:
            self._rot[kind] = complex_rotations(rope, max(_ROTATION_ROWS, 2 * need)).to(positions.device)
        return self._rot[kind][positions]

    # --- images --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """One image's LLM features [n_llm_h * n_llm_w, hidden] (bf16), cells in reading order."""
        if self.config.v41.vision is None:
            raise ValueError("this DeepSeek-V4.1 checkpoint has no vision tower (vision_config)")
        patches = patches.to(self.image_start.device, torch.bfloat16)
        return self.aligner(self.vision(patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)

    def embed_tokens(self, meta: ForwardMeta) -> torch.Tensor:
        """Token embeddings, with image spans overwritten: delimiters by their learned embeddings, IMAGE slots by
        the encoder's rows."""
        h = self.embed(meta.input_ids)
        img = meta.images
        if img is None:
            return h
        if self.config.v41.vision is None:
            raise ValueError("image inputs need a checkpoint with a vision tower")
        h = h.clone()
        for kind, value in ((IMAGE_START, self.image_start), (IMAGE_END, self.image_end),
                            (IMAGE_NEWLINE, self.image_newline)):
            h[img.rows[img.types == kind]] = value.to(h.dtype)
        h[img.rows[img.types == IMAGE_TYPE]] = img.features.to(h.dtype)
        return h

    # --- Engram ----------------------------------------------------------------------------------------
    def attach_checkpoint(self, path: str | Path) -> None:
        """Engram's token map (from the checkpoint's tokenizer.json) and its tables (memory-mapped)."""
        if self.config.v41.engram is not None:
            self.hasher = NgramHasher(self.config.v41.engram, self._token_map(Path(path)))
            self.engram_tables = self._open_tables(Path(path))

    def _token_map(self, root: Path) -> torch.Tensor:
        from tokenizers import Tokenizer

        from deepinfer.models.loader import CheckpointError

        if not (root / "tokenizer.json").is_file():
            raise CheckpointError(f"{root}: Engram needs the checkpoint's tokenizer.json (its hashes use a "
                                  "tokenizer-derived token map)")
        token_map, size = compressed_token_map(Tokenizer.from_file(str(root / "tokenizer.json")),
                                               self.config.vocab_size)
        if size != self.config.v41.engram.compressed_vocab_size:
            raise CheckpointError(f"{root}: tokenizer.json gives {size} compressed Engram ids, the config says "
                                  f"engram_compressed_vocab_size {self.config.v41.engram.compressed_vocab_size}")
        return token_map

    def _open_tables(self, root: Path) -> dict[int, EngramTable]:
        """Each Engram layer's table, with at least the rows its hash layout addresses."""
        from deepinfer.models.loader import CheckpointError, tensor_files

        files, tables = tensor_files(root), {}
        for i, rows in zip(self.config.v41.engram.layer_ids, self.hasher.table_rows):
            name = f"layers.{i}.engram.embed"
            if f"{name}.weight" not in files:
                raise CheckpointError(f"{root}: Engram table {name}.weight is missing")
            tables[i] = EngramTable.open(files[f"{name}.weight"], name)
            if tables[i].num_rows < rows:
                raise CheckpointError(f"{root}: {name}.weight has {tables[i].num_rows} rows; its hash layout "
                                      f"needs {rows}")
        return tables

    def engram_rows(self, meta: ForwardMeta) -> dict[int, torch.Tensor]:
        """Per Engram layer, bf16 [T, columns, head_dim]: the rows of this step's tokens, gathered up front."""
        n = self.hasher.n
        src = ring_source(meta, n + self.num_lookahead_tokens)
        ring = self.cache["engram.tokens"].view(-1)
        new = self.hasher.token_map[meta.input_ids.cpu()].to(meta.device)
        if meta.images is not None:  # an n-gram never reaches into an image span (-1 stops the look-back)
            new = new.masked_fill(meta.images.mask(meta.num_tokens), -1)
        pos = meta.positions[:, None] - torch.arange(n, device=meta.device)[None, :]
        req = meta.token_req[:, None].expand_as(pos)
        history = torch.cat([ring[src.ring_rows], new])[src.index(req, pos.clamp(min=0))]
        src.write(ring, new)
        hashes = self.hasher.hashes(torch.where(pos >= 0, history, -1))
        return {i: self.engram_tables[i].rows(hashes[:, k]).to(meta.device)
                for k, i in enumerate(self.config.v41.engram.layer_ids)}

    # --- cache -----------------------------------------------------------------------------------------
    def kv_cache_spec(self, block_size: int, include_mtp: bool = False) -> list[CacheTensorSpec]:
        if block_size % 2 or any(block_size % r for r in set(self.config.compress_ratios) - {0}):
            raise ValueError(f"block_size {block_size} must be a multiple of every compress ratio")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError("DeepSeek-V4.1 caches hold FP8 / FP4 values: kv_cache_dtype auto (as bf16) or fp8 "
                             f"(packed codes and scales, bit-identical), not {self.kv_cache_dtype!r}")
        look, packed = self.num_lookahead_tokens, self.kv_cache_dtype == "fp8"
        specs = [s for i, layer in enumerate(self.layers)
                 for s in layer.attn.cache_spec(f"layers.{i}", self.config, block_size, look, packed)]
        if self.has_engram:
            specs.append(CacheTensorSpec("engram.tokens", "state", (self.config.v41.engram.max_ngram_size + look,),
                                         torch.long))
        if include_mtp and len(self.mtp):  # the DSpark stages' rings of main-model KV
            specs += [CacheTensorSpec(f"mtp.{k}.window", "state", (self.config.sliding_window + look,
                                                                   self.config.head_dim), torch.bfloat16)
                      for k in range(len(self.mtp))]
        return specs

    def prefix_replay_tokens(self) -> int:
        """Layer l's window depends on (l + 1)(W - 1) earlier tokens; Engram's look-back is shorter."""
        return self.config.num_layers * (self.config.sliding_window - 1)

    def bind_kv_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        self.cache = tensors
        for prefix, layer in [(f"layers.{i}.", x) for i, x in enumerate(self.layers)] + \
                [(f"mtp.{k}.", x) for k, x in enumerate(self.mtp)]:
            layer.attn.cache = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    # --- compute ---------------------------------------------------------------------------------------
    def forward(self, meta: ForwardMeta, return_mtp_input: bool = False) -> torch.Tensor:
        if return_mtp_input and not len(self.mtp):
            raise ValueError("this DeepSeek-V4.1 config has no DSpark head (its input is what return_mtp_input gives)")
        taps = [] if return_mtp_input else None  # DSpark: target layers' input streams, mean over hc copies
        if self.has_engram and self.hasher is None:
            raise RuntimeError("Engram is configured but its tables are not attached (attach_checkpoint)")
        ctx = Step(self, meta)
        streams = self.embed_tokens(meta).unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        pre = torch.zeros(streams.shape[0], self.config.hc_mult, dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        floor, keep = truncation_floor(meta, self.prefill_truncation_tokens), None
        for i, layer in enumerate(self.layers):
            if layer.engram is not None:
                streams = layer.engram(streams, ctx.engram_rows[i], ctx.vl)
            if taps is not None and i in self.config.v41.dspark.target_layer_ids:
                taps.append(_scatter(streams.mean(dim=1), keep, meta.num_tokens))
            if floor is not None and i == self.truncate_from:
                sub, keep = keep_rows(meta, floor)
                rows = None if ctx.engram_rows is None else {k: v[keep] for k, v in ctx.engram_rows.items()}
                late = Step(self, sub, floor, rows, None if ctx.vl is None else ctx.vl[keep])
                streams, pre = layer.forward_truncated(streams, pre, ctx, late, keep)
                ctx = late
                continue
            streams, pre = layer(streams, pre, ctx)
        hidden = _scatter(self.norm(hc_collapse(streams, pre)), keep, meta.num_tokens)
        return (hidden, torch.cat(taps, dim=-1)) if taps is not None else hidden

    def enable_prefill_truncation(self, keep_tokens: int, lookahead: int = 0) -> None:
        """Prefill truncation (DeepSeek's "decoder SWA bounded replay"): from the first ratio-1 layer on, a prompt's
        layers compute only its last `keep_tokens` tokens; that layer still publishes every token's compressed KV
        (what later layers read of the rest). Exact when the prompt has at most keep_tokens tokens."""
        cfg, v41 = self.config, self.config.v41
        start = next((i for i, r in enumerate(cfg.compress_ratios) if r == 1), None)
        if start is None or start != v41.kv_source_layers[-1] or start not in v41.index_source_layers:
            raise ValueError("prefill truncation needs the first ratio-1 layer to be the last kv source and an index "
                             "source (as in DeepSeek-V4.1-Flash)")
        late_index = [v41.index_source_of(i) for i in range(start, cfg.num_layers) if cfg.compress_ratios[i]]
        if min(late_index, default=start) < start or v41.candidate_source_layer not in (-1, start):
            raise ValueError("prefill truncation needs every later layer to take its top-k from layers at or after "
                             f"layer {start}")
        if keep_tokens < cfg.sliding_window + lookahead:
            raise ValueError(f"prefill_truncation_tokens {keep_tokens} must be at least the window "
                             f"{cfg.sliding_window} plus the speculative tokens {lookahead}")
        self.prefill_truncation_tokens, self.truncate_from = keep_tokens, start

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """One row per call (see per_request_linear): a row's logits never depend on the other rows."""
        rows = [(i, i + 1, 1, 0) for i in range(hidden.shape[0])]
        return per_request_linear(hidden.float(), self.head.weight, rows)

    # --- weights ---------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        loaded = assign_weights(self, weights, optional_prefixes=("mtp.",))
        self.mtp_loaded = bool(len(self.mtp)) and "mtp." in loaded

    def skips_tensor(self, name: str) -> bool:
        """Checkpoint tensors not read through the loader: Engram tables (memory-mapped by attach_checkpoint), the
        mtp.* tensors of a config without the DSpark head, and vision tensors of a config without vision_config."""
        vision = name.startswith(("vision.", "aligner.", "image_start", "image_end", "image_newline")) or \
            name.endswith("gate.bias_vl")
        return name.endswith(("engram.embed.weight", "engram.embed.scale")) or (
            vision and self.config.v41.vision is None) or (name.startswith("mtp.") and not len(self.mtp))
