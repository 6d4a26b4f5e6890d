#!/usr/bin/env python
"""Generate DeepSeek-V4.1 golden data from DeepSeek's reference inference code.

    python tests/golden/make_v41_golden.py --reference PATH/TO/deepseek_v41 [--out tests/golden/v41] [--configs a b]

`--reference` is a directory holding the reference's `model.py`, `engram.py`, `kernel_cpu.py`, ... (the
CPU-runnable copy of DeepSeek-V4.1-Flash `inference/`). It is imported as a package at generation
time and never copied. For every tiny config below this writes, under `<out>/<name>/`:

  config.json            the checkpoint's HF layout (text_config; vision_config for the vision config)
  model.safetensors      seeded weights under the reference's parameter names, in checkpoint dtypes
  tokenizer.json (+ tokenizer_config.json)   a WordLevel tokenizer whose Engram token map merges tokens
  cpu/<kind>/golden.json / golden.safetensors  greedy logits/tokens (and DSpark drafts) from the reference, for
                                               this CPU kind's kernels (tests/v41_golden.py)

Configs a and b are text only. Config v adds the reference's vision path (ViT + aligner, image span
embeddings, the VL routing bias): it also writes seeded PNGs under `<out>/v/images/`, runs prompts with
images through the reference's own image processor, and stores per-image patches, ViT and aligner
outputs next to the greedy goldens.

Each config runs in its own interpreter (`--one NAME`): the reference keeps module globals and a
`shared_attn` singleton, one model per process.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import platform
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import torch

PKG = "deepseek_v41_reference"
REF_PLACEHOLDER = "PATH/TO/deepseek_v41"

# ---------------------------------------------------------------------------------------------------
# configs (reference ModelArgs fields)

COMMON = dict(
    max_batch_size=1,
    max_seq_len=256,
    temperature=0.0,
    dtype="fp8",
    expert_dtype="fp4",
    score_func="sqrtsoftplus",
    route_scale=1.5,
    swiglu_limit=10.0,
    norm_eps=1e-20,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_factor=4,
    original_seq_len=32,
    beta_fast=32,
    beta_slow=1,
    engram_max_ngram_size=4,
    engram_pad_id=2,
)

CONFIGS = {
    "a": dict(
        vocab_size=512, dim=256, moe_inter_dim=128, n_layers=6, n_mtp_layers=1, n_heads=4,
        n_routed_experts=4, n_activated_experts=2, q_lora_rank=64, head_dim=64, rope_head_dim=16,
        o_groups=2, o_lora_rank=64, window_size=16, compress_ratios=(0, 2, 2, 1, 1, 1, 0),
        kv_source_layers=(1, 3), index_source_layers=(1, 3, 5), index_n_heads=4, index_head_dim=64,
        index_topk=8, candidate_source_layer=3, candidate_topk_blocks=3, candidate_block_size=4,
        engram_layer_ids=(0, 1), engram_vocab_size=100, engram_n_heads=2, engram_head_dim=32,
        dspark_block_size=2, dspark_noise_token_id=511, dspark_target_layer_ids=(4, 5),
        dspark_markov_rank=32, dspark_n_routed_experts=0, dspark_n_activated_experts=0,
    ),
    "b": dict(
        vocab_size=512, dim=256, moe_inter_dim=64, n_layers=8, n_mtp_layers=2, n_heads=4,
        n_routed_experts=8, n_activated_experts=2, q_lora_rank=96, head_dim=64, rope_head_dim=16,
        o_groups=2, o_lora_rank=32, window_size=8, compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 0, 0),
        kv_source_layers=(2, 4, 5), index_source_layers=(2, 4, 5, 7), index_n_heads=2, index_head_dim=32,
        index_topk=6, candidate_source_layer=5, candidate_topk_blocks=3, candidate_block_size=4,
        engram_layer_ids=(1, 4), engram_vocab_size=64, engram_n_heads=2, engram_head_dim=32,
        dspark_block_size=3, dspark_noise_token_id=511, dspark_target_layer_ids=(5, 6, 7),
        dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_n_activated_experts=1,
    ),
    # a's attention shapes on 4 layers (SWA, ratio-2 kv/index source, ratio-1 kv/index/candidate source, ratio-1
    # candidate consumer); narrower experts, one Engram head and no DSpark keep the files small; a tiny ViT
    "v": dict(
        vocab_size=512, dim=256, moe_inter_dim=32, n_layers=4, n_mtp_layers=0, n_heads=4,
        n_routed_experts=4, n_activated_experts=2, q_lora_rank=64, head_dim=64, rope_head_dim=16,
        o_groups=2, o_lora_rank=64, window_size=16, compress_ratios=(0, 2, 1, 1),
        kv_source_layers=(1, 2), index_source_layers=(1, 2, 3), index_n_heads=4, index_head_dim=64,
        index_topk=8, candidate_source_layer=2, candidate_topk_blocks=3, candidate_block_size=4,
        engram_layer_ids=(0, 1), engram_vocab_size=100, engram_n_heads=1, engram_head_dim=32,
        dspark_block_size=0, dspark_noise_token_id=511, dspark_target_layer_ids=(),
        dspark_markov_rank=32, dspark_n_routed_experts=0, dspark_n_activated_experts=0,
        vision_n_layers=2, vision_dim=64, vision_n_heads=4, vision_inter_dim=96, vision_patch_size=4,
        vision_rope_theta=10000.0, vision_downsample_ratio=2, vision_max_n_token=64, vision_min_pixels=1024,
        vision_max_wh_ratio=3,
        image_token_id=510,  # vocab_size - 2: never drawn in the prompts' text
    ),
}
SEEDS = {"a": 0, "b": 1, "v": 2}
PROMPT_LENS = (7, 41, 101)  # odd: the last prompt token falls mid-group for ratio-2 layers
N_GENERATED = 12  # one prefill step plus 11 decode steps, greedy, EOS ignored

# vision configs: seeded images (name -> width, height), each a smooth random colour field (low-res noise,
# one colour per IMAGE_NOISE_CELL pixels, upsampled), so the reference's resizing shows in the patches
IMAGES = {
    "wide": (96, 24),  # width >= max_wh_ratio * height: stretched to 3:1 (Image.resize)
    "tall": (30, 52),  # aspect kept, padded to whole patches (ImageOps.pad)
    "small": (12, 10),  # below min_pixels: planned upscaled
    "big": (200, 120),  # more than max_image_tokens at full size: safe_resize shrinks it
    "plain": (40, 24),
}
IMAGE_NOISE_CELL = 8
# the prompts: text runs (number of drawn ids) and images (one placeholder each), in order
VISION_PROMPTS = ((9, "plain", 7), (5, "wide", 6, "tall", 4), (1, "small", 20), (3, "big", 5))
TEXT_ONLY_PROMPT = 1  # also run with its image spans as plain image tokens (no images, no token types)

# ModelArgs field -> key in the HF config's text_config ("rope_scaling.x" goes into that sub-dict)
HF_TEXT_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "rope_head_dim": "qk_rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_lora_rank": "o_lora_rank",
    "o_groups": "o_groups",
    "swiglu_limit": "swiglu_limit",
    "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rope_factor": "rope_scaling.factor",
    "beta_fast": "rope_scaling.beta_fast",
    "beta_slow": "rope_scaling.beta_slow",
    "original_seq_len": "rope_scaling.original_max_position_embeddings",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "norm_topk_prob": "norm_topk_prob",
    "route_scale": "routed_scaling_factor",
    "window_size": "sliding_window",
    "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer": "candidate_source_layer_id",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_id": "engram_pad_token_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "n_mtp_layers": "num_nextn_predict_layers",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
HF_TEXT_FIXED = {
    "model_type": "deepseek_v41_text",
    "num_key_value_heads": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "topk_method": "noaux_tc",
    "rope_scaling.rope_type": "yarn",
}
# ModelArgs field -> key in the HF config's vision_config (vision configs only)
HF_VISION_KEYS = {
    "vision_n_layers": "num_hidden_layers",
    "vision_dim": "hidden_size",
    "vision_n_heads": "num_attention_heads",
    "vision_inter_dim": "intermediate_size",
    "vision_patch_size": "patch_size",
    "vision_rope_theta": "rope_theta",
    "vision_downsample_ratio": "downsample_ratio",
    "vision_max_n_token": "max_image_tokens",
    "vision_min_pixels": "min_pixels",
    "vision_max_wh_ratio": "max_wh_ratio",
}
HF_VISION_FIXED = {"model_type": "deepseek_v41_vision"}

SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")

PATCHES = {
    "stable_topk": (
        "Every Tensor.topk the reference takes (indexer top-k, candidate-block top-k, MoE gate top-k) is "
        "replaced for the run by a stable sort: larger value first, equal values by lower index "
        "(torch.sort(descending=True, stable=True), first k). torch.topk leaves the order of ties "
        "unspecified, and masked (-inf) scores tie often."
    ),
    "own_index_keys": (
        "Indexer.forward is wrapped so that an indexer owning index keys (layer in kv_source_layers) "
        "publishes its own k_cache as shared_attn.index_k before scoring. Upstream publishes only when a "
        "compression group completed this step, so on the other decode steps it scores against the keys "
        "another layer published last."
    ),
}
TRACK_PATCHES = {"fixed": ["stable_topk", "own_index_keys"], "upstream": ["stable_topk"]}

# weight statistics: norm weight means by owner, projection gains by owner leaf name
EMBED_STD = 0.12
NORM_MEANS = {
    "attn_norm": 0.025,
    "ffn_norm": 0.2,
    "q_norm": 0.97,
    "kv_norm": 0.4,
    "compressor.norm": 0.6,
    "k_norm": 0.5,
}
GAINS = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5, "w3": 1.5, "w2": 1.05}
VISION_BIAS_STD = 0.02  # the ViT's and aligner's Linear biases
SPAN_EMBEDDINGS = ("image_start", "image_end", "image_newline")  # drawn like the token embedding
FP8_MAX = 448.0
E2M1_RMS = 3.2  # RMS of uniformly random e2m1 codes
BLOCK = 32


# ---------------------------------------------------------------------------------------------------
# reference loading


def load_reference(ref_dir: Path):
    """Import the reference directory as a package (model.py uses relative imports); returns (model, engram)."""
    ref_dir = ref_dir.resolve()
    if PKG not in sys.modules:
        init = ref_dir / "__init__.py"
        if init.exists():
            spec = importlib.util.spec_from_file_location(PKG, init, submodule_search_locations=[str(ref_dir)])
            pkg = importlib.util.module_from_spec(spec)
            sys.modules[PKG] = pkg
            spec.loader.exec_module(pkg)
        else:
            pkg = types.ModuleType(PKG)
            pkg.__path__ = [str(ref_dir)]
            sys.modules[PKG] = pkg
    return importlib.import_module(f"{PKG}.model"), importlib.import_module(f"{PKG}.engram")


# ---------------------------------------------------------------------------------------------------
# tokenizer


def vocab_tokens(vocab_size: int) -> list[str]:
    """Special tokens, then words with case / leading-space / accent variants that Engram's token map merges."""
    words = (
        "the of and to in is that it for on with as was at by be this from or have an are not but they which "
        "you his her one all we can had there were been has more will would their what when who some time"
    ).split()
    accented = [
        ("café", "cafe"), ("naïve", "naive"), ("résumé", "resume"), ("über", "uber"), ("façade", "facade"),
        ("jalapeño", "jalapeno"), ("élan", "elan"), ("crème", "creme"), ("señor", "senor"), ("déjà", "deja"),
    ]
    tokens = [*SPECIAL_TOKENS, "<unk>", " ", ".", ",", "!", "?", "\n"]
    for w in words:
        tokens += [w, w.capitalize(), " " + w.upper(), " " + w]
    for acc, plain in accented:
        tokens += [acc, plain, " " + acc.capitalize(), plain.upper()]
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    i = 0
    while len(tokens) < vocab_size:
        a, b, c = consonants[i % 14], vowels[(i // 14) % 5], consonants[(i // 70) % 14]
        stem = f"{a}{b}{c}{vowels[(i * 3) % 5]}"
        i += 1
        if stem in tokens:
            continue
        tokens.append(stem)
        if i % 3 == 0 and len(tokens) < vocab_size:
            tokens.append(" " + stem.capitalize())
    tokens = tokens[:vocab_size]
    assert len(set(tokens)) == vocab_size
    return tokens


def build_tokenizer(vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokens = vocab_tokens(vocab_size)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


class TokenizerAdapter:
    """What engram.build_compressed_token_map reads from a HF tokenizer: backend_tokenizer and len()."""

    def __init__(self, backend):
        self.backend_tokenizer = backend

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def tokenizer_config() -> dict:
    bos, eos, pad = SPECIAL_TOKENS
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": "<unk>",
        "model_max_length": COMMON["max_seq_len"],
    }


# ---------------------------------------------------------------------------------------------------
# args and HF config


def model_args(v41, engram, name: str, compressed_vocab: int):
    args = v41.ModelArgs(**COMMON, **CONFIGS[name], engram_compressed_vocab_size=compressed_vocab)
    # table rows per Engram layer = that layer's prime bucket sizes summed
    layout = engram.EngramLayout.from_args(replace(args, engram_num_embeddings=(0,) * len(args.engram_layer_ids)))
    rows = tuple(sum(p for per_ngram in layer for p in per_ngram) for layer in layout.primes)
    return replace(args, engram_num_embeddings=rows)


def hf_config(args) -> dict:
    text: dict = {}

    def put(key, value):
        if isinstance(value, tuple):
            value = list(value)
        if "." in key:
            outer, inner = key.split(".")
            text.setdefault(outer, {})[inner] = value
        else:
            text[key] = value

    for key, value in HF_TEXT_FIXED.items():
        put(key, value)
    for field, key in HF_TEXT_KEYS.items():
        put(key, getattr(args, field))
    assert text["n_shared_experts"] == 1
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": args.vocab_size - 2,  # never drawn in the prompts
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        },
        "text_config": text,
    }
    if args.vision_enabled:
        assert args.image_token_id == config["image_token_id"], args.image_token_id
        config["vision_config"] = hf_vision_config(args)
    return config


