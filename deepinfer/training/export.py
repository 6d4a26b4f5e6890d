"""Initialise a DeepSeek-V4 model for training and save it as a HF checkpoint.

Saved tensor names follow transformers' `save_pretrained` for DeepseekV4ForCausalLM (official names
under `model.`), so both transformers and deepinfer's loader read the files; MTP tensors keep their
official `mtp.K.*` names (transformers ignores them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

_TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "head.weight", "hc_head.fn": "model.hc_head.hc_fn",
              "hc_head.base": "model.hc_head.hc_base", "hc_head.scale": "model.hc_head.hc_scale"}
_HC = re.compile(r"\.hc_(attn|ffn|head)\.(fn|base|scale)$")


@torch.no_grad()
def init_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Normal(0, std) projections and embeddings; unit norms and mHC scales; zero biases/sinks/ape;
    hash-routing tables drawn uniformly (every token gets k distinct experts)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("fn", "weight", "w13", "w2") and p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * std)
        elif leaf == "scale" or name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.zero_()
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            experts = model.config.n_routed_experts
            rows = [torch.randperm(experts, generator=g)[: buf.shape[1]] for _ in range(buf.shape[0])]
            buf.copy_(torch.stack(rows))


def checkpoint_name(name: str) -> str:
    """deepinfer module name -> the name transformers' save_pretrained writes (or official for mtp)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    name = _HC.sub(lambda m: f".hc_{m[1]}_{m[2]}", name)
    if name.startswith("mtp."):
        return name
    return "model." + name.replace(".attn.kv_norm.", ".attn.norm.")


def _unstack_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    prefix = name.rsplit(".", 1)[0]
    if name.endswith(".w2"):
        return {f"{prefix}.{e}.w2.weight": t for e, t in enumerate(tensor)}
    gate, up = tensor.chunk(2, dim=1)
    out = {f"{prefix}.{e}.w1.weight": t for e, t in enumerate(gate)}
    out.update({f"{prefix}.{e}.w3.weight": t for e, t in enumerate(up)})
    return out


def export_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint tensors: projections in `dtype`; float32 tensors that V4 keeps in float32 stay so."""
    keep_fp32 = ("norm.weight", "attn_sink", ".ape", "hc_", "gate.bias")
    out = {}
    for name, tensor in model.state_dict().items():
        pieces = _unstack_experts(name, tensor) if name.endswith((".experts.w13", ".experts.w2")) else {name: tensor}
        for piece, t in pieces.items():
            ckpt = checkpoint_name(piece)
            cast = t if not t.is_floating_point() or any(k in ckpt for k in keep_fp32) else t.to(dtype)
            out[ckpt] = cast.contiguous().clone()
    return out


def save_checkpoint(model: nn.Module, hf_config: dict, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(export_state_dict(model, dtype), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {**hf_config, "dtype": str(dtype).removeprefix("torch.")}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
