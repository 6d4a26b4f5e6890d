"""DeepSeek-V3 / R1 and DeepSeek-V2 / V2-Lite: MLA attention over a paged latent cache, DeepSeekMoE.

Cache: one paged tensor per layer; the entry of a token is [c | k_pe] with c = kv_a_layernorm(latent)
(kv_lora_rank) and k_pe the already-rotated shared rope key (qk_rope_head_dim). Entries of the new
tokens are written before attention, so every query reads its whole context from the cache.
Requests with one new token attend in latent space (W_UK / W_UV absorbed from kv_b_proj, batched
over requests); longer chunks expand their context with kv_b_proj and attend causally.
RoPE: with rope_interleave the pairs (2i, 2i+1) are rotated in place; transformers writes the same
values de-interleaved, a permutation shared by q_pe and k_pe, so scores are identical.

Parallelism (``ModelParallel``; ``ModelParallel.single()`` builds exactly the one-process model):
- TP over ``parallel.tp_group``: a rank holds H / T whole query heads (rows of q_b_proj / q_proj and kv_b_proj,
  columns of o_proj), 1 / T of each dense MLP and shared expert (gate / up rows, down columns) and a vocab
  block of embed_tokens and lm_head. o_proj, the MLPs and the embedding are followed by one all-reduce each;
  compute_logits all-gathers the full [N, V] on every TP rank. q_a_proj, kv_a_proj_with_mqa, the norms and the
  routers are replicated: the latent is one shared "head", so every rank caches the full [c | k_pe] entry.
- Routed experts are ``ParallelExperts``: whole experts per EP rank (EP), else split over TP like an MLP.
- Parameters keep their checkpoint names with local shapes; a sharded one carries ``load_shard`` (full
  checkpoint tensor -> this rank's slice) and ``full_shape`` (checked before slicing), see _WeightLoader.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config import ConfigError, ModelConfig
from deepinfer.distributed.model_parallel import ModelParallel, ParallelExperts
from deepinfer.distributed.tp import (
    ParallelLMHead,
    VocabParallelEmbedding,
    all_reduce,
    column_shard,
    head_shard,
    row_shard,
    shard_range,
    vocab_range,
    vocab_shard,
)
from deepinfer.kernels import cpu_kernels, triton_enabled
from deepinfer.layers.batch_invariant import batch_invariant_enabled
from deepinfer.layers.kv_quant import PagedPool, is_quantised, storage_dtype
from deepinfer.layers.lm_head import LMHead
from deepinfer.layers.metadata import CacheTensorSpec, ForwardMeta
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryTable, rotate_halves, rotate_interleaved
from deepinfer.layers.static_step import StaticStep
from deepinfer.models.dsa import Indexer
from deepinfer.models.loader import CheckpointError, QuantInfo
from deepinfer.models.mla_mtp import MTP_SHARED_TENSORS, MLAMTPLayer
from deepinfer.models.mla_routing import select_experts
from deepinfer.models.quantized import V3_EXPERT_LEAVES, keep_quantized_modules

# q_a_layernorm / kv_a_layernorm use the RMSNorm default eps in DeepSeek's code, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def _linear(in_features: int, out_features: int, dtype: torch.dtype, device) -> nn.Linear:
    """Bias-free projection left uninitialised: load_weights fills every parameter."""
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False, dtype=dtype, device=device)


def _sharded(param: torch.Tensor, full_shape: tuple[int, ...], shard: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Mark a TP-sharded parameter: the checkpoint holds `full_shape`, this rank keeps shard(full)."""
    param.full_shape, param.load_shard = tuple(full_shape), shard


def _reduced(y: torch.Tensor, mp: ModelParallel) -> torch.Tensor:
    """The sum of the TP ranks' partial outputs (row parallel); the tensor itself on one rank."""
    return all_reduce(y, mp.tp_group) if mp.tp.size > 1 else y


# ---------------------------------------------------------------- per-step plan (shared by all layers)


@dataclass
class DecodeBatch:
    """Requests with one new token, attended together over a padded context."""

    rows: torch.Tensor  # [R] token row of each request
    slots: torch.Tensor  # [R, L] cache slot of positions 0..L-1 (slot of position 0 where invalid)
    valid: torch.Tensor  # [R, L] position < seq_len of the request
    attend: torch.Tensor | None = None  # [R, L] the positions attended (DSA: a layer's selection); None: valid
    block_table: torch.Tensor | None = None  # [R, max_blocks] for the paged kernel (reads rows itself)
    seq_lens: torch.Tensor | None = None  # [R]
    block_size: int = 0
    whole_blocks: bool = False  # off CUDA, read the context by blocks of the table (fixed-shape steps)


@dataclass
class PrefillSeq:
    """One request with several new tokens: rows of its queries and the slots of its whole context."""

    rows: slice
    ctx_slots: torch.Tensor  # [L] positions 0..L-1
    mask: torch.Tensor | None  # [n, L] key position <= query position; None: plain causal (no prefix)


@dataclass
class MLAStep:
    cos: torch.Tensor  # [T, rope // 2]
    sin: torch.Tensor
    new_slots: torch.Tensor  # [T]
    decode: DecodeBatch | None
    prefills: list[PrefillSeq]
    interleave: bool

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        rotate = rotate_interleaved if self.interleave else rotate_halves
        return rotate(x, self.cos, self.sin)