def hf_vision_config(args) -> dict:
    """The HF config's vision_config: the ViT/aligner shapes and the image processor's limits."""
    vision = dict(HF_VISION_FIXED)
    for field, key in HF_VISION_KEYS.items():
        vision[key] = getattr(args, field)
    return vision


# ---------------------------------------------------------------------------------------------------
# weights


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^ceil(log2(amax / qmax)) exactly (frexp: x = m * 2^e with m in [0.5, 1))."""
    m, e = torch.frexp(amax.float() / qmax)
    return torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, e - 1, e))


def quant_fp8_tiles(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] -> e4m3 [R, C] + e8m0 [ceil(R/32), C/32], one power-of-two scale per 32x32 tile."""
    rows, cols = w.shape
    padded = torch.cat([w, w.new_zeros(-rows % BLOCK, cols)])
    tiles = padded.view(-1, BLOCK, cols // BLOCK, BLOCK)
    scale = pow2_scale(tiles.abs().amax(dim=(1, 3)).clamp_min(1e-4), FP8_MAX)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(-1, cols)[:rows].contiguous(), scale.to(torch.float8_e8m0fnu)


def quant_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] -> e4m3 [R, C] + e8m0 [R, C/32], one power-of-two scale per 32 values of a row."""
    groups = w.unflatten(-1, (-1, BLOCK))
    scale = pow2_scale(groups.abs().amax(dim=-1).clamp_min(1e-4), FP8_MAX)
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2).contiguous(), scale.to(torch.float8_e8m0fnu)


def dequant_fp8_tiles(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    s = scale.float().repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :cols]
    return q.float() * s


def _norm_mean(owner: str) -> float:
    for key, mean in NORM_MEANS.items():
        if owner == key or owner.endswith("." + key):
            return mean
    return 1.0


def _gain(owner: str) -> float:
    return GAINS.get(owner.rpartition(".")[2], 1.0)


def is_promoted(v41, owner: torch.nn.Module, p: torch.Tensor) -> bool:
    """fp32 only by promotion in the reference; bf16 in the checkpoint (head, ratio>1 compressor, DSpark heads)."""
    return p.dtype == torch.float32 and isinstance(owner, (v41.Linear, v41.ParallelHead))


def is_wo_a(name: str) -> bool:
    return name.endswith("attn.wo_a.weight")


def is_vision_param(name: str) -> bool:
    """The ViT, the aligner and the image span embeddings (the gates' bias_vl is drawn like bias)."""
    return name.startswith(("vision.", "aligner.")) or name in SPAN_EMBEDDINGS


def vision_weight(owner: torch.nn.Module, name: str, p: torch.Tensor, randn) -> torch.Tensor:
    """fp32 draw for a vision parameter: projections fan_in^-0.5, biases small, norm weights 1 +-10 %."""
    leaf = name.rpartition(".")[2]
    if name in SPAN_EMBEDDINGS:
        return EMBED_STD * randn(*p.shape)
    if isinstance(owner, torch.nn.Linear):
        if leaf == "weight":
            return p.size(1) ** -0.5 * randn(*p.shape)
        return VISION_BIAS_STD * randn(*p.shape)
    assert type(owner).__name__ == "RMSNorm" and leaf == "weight", name
    return 1 + 0.1 * randn(*p.shape)


@torch.no_grad()
def init_weights(v41, model, seed: int) -> dict[str, torch.Tensor]:
    """Fill the model's parameters in named_parameters order; returns the checkpoint (official names/dtypes)."""
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    ckpt: dict[str, torch.Tensor] = {}

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    for name, p in model.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = modules[owner_name]
        fan_in = p.size(-1) if p.dim() >= 2 else 1
        if p.dtype == torch.float8_e8m0fnu:
            continue  # drawn together with its weight
        if p.dtype == torch.float8_e4m3fn:
            if isinstance(owner, v41.ParallelEngramEmbedding):
                q, s = quant_fp8_rows(randn(*p.shape))
            else:
                q, s = quant_fp8_tiles(randn(*p.shape) * _gain(owner_name) * fan_in**-0.5)
            p.copy_(q)
            owner.scale.copy_(s)
            ckpt[name], ckpt[f"{owner_name}.scale"] = q, s
        elif p.dtype == torch.float4_e2m1fn_x2:
            fan_in = 2 * p.size(1)
            codes = torch.randint(0, 256, p.shape, generator=gen, dtype=torch.int32).to(torch.uint8)
            exp = round(math.log2(_gain(owner_name) * fan_in**-0.5 / E2M1_RMS))
            jitter = torch.randint(-1, 2, owner.scale.shape, generator=gen, dtype=torch.int32)
            s = torch.ldexp(torch.ones(owner.scale.shape), exp + jitter).to(torch.float8_e8m0fnu)
            p.view(torch.uint8).copy_(codes)
            owner.scale.copy_(s)
            ckpt[name], ckpt[f"{owner_name}.scale"] = p.detach().clone(), s
        elif is_wo_a(name):
            # fp8 in the checkpoint; the reference holds it dequantized to bf16 (as its convert step does)
            q, s = quant_fp8_tiles(randn(*p.shape) * _gain(owner_name) * fan_in**-0.5)
            p.copy_(dequant_fp8_tiles(q, s).to(p.dtype))
            ckpt[name], ckpt[f"{owner_name}.scale"] = q, s
        else:
            if is_vision_param(name):
                w = vision_weight(owner, name, p, randn)
            elif isinstance(owner, v41.RMSNorm):
                w = _norm_mean(owner_name) * (1 + 0.1 * randn(*p.shape))
            elif isinstance(owner, v41.ParallelEmbedding):
                w = EMBED_STD * randn(*p.shape)
            elif p.dim() >= 2:
                w = _gain(owner_name) * fan_in**-0.5 * randn(*p.shape)
            else:
                w = 0.5 * randn(*p.shape)
            stored = torch.bfloat16 if is_promoted(v41, owner, p) else p.dtype
            w = w.to(stored)
            p.copy_(w)
            ckpt[name] = w.contiguous()
    return ckpt


@torch.no_grad()
def load_checkpoint(v41, model, ckpt: dict[str, torch.Tensor]) -> None:
    """Load official-name/dtype tensors into a reference model: 1:1 names, wo_a dequantized, dtype upcasts."""
    params = dict(model.named_parameters())
    extra = set(ckpt) - set(params) - {n[: -len("weight")] + "scale" for n in params if is_wo_a(n)}
    assert not extra, f"checkpoint tensors without a parameter: {sorted(extra)[:5]}"
    for name, p in params.items():
        t = ckpt[name]
        if is_wo_a(name):
            t = dequant_fp8_tiles(t, ckpt[name[: -len("weight")] + "scale"]).to(p.dtype)
        assert t.shape == p.shape, (name, t.shape, p.shape)
        if p.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2):
            assert t.dtype == p.dtype, (name, t.dtype, p.dtype)
            p.view(torch.uint8).copy_(t.view(torch.uint8))
        else:
            p.copy_(t.to(p.dtype))


