"""DeepSeek-V3 / R1 multi-token prediction layers, stored in checkpoints as `model.layers.{N + k}.*`
(N = num_hidden_layers), as DeepSeek-V3's technical report describes them:

    h'_t = eh_proj([enorm(embed(token t + 1)) ; hnorm(h_t)])      (concatenation, 2D -> D)
    out_t = DecoderLayer(h'_t)                                     (MLA + MoE, the layer's own latent cache)
    logits = head(shared_head.norm(out_t))                         (embedding and head shared with the model)

h_t is the main model's final (normed) hidden state at position t for k = 0. Row t runs at position t.
The checkpoint's duplicated `embed_tokens` and `shared_head.head` copies are not loaded: the main
model's are used.

Under TP / EP the block is sharded like a main decoder layer (its MoE registers the next EP tag); the tensors
`load` receives are already this rank's slices (the model's loader cut them as they arrived), with empty
placeholders for another EP rank's experts. eh_proj and the norms are replicated.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.distributed.model_parallel import ModelParallel
from deepinfer.layers.norm import RMSNorm
from deepinfer.models.loader import CheckpointError

MTP_SHARED_TENSORS = ("embed_tokens.weight", "shared_head.head.weight")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_STACKED = ("mlp.experts.w13", "mlp.experts.w2", "mlp.experts.w13_scale", "mlp.experts.w2_scale")
_FUSED = {"mlp.experts.gate_up_proj": "mlp.experts.w13", "mlp.experts.down_proj": "mlp.experts.w2"}


class MLAMTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, k: int, dtype: torch.dtype, device, parallel: ModelParallel | None = None):
        super().__init__()
        from deepinfer.models.deepseek_v3 import DecoderLayer, _linear  # deepseek_v3 imports this module

        d = cfg.hidden_size
        self.block = DecoderLayer(cfg, cfg.num_layers + k, dtype, device, parallel)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = _linear(2 * d, d, dtype, device)
        self.head_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, step, cache) -> torch.Tensor:
        """Previous hidden [T, D] and next-token embeddings [T, D] -> this layer's output [T, D]."""
        fused = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.block(fused, step, cache)

    def load(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """Tensors named `{prefix}*` (HF names; per-expert or fused experts) as this rank stores them; every
        parameter is required, and this rank's own experts (others' may be absent: the loader skips them), with
        their scales when the experts are kept quantised (`...weight_scale_inv`)."""
        targets, experts = self._targets(), self._experts()
        pending = set(targets) - set(_STACKED)
        count = 0 if experts is None else experts.num_experts
        own = range(0) if experts is None else experts.local
        kinds = ("weight", "weight_scale_inv") if getattr(experts, "quant", None) else ("weight",)
        pending |= {f"mlp.experts.{e}.{p}.{kind}" for e in own for p in ("gate_proj", "up_proj", "down_proj")
                    for kind in kinds}
        for full, tensor in tensors.items():
            name = _FUSED.get(full[len(prefix):], full[len(prefix):])
            if name in MTP_SHARED_TENSORS or self._elsewhere(name, experts):
                pending.discard(name)
                continue
            self._copy(self._destination(name, targets, experts), tensor, full)
            pending.discard(name)
            if name in ("mlp.experts.w13", "mlp.experts.w2"):
                parts = ("gate_proj", "up_proj") if name.endswith("w13") else ("down_proj",)
                pending -= {f"mlp.experts.{e}.{p}.weight" for e in range(count) for p in parts}
        if pending:
            raise CheckpointError(f"MTP layer {prefix!r} is missing {len(pending)} tensors, e.g. {sorted(pending)[:4]}")

    @staticmethod
    def _copy(dst: torch.Tensor | None, tensor: torch.Tensor, shown: str) -> None:
        if dst is None:
            raise CheckpointError(f"unknown MTP tensor {shown!r}")
        if tuple(dst.shape) != tuple(tensor.shape):
            raise CheckpointError(f"MTP tensor {shown!r} has shape {tuple(tensor.shape)}, expected "
                                  f"{tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)

    def _experts(self):
        """The block's routed experts (ParallelExperts), or None for a dense MTP block."""
        return getattr(self.block.mlp, "experts", None)

    @staticmethod
    def _elsewhere(name: str, experts) -> bool:
        """A per-expert tensor of a global expert that another EP rank holds (its placeholder is skipped)."""
        m = _EXPERT.match(name)
        return m is not None and experts is not None and int(m[1]) < experts.num_experts \
            and experts.local_index(int(m[1])) is None

    def _targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint-relative names -> parameters (the block's names carry no prefix in checkpoints)."""
        rename = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                  "head_norm.weight": "shared_head.norm.weight"}
        out = {}
        for name, t in self.state_dict(keep_vars=True).items():
            out[rename.get(name, name.removeprefix("block."))] = t
        return out

    @staticmethod
    def _destination(name: str, targets: dict[str, torch.Tensor], experts) -> torch.Tensor | None:
        from deepinfer.models.deepseek_v3 import HALF, expert_slot

        m = _EXPERT.match(name)
        if m is None:
            return targets.get(name)
        e = int(m[1])
        if experts is None or e >= experts.num_experts:
            return None
        if m[3] == "weight_scale_inv":
            return experts.scale_slot(experts.local_index(e), HALF[m[2]]) if experts.quant else None
        return expert_slot(experts, experts.local_index(e), HALF[m[2]])