def _decode_batch(meta: ForwardMeta, reqs: list[int]) -> DecodeBatch | None:
    if not reqs:
        return None
    dev = meta.device
    lens = torch.tensor([meta.seq_lens[r] for r in reqs], device=dev)
    pos = torch.arange(max(meta.seq_lens[r] for r in reqs), device=dev)
    valid = pos[None] < lens[:, None]
    req_rows = torch.tensor(reqs, device=dev)[:, None].expand_as(valid)
    slots = meta.slots_of(req_rows, torch.where(valid, pos, 0))
    rows = torch.tensor([meta.query_start[r] for r in reqs], device=dev)
    return DecodeBatch(rows, slots, valid, None, meta.block_table[torch.tensor(reqs, device=dev)], lens,
                       meta.block_size)


def _prefill_seq(meta: ForwardMeta, r: int) -> PrefillSeq:
    start, end = meta.seq_starts[r], meta.seq_lens[r]
    key_pos = torch.arange(end, device=meta.device)
    ctx_slots = meta.slots_of(torch.full_like(key_pos, r), key_pos)
    mask = None if start == 0 else key_pos[None] <= key_pos[start:, None]
    return PrefillSeq(slice(meta.query_start[r], meta.query_start[r + 1]), ctx_slots, mask)


def _rope_rows(rotary: RotaryTable, meta: ForwardMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of every new token; the table grows from host-side lengths (no device sync)."""
    longest = max(meta.seq_lens, default=0)
    if longest > rotary.cos.shape[0]:
        rotary.lookup(torch.tensor([longest - 1]))
    return rotary.cos[meta.positions], rotary.sin[meta.positions]


def _per_token_batch(meta: ForwardMeta) -> DecodeBatch:
    """Every new token as its own absorbed query over positions 0..its own (batch-invariant mode)."""
    qlens = meta.query_lens()
    reqs = [r for r, n in enumerate(qlens) for _ in range(n)]
    lens = [meta.seq_starts[r] + i + 1 for r, n in enumerate(qlens) for i in range(n)]
    dev = meta.device
    pos = torch.arange(max(lens), device=dev)
    valid = pos[None] < torch.tensor(lens, device=dev)[:, None]
    req_rows = torch.tensor(reqs, device=dev)[:, None].expand_as(valid)
    slots = meta.slots_of(req_rows, torch.where(valid, pos, 0))
    return DecodeBatch(torch.arange(len(reqs), device=dev), slots, valid)


def plan_step(meta: ForwardMeta, rotary: RotaryTable, interleave: bool) -> MLAStep:
    cos, sin = _rope_rows(rotary, meta)
    if batch_invariant_enabled():
        return MLAStep(cos, sin, meta.new_token_slots(), _per_token_batch(meta), [], interleave)
    qlens = meta.query_lens()
    decode = _decode_batch(meta, [r for r, n in enumerate(qlens) if n == 1])
    prefills = [_prefill_seq(meta, r) for r, n in enumerate(qlens) if n > 1]
    return MLAStep(cos, sin, meta.new_token_slots(), decode, prefills, interleave)


def static_plan(step: StaticStep, rotary: RotaryTable, interleave: bool) -> MLAStep:
    """The plan of a fixed-shape step (CUDA graphs, torch.compile on CPU): every token an absorbed query over
    positions 0..its own, read by the paged kernel through its request's block-table row (off CUDA, gathered
    from the slots of every position the table holds); no host sync (the table is pre-grown)."""
    req, pos = step.token_req, step.positions
    lens = pos + 1
    width = step.block_table.shape[1] * step.block_size
    cols = torch.arange(width, device=step.device)[None, :]
    valid = cols < lens[:, None]
    slots = valid if triton_enabled(pos) else step.slots_of(req[:, None], cols.expand(pos.numel(), -1))
    decode = DecodeBatch(torch.arange(pos.numel(), device=step.device), slots, valid, None,
                         step.block_table[req], lens, step.block_size, whole_blocks=True)
    return MLAStep(rotary.cos[pos], rotary.sin[pos], step.slots_of(req, pos), decode, [], interleave)


def decode_context(cache: PagedPool, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(context rows [R, L, latent + rope], valid [R, L]), rows past a request's length zeroed (padding may
    hold anything, even NaN, and masked probabilities must stay exact zeros). Whole blocks are read
    through the block table in fixed-shape steps without a DSA selection (compiled, the gather then computes
    an index per block, not per row: 2.6x faster steps on a 512 + 64 latent); otherwise (eager steps, DSA
    selections) the rows of batch.slots."""
    if not batch.whole_blocks or batch.attend is not None:
        return cache.read(batch.slots).masked_fill(~batch.valid[..., None], 0), batch.valid
    ctx = cache.read_blocks(batch.block_table, batch.block_size)  # valid spans the table's width too
    return ctx.masked_fill(~batch.valid[..., None], 0), batch.valid


def _cpu_kernel_serves(q: torch.Tensor, cache: PagedPool, batch: DecodeBatch) -> bool:
    """Whether kernels/cpu's MLA decode takes this batch: CPU, kernels loaded, a block table with lengths,
    no KV scales, no DSA selection (the gather below handles those), and few heads per rank: it reads each
    context row once per group of 4 heads, ahead of gather + two GEMMs up to 8 heads and behind from 16
    (measured, docs/performance.md)."""
    return (q.device.type == "cpu" and q.shape[1] <= cpu_kernels.MLA_DECODE_MAX_HEADS and cpu_kernels.available()
            and batch.block_table is not None and batch.seq_lens is not None and batch.attend is None
            and cache.scale is None and q.dtype == cache.data.dtype)


# ---------------------------------------------------------------- modules (names = HF checkpoint names)


