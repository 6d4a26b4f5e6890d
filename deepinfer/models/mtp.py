"""DeepSeek-V4 multi-token prediction (MTP) layer, with DeepSeek's official parameter names (`mtp.{k}.*`).

What this follows (read, not copied): DeepSeek's reference `inference/model.py` shipped with the V4
weights (deepseek-ai/DeepSeek-V4-Flash; read through the GitHub mirror Nicooo-Wang/DeepSeek-V4-Pro-code:
`MTPBlock`, `ParallelHead`, `Transformer`), cross-checked with vLLM's
`vllm/model_executor/models/deepseek_v4_mtp.py`:

- MTP layer k is a full V4 block built as layer `num_layers + k`: its attention kind is
  `compress_ratios[num_layers + k]` (0, sliding, in V4-Flash) and its MoE is never hash-routed.
- Its input is final mHC streams [T, hc, D], taken before the hc_head collapse and the final norm:
  the main model's for k = 0; for k > 0 (the reference has no chaining code) MTP layer k - 1's
  output streams, as vLLM feeds them back.
- fused = h_proj(hnorm(streams)) + e_proj(enorm(embed(next token))): hnorm and h_proj act on every
  stream; the embedding projection is added to each stream (no concatenation, no separate expansion).
- The block runs on the fused streams; hc_head_{fn,base,scale} (MTP's own) collapse them, MTP's own
  `norm` normalises, and the main model's `embed` and `head` are shared (no MTP copies exist).
- Row t runs at position t, the position of the streams it consumes (the reference calls the MTP
  block with the main model's start_pos), with its own caches.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.distributed.model_parallel import ModelParallel
from deepinfer.layers.norm import RMSNorm
from deepinfer.models.deepseek_v4 import Block, HyperHead, StepContext


def mtp_block_config(cfg: ModelConfig, k: int) -> ModelConfig:
    """A view of `cfg` whose layer 0 is MTP layer k: its own attention kind, learned (not hash) routing."""
    return replace(cfg, layer_kinds=(cfg.mtp_layer_kinds[k],), compress_ratios=(cfg.mtp_compress_ratios[k],),
                   hash_layers=(False,))


class MTPLayer(Block):
    """Block parameters (attn, ffn, attn_norm, ffn_norm, hc_attn, hc_ffn) plus the MTP fusion and head mix."""

    def __init__(self, cfg: ModelConfig, k: int, mp: ModelParallel | None = None):
        """mp: the model's parallel handle (None: one process). The fusion and head mix are replicated."""
        super().__init__(mtp_block_config(cfg, k), 0, mp or ModelParallel.single())
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)
        self.hc_head = HyperHead(cfg)

    def forward(self, streams: torch.Tensor, embeds: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Previous streams [T, hc, D] and next-token embeddings [T, D] -> this layer's streams [T, hc, D]."""
        fused = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(1)
        return super().forward(fused, ctx)

    def head_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The hidden [T, D] the shared head turns into logits."""
        return self.norm(self.hc_head(streams))
