"""DeepSeek-V4: hybrid sliding / compressed-sparse (CSA) / heavily-compressed (HCA) attention, mHC
residual streams, hash-routed and learned MoE. Parameter names are DeepSeek's official ones.

Cache layout (see docs/architecture.md): per layer a window ring (state); per compressed layer a
compressor-input ring (state) and a paged pool of compressed entries; CSA layers also an indexer
ring and a paged pool of indexer keys. Rings are position-indexed (slot = position % length).

Parallelism (``parallel: ModelParallel``): over a TP group of T ranks, rank r holds query heads [r H / T, (r +
1) H / T) and wo_a groups [r G / T, (r + 1) G / T) (wq_b rows, attn_sink, wo_a rows, wo_b columns; wo_b's
partial sums are all-reduced), 1/T of the shared expert (w1 / w3 rows, w2 columns; see MoE for its all-reduce)
and vocab rows of embed and head (tp.vocab_range). Everything else (wq_a, q_norm, the one MQA KV head,
compressors, the Lightning Indexer, mHC, norms, routers) is replicated and computed identically on every rank,
so the cache layout does not depend on the layout. Routed experts are ParallelExperts (EP or TP-split). On one
rank every module is the plain single-process one (bit-identical to the model without parallelism). Parameters
keep the checkpoint's names; a split one carries ``load_shard`` (models/weights.py), so loading takes full
tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config import CSA, SLIDING, ModelConfig
from deepinfer.distributed.model_parallel import ModelParallel, ParallelExperts
from deepinfer.distributed.tp import (
    ParallelLMHead,
    TPRank,
    VocabParallelEmbedding,
    all_reduce,
    split_units,
    vocab_range,
    vocab_shard,
)
from deepinfer.kernels import cpu_kernels, triton_enabled
from deepinfer.layers.attention import sink_attention, tiled_sink_attention
from deepinfer.layers.batch_invariant import batch_invariant_enabled
from deepinfer.layers.gather import take_rows
from deepinfer.layers.kv_quant import PagedPool, is_quantised, storage_dtype
from deepinfer.layers.lm_head import LMHead
from deepinfer.layers.metadata import CacheTensorSpec, ForwardMeta
from deepinfer.layers.moe import routed_experts, swiglu
from deepinfer.layers.norm import RMSNorm, rms_normalize
from deepinfer.layers.rotary import RotaryTable, rotate_tail
from deepinfer.layers.static_step import StaticStep
from deepinfer.models.loader import QuantInfo
from deepinfer.models.quantized import V4_EXPERT_LEAVES, keep_quantized_modules
from deepinfer.models.v4_plan import CompressPlan, TilePlan, WindowPlan, compress_plan, tile_plan, window_plan
from deepinfer.models.v4_static import StaticCompress, StaticRing, StaticRope, StaticWindow, static_compress
from deepinfer.models.weights import assign_weights


class StepContext:
    """Per-step values shared by all layers: plans, rope tables, token ids."""

    def __init__(self, model: DeepseekV4ForCausalLM, meta: ForwardMeta):
        self.meta = meta
        self.cfg = model.config
        self.rope = {"main": model.rope_main.lookup(meta.positions),
                     "compress": model.rope_compress.lookup(meta.positions)}
        self.rope_table = {"main": model.rope_main, "compress": model.rope_compress}
        self.lookahead = model.num_lookahead_tokens
        self.window: WindowPlan = window_plan(meta, model.config.sliding_window, self.lookahead)
        self._compress: dict[tuple[int, bool], CompressPlan] = {}
        # the Triton path (CUDA): keys read in the kernel through these per-token indices, never gathered
        self.use_kernels = triton_enabled(meta.input_ids) and not batch_invariant_enabled()
        # the torch path's prompt chunks in tiles; batch-invariant mode attends every query over its own keys
        torch_tiles = not self.use_kernels and not batch_invariant_enabled()
        self.tiles = tile_plan(meta, self.window.source, model.config.sliding_window) if torch_tiles else None

    def window_source(self, ring: torch.Tensor, kv: torch.Tensor):
        """This step's window keys as the sparse-attention kernel reads them (ring before the step's write)."""
        from deepinfer.kernels.sparse_attention import WindowSource

        meta, req = self.meta, self.meta.token_req
        per_req = self.meta.cached("v4_window_rows", lambda: (
            torch.tensor(meta.seq_starts, device=meta.device)[req],
            torch.tensor(meta.query_start[:-1], device=meta.device)[req], meta.state_slots[req]))
        start, qstart, slot = per_req
        return WindowSource(ring, self.window.source.ring_len, self.cfg.sliding_window, kv, slot, start, qstart,
                            meta.positions)

    def compress(self, ratio: int, overlap: bool) -> CompressPlan:
        key = (ratio, overlap)
        if key not in self._compress:
            self._compress[key] = compress_plan(self.meta, ratio, overlap, self.lookahead)
        return self._compress[key]


class StaticStepContext(StepContext):
    """StepContext of a fixed-shape step (layers/static_step.py; what CUDA graphs and torch.compile replay):
    the same interface, plans from models/v4_static.py, always the paged-source path (the Triton kernels on
    CUDA, their torch references elsewhere). Padding rows use the scratch block / slot."""

    def __init__(self, model: DeepseekV4ForCausalLM, step: StaticStep, scratch_block: int):
        self.meta, self.cfg, self.lookahead = step, model.config, model.num_lookahead_tokens
        self.rope_table = {"main": StaticRope(model.rope_main), "compress": StaticRope(model.rope_compress)}
        self.rope = {kind: table.lookup(step.positions) for kind, table in self.rope_table.items()}
        self.use_kernels, self.scratch_block = True, scratch_block
        self.slot = step.state_slots[step.token_req]
        self.window = StaticWindow(StaticRing(model.config.sliding_window + self.lookahead, step, self.slot))
        self._compress = {}

    def compress(self, ratio: int, overlap: bool) -> StaticCompress:
        key = (ratio, overlap)
        if key not in self._compress:
            ring = StaticRing(ratio * (2 if overlap else 1) + self.lookahead, self.meta, self.slot)
            self._compress[key] = static_compress(self.meta, ring, ratio, overlap, self.scratch_block)
        return self._compress[key]

    def window_source(self, ring: torch.Tensor, kv: torch.Tensor):
        from deepinfer.kernels.sparse_attention import WindowSource

        step = self.meta
        return WindowSource(ring, self.window.source.ring_len, self.cfg.sliding_window, kv, self.slot,
                            step.token_start, step.token_qstart, step.positions)


# ----------------------------------------------------------------------------------------- TP helpers


def _split(tp: TPRank, dim: int, units: int, name: str, unit: str):
    """load_shard for rank tp's block of `units` along `dim` (None on one rank: the full tensor is the shard)."""
    return None if tp.size == 1 else (lambda t: split_units(t, dim, units, tp, name, unit))