class MLP(nn.Module):
    """Dense MLP / shared experts: gate_proj, up_proj column-parallel, down_proj row-parallel (+ all-reduce)."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype, device, mp: ModelParallel | None = None):
        super().__init__()
        self.mp = mp = mp or ModelParallel.single()
        local = len(shard_range(inter, mp.tp, "MLP", "intermediate size"))
        self.gate_proj = _linear(dim, local, dtype, device)
        self.up_proj = _linear(dim, local, dtype, device)
        self.down_proj = _linear(local, dim, dtype, device)
        if mp.tp.size > 1:
            for name in ("gate_proj", "up_proj"):
                _sharded(getattr(self, name).weight, (inter, dim), partial(column_shard, tp=mp.tp, name=name))
            _sharded(self.down_proj.weight, (dim, inter), partial(row_shard, tp=mp.tp, name="down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _reduced(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.mp)


class Router(nn.Module):
    """Router weight and correction bias stay float32 whatever the model dtype."""

    def __init__(self, cfg: ModelConfig, device):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, device=device))
        bias = torch.zeros(cfg.n_routed_experts, device=device) if cfg.topk_method == "noaux_tc" else None
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return select_experts(logits, self.e_score_correction_bias, self.cfg)


def routed_expert_layer(cfg: ModelConfig, dtype: torch.dtype, device, mp: ModelParallel) -> ParallelExperts:
    """This rank's routed experts: w13 [E_local, 2 I_local, D] = [gate; up], w2 [E_local, D, I_local], left
    uninitialised (load_weights fills every row). Built on the meta device first (ParallelExperts would
    allocate float32 zeros); with EP it registers its MoE tag with `mp` in construction order."""
    with torch.device("meta"):
        experts = ParallelExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                  cfg.num_experts_per_tok, mp)
    for name, p in list(experts.named_parameters()):
        setattr(experts, name, nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device)))
    return experts


class MoE(nn.Module):
    """Replicated router (global top-k ids and weights), routed experts through ParallelExperts (the full sum
    on every TP rank), TP-sharded shared experts."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, mp: ModelParallel | None = None):
        super().__init__()
        mp = mp or ModelParallel.single()
        self.gate = Router(cfg, device)
        self.experts = routed_expert_layer(cfg, dtype, device, mp)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = MLP(cfg.hidden_size, shared, dtype, device, mp) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class MLAttention(nn.Module):
    """MLA over this rank's H / T query heads; the latent cache entry and its projections are replicated."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, mp: ModelParallel | None = None):
        super().__init__()
        self.mp = mp = mp or ModelParallel.single()
        self.heads = len(shard_range(cfg.num_heads, mp.tp, "num_attention_heads", "heads"))
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.latent, self.v_dim, self.scale = cfg.kv_lora_rank, cfg.v_head_dim, cfg.softmax_scale
        self.q_lora_rank, d, q_dim = cfg.q_lora_rank, cfg.hidden_size, self.heads * (self.nope + self.rope)
        if self.q_lora_rank:
            self.q_a_proj = _linear(d, self.q_lora_rank, dtype, device)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = _linear(self.q_lora_rank, q_dim, dtype, device)
        else:
            self.q_proj = _linear(d, q_dim, dtype, device)
        self.kv_a_proj_with_mqa = _linear(d, self.latent + self.rope, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.latent, _LATENT_NORM_EPS)
        self.kv_b_proj = _linear(self.latent, self.heads * (self.nope + self.v_dim), dtype, device)
        self.o_proj = _linear(self.heads * self.v_dim, d, dtype, device)
        # V3.2: the lightning indexer, replicated on every TP rank (see models/dsa.py)
        self.indexer = Indexer(cfg, dtype, device) if cfg.has_dsa_indexer else None
        if mp.tp.size > 1:
            self._shard_heads(cfg.num_heads)

    def _shard_heads(self, num_heads: int) -> None:
        """Whole heads per rank: rows of the query and kv_b projections, columns of o_proj."""
        q = "q_b_proj" if self.q_lora_rank else "q_proj"
        for name, dim in ((q, 0), ("kv_b_proj", 0), ("o_proj", 1)):
            weight = getattr(self, name).weight
            full = list(weight.shape)
            full[dim] *= self.mp.tp.size
            _sharded(weight, full, partial(head_shard, num_heads=num_heads, tp=self.mp.tp, name=name, dim=dim))

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T, H, nope + rope] and the compressed query [T, q_lora_rank] (None without q compression)."""
        if self.q_lora_rank:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        else:
            q, q_resid = self.q_proj(x), None
        return q.view(x.shape[0], self.heads, self.nope + self.rope), q_resid

    def _cache_entries(self, x: torch.Tensor, step: MLAStep) -> torch.Tensor:
        """[T, latent + rope]: normalised latent and rotated rope key of each new token."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), step.rotate(k_pe)], dim=-1)

    def _w_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, latent] and W_UV [H, v, latent], views of kv_b_proj.weight."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.latent)
        return w[:, : self.nope], w[:, self.nope:]

    def _absorbed(self, q_nope, q_pe, cache: PagedPool, batch: DecodeBatch) -> torch.Tensor:
        """[R, H, v] for one query per request: scores q_nope W_UK . c + q_pe . k_pe, output (p c) W_UV^T."""
        if batch_invariant_enabled():  # each query alone, over exactly its own context
            return torch.cat([self._absorbed_batch(q_nope[r:r + 1], q_pe[r:r + 1], cache, self._own(batch, r))
                              for r in range(q_nope.shape[0])])
        return self._absorbed_batch(q_nope, q_pe, cache, batch)

    @staticmethod
    def _own(batch: DecodeBatch, r: int) -> DecodeBatch:
        n = int(batch.valid[r].sum())
        attend = None if batch.attend is None else batch.attend[r:r + 1, :n]
        return DecodeBatch(batch.rows[r:r + 1], batch.slots[r:r + 1, :n], batch.valid[r:r + 1, :n], attend)

    def _absorbed_batch(self, q_nope, q_pe, cache: PagedPool, batch: DecodeBatch) -> torch.Tensor:
        w_uk, w_uv = self._w_kv_b()
        q = torch.cat([torch.einsum("rhd,hdc->rhc", q_nope, w_uk), q_pe], dim=-1)
        if batch.block_table is not None and triton_enabled(q):  # CUDA: the paged kernel reads the rows itself
            from deepinfer.kernels.mla_decode import mla_decode

            o_c = mla_decode(q, cache.data, cache.scale, batch.block_table, batch.seq_lens, self.latent, self.scale,
                             batch.attend, block_size=batch.block_size)
            return torch.einsum("rhc,hvc->rhv", o_c, w_uv)
        if _cpu_kernel_serves(q, cache, batch):  # CPU: one pass over the rows, no gathered copy
            o_c = cpu_kernels.mla_decode(q, cache.data, batch.block_table, batch.seq_lens, batch.block_size,
                                         self.latent, self.scale)
            return torch.einsum("rhc,hvc->rhv", o_c, w_uv)
        ctx, valid = decode_context(cache, batch)
        scores = torch.matmul(q, ctx.transpose(1, 2)) * self.scale
        attend = valid if batch.attend is None else batch.attend
        scores = scores.masked_fill(~attend[:, None], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(ctx.dtype)
        o_c = torch.matmul(probs, ctx[..., : self.latent])
        return torch.einsum("rhc,hvc->rhv", o_c, w_uv)

    def _expanded(self, q_nope, q_pe, cache: PagedPool, seq: PrefillSeq,
                  attend: torch.Tensor | None = None) -> torch.Tensor:
        """[n, H, v] for a chunk of queries: context latents expanded to per-head keys and values; attend [n, L]
        (the DSA selection) replaces the causal mask."""
        c, k_pe = cache.read(seq.ctx_slots).split([self.latent, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(c.shape[0], self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        mask = seq.mask if attend is None else attend
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return out.transpose(0, 1)

    def forward(self, x: torch.Tensor, step: MLAStep, cache: PagedPool,
                index_cache: PagedPool | None = None) -> torch.Tensor:
        """index_cache: this layer's indexer keys (required with the DSA indexer)."""
        q, q_resid = self._queries(x)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = step.rotate(q_pe)
        cache.write(step.new_slots, self._cache_entries(x, step))
        decode, attends = step.decode, [None] * len(step.prefills)
        if self.indexer is not None:
            decode, attends = self._select(x, q_resid, step, index_cache)
        out = x.new_empty(x.shape[0], self.heads, self.v_dim)
        if decode is not None:
            rows = decode.rows
            out[rows] = self._absorbed(q_nope[rows], q_pe[rows], cache, decode)
        for seq, attend in zip(step.prefills, attends):
            out[seq.rows] = self._expanded(q_nope[seq.rows], q_pe[seq.rows], cache, seq, attend)
        return _reduced(self.o_proj(out.flatten(1)), self.mp)

    def _select(self, x: torch.Tensor, q_resid: torch.Tensor, step: MLAStep,
                index_cache: PagedPool | None) -> tuple[DecodeBatch | None, list[torch.Tensor]]:
        """DSA: write the new indexer keys, then each query's selected positions (the decode batch carries
        them as `attend`; one [n, L] mask per prefill chunk)."""
        if index_cache is None:
            raise RuntimeError("a DSA layer needs its indexer key cache (bind_kv_cache)")
        idx = self.indexer
        index_cache.write(step.new_slots, idx.keys(x, step.cos, step.sin))
        q, w = idx.queries(x, q_resid, step.cos, step.sin)
        decode = step.decode
        if decode is not None and triton_enabled(q):
            decode = replace(decode, attend=self._kernel_select(q[decode.rows], w[decode.rows], index_cache, decode))
        elif decode is not None:
            rows = decode.rows
            decode = replace(decode, attend=idx.select_decode(q[rows], w[rows], index_cache, decode.slots,
                                                               decode.valid))
        attends = [idx.select_prefill(q[seq.rows], w[seq.rows], index_cache, seq.ctx_slots) for seq in step.prefills]
        return decode, attends


    def _kernel_select(self, q: torch.Tensor, w: torch.Tensor, index_cache: PagedPool,
                       decode: DecodeBatch) -> torch.Tensor:
        """DSA decode on CUDA: the indexer kernel's top-k positions as the [R, L] attend mask."""
        from deepinfer.kernels.indexer import indexer_topk

        reqs = torch.arange(q.shape[0], device=q.device)
        picked, ok = indexer_topk(q, w, index_cache.data, index_cache.scale, decode.block_table, reqs,
                                  decode.seq_lens, decode.block_size, self.indexer.topk, self.indexer.scale,
                                  max_entries=decode.valid.shape[1])
        length = decode.valid.shape[1]  # padding slots land in one extra column, dropped after
        attend = decode.valid.new_zeros(q.shape[0], length + 1)
        attend.scatter_(1, torch.where(ok, picked, length), True)
        return attend[:, :length] & decode.valid


