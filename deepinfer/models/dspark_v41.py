"""DeepSeek-V4.1's own DSpark draft head: the `mtp.{K}.*` stages (K < dspark.num_stages), as DeepSeek's reference
computes them.

What runs (per request, after the target validated positions up to P):
  * every validated position p is consumed: stage 0 projects the target's tap features (the means over hc copies
    of the input streams of `dspark.target_layer_ids`, concatenated) to `main_x = main_norm(main_proj(taps))`,
    shared by all stages; each stage writes `fp8_qdq(rope_p(kv_norm(wkv(main_x))))` into its own window ring
    (`mtp.{K}.window`, slot p % (W + lookahead), position-indexed, so a rejected draft's slot is rewritten later);
  * a draft block of B = dspark.block_size rows [next token, noise, noise, ...] at positions P + 1 .. P + B runs
    through the stages (plain rope, ratio 0): each block row attends to the ring's valid slots of a W-slot ring
    (in slot order p % W, the reference's column order, which the blocked softmax depends on), then to all B block
    rows (bidirectional), plus the per-head sink;
  * the last stage's head: logits = head(norm(collapse(streams))) in float32, then the Markov walk adds
    markov_head.head(markov_head.embed(prev_i)) to row i, prev_{i+1} = argmax(row i) (ties: lower id), and
    confidence_i = confidence_head.proj(cat([collapse_i, markov_embed_i]).float()) (a logit).

Numerics: the backbone's helpers (QLinear, Block / MoE / hc mixes, fp8_qdq, complex RoPE, blocked sink attention)
with the reference's op order, so drafts, logits and confidence are bit-identical to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.layers.attention import blocked_sink_attention
from deepinfer.layers.metadata import CacheTensorSpec
from deepinfer.layers.mx_quant import fp8_qdq
from deepinfer.layers.rotary import rotate_tail_complex
from deepinfer.models.deepseek_v41 import Attention, Block, QLinear, _linear, _norm, hc_collapse


class DraftStep:
    """Per-draft values the stages share: block rotations and each block row's ring columns."""

    vl = None  # drafts are text: no image-span routing bias

    def __init__(self, model, slots: torch.Tensor, last: torch.Tensor, block: int, ring_len: int, window: int):
        dev = slots.device
        self.block, self.ring_len = block, ring_len
        offs = torch.arange(block, device=dev)
        self.positions = (last[:, None] + 1 + offs[None, :]).flatten()  # [R * B]
        self.rot = model.rotations("main", self.positions)
        n_ring = torch.clamp(last + 1, max=window)  # [R] valid ring columns: slots 0 .. min(W, P + 1) - 1
        width = int(n_ring.max()) + block
        col = torch.arange(width, device=dev)[None, :]
        j = col.clamp(max=window - 1)
        pos = last[:, None] - (last[:, None] - j) % window  # the position whose W-ring slot is j
        self.ring_rows = slots[:, None] * ring_len + pos.clamp(min=0) % ring_len  # [R, C]
        self.from_ring = col < n_ring[:, None]
        self.block_col = (col - n_ring[:, None]).clamp(min=0, max=block - 1)  # block row read by a block column
        self.valid = self.from_ring | (col < (n_ring[:, None] + block))  # [R, C]
        self.segments = [(i * block, (i + 1) * block, block, 0) for i in range(last.numel())]  # one call per block


class DSparkAttention(Attention):
    """A ratio-0 V4.1 attention whose window ring holds main-model KV; queries are the draft block."""

    def main_kv(self, main_x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        return fp8_qdq(rotate_tail_complex(self.kv_norm(self.wkv(main_x)), rot))

    def forward(self, x: torch.Tensor, ctx: DraftStep) -> torch.Tensor:
        rot, b = ctx.rot, ctx.block
        qr = self.q_norm(self.wq_a(x))
        q = rotate_tail_complex(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), rot)
        kv = fp8_qdq(rotate_tail_complex(self.kv_norm(self.wkv(x)), rot))
        ring = self.cache["window"].view(-1, self.head_dim)
        n_req = ctx.ring_rows.shape[0]
        block_kv = kv.view(n_req, b, self.head_dim)
        from_block = block_kv.gather(1, ctx.block_col.unsqueeze(-1).expand(-1, -1, self.head_dim))
        keys = torch.where(ctx.from_ring.unsqueeze(-1), ring[ctx.ring_rows], from_block)  # [R, C, d]
        keys = keys.repeat_interleave(b, dim=0)
        valid = ctx.valid.repeat_interleave(b, dim=0)
        out = blocked_sink_attention(q, keys, valid, self.attn_sink, self.head_dim**-0.5)
        out = rotate_tail_complex(out, rot, inverse=True)
        grouped = out.view(1, -1, self.groups, self.n_heads * self.head_dim // self.groups)
        grouped = torch.einsum("bsgd,grd->bsgr", grouped, self.wo_a.weight.view(self.groups, self.o_rank, -1))
        return self.wo_b(grouped.flatten(2)[0])


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank, dtype=torch.bfloat16)
        self.head = _linear(rank, vocab, torch.float32)  # the checkpoint's bf16 values, held in float32

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.embed(ids)
        return F.linear(embed.float(), self.head.weight), embed


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = _linear(dim, 1, torch.float32)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, markov_embed], dim=-1).float()).squeeze(-1)


