"""DeepSeek-V3 / R1 and DeepSeek-V2 / V2-Lite: MLA attention over a paged latent cache, DeepSeekMoE.

Cache: one paged tensor per layer; the entry of a token is [c | k_pe] with c = kv_a_layernorm(latent)
(kv_lora_rank) and k_pe the already-rotated shared rope key (qk_rope_head_dim). Entries of the new
tokens are written before attention, so every query reads its whole context from the cache.
Requests with one new token attend in latent space (W_UK / W_UV absorbed from kv_b_proj, batched
over requests); longer chunks expand their context with kv_b_proj and attend causally.
RoPE: with rope_interleave the pairs (2i, 2i+1) are rotated in place; transformers writes the same
values de-interleaved, a permutation shared by q_pe and k_pe, so scores are identical.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config import ConfigError, ModelConfig
from deepinfer.layers.batch_invariant import batch_invariant_enabled
from deepinfer.layers.kv_quant import PagedPool, is_quantised, storage_dtype
from deepinfer.layers.metadata import CacheTensorSpec, ForwardMeta
from deepinfer.layers.moe import routed_experts
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryTable, rotate_interleaved
from deepinfer.models.loader import CheckpointError
from deepinfer.models.mla_mtp import MLAMTPLayer
from deepinfer.models.mla_routing import select_experts

# q_a_layernorm / kv_a_layernorm use the RMSNorm default eps in DeepSeek's code, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def _linear(in_features: int, out_features: int, dtype: torch.dtype, device) -> nn.Linear:
    """Bias-free projection left uninitialised: load_weights fills every parameter."""
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False, dtype=dtype, device=device)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + dim/2) of x [N, (H,) dim] (rope_interleave false); cos/sin [N, dim // 2]."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# ---------------------------------------------------------------- per-step plan (shared by all layers)


@dataclass
class DecodeBatch:
    """Requests with one new token, attended together over a padded context."""

    rows: torch.Tensor  # [R] token row of each request
    slots: torch.Tensor  # [R, L] cache slot of positions 0..L-1 (slot of position 0 where invalid)
    valid: torch.Tensor  # [R, L] position < seq_len of the request


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
    return DecodeBatch(rows, slots, valid)


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


# ---------------------------------------------------------------- modules (names = HF checkpoint names)


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int, dtype: torch.dtype, device):
        super().__init__()
        self.gate_proj = _linear(dim, inter, dtype, device)
        self.up_proj = _linear(dim, inter, dtype, device)
        self.down_proj = _linear(inter, dim, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


class Experts(nn.Module):
    """Routed experts stacked: w13 [E, 2I, D] = [gate; up], w2 [E, D, I]."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(e, d, i, dtype=dtype, device=device))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.gate = Router(cfg, device)
        self.experts = Experts(cfg, dtype, device)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = MLP(cfg.hidden_size, shared, dtype, device) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = routed_experts(x, ids, weights, self.experts.w13, self.experts.w2)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.heads, self.nope, self.rope = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.latent, self.v_dim, self.scale = cfg.kv_lora_rank, cfg.v_head_dim, cfg.softmax_scale
        self.q_lora_rank, d, q_dim = cfg.q_lora_rank, cfg.hidden_size, cfg.num_heads * (self.nope + self.rope)
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

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, nope + rope]"""
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        return q.view(x.shape[0], self.heads, self.nope + self.rope)

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
            return torch.cat([self._absorbed_batch(q_nope[r:r + 1], q_pe[r:r + 1], cache,
                                                   DecodeBatch(batch.rows[r:r + 1], *self._own(batch, r)))
                              for r in range(q_nope.shape[0])])
        return self._absorbed_batch(q_nope, q_pe, cache, batch)

    @staticmethod
    def _own(batch: DecodeBatch, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(batch.valid[r].sum())
        return batch.slots[r:r + 1, :n], batch.valid[r:r + 1, :n]

    def _absorbed_batch(self, q_nope, q_pe, cache: PagedPool, batch: DecodeBatch) -> torch.Tensor:
        w_uk, w_uv = self._w_kv_b()
        q = torch.cat([torch.einsum("rhd,hdc->rhc", q_nope, w_uk), q_pe], dim=-1)
        # padded slots may hold anything (even NaN): zero them so masked probabilities stay exact zeros
        ctx = cache.read(batch.slots).masked_fill(~batch.valid[..., None], 0)
        scores = torch.matmul(q, ctx.transpose(1, 2)) * self.scale
        scores = scores.masked_fill(~batch.valid[:, None], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(ctx.dtype)
        o_c = torch.matmul(probs, ctx[..., : self.latent])
        return torch.einsum("rhc,hvc->rhv", o_c, w_uv)

    def _expanded(self, q_nope, q_pe, cache: PagedPool, seq: PrefillSeq) -> torch.Tensor:
        """[n, H, v] for a chunk of queries: context latents expanded to per-head keys and values."""
        c, k_pe = cache.read(seq.ctx_slots).split([self.latent, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(c.shape[0], self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=seq.mask, is_causal=seq.mask is None, scale=self.scale)
        return out.transpose(0, 1)

    def forward(self, x: torch.Tensor, step: MLAStep, cache: PagedPool) -> torch.Tensor:
        q_nope, q_pe = self._queries(x).split([self.nope, self.rope], dim=-1)
        q_pe = step.rotate(q_pe)
        cache.write(step.new_slots, self._cache_entries(x, step))
        out = x.new_empty(x.shape[0], self.heads, self.v_dim)
        if step.decode is not None:
            rows = step.decode.rows
            out[rows] = self._absorbed(q_nope[rows], q_pe[rows], cache, step.decode)
        for seq in step.prefills:
            out[seq.rows] = self._expanded(q_nope[seq.rows], q_pe[seq.rows], cache, seq)
        return self.o_proj(out.flatten(1))


def is_moe_layer(cfg: ModelConfig, idx: int) -> bool:
    return cfg.n_routed_experts > 0 and idx >= cfg.first_k_dense_replace and idx % cfg.moe_layer_freq == 0


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, dtype: torch.dtype, device):
        super().__init__()
        self.self_attn = MLAttention(cfg, dtype, device)
        if is_moe_layer(cfg, idx):
            self.mlp = MoE(cfg, dtype, device)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, step: MLAStep, cache: PagedPool) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), step, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.embed_tokens = nn.utils.skip_init(nn.Embedding, cfg.vocab_size, cfg.hidden_size,
                                               dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# ---------------------------------------------------------------- checkpoint loading

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_STACKED_PARTS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
_FUSED_TO_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def _expert_part_names(prefix: str, leaf: str, n_experts: int) -> list[str]:
    """Per-expert checkpoint names that one stacked tensor (w13 or w2) is made of."""
    return [f"{prefix}.{e}.{part}.weight" for e in range(n_experts) for part in _STACKED_PARTS[leaf]]


def _expected_names(targets: dict[str, torch.Tensor]) -> set[str]:
    """Checkpoint names still to load; a stacked expert tensor stands for its per-expert parts."""
    names = set()
    for name, t in targets.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf in _STACKED_PARTS:
            names.update(_expert_part_names(prefix, leaf, t.shape[0]))
        else:
            names.add(name)
    return names


class _WeightLoader:
    def __init__(self, model: DeepseekV3ForCausalLM):
        self.cfg = model.config
        self.targets = model.state_dict(keep_vars=True)
        self.pending = _expected_names(self.targets)
        self.mtp: dict[str, torch.Tensor] = {}

    def _is_mtp(self, name: str) -> bool:
        m = _LAYER.match(name)
        return m is not None and 0 <= int(m[1]) - self.cfg.num_layers < self.cfg.num_mtp_layers

    def _target(self, name: str, source: str, shown: str = "") -> torch.Tensor:
        if name not in self.targets:
            raise CheckpointError(f"{source}: unknown tensor {shown or name!r} for {self.cfg.model_type}")
        return self.targets[name]

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, name: str, source: str) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(src.shape)}, "
                                  f"the model expects {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)

    def _mark_stacked(self, prefix: str, leaf: str) -> None:
        n = self.targets[f"{prefix}.{leaf}"].shape[0]
        self.pending.difference_update(_expert_part_names(prefix, leaf, n))

    def _put_expert(self, m: re.Match, tensor: torch.Tensor, source: str) -> None:
        prefix, e, part = m[1], int(m[2]), m[3]
        stacked = self._target(f"{prefix}.{'w2' if part == 'down_proj' else 'w13'}", source, m[0])
        if e >= stacked.shape[0]:
            raise CheckpointError(f"{source}: unknown tensor {m[0]!r} (only {stacked.shape[0]} experts)")
        half = stacked.shape[1] // 2
        dst = {"gate_proj": stacked[e, :half], "up_proj": stacked[e, half:], "down_proj": stacked[e]}[part]
        self._copy(dst, tensor, m[0], source)
        self.pending.discard(m[0])

    def put(self, name: str, tensor: torch.Tensor, source: str) -> None:
        if self._is_mtp(name):
            self.mtp[name] = tensor
        elif name.endswith("rotary_emb.inv_freq"):
            return  # derived from the config
        elif m := _EXPERT.match(name):
            self._put_expert(m, tensor, source)
        else:
            fused = _FUSED.match(name)
            if fused:
                name = f"{fused[1]}.{_FUSED_TO_STACKED[fused[2]]}"
            self._copy(self._target(name, source, fused and fused[0]), tensor, name, source)
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith(".mlp.experts") and leaf in _STACKED_PARTS:
                self._mark_stacked(prefix, leaf)
            self.pending.discard(name)

    def finish(self) -> None:
        tied = self.cfg.extra.get("tie_word_embeddings") and "model.embed_tokens.weight" not in self.pending
        if tied and "lm_head.weight" in self.pending:
            embed = self.targets["model.embed_tokens.weight"]
            self._copy(self.targets["lm_head.weight"], embed, "lm_head.weight", "tied embeddings")
            self.pending.discard("lm_head.weight")
        if self.pending:
            few = ", ".join(sorted(self.pending)[:6])
            raise CheckpointError(f"checkpoint is missing {len(self.pending)} tensors, e.g. {few}")


# ---------------------------------------------------------------- the model


class DeepseekV3ForCausalLM(nn.Module):
    """V3 / R1 / V2 / V2-Lite. forward(meta) -> final-normed hidden [T, D]; compute_logits -> fp32."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__()
        if config.model_type not in ("deepseek_v3", "deepseek_v2") or not config.kv_lora_rank:
            raise ConfigError(f"DeepseekV3ForCausalLM serves MLA models, not {config.model_type!r}")
        self.config, self.dtype = config, dtype
        self.model = DeepseekV3Model(config, dtype, device)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, dtype, device)
        self.to(device)
        self.requires_grad_(False)
        self.rotary = RotaryTable(config.rope, config.max_position, device)
        self.mtp_weights: dict[str, torch.Tensor] = {}  # model.layers.{num_layers + k}.*, for MTP drafting
        self.mtp = nn.ModuleList()  # built from mtp_weights by build_mtp() when MTP drafting is used
        self._kv: list[PagedPool] = []
        self._mtp_kv: list[PagedPool] = []
        self.kv_cache_dtype = "auto"  # storage of the latent pools: auto (model dtype) | fp8 | int8
        self.batch_invariant_kernels = True  # attention honours layers.batch_invariant

    @property
    def cache_width(self) -> int:
        return self.config.kv_lora_rank + self.config.qk_rope_head_dim

    def prefix_replay_tokens(self) -> int:
        """MLA keeps no bounded state: a cached prefix is resumed without recomputing anything."""
        return 0

    @property
    def mtp_loaded(self) -> bool:
        return bool(self.mtp_weights)

    def build_mtp(self) -> None:
        """The MTP layers from the checkpoint's `model.layers.{N + k}.*` tensors (CheckpointError if incomplete)."""
        if len(self.mtp) or not self.mtp_weights:
            return
        device, layers = self.lm_head.weight.device, []
        for k in range(self.config.num_mtp_layers):
            prefix = f"model.layers.{self.config.num_layers + k}."
            layer = MLAMTPLayer(self.config, k, self.dtype, device)
            layer.load({n: t for n, t in self.mtp_weights.items() if n.startswith(prefix)}, prefix)
            layers.append(layer.requires_grad_(False).eval())
        self.mtp = nn.ModuleList(layers)

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
        return specs

    def bind_kv_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        """Paged tensors [num_blocks, block_size, width] viewed flat: slot = block * block_size + offset."""
        names = [f"layers.{i}.mla" for i in range(self.config.num_layers)]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"bind_kv_cache: no tensor for {missing[:3]}")
        self._kv = [PagedPool.of(tensors, n, self.cache_width, self.dtype) for n in names]
        mtp = [n for n in self._layer_names(True)[len(names):] if n in tensors]
        self._mtp_kv = [PagedPool.of(tensors, n, self.cache_width, self.dtype) for n in mtp]

    def _step(self, meta: ForwardMeta) -> MLAStep:
        return meta.cached("mla_step", lambda: plan_step(meta, self.rotary, self.config.rope_interleave))

    def forward(self, meta: ForwardMeta, return_mtp_input: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Final normed hidden [T, D]; with return_mtp_input twice (it is also what MTP layer 0 takes)."""
        if not self._kv:
            raise RuntimeError("bind_kv_cache() must be called before forward()")
        step = self._step(meta)
        h = self.model.embed_tokens(meta.input_ids)
        for layer, cache in zip(self.model.layers, self._kv):
            h = layer(h, step, cache)
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