def is_moe_layer(cfg: ModelConfig, idx: int) -> bool:
    return cfg.n_routed_experts > 0 and idx >= cfg.first_k_dense_replace and idx % cfg.moe_layer_freq == 0


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, dtype: torch.dtype, device, mp: ModelParallel | None = None):
        super().__init__()
        mp = mp or ModelParallel.single()
        self.self_attn = MLAttention(cfg, dtype, device, mp)
        if is_moe_layer(cfg, idx):
            self.mlp = MoE(cfg, dtype, device, mp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, mp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, step: MLAStep, cache: PagedPool,
                index_cache: PagedPool | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), step, cache, index_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _vocab_table(cls, cfg: ModelConfig, dtype: torch.dtype, device, mp: ModelParallel) -> nn.Module:
    """A TP rank's block of a [V, D] table (VocabParallelEmbedding or ParallelLMHead), loaded by vocab_shard."""
    rows = len(vocab_range(cfg.vocab_size, mp.tp))
    table = cls(torch.empty(rows, cfg.hidden_size, dtype=dtype, device=device), cfg.vocab_size, mp.tp_group)
    _sharded(table.weight, (cfg.vocab_size, cfg.hidden_size), partial(vocab_shard, tp=mp.tp))
    return table


def _embedding(cfg: ModelConfig, dtype: torch.dtype, device, mp: ModelParallel) -> nn.Module:
    if mp.tp.size > 1:
        return _vocab_table(VocabParallelEmbedding, cfg, dtype, device, mp)
    return nn.utils.skip_init(nn.Embedding, cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)