def _sharded(param: nn.Parameter, shard) -> nn.Parameter:
    if shard is not None:
        param.load_shard = shard
    return param


def _linear(in_features: int, out_features: int, shard=None) -> nn.Linear:
    """A bias-free projection of this rank's shape; `shard` (None: replicated) cuts it from the full weight."""
    linear = nn.Linear(in_features, out_features, bias=False)
    _sharded(linear.weight, shard)
    return linear


def _tp_sum(x: torch.Tensor, mp: ModelParallel) -> torch.Tensor:
    """Sum of a row-parallel projection's partial outputs over the TP group (x itself on one rank)."""
    return all_reduce(x, mp.tp_group) if mp.tp.size > 1 else x


# The vocab-parallel tables and the plain modules they stand for on one TP rank.
_PLAIN_TABLE = {VocabParallelEmbedding: lambda vocab, dim: nn.Embedding(vocab, dim),
                ParallelLMHead: lambda vocab, dim: LMHead(dim, vocab, bias=False)}


def _vocab_table(cls: type, vocab: int, dim: int, mp: ModelParallel) -> nn.Module:
    """embed / head: the plain module on one TP rank, else this rank's vocab rows of cls (full outputs)."""
    if mp.tp.size == 1:
        return _PLAIN_TABLE[cls](vocab, dim)
    table = cls(torch.zeros(len(vocab_range(vocab, mp.tp)), dim), vocab, mp.tp_group)
    _sharded(table.weight, lambda t: vocab_shard(t, mp.tp))
    return table


def check_tp_heads(cfg: ModelConfig, tp_size: int) -> None:
    """Query heads and wo_a groups are split whole over the TP ranks."""
    if cfg.num_heads % tp_size or cfg.o_groups % tp_size:
        raise ValueError(f"DeepSeek-V4 tensor parallelism needs num_attention_heads ({cfg.num_heads}) and o_groups "
                         f"({cfg.o_groups}) divisible by the tensor-parallel size {tp_size}")


