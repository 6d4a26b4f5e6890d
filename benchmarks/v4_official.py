"""A random DeepSeek-V4 checkpoint in DeepSeek's original layout, as DeepSeek ships V4-Flash: official tensor names
(`layers.N.attn.wq_a.weight`, `embed.weight`, ...) and config keys (`compress_ratios`, `num_hash_layers`,
`rope_scaling`), routed experts in MXFP4 (E2M1 codes two a byte, input 2i in the low nibble, and one UE8M0 scale
per 32 inputs of a row). llama.cpp's V4 converter reads only this layout; deepinfer's loader reads it and the
transformers layout alike.

The weights are transformers' random initialisation of the same config, saved by transformers and renamed; the
routed experts are rounded to MXFP4 (`quantize_mxfp4`), so every engine serving the checkpoint runs the same FP4
expert weights.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

# DeepSeek-V4's shapes where they matter for speed (head dim 512, a 64-dim rope, window 128, HCA ratio 128), at a
# hidden size of 128: 5.1 M parameters (2.1 M of them the embedding and head of the bundled tokenizer's 8192 tokens).
V4_HD512 = dict(
    vocab_size=8192, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=512, partial_rotary_factor=0.125, q_lora_rank=64, o_groups=2, o_lora_rank=32,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=128, index_n_heads=4, index_head_dim=64, index_topk=16, hc_mult=4, hc_sinkhorn_iters=20,
    swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=2048, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, pad_token_id=2)

MXFP4_GROUP = 32
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0-7; bit 3 is the sign
_ROUTED = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_TRANSFORMERS_ONLY = ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters")


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 [out, in/2], UE8M0 scale [out, in/32]): each group of 32 inputs scaled by the power of two
    that brings its largest magnitude within E2M1's 6, each value rounded to the nearest E2M1 code."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0))
    exponent = exponent.clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    codes = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(-1)
    codes = (codes | ((scaled < 0) & (codes > 0)).long() << 3).reshape(rows, cols)
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8).view(torch.int8)
    scale = (exponent.squeeze(-1) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale


def official_name(name: str) -> str:
    """A transformers-saved V4 tensor name -> DeepSeek's."""
    name = name.removeprefix("model.")
    name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
    name = re.sub(r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name)
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)


def official_config(config: dict) -> dict:
    """transformers' V4 config keys -> DeepSeek's (per-layer compress ratios, hash layer count, rope_scaling)."""
    rates = config["compress_rates"]
    ratios = [rates.get(kind, 0) for kind in config["layer_types"]]
    rope = dict(config["rope_parameters"])
    out = {k: v for k, v in config.items() if k not in _TRANSFORMERS_ONLY}
    return {**out, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "compress_ratios": ratios, "num_hash_layers": config["mlp_layer_types"].count("hash_moe"),
            "qk_rope_head_dim": round(config["head_dim"] * config["partial_rotary_factor"]),
            "rope_scaling": {"type": rope.pop("rope_type"), **rope}, "torch_dtype": "float32"}


def build(out: Path, tokenizer_dir: Path, config: dict = V4_HD512, seed: int = 0) -> Path:
    """Write the checkpoint (config.json, model.safetensors, the tokenizer files of tokenizer_dir) once."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    staging = out.with_name(out.name + ".transformers")
    tf.DeepseekV4ForCausalLM(tf.DeepseekV4Config(**config)).eval().save_pretrained(staging)
    tensors = {}
    for name, tensor in load_file(staging / "model.safetensors").items():
        name = official_name(name)
        if _ROUTED.match(name):
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = quantize_mxfp4(tensor)
        else:
            tensors[name] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(official_config(config), indent=2))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, out / file)
    shutil.rmtree(staging)
    return out