def _lm_head(cfg: ModelConfig, dtype: torch.dtype, device, mp: ModelParallel) -> nn.Module:
    """Full [..., V] logits on every TP rank (ParallelLMHead all-gathers the vocab blocks)."""
    if mp.tp.size > 1:
        return _vocab_table(ParallelLMHead, cfg, dtype, device, mp)
    return nn.utils.skip_init(LMHead, cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, mp: ModelParallel | None = None):
        super().__init__()
        mp = mp or ModelParallel.single()
        self.embed_tokens = _embedding(cfg, dtype, device, mp)
        # with EP, the MoE layers register their tags here in layer order, the same on every rank
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, mp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# ---------------------------------------------------------------- checkpoint loading
#
# Every rank reads every checkpoint tensor in full and keeps its slice only (peak: its shards + one full tensor):
# a TP-sharded parameter through its load_shard, experts through ParallelExperts.local_index / shard_weight
# (another EP rank's expert is counted as seen and dropped). Full shapes are checked before slicing, so a bad
# checkpoint fails with the same message on every rank, and every rank requires every tensor.

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)"
                     r"\.(weight|weight_scale_inv)$")  # group 4: a kept-quantised expert's scale
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj|w13|w2)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED_PARTS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",),  # (kept-quantised: their scales)
                  "w13_scale": ("gate_proj", "up_proj"), "w2_scale": ("down_proj",)}
# Kept quantised, these stay nn.Linear and dequantised: absorbed decode reads kv_b_proj.weight as a float matrix.
_KEEP_DEQUANTIZED = ("kv_b_proj",)
_FUSED_TO_STACKED = {"gate_up_proj": "w13", "down_proj": "w2", "w13": "w13", "w2": "w2"}
_MTP_FUSED = {"mlp.experts.gate_up_proj": "w13", "mlp.experts.down_proj": "w2"}
HALF = {"gate_proj": 0, "up_proj": 1, "down_proj": None}  # which half of w13 a per-expert part fills (None: w2)


def _expert_part_names(prefix: str, leaf: str, experts) -> list[str]:
    """Per-expert checkpoint names that one stacked tensor (w13 or w2, or their kept-quantised scales) is made of,
    for the experts `experts`."""
    kind = "weight_scale_inv" if leaf.endswith("_scale") else "weight"
    return [f"{prefix}.{e}.{part}.{kind}" for e in experts for part in _STACKED_PARTS[leaf]]


def _expected_names(targets: dict[str, torch.Tensor], experts: dict[str, ParallelExperts]) -> set[str]:
    """Checkpoint names still to load; a stacked expert tensor stands for the per-expert parts of this rank's
    own experts (the loader may skip other ranks' experts unread: weights.wanted_names)."""
    names = set()
    for name in targets:
        prefix, _, leaf = name.rpartition(".")
        if prefix in experts and leaf in _STACKED_PARTS:
            names.update(_expert_part_names(prefix, leaf, experts[prefix].local))
        else:
            names.add(name)
    return names


def expert_slot(experts: ParallelExperts, local: int, half: int | None) -> torch.Tensor:
    """The view of w13 (gate: half 0, up: half 1) or w2 (half None) that local expert `local` fills."""
    if half is None:
        return experts.w2[local]
    inter = experts.w13.shape[1] // 2
    return experts.w13[local, half * inter:(half + 1) * inter]


def _expert_full_shape(cfg: ModelConfig, half: int | None) -> tuple[int, int]:
    """Checkpoint shape of one expert's gate / up [I, D] or down [D, I] matrix."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return (d, i) if half is None else (i, d)


def _fused_full_shape(cfg: ModelConfig, leaf: str) -> tuple[int, int, int]:
    """Checkpoint shape of a fused gate_up [E, 2I, D] (w13) or down [E, D, I] (w2) tensor."""
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return (e, 2 * i, d) if leaf == "w13" else (e, d, i)


def _fused_parts(leaf: str, w: torch.Tensor) -> tuple[tuple[int | None, torch.Tensor], ...]:
    """One expert's rows of a fused tensor as (half, matrix): gate and up of w13, or the w2 matrix."""
    return ((None, w),) if leaf == "w2" else tuple(enumerate(w.chunk(2)))


def shard_fused_experts(experts: ParallelExperts, leaf: str, t: torch.Tensor) -> torch.Tensor:
    """A fused [E, 2I, D] / [E, D, I] tensor as this rank stores it: its experts' rows, each matrix sliced by
    shard_weight (the gate and up halves separately)."""
    rows = t[experts.local.start:experts.local.stop]
    if not rows.shape[0]:  # a rank that owns no experts
        return rows
    return torch.stack([torch.cat([experts.shard_weight(m, half) for half, m in _fused_parts(leaf, w)]) for w in rows])


