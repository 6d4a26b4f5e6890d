"""DeepSeek-V4.1(-Flash) HF config -> ModelConfig (with a V41Config), converted once and validated.

The official `config.json` nests the text model under `text_config` (model_type `deepseek_v41_text`) beside a
`vision_config` and a `quantization_config` (FP8 E4M3 with 32x32 UE8M0 block scales, MXFP4 routed experts).
`compress_ratios` lists the backbone layers then the DSpark stages. What the fields mean: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config import ConfigError, ModelConfig, RopeConfig, _common, _rope_from

_EXPECTED_QUANT = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
_NEEDED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
           "o_groups", "o_lora_rank", "sliding_window", "compress_ratios", "kv_source_layer_ids",
           "index_source_layer_ids", "vocab_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class EngramConfig:
    """n-gram hash memory: `layer_ids` get a gated lookup of hashed 2..max_ngram-grams (docs/models.md)."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]  # table rows per Engram layer
    max_ngram_size: int
    bucket_start: int  # engram_vocab_size: each (n-gram, head) prime is searched upward from here
    n_heads: int
    head_dim: int
    pad_token_id: int
    compressed_vocab_size: int  # size of the tokenizer-derived token map; every hash multiplier depends on it

    @property
    def num_hash_columns(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark draft head stored under `mtp.*`: stages, block, the backbone layers it taps."""

    num_stages: int
    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    n_routed_experts: int
    num_experts_per_tok: int


@dataclass(frozen=True)
class VisionConfig:
    """The ViT + aligner of `vision_config` and the image processor's limits (docs/images.md)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int  # LLM tokens of one image span, delimiters included
    min_pixels: int  # smaller images are upscaled (aspect kept) to at least this many pixels
    max_wh_ratio: float | None  # images wider than this x their height are stretched to this aspect

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def cell(self) -> int:
        """Pixels per side of one LLM image token (patch x downsample)."""
        return self.patch_size * self.downsample_ratio


@dataclass(frozen=True)
class V41Config:
    """V4.1's layer roles. A ratio > 0 layer reads the compressed KV of the latest kv source at or before it,
    and the top-k of the latest index source at or before it; index sources score against the latest kv
    source's keys; index sources after the candidate source score only inside its candidate blocks."""

    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int  # -1: no two-level indexer
    candidate_topk_blocks: int
    candidate_block_size: int
    engram: EngramConfig | None
    dspark: DSparkConfig | None
    quantized: bool  # FP8 / MXFP4 checkpoint (else plain bf16 weights)
    vision: VisionConfig | None
    image_token_id: int

    @property
    def has_vision(self) -> bool:
        return self.vision is not None

    def kv_source_of(self, layer: int) -> int:
        return max(s for s in self.kv_source_layers if s <= layer)

    def index_source_of(self, layer: int) -> int:
        return max(s for s in self.index_source_layers if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        return 0 <= self.candidate_source_layer < layer


def v41_from_dict(raw: dict) -> ModelConfig:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("a deepseek_v41 config needs a text_config object (the official layout)")
    missing = [k for k in _NEEDED if k not in text]
    if missing:
        raise ConfigError(f"deepseek_v41 text_config is missing {missing}")
    quantized = _check_quantization(raw.get("quantization_config"))
    flat = {**text, "model_type": "deepseek_v41", **{k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw}}
    n, n_mtp = int(text["num_hidden_layers"]), int(text.get("num_nextn_predict_layers", 0) or 0)
    ratios = tuple(int(r) for r in text["compress_ratios"])
    if len(ratios) != n + n_mtp:
        raise ConfigError(f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers + "
                          f"num_nextn_predict_layers = {n} + {n_mtp}")
    layout = _layout(text, raw, ratios[:n], n, n_mtp, quantized)
    _check_candidates(layout, int(text.get("index_topk", 0)))
    rope_dim = int(text["qk_rope_head_dim"])
    return ModelConfig(
        **{**_common(flat), "norm_topk_prob": bool(text.get("norm_topk_prob", True)), "num_mtp_layers": n_mtp,
           "hf_dtype": "bfloat16"},
        head_dim=int(text["head_dim"]), rope_dim=rope_dim, q_lora_rank=int(text["q_lora_rank"]),
        o_groups=int(text["o_groups"]), o_lora_rank=int(text["o_lora_rank"]),
        sliding_window=int(text["sliding_window"]), compress_ratios=ratios[:n], mtp_compress_ratios=ratios[n:],
        index_n_heads=int(text.get("index_n_heads", 0)), index_head_dim=int(text.get("index_head_dim", 0)),
        index_topk=int(text.get("index_topk", 0)), hc_mult=int(text.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(text.get("hc_sinkhorn_iters", 20)), hc_eps=float(text.get("hc_eps", 1e-6)),
        swiglu_limit=float(text.get("swiglu_limit", 0.0) or 0.0),
        rope_main=RopeConfig(theta=float(text.get("rope_theta", 10000.0)), dim=rope_dim),
        rope_compress=_compress_rope(text, rope_dim), weight_block_size=(32, 32), v41=layout,
    )


def _check_quantization(quant: dict | None) -> bool:
    if not quant:
        return False
    wrong = {k: quant.get(k) for k, v in _EXPECTED_QUANT.items() if quant.get(k) != v}
    if wrong:
        raise ConfigError(f"deepseek_v41 quantization_config {wrong} is not the official layout {_EXPECTED_QUANT}")
    return True


def _compress_rope(text: dict, rope_dim: int) -> RopeConfig:
    """Every ratio > 0 layer (ratio 1 included) rotates with compress_rope_theta and YaRN."""
    theta = float(text.get("compress_rope_theta", 160000.0))
    scaling = text.get("rope_scaling") or {"rope_type": "default"}
    return _rope_from({**scaling, "rope_theta": theta}, theta, rope_dim)


def _ids(text: dict, key: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.get(key) or ())


def _layout(text: dict, raw: dict, ratios: tuple[int, ...], n: int, n_mtp: int, quantized: bool) -> V41Config:
    kv, idx = _ids(text, "kv_source_layer_ids"), _ids(text, "index_source_layer_ids")
    cand = int(text.get("candidate_source_layer_id", -1) if text.get("candidate_source_layer_id") is not None else -1)
    layout = V41Config(
        kv_source_layers=kv, index_source_layers=idx, candidate_source_layer=cand,
        candidate_topk_blocks=int(text.get("candidate_topk_blocks", 0) or 0),
        candidate_block_size=int(text.get("candidate_block_size", 0) or 0),
        engram=_engram(text), dspark=_dspark(text, n_mtp), quantized=quantized,
        vision=_vision(raw), image_token_id=int(raw.get("image_token_id", -1)))
    _validate_roles(layout, ratios, n)
    return layout


def _validate_roles(layout: V41Config, ratios: tuple[int, ...], n: int) -> None:
    kv, idx, cand = layout.kv_source_layers, layout.index_source_layers, layout.candidate_source_layer
    if any(not 0 <= s < n or ratios[s] == 0 for s in kv + idx):
        raise ConfigError(f"kv_source_layer_ids {list(kv)} and index_source_layer_ids {list(idx)} must be backbone "
                          "layers with compress ratio > 0")
    for layer, ratio in enumerate(ratios):
        if ratio and (not any(s <= layer for s in kv) or not any(s <= layer for s in idx)):
            raise ConfigError(f"layer {layer} (ratio {ratio}) has no kv source and index source at or before it")
        if ratio and ratios[layout.kv_source_of(layer)] != ratio:
            raise ConfigError(f"layer {layer} has ratio {ratio} but reads kv source {layout.kv_source_of(layer)} "
                              f"of ratio {ratios[layout.kv_source_of(layer)]}")
    if cand >= 0 and (cand not in idx or layout.candidate_topk_blocks <= 0 or layout.candidate_block_size <= 0):
        raise ConfigError("candidate_source_layer_id must be an index source, with candidate_topk_blocks and "
                          "candidate_block_size > 0")


def _check_candidates(layout: V41Config, index_topk: int) -> None:
    """The candidate blocks must always hold index_topk visible entries (the newest block may hold just one):
    otherwise the reference's top-k would pick entries outside the candidates."""
    if layout.candidate_source_layer >= 0 and \
            (layout.candidate_topk_blocks - 1) * layout.candidate_block_size + 1 < index_topk:
        raise ConfigError(f"candidate_topk_blocks {layout.candidate_topk_blocks} x candidate_block_size "
                          f"{layout.candidate_block_size} cannot always hold index_topk {index_topk} entries")


def _engram(text: dict) -> EngramConfig | None:
    layers = _ids(text, "engram_layer_ids")
    if not layers:
        return None
    rows = tuple(int(x) for x in text.get("engram_num_embeddings") or ())
    if len(rows) != len(layers):
        raise ConfigError(f"engram_num_embeddings {list(rows)} must list one table size per engram layer {layers}")
    cfg = EngramConfig(layers, rows, int(text.get("engram_max_ngram_size", 1)), int(text.get("engram_vocab_size", 0)),
                       int(text.get("engram_n_heads", 0)), int(text.get("engram_head_dim", 0)),
                       int(text.get("engram_pad_token_id", 2)), int(text.get("engram_compressed_vocab_size", 0)))
    if cfg.max_ngram_size < 2 or cfg.n_heads <= 0 or cfg.head_dim % 32 or cfg.compressed_vocab_size <= 0:
        raise ConfigError("engram needs engram_max_ngram_size >= 2, engram_n_heads > 0, engram_head_dim a multiple "
                          "of 32 and engram_compressed_vocab_size > 0")
    return cfg


def _vision(raw: dict) -> VisionConfig | None:
    v = raw.get("vision_config")
    if not isinstance(v, dict) or not int(v.get("num_hidden_layers", 0) or 0):
        return None
    ratio = v.get("max_wh_ratio")
    cfg = VisionConfig(int(v["num_hidden_layers"]), int(v.get("hidden_size", 1024)),
                       int(v.get("num_attention_heads", 16)), int(v.get("intermediate_size", 2816)),
                       int(v.get("patch_size", 14)),
                       float(v.get("rope_theta", 10000.0)), int(v.get("downsample_ratio", 3)),
                       int(v.get("max_image_tokens", 1024)), int(v.get("min_pixels", 544 * 544)),
                       None if ratio is None else float(ratio))
    if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4 or cfg.max_image_tokens < 4 or cfg.patch_size < 1:
        raise ConfigError("vision_config needs hidden_size divisible by num_attention_heads into a head dim that is "
                          "a multiple of 4 (2-D rope), max_image_tokens >= 4 and patch_size >= 1")
    if int(raw.get("image_token_id", -1)) < 0:
        raise ConfigError("a deepseek_v41 config with a vision_config needs image_token_id")
    return cfg


def _dspark(text: dict, n_mtp: int) -> DSparkConfig | None:
    block = int(text.get("dspark_block_size", 0) or 0)
    if not block or not n_mtp:
        return None
    targets = _ids(text, "dspark_target_layer_ids")
    if not targets:
        raise ConfigError("dspark_block_size is set but dspark_target_layer_ids is empty")
    return DSparkConfig(n_mtp, block, int(text.get("dspark_noise_token_id", 0)), targets,
                        int(text.get("dspark_markov_rank", 256)),
                        int(text.get("dspark_n_routed_experts") or text.get("n_routed_experts")),
                        int(text.get("dspark_num_experts_per_tok") or text.get("num_experts_per_tok")))