def assert_same_params(a, b) -> int:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, x in pa.items():
        y = pb[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.detach().contiguous().view(torch.uint8), y.detach().contiguous().view(torch.uint8)), name
    return len(pa)


# ---------------------------------------------------------------------------------------------------
# patches and the generation schedule


def stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """Tensor.topk's signature; ties go to the lower index (`sorted` is moot: results are always sorted)."""
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class Patched:
    """Apply a track's patches to the reference for the duration of a `with` block."""

    def __init__(self, v41, track: str):
        self.v41, self.names = v41, TRACK_PATCHES[track]

    def __enter__(self):
        v41 = self.v41
        self.saved_topk, self.saved_indexer = torch.Tensor.topk, v41.Indexer.forward
        if "stable_topk" in self.names:
            torch.Tensor.topk = stable_topk
        if "own_index_keys" in self.names:
            original = self.saved_indexer

            def forward(indexer, *args, **kwargs):
                if indexer.owns_k:
                    v41.shared_attn.index_k = indexer.k_cache
                return original(indexer, *args, **kwargs)

            v41.Indexer.forward = forward
        return self

    def __exit__(self, *exc):
        torch.Tensor.topk = self.saved_topk
        self.v41.Indexer.forward = self.saved_indexer


def greedy(model, prompt: torch.Tensor, with_dspark: bool, images=None, token_types=None) -> dict[str, torch.Tensor]:
    """The reference schedule: prefill from 0, then one token per step; DSpark after every backbone step.
    `images` / `token_types` (vision configs) go to the prefill only: image spans lie in the prompt."""
    n = prompt.numel()
    logits_steps, tokens, drafts, draft_logits, confidences = [], [], [], [], []
    out_ids, logits, main_hidden = model(prompt[None], 0, images=images, token_types=token_types)
    if with_dspark:
        assert model.forward_spec(out_ids, main_hidden, 0) is None
    for step in range(N_GENERATED):
        logits_steps.append(logits[0].float())
        tokens.append(int(out_ids[0]))
        if step == N_GENERATED - 1:
            break
        pos = n + step
        out_ids, logits, main_hidden = model(out_ids.view(1, 1), pos)
        if with_dspark:
            ids, dl, conf = model.forward_spec(out_ids, main_hidden, pos)
            drafts.append(ids[0])
            draft_logits.append(dl[0].float())
            confidences.append(conf[0].float())
    out = {"logits": torch.stack(logits_steps), "tokens": torch.tensor(tokens, dtype=torch.int64)}
    if with_dspark:
        out["dspark_tokens"] = torch.stack(drafts).to(torch.int64)
        out["dspark_logits"] = torch.stack(draft_logits)
        out["dspark_confidence"] = torch.stack(confidences)
    return out