class _WeightLoader:
    def __init__(self, model: DeepseekV3ForCausalLM):
        self.cfg = model.config
        self.targets = model.state_dict(keep_vars=True)
        self.experts = {n: m for n, m in model.named_modules() if isinstance(m, ParallelExperts)}
        self.pending = _expected_names(self.targets, self.experts)
        self.mtp: dict[str, torch.Tensor] = {}

    def _is_mtp(self, name: str) -> bool:
        m = _LAYER.match(name)
        return m is not None and 0 <= int(m[1]) - self.cfg.num_layers < self.cfg.num_mtp_layers

    def _unknown(self, name: str, source: str) -> CheckpointError:
        return CheckpointError(f"{source}: unknown tensor {name!r} for {self.cfg.model_type}")

    def _target(self, name: str, source: str) -> torch.Tensor:
        if name not in self.targets:
            raise self._unknown(name, source)
        return self.targets[name]

    def _experts_at(self, prefix: str, source: str, shown: str) -> ParallelExperts:
        if prefix not in self.experts:
            raise self._unknown(shown, source)
        return self.experts[prefix]

    @staticmethod
    def _check_shape(shape, expected, name: str, source: str) -> None:
        if tuple(shape) != tuple(expected):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(shape)}, "
                                  f"the model expects {tuple(expected)}")

    @classmethod
    def _copy(cls, dst: torch.Tensor, src: torch.Tensor, name: str, source: str) -> None:
        cls._check_shape(src.shape, dst.shape, name, source)
        with torch.no_grad():
            dst.copy_(src)

    def _put_param(self, dst: torch.Tensor, full: torch.Tensor, name: str, source: str) -> None:
        """A full checkpoint tensor into a parameter: its full shape checked, then its TP slice (if any) copied."""
        self._check_shape(getattr(full, "checkpoint_shape", full.shape), getattr(dst, "full_shape", dst.shape), name,
                          source)
        shard = getattr(dst, "load_shard", None)
        cut = shard is None or hasattr(full, "checkpoint_shape")  # the loader read only the block
        self._copy(dst, full if cut else shard(full), name, source)

    def _put_expert(self, m: re.Match, tensor: torch.Tensor, source: str) -> None:
        prefix, e, half, scale = m[1], int(m[2]), HALF[m[3]], m[4] == "weight_scale_inv"
        experts = self._experts_at(prefix, source, m[0])
        if e >= experts.num_experts or (scale and experts.quant is None):
            raise CheckpointError(f"{source}: unknown tensor {m[0]!r} ({experts.num_experts} experts, "
                                  f"stored {experts.quant or 'dequantised'})")
        if not scale:  # a kept scale's shape was checked by the loader; its slot's shape by _copy
            self._check_shape(tensor.shape, _expert_full_shape(self.cfg, half), m[0], source)
        self.pending.discard(m[0])
        local = experts.local_index(e)
        if local is not None:  # else another EP rank's expert: seen, not kept
            slot = experts.scale_slot(local, half) if scale else expert_slot(experts, local, half)
            self._copy(slot, experts.shard_weight(tensor, half), m[0], source)

    def _put_fused(self, m: re.Match, tensor: torch.Tensor, source: str) -> None:
        """transformers' fused gate_up_proj / down_proj, or our own stacked w13 / w2 (the same layouts)."""
        prefix, leaf = m[1], _FUSED_TO_STACKED[m[2]]
        experts = self._experts_at(prefix, source, m[0])
        self._check_shape(tensor.shape, _fused_full_shape(self.cfg, leaf), m[0], source)
        for local, expert in enumerate(experts.local):  # expert by expert: no second full-size copy
            for half, part in _fused_parts(leaf, tensor[expert]):
                self._copy(expert_slot(experts, local, half), experts.shard_weight(part, half), m[0], source)
        self.pending.difference_update(_expert_part_names(prefix, leaf, range(experts.num_experts)))

    def put(self, name: str, tensor: torch.Tensor, source: str) -> None:
        if self._is_mtp(name):
            self.mtp[name] = self._mtp_shard(name, tensor)
        elif name.endswith("rotary_emb.inv_freq"):
            return  # derived from the config
        elif m := _EXPERT.match(name):
            self._put_expert(m, tensor, source)
        elif m := _FUSED.match(name):
            self._put_fused(m, tensor, source)
        else:
            self._put_param(self._target(name, source), tensor, name, source)
            self.pending.discard(name)

    def _mtp_shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An MTP tensor as this rank keeps it for build_mtp: sliced like its twin in the main model (the same
        name in the last main layer of the same kind); an empty placeholder for what this rank never loads
        (another EP rank's expert, the duplicated embedding and head). Shapes are checked by MLAMTPLayer.load."""
        layer, rel = int(_LAYER.match(name)[1]), _LAYER.sub("", name)
        experts = next(iter(self.experts.values()), None)  # every MoE layer has the same placement and sizes
        if rel in MTP_SHARED_TENSORS:
            return tensor.new_empty(0)
        if experts is not None and (m := _MTP_EXPERT.match(rel)):
            local = experts.local_index(int(m[1]))
            return tensor.new_empty(0) if local is None else experts.shard_weight(tensor, HALF[m[2]])
        if experts is not None and rel in _MTP_FUSED:
            return shard_fused_experts(experts, _MTP_FUSED[rel], tensor)
        twin = self.targets.get(f"model.layers.{self._twin(layer)}.{rel}")
        shard = getattr(twin, "load_shard", None)
        return tensor if shard is None else shard(tensor)

    def _twin(self, layer: int) -> int | None:
        """The last main layer of the same kind (MoE or dense) as layer `layer`."""
        moe = is_moe_layer(self.cfg, layer)
        return next((i for i in reversed(range(self.cfg.num_layers)) if is_moe_layer(self.cfg, i) == moe), None)

    def finish(self) -> None:
        tied = self.cfg.extra.get("tie_word_embeddings") and "model.embed_tokens.weight" not in self.pending
        if tied and "lm_head.weight" in self.pending:
            embed = self.targets["model.embed_tokens.weight"]  # the same vocab block as lm_head's under TP
            self._copy(self.targets["lm_head.weight"], embed, "lm_head.weight", "tied embeddings")
            self.pending.discard("lm_head.weight")
        if self.pending:
            few = ", ".join(sorted(self.pending)[:6])
            raise CheckpointError(f"checkpoint is missing {len(self.pending)} tensors, e.g. {few}")


# ---------------------------------------------------------------- the model


class DeepseekV3ForCausalLM(nn.Module):
    """V3 / R1 / V2 / V2-Lite. forward(meta) -> final-normed hidden [T, D]; compute_logits -> fp32."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 parallel: ModelParallel | None = None):
        """parallel: this rank's TP / EP place (None: one process, ModelParallel.single())."""
        super().__init__()
        if config.model_type not in ("deepseek_v32", "deepseek_v3", "deepseek_v2") or not config.kv_lora_rank:
            raise ConfigError(f"DeepseekV3ForCausalLM serves MLA models, not {config.model_type!r}")
        self.config, self.dtype = config, dtype
        self.parallel = ModelParallel.single() if parallel is None else parallel
        shard_range(config.num_heads, self.parallel.tp, "num_attention_heads", "heads")  # before any collective
        self.model = DeepseekV3Model(config, dtype, device, self.parallel)
        self.lm_head = _lm_head(config, dtype, device, self.parallel)
        self.to(device)
        self.requires_grad_(False)
        self.rotary = RotaryTable(config.rope, config.max_position, device)
        self.mtp_weights: dict[str, torch.Tensor] = {}  # model.layers.{num_layers + k}.*, for MTP drafting
        self.mtp = nn.ModuleList()  # built from mtp_weights by build_mtp() when MTP drafting is used
        self._kv: list[PagedPool] = []
        self._index_kv: list[PagedPool | None] = [None] * config.num_layers  # V3.2: indexer keys per layer
        self._mtp_kv: list[PagedPool] = []
        self.kv_cache_dtype = "auto"  # storage of the latent pools: auto (model dtype) | fp8 | int8
        self.batch_invariant_kernels = True  # attention honours layers.batch_invariant
        if torch.device(device).type == "cpu":  # its CPU decode's kernels: every process serving the model loads them
            cpu_kernels.load()

    @property
    def cache_width(self) -> int:
        return self.config.kv_lora_rank + self.config.qk_rope_head_dim

    def prefix_replay_tokens(self) -> int:
        """MLA keeps no bounded state: a cached prefix is resumed without recomputing anything."""
        return 0

    @property
    def mtp_loaded(self) -> bool:
        return bool(self.mtp_weights) or len(self.mtp) > 0

    def build_mtp(self) -> None:
        """The MTP layers from the checkpoint's `model.layers.{N + k}.*` tensors (CheckpointError if incomplete);
        the kept tensors are freed once the layers hold them.

        With EP every rank must build them at the same point: each MTP MoE registers the next tag with
        `parallel`, and a rank that does not draft still runs that tag's experts for its peers in finish_step.
        load_weights therefore builds them itself under EP (on every rank, right after loading)."""
        if len(self.mtp) or not self.mtp_weights:
            return
        if self.config.has_dsa_indexer:
            raise ConfigError("MTP drafting is not supported for deepseek_v32 (DSA) yet")
        device, layers = self.lm_head.weight.device, []
        for k in range(self.config.num_mtp_layers):
            prefix = f"model.layers.{self.config.num_layers + k}."
            layer = MLAMTPLayer(self.config, k, self.dtype, device, self.parallel)
            self._keep_mtp_quantized(layer, prefix)
            layer.load({n: t for n, t in self.mtp_weights.items() if n.startswith(prefix)}, prefix)
            layers.append(layer.requires_grad_(False).eval())
        self.mtp = nn.ModuleList(layers)
        self.mtp_weights = {}

    def keep_quantized_weights(self, quantized: Mapping[str, QuantInfo],
                               block: tuple[int, int] | None = None) -> Callable[[str], bool]:
        """Store the weights `quantized` (loader.quantized_weights of the checkpoint) says are FP8 as they are:
        dense projections become FP8BlockLinear, routed experts FP8 ParallelExperts (when `block[0]` divides
        moe_intermediate_size); kv_b_proj stays dequantised (absorbed decode reads its weight). MTP layers are
        kept alike (swapped when build_mtp builds them). Call before load_weights and pass the returned predicate
        to iter_checkpoint(keep_quantized=...). One process only (ValueError under TP / EP). `block`: the FP8
        block, default config.weight_block_size."""
        block = tuple(block or self.config.weight_block_size)
        kept = keep_quantized_modules(self, quantized, block, V3_EXPERT_LEAVES, self.parallel,
                                      excluded=_KEEP_DEQUANTIZED)
        kept |= self._mtp_kept(quantized, block)
        self._kept_quantized = ({n: quantized[n] for n in kept}, block)
        return frozenset(kept).__contains__

    def _mtp_kept(self, quantized: Mapping[str, QuantInfo], block: tuple[int, int]) -> set[str]:
        """The MTP names build_mtp's layers will keep quantised: decided on meta-device twins of those layers."""
        if self.config.has_dsa_indexer:  # no MTP drafting for DSA: its MTP tensors load dequantised
            return set()
        kept: set[str] = set()
        for k in range(self.config.num_mtp_layers):
            with torch.device("meta"):
                layer = MLAMTPLayer(self.config, k, self.dtype, "meta", self.parallel)
            kept |= self._keep_mtp_quantized(layer, f"model.layers.{self.config.num_layers + k}.", quantized, block)
        return kept

    def _keep_mtp_quantized(self, layer: MLAMTPLayer, prefix: str, quantized: Mapping[str, QuantInfo] | None = None,
                            block: tuple[int, int] | None = None) -> set[str]:
        """Swap an MTP layer's modules like the main layers' (default: as keep_quantized_weights decided)."""
        if quantized is None:
            quantized, block = getattr(self, "_kept_quantized", ({}, None))
        if not quantized:
            return set()
        return keep_quantized_modules(layer, quantized, block, V3_EXPERT_LEAVES, self.parallel,
                                      lambda path: prefix + path.removeprefix("block."), _KEEP_DEQUANTIZED)

    def _layer_names(self, include_mtp: bool) -> list[str]:
        mtp = [f"mtp.{k}.mla" for k in range(len(self.mtp))] if include_mtp else []
        return [f"layers.{i}.mla" for i in range(self.config.num_layers)] + mtp

    def kv_cache_spec(self, block_size: int, include_mtp: bool = False) -> list[CacheTensorSpec]:
        """One latent + rope-key entry per token per layer (and per built MTP layer with include_mtp);
        quantised storage adds a float32 scale per token."""
        dtype = storage_dtype(self.kv_cache_dtype, self.dtype)
        names = self._layer_names(include_mtp)
        specs = [CacheTensorSpec(n, "paged", (block_size, self.cache_width), dtype) for n in names]
        if is_quantised(dtype):
            specs += [CacheTensorSpec(f"{n}_scale", "paged", (block_size, 1), torch.float32) for n in names]
        specs += [CacheTensorSpec(n, "paged", (block_size, self.config.index_head_dim), self.dtype)
                  for n in self._index_names()]
        return specs

    def _index_names(self) -> list[str]:
        """V3.2: one paged tensor of indexer keys per layer (model dtype, never quantised)."""
        if not self.config.has_dsa_indexer:
            return []
        return [f"layers.{i}.index_k" for i in range(self.config.num_layers)]

    def bind_kv_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        """Paged tensors [num_blocks, block_size, width] viewed flat: slot = block * block_size + offset."""
        names = [f"layers.{i}.mla" for i in range(self.config.num_layers)]
        missing = [n for n in names + self._index_names() if n not in tensors]
        if missing:
            raise ValueError(f"bind_kv_cache: no tensor for {missing[:3]}")
        self._kv = [PagedPool.of(tensors, n, self.cache_width, self.dtype) for n in names]
        if self.config.has_dsa_indexer:
            self._index_kv = [PagedPool.of(tensors, n, self.config.index_head_dim, self.dtype)
                              for n in self._index_names()]
        mtp = [n for n in self._layer_names(True)[len(names):] if n in tensors]
        self._mtp_kv = [PagedPool.of(tensors, n, self.cache_width, self.dtype) for n in mtp]

    def _step(self, meta: ForwardMeta) -> MLAStep:
        return meta.cached("mla_step", lambda: plan_step(meta, self.rotary, self.config.rope_interleave))

    def forward(self, meta: ForwardMeta, return_mtp_input: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Final normed hidden [T, D]; with return_mtp_input twice (it is also what MTP layer 0 takes)."""
        return self._run(self._step(meta), meta.input_ids, return_mtp_input)

    def forward_static(self, step: StaticStep, scratch_block: int, return_mtp_input: bool = False):
        """forward over a fixed-shape step (CUDA graphs, torch.compile on CPU; padding rows in the scratch
        block); the rope table must cover every position (grow_rope)."""
        return self._run(static_plan(step, self.rotary, self.config.rope_interleave), step.input_ids,
                         return_mtp_input)

    def grow_rope(self, max_position: int) -> None:
        """Reserve (and freeze) the rope table for positions < max_position."""
        self.rotary.reserve(max_position)

    def _run(self, step: MLAStep, input_ids: torch.Tensor, return_mtp_input: bool):
        if not self._kv:
            raise RuntimeError("bind_kv_cache() must be called before forward()")
        h = self.model.embed_tokens(input_ids)
        for layer, cache, index_cache in zip(self.model.layers, self._kv, self._index_kv):
            h = layer(h, step, cache, index_cache)
        hidden = self.model.norm(h)
        return (hidden, hidden) if return_mtp_input else hidden

    def mtp_forward(self, k: int, mtp_input: torch.Tensor, next_token_ids: torch.Tensor, meta: ForwardMeta,
                    return_mtp_input: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """MTP layer k at the positions of `meta` in its own `mtp.{k}` cache: row t pairs mtp_input[t] with
        the embedding of next_token_ids[t]; returns the hidden the shared head scores (and the layer output)."""
        if k >= len(self._mtp_kv):
            raise RuntimeError(f"MTP layer {k} has no cache: build_mtp(), then bind kv_cache_spec(include_mtp=True)")
        out = self.mtp[k](mtp_input, self.model.embed_tokens(next_token_ids), self._step(meta), self._mtp_kv[k])
        hidden = self.mtp[k].head_norm(out)
        return (hidden, out) if return_mtp_input else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        """Copy (name, tensor, source file) into the parameters; raises CheckpointError on any mismatch."""
        loader = _WeightLoader(self)
        for name, tensor, source in weights:
            loader.put(name, tensor, source)
        self.mtp_weights.update(loader.mtp)
        loader.finish()
        if self.parallel.expert_parallel and not self.config.has_dsa_indexer:
            self.build_mtp()  # every EP rank registers the MTP MoE tags here, in the same order (see build_mtp)