class Compressor(nn.Module):
    """Softmax-gated pooling of `ratio` tokens into one entry. With overlap (CSA) each token
    projects two series: the first half feeds the next window's entry, the second half its own."""

    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        width = head_dim * (2 if overlap else 1)
        self.ratio, self.overlap, self.head_dim = ratio, overlap, head_dim
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)

    def cache_spec(self, prefix: str, block_size: int, dtype: torch.dtype, lookahead: int = 0) -> list[CacheTensorSpec]:
        """`dtype` is the entries' storage dtype; a quantised one adds a float32 scale per entry. The input
        ring keeps `lookahead` extra positions so rolled-back tokens can be recomputed exactly."""
        span, width = self.ratio * (2 if self.overlap else 1) + lookahead, self.wkv.out_features
        per_block = block_size // self.ratio
        specs = [CacheTensorSpec(f"{prefix}.ring", "state", (span, 2 * width), torch.float32),
                 CacheTensorSpec(f"{prefix}.entries", "paged", (per_block, self.head_dim), dtype)]
        if is_quantised(dtype):
            specs.append(CacheTensorSpec(f"{prefix}.entries_scale", "paged", (per_block, 1), torch.float32))
        return specs

    def forward(self, x: torch.Tensor, ctx: StepContext, ring: torch.Tensor, pool: PagedPool) -> None:
        """Append the entries of windows completed this step to `pool`, then advance the ring."""
        plan = ctx.compress(self.ratio, self.overlap)
        positions = ctx.meta.positions
        new = torch.cat([self.wkv(x).float(), self.wgate(x).float() + self.ape[positions % self.ratio]], -1)
        ring_flat = ring.view(-1, ring.shape[-1])
        if plan.num_new:
            slots = plan.source.gather(ring_flat, new, plan.slot_idx)  # [Nw, L, 2 * width]
            entries = self._pool(slots, plan.slot_valid)
            cos, sin = ctx.rope_table["compress"].lookup(plan.entry_pos)
            pool.write(plan.entry_dst, rotate_tail(entries, cos, sin))
        plan.source.write(ring_flat, new)

    def _pool(self, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        kv, gate = slots.chunk(2, dim=-1)
        if self.overlap:
            d, r = self.head_dim, self.ratio
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            gate = torch.cat([gate[:, :r, :d], gate[:, r:, d:]], dim=1)
        gate = gate.masked_fill(~valid[..., None], float("-inf"))
        kv = kv.masked_fill(~valid[..., None], 0.0)
        pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
        return self.norm(pooled)


class Indexer(nn.Module):
    """Lightning Indexer: scores compressed entries per query and keeps the top-k."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, ratio, True, cfg.rms_norm_eps)

    def select(self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext, pool: PagedPool,
               plan: CompressPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k visible entry numbers per query [T, k] and their validity; ties go to the lower index."""
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        q = rotate_tail(q, *ctx.rope["compress"])
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        if ctx.use_kernels:  # entry numbers ascending, -1 padded; keys read through the block table
            return self._kernel_select(q, weights, ctx.meta, pool, plan)
        if batch_invariant_enabled():
            scores = self._scores_per_token(q, pool.read(plan.query_entries), weights, plan.query_valid)
        elif ctx.tiles is not None:
            scores = self._tiled_scores(q, weights, pool, plan, ctx.tiles)
        else:
            scores = self._scores(q, pool.read(plan.query_entries), weights)
        scores = scores.masked_fill(~plan.query_valid, float("-inf"))
        k = min(self.topk, scores.shape[1])
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
        return order, plan.query_valid.gather(1, order)

    def _kernel_select(self, q: torch.Tensor, weights: torch.Tensor, meta: ForwardMeta, pool: PagedPool,
                       plan: CompressPlan) -> tuple[torch.Tensor, torch.Tensor]:
        from deepinfer.kernels.indexer import indexer_topk, indexer_topk_reference

        visible = (meta.positions + 1) // plan.ratio
        topk = indexer_topk if triton_enabled(q) else indexer_topk_reference
        return topk(q, weights, pool.data, pool.scale, meta.block_table, meta.token_req, visible,
                    meta.block_size // plan.ratio, self.topk, self.head_dim**-0.5,
                    max_entries=plan.max_entries)

    def _scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Index scores [T, E] of queries q [T, h, d] over their own keys [T, E, d]."""
        scores = F.relu(torch.einsum("thd,ted->the", q.float(), keys.float())) * self.head_dim**-0.5
        return (scores * weights[..., None]).sum(dim=1)

    def _tiled_scores(self, q: torch.Tensor, weights: torch.Tensor, pool: PagedPool, plan: CompressPlan,
                      tiles: TilePlan) -> torch.Tensor:
        """_scores with each tile's keys (its request's entries up to its last query) read once and scored by
        one matrix product; tokens outside tiles as _scores. Columns past a query's visible entries are
        clamped copies, masked by the caller."""
        nt, b = tiles.tokens.shape
        flat = tiles.tokens.flatten()
        keys = pool.read(take_rows(plan.query_entries, tiles.last)).float()  # [nt, E, d]
        rows = q.float().index_select(0, flat).view(nt, -1, q.shape[-1])  # [nt, B * h, d]
        tiled = F.relu(torch.bmm(rows, keys.transpose(1, 2))).view(nt, b, q.shape[1], -1) * self.head_dim**-0.5
        tiled = (tiled * weights.index_select(0, flat).view(nt, b, -1, 1)).sum(dim=2).flatten(0, 1)
        scores = tiled.new_empty(q.shape[0], keys.shape[1])
        scores.index_copy_(0, tiles.real_tokens, tiled.index_select(0, tiles.real_rows))
        if tiles.others.numel():
            own = pool.read(take_rows(plan.query_entries, tiles.others))
            scores.index_copy_(0, tiles.others, self._scores(take_rows(q, tiles.others), own,
                                                               take_rows(weights, tiles.others)))
        return scores

    def _scores_per_token(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                          valid: torch.Tensor) -> torch.Tensor:
        """Index scores [T, E], each query over exactly its own valid entries (batch-invariant mode)."""
        scores = keys.new_zeros(keys.shape[:2], dtype=torch.float32)
        for t in range(q.shape[0]):
            own = F.relu(q[t].float() @ keys[t][valid[t]].float().t()) * self.head_dim**-0.5
            scores[t, valid[t]] = (own * weights[t, :, None]).sum(dim=0)
        return scores


class Attention(nn.Module):
    """n_heads / groups are this rank's (all of them on one TP rank, check_tp_heads); one KV head for all."""

    def __init__(self, cfg: ModelConfig, layer: int, mp: ModelParallel):
        super().__init__()
        heads, groups, tp = cfg.num_heads, cfg.o_groups, mp.tp
        self.kind, self.ratio, self.mp = cfg.layer_kinds[layer], cfg.compress_ratios[layer], mp
        self.n_heads, self.head_dim, self.groups = heads // tp.size, cfg.head_dim, groups // tp.size
        self.rope_kind = "main" if self.kind == SLIDING else "compress"
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = _linear(cfg.q_lora_rank, self.n_heads * self.head_dim, _split(tp, 0, heads, "wq_b", "heads"))
        self.wkv = nn.Linear(d, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.wo_a = _linear(heads * self.head_dim // groups, self.groups * cfg.o_lora_rank,
                            _split(tp, 0, groups, "wo_a", "groups"))
        self.wo_b = _linear(self.groups * cfg.o_lora_rank, d, _split(tp, 1, groups, "wo_b", "groups"))
        self.attn_sink = _sharded(nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32)),
                                  _split(tp, 0, heads, "attn_sink", "heads"))
        self.eps = eps
        if self.kind != SLIDING:
            self.compressor = Compressor(d, self.head_dim, self.ratio, self.kind == CSA, eps)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, self.ratio)
        self.cache: dict[str, torch.Tensor] = {}

    def cache_spec(self, prefix: str, window: int, block_size: int, dtype: torch.dtype,
                   paged_dtype: torch.dtype, lookahead: int = 0) -> list[CacheTensorSpec]:
        """The window ring is kept in the model dtype; paged pools in `paged_dtype` (maybe quantised)."""
        specs = [CacheTensorSpec(f"{prefix}.window", "state", (window + lookahead, self.head_dim), dtype)]
        if self.kind != SLIDING:
            specs += self.compressor.cache_spec(f"{prefix}.compressor", block_size, paged_dtype, lookahead)
        if self.kind == CSA:
            specs += self.indexer.compressor.cache_spec(f"{prefix}.indexer", block_size, paged_dtype, lookahead)
        return specs

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        cos, sin = ctx.rope[self.rope_kind]
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        q = rotate_tail(rms_normalize(q, self.eps).to(q.dtype), cos, sin)
        kv = rotate_tail(self.kv_norm(self.wkv(x)), cos, sin)
        out = self._kernel_attention(x, qr, q, kv, ctx) if ctx.use_kernels else self._attention(x, qr, q, kv, ctx)
        out = rotate_tail(out, cos, -sin)  # undo the rope the values carried
        return _tp_sum(self.wo_b(self._grouped_wo_a(out)), self.mp)

    def _attention(self, x, qr, q, kv, ctx: StepContext) -> torch.Tensor:
        """The torch path (eager, off CUDA): prompt chunks tile by tile (ctx.tiles), other tokens over their own
        gathered keys. The step's entries are written before any read; the window ring after every read."""
        entries = self._entries(x, qr, ctx) if self.kind != SLIDING else None
        ring = self.cache["window"].view(-1, self.head_dim)
        source, tiles = ctx.window.source.keys(ring, kv), ctx.tiles
        if tiles is None:
            out = self._row_attention(q, source, ctx.window, entries, None)
        else:
            out = torch.empty_like(q)
            tiled = tiled_sink_attention(q, tiles.tokens, take_rows(source, tiles.key_idx), tiles.key_valid,
                                         *_tile_entries(entries, tiles), self.attn_sink, self.head_dim**-0.5)
            out.index_copy_(0, tiles.real_tokens, tiled.index_select(0, tiles.real_rows))
            if tiles.others.numel():
                out.index_copy_(0, tiles.others, self._row_attention(q, source, ctx.window, entries, tiles.others))
        ctx.window.source.write(ring, kv)
        return out

    def _row_attention(self, q, source: torch.Tensor, plan: WindowPlan, entries: EntryKeys | None,
                       tokens: torch.Tensor | None) -> torch.Tensor:
        """Tokens (None: all) over their window and entry keys, gathered per query."""
        keys, valid = take_rows(source, _rows(plan.key_idx, tokens)), _rows(plan.key_valid, tokens)
        if entries is not None:
            extra, extra_valid = entries.per_row(tokens)
            keys, valid = torch.cat([keys, extra], 1), torch.cat([valid, extra_valid], 1)
        return sink_attention(_rows(q, tokens), keys, valid, self.attn_sink, self.head_dim**-0.5)

    def _kernel_attention(self, x, qr, q, kv, ctx: StepContext) -> torch.Tensor:
        """The paged-source path: the kernel reads the ring, the new rows and the pools itself (off CUDA, a
        fixed-shape step's torch reference gathers them: no host sync)."""
        from deepinfer.kernels.sparse_attention import sparse_attention, sparse_attention_reference

        ring = self.cache["window"].view(-1, self.head_dim)
        window = ctx.window_source(ring, kv)
        entries = self._entry_source(x, qr, ctx) if self.kind != SLIDING else None
        attend = sparse_attention if triton_enabled(q) else sparse_attention_reference
        out = attend(q, window, entries, self.attn_sink, self.head_dim**-0.5)
        ctx.window.source.write(ring, kv)
        return out

    def _entry_source(self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext):
        """Writes this step's compressed entries, then names the ones each token attends (CSA: the indexer's
        top-k, -1 for none; HCA: all visible)."""
        from deepinfer.kernels.sparse_attention import EntrySource

        pool = PagedPool.of(self.cache, "compressor.entries", self.head_dim, x.dtype)
        self.compressor(x, ctx, self.cache["compressor.ring"], pool)
        meta, per_block = ctx.meta, ctx.meta.block_size // self.ratio
        source = EntrySource(pool.data, pool.scale, meta.block_table, meta.token_req, per_block)
        if self.kind != CSA:
            return replace(source, visible=(meta.positions + 1) // self.ratio)
        plan = ctx.compress(self.ratio, True)
        idx_pool = PagedPool.of(self.cache, "indexer.entries", self.indexer.head_dim, x.dtype)
        self.indexer.compressor(x, ctx, self.cache["indexer.ring"], idx_pool)
        chosen, valid = self.indexer.select(x, qr, ctx, idx_pool, plan)
        return replace(source, entry_ids=torch.where(valid, chosen, -1))

    def _entries(self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext) -> EntryKeys:
        """Writes this step's compressed entries (and CSA's indexer keys), then names what each query sees."""
        pool = PagedPool.of(self.cache, "compressor.entries", self.head_dim, x.dtype)
        self.compressor(x, ctx, self.cache["compressor.ring"], pool)
        plan = ctx.compress(self.ratio, self.kind == CSA)
        if self.kind != CSA:
            return EntryKeys(pool, plan.query_entries, plan.query_valid)
        idx_pool = PagedPool.of(self.cache, "indexer.entries", self.indexer.head_dim, x.dtype)
        self.indexer.compressor(x, ctx, self.cache["indexer.ring"], idx_pool)
        chosen, valid = self.indexer.select(x, qr, ctx, idx_pool, plan)
        return EntryKeys(pool, plan.query_entries, plan.query_valid, chosen, valid)

    def _grouped_wo_a(self, out: torch.Tensor) -> torch.Tensor:
        t = out.shape[0]
        grouped = out.reshape(t, self.groups, -1).transpose(0, 1)  # [G, T, H*d/G]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])  # [G, o_lora, H*d/G]
        return torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, -1)