def prefill_vs_decode(model, prompt: torch.Tensor) -> float:
    """max |logits(prefill(n)) - logits(prefill(n-1) + decode(token n-1))|."""
    n = prompt.numel()
    full = model(prompt[None], 0)[1].float()
    model(prompt[None, : n - 1], 0)
    step = model(prompt[None, n - 1 :], n - 1)[1].float()
    return float((full - step).abs().max())


# ---------------------------------------------------------------------------------------------------
# text configs


def text_goldens(v41, model, args, name: str, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Text configs: three drawn prompts on both tracks, with DSpark drafts and prefill-vs-decode."""
    gen = torch.Generator().manual_seed(1000 + seed)
    # ids 0..2 are special; the top two ids (image token, DSpark noise token) are left out too
    prompts = [torch.randint(3, args.vocab_size - 2, (n,), generator=gen) for n in PROMPT_LENS]
    needed = args.candidate_topk_blocks * args.candidate_block_size * args.compress_ratios[args.candidate_source_layer]
    assert max(PROMPT_LENS) > needed

    tensors: dict[str, torch.Tensor] = {}
    tracks: dict = {}
    for track in ("fixed", "upstream"):
        with Patched(v41, track):
            info = {"patches": TRACK_PATCHES[track], "tokens": [], "prefill_vs_decode_max_abs": []}
            for i, prompt in enumerate(prompts):
                res = greedy(model, prompt, with_dspark=track == "fixed")
                for key, t in res.items():
                    tensors[f"{track}.p{i}.{key}"] = t.contiguous()
                info["tokens"].append(res["tokens"].tolist())
                info["prefill_vs_decode_max_abs"].append(prefill_vs_decode(model, prompt))
        tracks[track] = info
        print(f"[{name}] {track}: prefill-vs-decode {info['prefill_vs_decode_max_abs']}", flush=True)
        for toks in info["tokens"]:
            print(f"[{name}] {track} tokens {toks}", flush=True)
            assert len(set(toks)) > 1, "degenerate greedy output"
    for i, prompt in enumerate(prompts):
        tensors[f"prompt.p{i}"] = prompt.to(torch.int64)

    golden = {
        "config": name,
        "seed": seed,
        "prompt_seed": 1000 + seed,
        "schedule": (
            "prefill model(ids[None], 0), then model(tok[None, None], pos) one token per step; greedy "
            f"(temperature 0), {N_GENERATED} generated tokens (1 prefill + {N_GENERATED - 1} decode steps), EOS "
            "ignored. DSpark (fixed track only): forward_spec(output_ids, main_hidden, pos) after every "
            "backbone step; the prefill call seeds caches and returns None, each decode call returns "
            "(output_ids [1, block+1], logits [1, block, vocab], confidence [1, block])."
        ),
        "prefill_vs_decode": (
            "max |logits| difference between prefill(n) and prefill(n-1) followed by one decode step of token n-1"
        ),
        "prompts": [p.tolist() for p in prompts],
        "tracks": tracks,
        "patches": {k: PATCHES[k] for k in PATCHES},
    }
    return tensors, golden


# ---------------------------------------------------------------------------------------------------
# images (vision configs)


def smooth_image(width: int, height: int, gen: torch.Generator):
    """A smooth random RGB field: one random colour per IMAGE_NOISE_CELL pixels, bicubic-upsampled."""
    from PIL import Image

    cells = (max(2, -(-height // IMAGE_NOISE_CELL)), max(2, -(-width // IMAGE_NOISE_CELL)), 3)
    noise = torch.randint(0, 256, cells, generator=gen, dtype=torch.int32).to(torch.uint8)
    return Image.fromarray(noise.numpy()).resize((width, height), Image.Resampling.BICUBIC)


def write_images(image_dir: Path, seed: int) -> dict[str, bytes]:
    """Draw IMAGES from one seeded generator and write them as PNGs; returns each file's bytes."""
    image_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    files = {}
    for name, (width, height) in IMAGES.items():
        buf = io.BytesIO()
        smooth_image(width, height, gen).save(buf, format="PNG")
        (image_dir / f"{name}.png").write_bytes(buf.getvalue())
        files[name] = (image_dir / f"{name}.png").read_bytes()
    return files


def vision_prompt(layout: tuple, args, gen: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """Unexpanded ids: drawn text runs, and one image_token_id per image where a user puts a placeholder."""
    parts, names = [], []
    for item in layout:
        if isinstance(item, str):
            parts.append(torch.tensor([args.image_token_id]))
            names.append(item)
        else:
            parts.append(torch.randint(3, args.vocab_size - 2, (item,), generator=gen))
    return torch.cat(parts), names


def expand_placeholders(ip, ids: torch.Tensor, records: list[dict], args):
    """image_processor.prepare_vl_inputs after tokenizing (it imports an `encoding` module upstream does not
    ship): each placeholder becomes its image's span of image_token_id, typed by image_token_types.
    Returns (ids, token_types, [ImageInput], [(n_llm_h, n_llm_w)])."""
    tokens, token_types, inputs, grids = [], [], [], []
    records = iter(records)
    for tok in ids.tolist():
        if tok != args.image_token_id:
            tokens.append(tok)
            token_types.append(ip.TEXT)
            continue
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = ip.load_image(next(records), args)
        types = ip.image_token_types(n_llm_h, n_llm_w)
        inputs.append(ip.ImageInput(len(tokens), patches, n_vit_h, n_vit_w, types))
        grids.append((n_llm_h, n_llm_w))
        tokens += [args.image_token_id] * types.numel()
        token_types += types.tolist()
    return torch.tensor(tokens, dtype=torch.int64), torch.tensor(token_types, dtype=torch.int64), inputs, grids


@torch.inference_mode()
def image_goldens(ip, model, files: dict[str, bytes], args) -> tuple[dict[str, torch.Tensor], dict]:
    """Per image file: the reference's patches, ViT output and encode_image output, and its resize plan."""
    from PIL import Image

    tensors, info = {}, {}
    for name, data in files.items():
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = ip.load_image({"data": data}, args)
        vit = model.vision(patches, n_vit_h, n_vit_w)
        encoded = model.encode_image(patches, n_vit_h, n_vit_w)
        assert torch.equal(encoded, model.aligner(vit, n_vit_h, n_vit_w)), name
        assert encoded.shape[0] == n_llm_h * n_llm_w, name
        tensors[f"image.{name}.patches"] = patches.contiguous()
        tensors[f"image.{name}.vit"] = vit.contiguous()
        tensors[f"image.{name}.encoded"] = encoded.contiguous()
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
        _, _, best_height, best_width = ip.plan_image_grid(width, height, args)
        stretch = args.vision_max_wh_ratio is not None and width >= args.vision_max_wh_ratio * height
        info[name] = {
            "file": f"images/{name}.png",
            "size": [width, height],
            "resized_to": [best_width, best_height],
            "resize": "stretch (Image.resize)" if stretch else "pad (ImageOps.pad, grey 127, centred)",
            "n_vit_h": n_vit_h,
            "n_vit_w": n_vit_w,
            "n_llm_h": n_llm_h,
            "n_llm_w": n_llm_w,
            "span_tokens": ip.num_image_tokens(n_llm_h, n_llm_w),
        }
    return tensors, info


def vision_goldens(v41, model, args, name: str, seed: int, out_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Vision configs: seeded images, prompts with image placeholders expanded as the reference does, the fixed
    track's greedy goldens with images, and p{TEXT_ONLY_PROMPT} once more as plain image tokens."""
    ip = importlib.import_module(f"{PKG}.image_processor")
    files = write_images(out_dir / "images", 2000 + seed)
    tensors, images = image_goldens(ip, model, files, args)

    gen = torch.Generator().manual_seed(1000 + seed)
    prompts, golden_prompts = [], []
    for i, layout in enumerate(VISION_PROMPTS):
        ids, names = vision_prompt(layout, args, gen)
        expanded, types, inputs, grids = expand_placeholders(ip, ids, [{"data": files[n]} for n in names], args)
        for n, img in zip(names, inputs):
            assert torch.equal(img.patches, tensors[f"image.{n}.patches"]), n
        prompts.append((expanded, types, inputs))
        tensors[f"prompt.p{i}"] = ids
        tensors[f"input_ids.p{i}"] = expanded
        tensors[f"token_types.p{i}"] = types
        golden_prompts.append({
            "ids": ids.tolist(),
            "input_ids": expanded.tolist(),
            "token_types": types.tolist(),
            "images": [
                {"image": n, "file": images[n]["file"], "start": img.start, "span_tokens": img.types.numel(),
                 "n_vit_h": img.n_vit_h, "n_vit_w": img.n_vit_w, "n_llm_h": h, "n_llm_w": w}
                for n, img, (h, w) in zip(names, inputs, grids)
            ],
        })

    def run(i: int, with_images: bool = True) -> dict[str, torch.Tensor]:
        expanded, types, inputs = prompts[i]
        if not with_images:
            return greedy(model, expanded, with_dspark=False)
        return greedy(model, expanded, with_dspark=False, images=[inputs], token_types=types[None])

    info = {"patches": TRACK_PATCHES["fixed"], "tokens": []}
    with Patched(v41, "fixed"):
        for i in range(len(prompts)):
            res = run(i)
            for key, t in res.items():
                tensors[f"fixed.p{i}.{key}"] = t.contiguous()
            info["tokens"].append(res["tokens"].tolist())
            print(f"[{name}] fixed tokens {info['tokens'][-1]}", flush=True)
            assert len(set(info["tokens"][-1])) > 1, "degenerate greedy output"
        text_only = run(TEXT_ONLY_PROMPT, with_images=False)["tokens"]
        again = run(TEXT_ONLY_PROMPT)
    tensors[f"text_only.p{TEXT_ONLY_PROMPT}.tokens"] = text_only
    print(f"[{name}] p{TEXT_ONLY_PROMPT} without images: tokens {text_only.tolist()}", flush=True)
    # self-checks: the images change the output, and a second run reproduces the first bit for bit
    assert not torch.equal(text_only, tensors[f"fixed.p{TEXT_ONLY_PROMPT}.tokens"]), "images changed nothing"
    for key, t in again.items():
        assert torch.equal(t, tensors[f"fixed.p{TEXT_ONLY_PROMPT}.{key}"]), f"rerun differs: {key}"

    golden = {
        "config": name,
        "seed": seed,
        "prompt_seed": 1000 + seed,
        "image_seed": 2000 + seed,
        "schedule": (
            "prefill model(input_ids[None], 0, images=[[ImageInput(start, patches, n_vit_h, n_vit_w, types), ...]], "
            "token_types=token_types[None]), then model(tok[None, None], pos) one token per step (text: no images, "
            f"no token types); greedy (temperature 0), {N_GENERATED} generated tokens (1 prefill + "
            f"{N_GENERATED - 1} decode steps), EOS ignored. No DSpark in this config."
        ),
        "image_token_id": args.image_token_id,
        "token_types": {"text": ip.TEXT, "image_start": ip.IMAGE_START, "image": ip.IMAGE,
                        "image_newline": ip.IMAGE_NEW_LINE, "image_end": ip.IMAGE_END},
        "images": images,
        "prompts": golden_prompts,
        "tracks": {"fixed": info},
        "text_only": {
            "prompt": TEXT_ONLY_PROMPT,
            "what": "the same input_ids with images None and token_types None: the image spans are plain "
            "image_token_id tokens (embedding rows, Engram hashes, text routing bias)",
            "tokens": text_only.tolist(),
        },
        "patches": {k: PATCHES[k] for k in TRACK_PATCHES["fixed"]},
    }
    return tensors, golden


# ---------------------------------------------------------------------------------------------------
# one config


def run_one(ref_dir: Path, name: str, out_dir: Path, command: list[str]) -> None:
    from safetensors.torch import load_file, save_file

    torch.set_default_dtype(torch.bfloat16)
    v41, engram = load_reference(ref_dir)
    seed = SEEDS[name]
    out_dir.mkdir(parents=True, exist_ok=True)

    backend = build_tokenizer(CONFIGS[name]["vocab_size"])
    tokenizer = TokenizerAdapter(backend)
    _, compressed_vocab = engram.build_compressed_token_map(tokenizer)
    args = model_args(v41, engram, name, compressed_vocab)
    assert compressed_vocab < args.vocab_size
    backend.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    (out_dir / "config.json").write_text(json.dumps(hf_config(args), indent=2, ensure_ascii=False) + "\n")

    with v41.set_dtype(torch.bfloat16):
        source = v41.Transformer(args, tokenizer).eval()
    ckpt = init_weights(v41, source, seed)
    save_file(ckpt, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    # round trip: a fresh model loaded from the file must hold exactly the generating model's parameters
    with v41.set_dtype(torch.bfloat16):
        model = v41.Transformer(args, tokenizer).eval()
    load_checkpoint(v41, model, load_file(str(out_dir / "model.safetensors")))
    n_params = assert_same_params(source, model)
    del source

    if args.vision_enabled:
        tensors, golden = vision_goldens(v41, model, args, name, seed, out_dir)
    else:
        tensors, golden = text_goldens(v41, model, args, name, seed)
    kind = _cpu_kind()
    golden_dir = out_dir / "cpu" / kind  # the goldens hold for this CPU kind's kernels (tests/v41_golden.py)
    golden_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(golden_dir / "golden.safetensors"), metadata={"format": "pt"})

    golden.update({
        "cpu_kind": kind,
        "machine": f"{_cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "reference": "DeepSeek-V4.1-Flash inference/ at revision dba1be0a40aa45a94ad051997016db3960a90277 "
        "(CPU copy from tenstorrent/tt-metal models/demos/deepseek_v3_d_p/reference/deepseek_v41/)",
        "model_safetensors": {"tensors": len(load_file(str(out_dir / "model.safetensors"))), "parameters": n_params},
        "tensors": {k: {"dtype": str(t.dtype)[6:], "shape": list(t.shape)} for k, t in tensors.items()},
        "command": command,
    })
    (golden_dir / "golden.json").write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"[{name}] wrote {out_dir}, goldens in {golden_dir.relative_to(out_dir)} ({n_params} parameters, round "
          "trip bit-identical)", flush=True)


def _cpu_kind() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for v41_golden
    from v41_golden import cpu_kind

    return cpu_kind()


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="directory of the V4.1 reference code")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "v41", help="output root")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)  # internal: one config, this process
    ns = parser.parse_args()
    command = ["python", "tests/golden/make_v41_golden.py", "--reference", REF_PLACEHOLDER]
    if ns.one:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        run_one(ns.reference, ns.one, ns.out / ns.one, command)
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for name in ns.configs:
        cmd = [sys.executable, __file__, "--reference", str(ns.reference), "--out", str(ns.out), "--one", name]
        subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    main()