class DSparkStage(Block):
    """`mtp.{K}`: a V4.1 block (its own MoE size) with a DSpark attention; stage 0 owns the tap projection, the
    last stage the norm, Markov head and confidence head."""

    def __init__(self, cfg: ModelConfig, stage: int):
        ds = cfg.v41.dspark
        super().__init__(cfg, cfg.num_layers + stage, ds.n_routed_experts, ds.num_experts_per_tok)
        self.attn = DSparkAttention(cfg, cfg.num_layers + stage)
        d = cfg.hidden_size
        if stage == 0:
            self.main_proj = QLinear(d * len(ds.target_layer_ids), d, cfg.v41.quantized)
            self.main_norm = _norm(d, cfg.rms_norm_eps)
        if stage == ds.num_stages - 1:
            self.norm = _norm(d, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, ds.markov_rank)
            self.confidence_head = ConfidenceHead(d + ds.markov_rank)


class DSparkHead:
    """Runs the target's DSpark stages (`model.mtp`, loaded from the checkpoint): ring writes and draft blocks."""

    def __init__(self, model):
        self.model, self.cfg = model, model.config
        self.ds = self.cfg.v41.dspark
        self.stages = model.mtp

    @property
    def ring_len(self) -> int:
        return self.cfg.sliding_window + self.model.num_lookahead_tokens

    def cache_spec(self) -> list[CacheTensorSpec]:
        return [CacheTensorSpec(f"mtp.{k}.window", "state", (self.ring_len, self.cfg.head_dim), torch.bfloat16)
                for k in range(len(self.stages))]

    def consume(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the main-model KV of validated positions (taps [N, dim * n_targets], positions / state slots
        [N]) into every stage's ring."""
        if not positions.numel():
            return
        # only each request's last ring_len positions: a row written twice in one index_put has no defined winner
        newest = torch.full((int(slots.max()) + 1,), -1, dtype=positions.dtype, device=positions.device)
        newest = newest.scatter_reduce(0, slots, positions, "amax")
        keep = positions > newest[slots] - self.ring_len
        taps, positions, slots = taps[keep], positions[keep], slots[keep]
        s0 = self.stages[0]
        main_x = s0.main_norm(s0.main_proj(taps))
        rot = self.model.rotations("main", positions)
        rows = slots * self.ring_len + positions % self.ring_len
        for stage in self.stages:
            ring = stage.attn.cache["window"].view(-1, self.cfg.head_dim)
            ring[rows] = stage.attn.main_kv(main_x, rot)

    def draft(self, next_ids: torch.Tensor, last: torch.Tensor, slots: torch.Tensor):
        """Draft blocks after the last validated positions `last` [R] (next tokens `next_ids` [R]):
        (tokens [R, B + 1] (next token first), logits [R, B, vocab] float32, confidence logits [R, B])."""
        b, n = self.ds.block_size, self.cfg.hc_mult
        ctx = DraftStep(self.model, slots, last, b, self.ring_len, self.cfg.sliding_window)
        ids = torch.full((len(next_ids), b), self.ds.noise_token_id, dtype=torch.long, device=next_ids.device)
        ids[:, 0] = next_ids
        streams = self.model.embed(ids.flatten()).unsqueeze(1).repeat(1, n, 1)
        pre = torch.zeros(streams.shape[0], n, dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        for stage in self.stages:
            streams, pre = stage(streams, pre, ctx)
        last_stage = self.stages[-1]
        x = hc_collapse(streams, pre)
        logits = F.linear(last_stage.norm(x).float(), self.model.head.weight).view(len(next_ids), b, -1)
        tokens = ids.new_empty(len(next_ids), b + 1)
        tokens[:, 0] = next_ids
        embeds = []
        for i in range(b):
            bias, embed = last_stage.markov_head(tokens[:, i])
            logits[:, i].add_(bias)
            embeds.append(embed)
            tokens[:, i + 1] = logits[:, i].argmax(dim=-1)
        conf = last_stage.confidence_head(x.view(len(next_ids), b, -1), torch.stack(embeds, dim=1))
        return tokens, logits, conf


def build_stages(cfg: ModelConfig) -> nn.ModuleList:
    ds = cfg.v41.dspark
    return nn.ModuleList(DSparkStage(cfg, k) for k in range(ds.num_stages)) if ds is not None else nn.ModuleList()