DENSE_SELECTION = 4  # a tile scores all of its request's entries while they are at most this many top-k's


@dataclass(frozen=True)
class EntryKeys:
    """The compressed entries of a step's queries: rows [T, E] (paged rows of entries 0..E-1 of the query's
    request, clamped past its visible ones) with valid [T, E] (visible); CSA adds the indexer's choice, chosen
    [T, k] columns of rows with chosen_valid [T, k]."""

    pool: PagedPool
    rows: torch.Tensor
    valid: torch.Tensor
    chosen: torch.Tensor | None = None
    chosen_valid: torch.Tensor | None = None

    def per_row(self, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's own keys [T', K, d] and validity (tokens None: all)."""
        if self.chosen is None:
            return self.pool.read(_rows(self.rows, tokens)), _rows(self.valid, tokens)
        return (self.pool.read(_rows(self.rows.gather(1, self.chosen), tokens)), _rows(self.chosen_valid, tokens))

    def selected(self) -> torch.Tensor:
        """[T, E] the entries each query attends (CSA: its top-k, as a mask over rows' columns)."""
        if self.chosen is None:
            return self.valid
        return torch.zeros_like(self.valid).scatter_(1, self.chosen, self.chosen_valid)


def _rows(t: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    return t if tokens is None else take_rows(t, tokens)


def _tile_entries(entries: EntryKeys | None, tiles: TilePlan) -> tuple:
    """(keys, valid) of tiled_sink_attention's extra keys: per tile (all entries of the tile's request up to its
    last query, each row masked to its own) or, for a CSA top-k much smaller than that, per tile row."""
    if entries is None:
        return None, None
    nt, b = tiles.tokens.shape
    flat = tiles.tokens.flatten()
    if entries.chosen is None or entries.rows.shape[1] <= DENSE_SELECTION * entries.chosen.shape[1]:
        return entries.pool.read(entries.rows[tiles.last]), entries.selected()[flat].view(nt, b, -1)
    keys, valid = entries.per_row(flat)
    return keys.view(nt, b, *keys.shape[1:]), valid.view(nt, b, -1)


class Gate(nn.Module):
    """sqrt-softplus scores; learned layers pick top-k of score + bias, hash layers use tid2eid."""

    def __init__(self, cfg: ModelConfig, is_hash: bool):
        super().__init__()
        self.is_hash, self.topk = is_hash, cfg.num_experts_per_tok
        self.scaling, self.normalize, self.score_fn = cfg.routed_scaling_factor, cfg.norm_topk_prob, cfg.scoring_func
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = _score(F.linear(x.float(), self.weight.float()), self.score_fn)
        if self.is_hash:
            ids = self.tid2eid[token_ids]
        else:
            ids = torch.topk(scores + self.bias, self.topk, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


def _score(logits: torch.Tensor, fn: str) -> torch.Tensor:
    if fn == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if fn == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class SharedExpert(nn.Module):
    """swiglu MLP; over TP, w1 / w3 rows and w2 columns split (column- then row-parallel, one all-reduce)."""

    def __init__(self, dim: int, inter: int, limit: float, mp: ModelParallel):
        super().__init__()
        tp = mp.tp
        if inter % tp.size:
            raise ValueError(f"shared expert intermediate size {inter} is not divisible by tensor-parallel size "
                             f"{tp.size}")
        self.w1 = _linear(dim, inter // tp.size, _split(tp, 0, inter, "shared_experts.w1", "rows"))
        self.w2 = _linear(inter // tp.size, dim, _split(tp, 1, inter, "shared_experts.w2", "columns"))
        self.w3 = _linear(dim, inter // tp.size, _split(tp, 0, inter, "shared_experts.w3", "rows"))
        self.limit, self.mp = limit, mp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (the whole output on one TP rank); forward sums the shares."""
        return self.w2(swiglu(torch.cat([self.w1(x), self.w3(x)], -1), self.limit))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tp_sum(self.partial(x), self.mp)


class MoE(nn.Module):
    """Routed experts (ParallelExperts) plus the shared expert. With EP, ParallelExperts returns the complete
    routed sum; otherwise both are split over the TP group along the intermediate dim, and one all-reduce
    sums the two partial outputs (routed_experts on the local slices is ParallelExperts' unreduced output)."""

    def __init__(self, cfg: ModelConfig, layer: int, mp: ModelParallel):
        super().__init__()
        self.gate = Gate(cfg, cfg.hash_layers[layer])
        self.experts = ParallelExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                       cfg.num_experts_per_tok, mp, cfg.swiglu_limit)
        inter = cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1)
        self.shared_experts = SharedExpert(cfg.hidden_size, inter, cfg.swiglu_limit, mp)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, token_ids)
        experts, mp = self.experts, self.experts.mp
        if mp.expert_parallel:
            return experts(x, ids, weights) + self.shared_experts(x)
        routed = routed_experts(x, ids, weights, experts.w13, experts.w2, experts.limit)
        return _tp_sum(routed + self.shared_experts.partial(x), mp)


class HyperConnection(nn.Module):
    """mHC mixing weights from the flattened streams: pre (collapse), post (expand), comb (Sinkhorn)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor):
        """streams [T, n, D] -> (post [T, n], comb [T, n, n], collapsed [T, D])."""
        n = self.n
        mixes = F.linear(rms_normalize(streams.flatten(1), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hc_mix(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[k] = post_k * out + sum_j comb[j, k] X[j]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(1, 2), streams)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, mp: ModelParallel):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, mp)
        self.ffn = MoE(cfg, layer, mp)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)

    def forward(self, streams: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        post, comb, collapsed = self.hc_attn(streams)
        streams = hc_mix(streams, self.attn(self.attn_norm(collapsed), ctx), post, comb)
        post, comb, collapsed = self.hc_ffn(streams)
        return hc_mix(streams, self.ffn(self.ffn_norm(collapsed), ctx.meta.input_ids), post, comb)


# Official flat names of the mHC parameters <-> module attributes.
_HC_RENAMES = {"hc_attn_fn": "hc_attn.fn", "hc_attn_base": "hc_attn.base", "hc_attn_scale": "hc_attn.scale",
               "hc_ffn_fn": "hc_ffn.fn", "hc_ffn_base": "hc_ffn.base", "hc_ffn_scale": "hc_ffn.scale",
               "hc_head_fn": "hc_head.fn", "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale"}


class HyperHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(rms_normalize(streams.flatten(1), self.norm_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.eps
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


def _mtp_layers(config: ModelConfig, mp: ModelParallel) -> nn.ModuleList:
    """Built after the main layers on every rank: their MoE tags follow the main layers' (ParallelExperts)."""
    from deepinfer.models.mtp import MTPLayer  # imported here: mtp.py builds on this module's Block

    return nn.ModuleList(MTPLayer(config, k, mp) for k in range(config.num_mtp_layers))


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 parallel: ModelParallel | None = None):
        """parallel: this rank's place in the TP / EP layout (None: one process). compute_logits returns the
        full [N, V] logits on every TP rank; with EP every rank calls parallel.finish_step() after each step."""
        super().__init__()
        self.config, self.dtype = config, dtype
        self.parallel = parallel = parallel or ModelParallel.single()
        check_tp_heads(config, parallel.tp.size)  # before any layer (the vocab-parallel ones touch the group)
        self.kv_cache_dtype = "auto"  # storage of the paged pools: auto (model dtype) | fp8 | int8
        self.batch_invariant_kernels = True  # attention and indexer honour layers.batch_invariant
        self.num_lookahead_tokens = 0  # how many computed tokens may later be rolled back (speculation)
        self.embed = _vocab_table(VocabParallelEmbedding, config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(Block(config, i, parallel) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = _vocab_table(ParallelLMHead, config.vocab_size, config.hidden_size, parallel)
        self.hc_head = HyperHead(config)
        self.mtp = _mtp_layers(config, parallel)
        self.mtp_loaded = False  # True once a checkpoint supplied every mtp.* tensor
        self.to(device=device)
        self._cast_compute_weights(dtype)
        if torch.device(device).type == "cpu":  # its LM head's decode kernel: every process serving it loads it
            cpu_kernels.load()
        self.rope_main = RotaryTable(config.rope_main, min(config.max_position, 8192), device)
        self.rope_compress = RotaryTable(config.rope_compress, min(config.max_position, 8192), device)

    def _cast_compute_weights(self, dtype: torch.dtype) -> None:
        """Projections run in `dtype`; norms, sinks, ape, mHC and router biases stay float32."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, ParallelExperts, VocabParallelEmbedding, ParallelLMHead)):
                module.to(dtype)

    # --- cache -----------------------------------------------------------------------------------
    def kv_cache_spec(self, block_size: int, include_mtp: bool = False) -> list[CacheTensorSpec]:
        """Cache tensors of the main layers (`layers.{i}.*`), and with include_mtp of the MTP layers (`mtp.{k}.*`)."""
        all_ratios = set(self.config.compress_ratios) | set(self.config.mtp_compress_ratios if include_mtp else ())
        for ratio in all_ratios - {0}:
            if block_size % ratio:
                raise ValueError(f"block_size {block_size} must be a multiple of every compress ratio "
                                 f"{sorted(all_ratios - {0})}")
        paged = storage_dtype(self.kv_cache_dtype, self.dtype)
        specs = []
        for i, layer in enumerate(self.layers):
            specs += layer.attn.cache_spec(f"layers.{i}", self.config.sliding_window, block_size, self.dtype, paged,
                                           self.num_lookahead_tokens)
        for k, layer in enumerate(self.mtp if include_mtp else ()):
            specs += layer.attn.cache_spec(f"mtp.{k}", self.config.sliding_window, block_size, self.dtype, paged,
                                           self.num_lookahead_tokens)
        return specs

    def prefix_replay_tokens(self) -> int:
        """Tokens to recompute before a cached prefix so every layer's window is exact again: layer l's
        window depends on (l + 1) * (W - 1) earlier tokens (the compressor state is covered too, since
        hits are block-aligned and blocks are whole compression windows)."""
        return self.config.num_layers * (self.config.sliding_window - 1)

    def bind_kv_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        named = [(f"layers.{i}.", layer) for i, layer in enumerate(self.layers)]
        for prefix, layer in named + [(f"mtp.{j}.", layer) for j, layer in enumerate(self.mtp)]:
            layer.attn.cache = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    # --- compute ---------------------------------------------------------------------------------
    def forward(self, meta: ForwardMeta, return_mtp_input: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Final normed hidden [T, D]; with return_mtp_input also the final streams [T, hc, D] MTP layer 0 takes."""
        return self._run(StepContext(self, meta), return_mtp_input)

    def forward_static(self, step: StaticStep, scratch_block: int, return_mtp_input: bool = False):
        """forward over a fixed-shape step (CUDA-graph capture and replay, torch.compile on CPU): no host sync,
        no data-dependent shape; the rope tables must already cover every position (grow_rope)."""
        return self._run(StaticStepContext(self, step, scratch_block), return_mtp_input)

    def grow_rope(self, max_position: int) -> None:
        """Reserve (and freeze) the rope tables for positions < max_position."""
        for table in (self.rope_main, self.rope_compress):
            table.reserve(max_position)

    def _run(self, ctx: StepContext, return_mtp_input: bool):
        x = self.embed(ctx.meta.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, ctx)
        hidden = self.norm(self.hc_head(streams))
        return (hidden, streams) if return_mtp_input else hidden

    def mtp_forward(self, k: int, mtp_input: torch.Tensor, next_token_ids: torch.Tensor, meta: ForwardMeta,
                    return_mtp_input: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """MTP layer k over the positions of `meta`, in its own `mtp.{k}` caches.

        Row t pairs mtp_input[t] (the streams of forward, or of mtp_forward(k - 1), at row t) with the
        embedding of next_token_ids[t] = token t + 1 + k; the returned hidden [T, D] predicts token
        t + 2 + k through compute_logits. With return_mtp_input also the streams MTP layer k + 1 takes.
        """
        layer = self.mtp[k]
        if mtp_input.dim() != 3:
            raise ValueError(f"mtp_input must be streams [T, hc, D], got shape {tuple(mtp_input.shape)}: "
                             "take them from forward / mtp_forward with return_mtp_input=True")
        if not layer.attn.cache:
            raise RuntimeError(f"MTP layer {k} has no cache: bind kv_cache_spec(block_size, include_mtp=True)")
        streams = layer(mtp_input, self.embed(next_token_ids), StepContext(self, meta))
        hidden = layer.head_hidden(streams)
        return (hidden, streams) if return_mtp_input else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    # --- weights ---------------------------------------------------------------------------------
    def keep_quantized_weights(self, quantized: Mapping[str, QuantInfo],
                               block: tuple[int, int] | None = None) -> Callable[[str], bool]:
        """Store the weights `quantized` (loader.quantized_weights of the checkpoint) says are quantised as they
        are, main and MTP layers alike: FP8 projections become FP8BlockLinear (wo_a stays dequantised: its weight
        feeds the grouped bmm), FP4 / FP8 routed experts quantised ParallelExperts. Call before load_weights and
        pass the returned predicate to iter_checkpoint(keep_quantized=...). One process only (ValueError under
        TP / EP). `block`: the FP8 block, default config.weight_block_size."""
        block = tuple(block or self.config.weight_block_size)
        kept = keep_quantized_modules(self, quantized, block, V4_EXPERT_LEAVES, self.parallel, excluded=("attn.wo_a",))
        return frozenset(kept).__contains__

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        """Main weights are required; the MTP weights (`mtp.*`) all or none (transformers drops them)."""
        loaded = assign_weights(self, self._internal_names(weights), optional_prefixes=("mtp.",))
        self.mtp_loaded = bool(self.mtp) and "mtp." in loaded

    def _internal_names(self, weights):
        for name, tensor, source in weights:
            head, _, leaf = name.rpartition(".")
            if leaf in _HC_RENAMES:
                name = f"{head}.{_HC_RENAMES[leaf]}" if head else _HC_RENAMES[leaf]
            yield name, tensor, source
