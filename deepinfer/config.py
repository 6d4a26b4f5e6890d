"""Frozen, typed configuration. HF configs are converted once, here; nothing else reads config.json."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer.quantization.spec import INT4_METHODS, Int4Spec, QuantConfigError, int4_spec

if TYPE_CHECKING:
    from deepinfer.config_v41 import V41Config

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
SUPPORTED_MODEL_TYPES = ("deepseek_v4", "deepseek_v41", "deepseek_v32", "deepseek_v3", "deepseek_v2")
# Keys that only DeepSeek-V4.1 / Flash-0731 configs carry; their semantics have no reference here.
_V41_ONLY_KEYS = ("dspark", "engram", "csa2", "delayed_hc", "num_dspark_layers", "engram_vocab_size",
                  "shared_compressed_kv", "hc_delay")


_DEFAULT_SCORING = {"deepseek_v4": "sqrtsoftplus", "deepseek_v32": "sigmoid", "deepseek_v3": "sigmoid",
                    "deepseek_v2": "softmax"}


class ConfigError(ValueError):
    """A checkpoint config that deepinfer cannot serve, with the reason."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding for one rope dimension; YaRN when `factor` > 1."""

    theta: float
    dim: int
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos/sin
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    @property
    def is_yarn(self) -> bool:
        return self.factor > 1.0 and self.original_max_position > 0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    max_position: int
    rms_norm_eps: float
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # MoE
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str  # sqrtsoftplus | sigmoid | softmax
    num_mtp_layers: int
    hf_dtype: str
    # V4
    head_dim: int = 0
    rope_dim: int = 0
    q_lora_rank: int = 0
    o_groups: int = 0
    o_lora_rank: int = 0
    sliding_window: int = 0
    layer_kinds: tuple[str, ...] = ()
    compress_ratios: tuple[int, ...] = ()  # per layer, 0 for sliding-only
    mtp_layer_kinds: tuple[str, ...] = ()  # per MTP layer (see _v4_layer_kinds)
    mtp_compress_ratios: tuple[int, ...] = ()
    hash_layers: tuple[bool, ...] = ()
    index_n_heads: int = 0  # V4 and V3.2: the lightning indexer (0: none)
    index_head_dim: int = 0
    index_topk: int = 0
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 0.0
    swiglu_limit: float = 0.0
    rope_main: RopeConfig | None = None
    rope_compress: RopeConfig | None = None
    # MLA (V2/V3)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    rope_interleave: bool = True
    rope: RopeConfig | None = None
    softmax_scale: float = 0.0
    weight_block_size: tuple[int, int] = (128, 128)  # FP8 [out, in] block of one scale
    quantization: Int4Spec | None = None  # an AWQ / GPTQ int4 checkpoint's layout (quantization_config)
    v41: V41Config | None = None  # DeepSeek-V4.1 layer roles, Engram and DSpark (config_v41.py)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_v4(self) -> bool:
        return self.model_type == "deepseek_v4"

    @property
    def is_v41(self) -> bool:
        return self.model_type == "deepseek_v41"

    @property
    def has_dsa_indexer(self) -> bool:
        """MLA with DeepSeek-V3.2's lightning indexer: every layer attends to its top-k scored positions."""
        return not self.is_v4 and not self.is_v41 and self.index_topk > 0

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        p = Path(path)
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.exists():
            raise ConfigError(f"no config.json in {p}")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        mt = raw.get("model_type")
        if "index_topk" in raw and mt == "deepseek_v3":
            raise ConfigError("a deepseek_v3 config with index_topk is ambiguous: DeepSeek-V3.2 (DSA) checkpoints "
                              "are served as model_type 'deepseek_v32'")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {mt!r}; deepinfer serves {', '.join(SUPPORTED_MODEL_TYPES)}")
        if mt == "deepseek_v41":
            from deepinfer.config_v41 import v41_from_dict

            return v41_from_dict(raw)
        return _v4_from_dict(raw) if mt == "deepseek_v4" else _mla_from_dict(raw)


def _common(raw: dict) -> dict:
    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return dict(
        model_type=raw["model_type"],
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(raw["num_attention_heads"]),
        max_position=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        n_routed_experts=int(raw.get("n_routed_experts") or 0),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        num_mtp_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
        hf_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        scoring_func=str(raw.get("scoring_func") or _DEFAULT_SCORING[raw["model_type"]]),
        quantization=_int4(raw),
    )


def _int4(raw: dict) -> Int4Spec | None:
    try:
        return int4_spec(raw.get("quantization_config"))
    except QuantConfigError as e:
        raise ConfigError(f"config.json: {e}") from e


def _rope_from(params: dict, theta: float, dim: int) -> RopeConfig:
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype in ("default", None):
        return RopeConfig(theta=float(params.get("rope_theta", theta)), dim=dim)
    if rtype != "yarn":
        raise ConfigError(f"rope type {rtype!r} is not supported (default and yarn are)")
    return RopeConfig(
        theta=float(params.get("rope_theta", theta)),
        dim=dim,
        factor=float(params["factor"]),
        original_max_position=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(params["attention_factor"]) if params.get("attention_factor") is not None else 0.0,
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def _v4_rates(raw: dict) -> dict[str, int]:
    rates = {CSA: 4, HCA: 128}
    rates.update(raw.get("compress_rates") or {})
    if "compress_rate_csa" in raw:
        rates[CSA] = raw["compress_rate_csa"]
    if "compress_rate_hca" in raw:
        rates[HCA] = raw["compress_rate_hca"]
    heavy = {r for r in raw.get("compress_ratios") or () if r not in (0, rates[CSA])}
    if len(heavy) > 1 or any(not isinstance(r, int) or r < 0 for r in heavy):
        raise ConfigError(f"compress_ratios must use 0 (sliding), {rates[CSA]} (CSA) and one HCA ratio; "
                          f"got {sorted(heavy)}")
    if heavy and not raw.get("compress_rates"):
        rates[HCA] = heavy.pop()  # official configs carry the HCA ratio only in compress_ratios
    return rates


def _v4_listed_kinds(raw: dict, n: int, rates: dict[str, int]) -> tuple[str, ...]:
    """Attention kinds as the config lists them; entries past the first n belong to MTP layers."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    if raw.get("compress_ratios"):
        return tuple(SLIDING if r == 0 else CSA if r == rates[CSA] else HCA for r in raw["compress_ratios"])
    return tuple([HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))])


def _v4_layer_kinds(raw: dict, n: int, n_mtp: int = 0) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Kinds and ratios of the n main layers followed by the n_mtp MTP layers.

    DeepSeek's official config lists one `compress_ratios` entry per MTP layer after the main layers
    (V4-Flash: 44 entries, the last 0). transformers truncates `layer_types` to the main layers and
    drops MTP, so a missing MTP entry defaults to the last main layer's kind.
    """
    rates = _v4_rates(raw)
    listed = _v4_listed_kinds(raw, n, rates)
    kinds = listed[:n]
    unknown = sorted({k for k in listed[:n + n_mtp] if k not in (SLIDING, CSA, HCA)})
    if unknown or len(kinds) != n:
        raise ConfigError(f"layer_types must list {n} of {SLIDING}/{CSA}/{HCA}; got {list(kinds)}")
    mtp = listed[n:n + n_mtp]
    kinds += mtp + kinds[-1:] * (n_mtp - len(mtp))
    return kinds, tuple(0 if k == SLIDING else int(rates[k]) for k in kinds)


def _v4_rope(raw: dict, rope_dim: int) -> tuple[RopeConfig, RopeConfig]:
    rp = raw.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
    else:
        yarn = {k: v for k, v in (raw.get("rope_scaling") or rp).items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        comp = {**yarn, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
    main_cfg = _rope_from(main, float(raw.get("rope_theta", 10000.0)), rope_dim)
    comp_cfg = _rope_from(comp, float(raw.get("compress_rope_theta", 160000.0)), rope_dim)
    if comp_cfg.is_yarn and comp_cfg.attention_factor == 0.0:
        # V4 applies YaRN frequencies without an mscale on cos/sin.
        comp_cfg = RopeConfig(**{**comp_cfg.__dict__, "attention_factor": 1.0})
    return main_cfg, comp_cfg


def _v4_from_dict(raw: dict) -> ModelConfig:
    present = [k for k in _V41_ONLY_KEYS if raw.get(k)]
    if present:
        raise ConfigError(f"DeepSeek-V4.1 features {present} are not supported (no reference implementation)")
    if len(raw.get("compress_ratios") or []) > int(raw["num_hidden_layers"]) + 1:
        raise ConfigError("this compress_ratios layout (V4.1 / Flash-0731) is not supported")
    n = int(raw["num_hidden_layers"])
    head_dim = int(raw.get("head_dim", 512))
    if raw.get("qk_rope_head_dim"):
        rope_dim = int(raw["qk_rope_head_dim"])
    else:
        rope_dim = int(head_dim * float(raw.get("partial_rotary_factor") or 64 / 512))
    n_mtp = int(raw.get("num_nextn_predict_layers", 0) or 0)
    kinds, ratios = _v4_layer_kinds(raw, n, n_mtp)
    if raw.get("mlp_layer_types"):
        hash_layers = tuple(t == "hash_moe" for t in raw["mlp_layer_types"][:n])
    else:
        n_hash = int(raw.get("num_hash_layers", 3))
        hash_layers = tuple(i < n_hash for i in range(n))
    main, comp = _v4_rope(raw, rope_dim)
    return ModelConfig(
        **{**_common(raw), "norm_topk_prob": bool(raw.get("norm_topk_prob", True))},  # V4 always renormalises
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(raw["q_lora_rank"]),
        o_groups=int(raw["o_groups"]),
        o_lora_rank=int(raw["o_lora_rank"]),
        sliding_window=int(raw["sliding_window"]),
        layer_kinds=kinds[:n],
        compress_ratios=ratios[:n],
        mtp_layer_kinds=kinds[n:],
        mtp_compress_ratios=ratios[n:],
        hash_layers=hash_layers,
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        swiglu_limit=float(raw.get("swiglu_limit", 0.0) or 0.0),
        rope_main=main,
        rope_compress=comp,
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


_MLA_TOPK_METHODS = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",),
                     "deepseek_v32": ("noaux_tc",)}


def _mla_rope(raw: dict) -> RopeConfig:
    """RoPE of the qk_rope slice; YaRN cos/sin carry mscale(f, mscale) / mscale(f, mscale_all_dim)."""
    rp = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rp.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if rp.get("rope_type", rp.get("type")) == "yarn":
        if rp.get("truncate") is False:
            raise ConfigError("yarn rope with truncate=false is not supported")
        # transformers derives a missing original length / factor from max_position_embeddings
        max_pos = int(raw.get("max_position_embeddings", 4096))
        rp.setdefault("original_max_position_embeddings", max_pos)
        if rp.get("factor") is None:
            rp["factor"] = max_pos / int(rp["original_max_position_embeddings"])
    rope = _rope_from(rp, float(rp["rope_theta"]), int(raw["qk_rope_head_dim"]))
    if rope.is_yarn and rope.attention_factor == 0.0:
        af = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim) \
            if rope.mscale and rope.mscale_all_dim else _yarn_mscale(rope.factor)
        rope = RopeConfig(**{**rope.__dict__, "attention_factor": af})
    return rope


def _mla_topk_method(raw: dict) -> str:
    """transformers' V3 router is always noaux_tc (topk_method ignored); V2 knows greedy / group-limited."""
    mt = raw["model_type"]
    if mt in ("deepseek_v3", "deepseek_v32"):
        return "noaux_tc"
    method = str(raw.get("topk_method") or "greedy")
    if method not in _MLA_TOPK_METHODS[mt]:
        known = ", ".join(_MLA_TOPK_METHODS[mt])
        raise ConfigError(f"{mt} topk_method {method!r} is not supported ({known} are)")
    return method


def _mla_check(raw: dict) -> None:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError("attention_bias / mlp_bias are not supported (no DeepSeek checkpoint uses them)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (silu is)")


def _dsa_indexer(raw: dict) -> dict:
    """DeepSeek-V3.2's lightning indexer (DSA): sizes of its heads and of the per-query top-k; {} for V2 / V3."""
    if raw["model_type"] != "deepseek_v32":
        return {}
    n = int(raw["num_hidden_layers"])
    dense = min(int(raw.get("first_k_dense_replace") or 0), n)
    freq = int(raw.get("moe_layer_freq") or 1)
    kinds = raw.get("mlp_layer_types")
    ours = ["sparse" if i >= dense and i % freq == 0 else "dense" for i in range(n)]
    if kinds is not None and list(kinds) != ours:
        raise ConfigError(f"mlp_layer_types {kinds} do not follow first_k_dense_replace={dense} "
                          f"(only that layout is supported)")
    if not raw.get("q_lora_rank"):
        raise ConfigError("deepseek_v32 needs q_lora_rank (the indexer queries read the compressed q)")
    out = dict(index_n_heads=int(raw.get("index_n_heads", 64)), index_head_dim=int(raw.get("index_head_dim", 128)),
               index_topk=int(raw.get("index_topk", 2048)))
    if out["index_head_dim"] < int(raw["qk_rope_head_dim"]) or min(out.values()) <= 0:
        raise ConfigError(f"indexer sizes {out} are invalid (index_head_dim must cover qk_rope_head_dim)")
    return out


def _mla_from_dict(raw: dict) -> ModelConfig:
    _mla_check(raw)
    rope = _mla_rope(raw)
    scale = (int(raw["qk_nope_head_dim"]) + rope.dim) ** -0.5
    if rope.is_yarn and rope.mscale_all_dim:
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    is_v2 = raw["model_type"] == "deepseek_v2"
    return ModelConfig(
        **{**_common(raw), "norm_topk_prob": bool(raw.get("norm_topk_prob", not is_v2))},
        **_dsa_indexer(raw),
        q_lora_rank=int(raw.get("q_lora_rank") or 0),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=rope.dim,
        v_head_dim=int(raw["v_head_dim"]),
        intermediate_size=int(raw["intermediate_size"]),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        topk_method=_mla_topk_method(raw),
        # V2 rotates interleaved pairs (complex multiply) and has no rope_interleave switch; neither has V3.2
        rope_interleave=is_v2 or raw["model_type"] == "deepseek_v32" or bool(raw.get("rope_interleave", True)),
        rope=rope,
        softmax_scale=scale,
        extra={"tie_word_embeddings": bool(raw.get("tie_word_embeddings", False))},
    )


def model_dtype(dtype: str | torch.dtype, config: ModelConfig, device: str = "cpu") -> torch.dtype:
    """The compute dtype of `config`'s model. DeepSeek-V4.1 runs in bfloat16 only: its quantise-dequantise points
    and GEMMs are defined on bf16 activations (the reference's numerics)."""
    if not config.is_v41:
        return resolve_dtype(dtype, config.hf_dtype, device)
    if dtype not in ("auto", "bfloat16", torch.bfloat16):
        raise ConfigError(f"DeepSeek-V4.1 runs in bfloat16 (its QAT quantisation points are bf16); got dtype {dtype!r}")
    return torch.bfloat16


def resolve_dtype(dtype: str | torch.dtype, hf_dtype: str = "bfloat16", device: str = "cpu") -> torch.dtype:
    """`auto` keeps the checkpoint dtype on CUDA; on a CPU it keeps a bfloat16 checkpoint in bfloat16 where the
    CPU has native bf16 GEMMs (AVX512-BF16 / AMX, cpu_has_native_bf16) and uses float32 otherwise (float32 is
    still the parity reference: tests and benchmarks pass dtype="float32" to compare)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if dtype == "auto":
        if device == "cpu":
            native = names.get(hf_dtype) is torch.bfloat16 and cpu_bf16_by_default()
            return torch.bfloat16 if native else torch.float32
        return names.get(hf_dtype, torch.bfloat16)
    if dtype not in names:
        raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {dtype!r}")
    return names[dtype]


def cpu_bf16_by_default() -> bool:
    """Whether `auto` picks bfloat16 on this CPU: native bf16 and DEEPINFER_CPU_BF16 not 0."""
    return os.environ.get("DEEPINFER_CPU_BF16", "1") != "0" and cpu_has_native_bf16()


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's instruction-set flags from /proc/cpuinfo (Linux; empty where it is absent)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return []
    return next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """AVX512-BF16 or AMX-BF16 among the CPU's flags (Linux; False where /proc/cpuinfo is absent)."""
    flags = cpu_flags(cpuinfo)
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the model's max_position
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority
    async_scheduling: bool = False  # schedule step N+1 before step N's sampled tokens are known

    def __post_init__(self):
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {self.policy!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks and how they split the model: world = data_parallel_size x tensor_parallel_size.
    With `enable_expert_parallel` the MoE experts are spread over the whole world (EP = world); without it
    they are sharded like every other layer, over the tensor-parallel group (deepinfer/distributed/layout.py)."""

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self):
        for name in ("data_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size


@dataclass(frozen=True)
class EplbConfig:
    """Expert-parallel load balancing (docs/eplb.md): which logical expert each physical expert slot holds.

    num_redundant_experts extra slots in all (replicas of hot experts); placement_file a static placement
    (`deepinfer eplb` writes one); enabled recomputes the placement from the load window every step_interval
    steps and moves layers_per_step layers' weights per step until the new placement is in."""

    enabled: bool = False
    step_interval: int = 3000
    layers_per_step: int = 1
    num_redundant_experts: int = 0
    placement_file: str | None = None

    def __post_init__(self):
        for name, low in (("step_interval", 1), ("layers_per_step", 1), ("num_redundant_experts", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"eplb_{name} must be an integer >= {low}, got {value!r}".replace(
                    "eplb_num_redundant", "num_redundant"))

    @property
    def active(self) -> bool:
        """Whether any placement other than the contiguous one is served."""
        return self.enabled or self.num_redundant_experts > 0 or self.placement_file is not None


SPECULATIVE_METHODS = ("mtp", "ngram", "dspark")
VERIFY_POLICIES = ("fixed", "adaptive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: `method` proposes up to `num_speculative_tokens` draft tokens per request and
    step; the target verifies them losslessly. `verify_policy` fixed verifies every draft; adaptive picks
    each request's verify length from predicted acceptance and the measured step-time profile."""

    method: str
    num_speculative_tokens: int = 3
    verify_policy: str = "fixed"
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram searched for in the history
    prompt_lookup_min: int = 1  # ngram: shortest
    model: str | None = None  # dspark: drafter directory (default: `dspark/` inside the target checkpoint)

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.verify_policy not in VERIFY_POLICIES:
            raise ValueError(f"verify_policy must be one of {VERIFY_POLICIES}, got {self.verify_policy!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict, or JSON text (the server's --speculative-config); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown or "method" not in value:
            raise ValueError(f"speculative_config needs 'method' and accepts only {sorted(cls.__dataclass_fields__)}"
                             f"; got unknown {unknown}" if unknown else "speculative_config needs a 'method'")
        return cls(**value)


@dataclass(frozen=True)
class EngineArgs:
    """Every engine option of the offline API and the server; unknown names are rejected."""

    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 0
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_fraction: float = 0.1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # paged pools: auto (model dtype) | fp8 | int8 (one float32 scale per entry)
    # weight quantisation (vLLM's name): None reads it from the checkpoint's quantization_config; "awq" / "gptq"
    # insist on that int4 layout (an error when the checkpoint is not in it)
    quantization: str | None = None
    swa_restore: str = "replay"  # how a V4 prefix hit gets its bounded state: replay | snapshot | auto
    num_prefix_snapshots: int = 0  # state rows kept for snapshots (0: 2 x max_num_seqs when snapshots are on)
    scheduling_policy: str = "fcfs"
    load_progress: bool = True
    # Overlap the forward of step N (worker thread) with scheduling N+1 and processing N-1's outputs.
    # Speculative decoding runs synchronous steps (the next schedule needs the accepted count).
    async_scheduling: bool = False
    # Batch-invariant kernels and position-seeded sampling: a request's logits and tokens do not depend
    # on the batch, chunking or preemption (docs/determinism.md). Slower.
    deterministic: bool = False
    # CUDA graphs (worker/cuda_graphs.py): decode and verify steps of up to max_cuda_graph_batch_size requests
    # are replayed from graphs captured at start-up (CUDA, one process, models with a fixed-shape forward).
    # Off CUDA the same fixed-shape steps are compiled by torch.compile (worker/compiled_step.py) instead.
    # enforce_eager: never capture or compile; every step runs eagerly (default: DEEPINFER_ENFORCE_EAGER=1).
    enforce_eager: bool = field(default_factory=lambda: os.environ.get("DEEPINFER_ENFORCE_EAGER", "0") == "1")
    max_cuda_graph_batch_size: int = 256
    # intra-op threads of a one-process CPU engine (worker/threads.py). 0: every core offline; every core but one
    # when served (the API process streams tokens on the other). Ranks of a multi-rank engine split the cores.
    # Default: DEEPINFER_CPU_THREADS, else 0.
    cpu_threads: int = field(default_factory=lambda: int(os.environ.get("DEEPINFER_CPU_THREADS", "0")))
    grammar_compile_timeout_s: float = 30.0  # a structured-output grammar that takes longer fails its request
    # budget-aware structured outputs: once the remaining max_tokens / context is within this many tokens of
    # what finishing the grammar needs, only closing tokens are allowed (docs/structured-outputs.md); -1: off
    grammar_closing_margin: int = 4
    # {"method": "mtp" | "ngram" | "dspark", "num_speculative_tokens": k, ...} as a dict or JSON text; None: off
    speculative_config: str | dict | None = None
    # Multi-rank engine (deepinfer/distributed, docs/parallelism.md); world = data x tensor parallel size.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    moe_comm: str = "allgather"  # expert-parallel dispatch/combine: allgather | alltoall
    # split each step into two micro-batches whose MoE dispatch/combine overlaps the other's compute (EP, TP 1)
    two_batch_overlap: bool = False
    distributed_timeout_s: float = 60.0  # a collective, or the ranks' answer to a step, taking longer fails
    distributed_workers: str = "spawn"  # spawn: this process starts one per rank | external: torchrun starts them
    driver_address: str = "127.0.0.1:0"  # host:port the ranks reach this process at (0: any free port)
    # DeepSeek-V4.1 prefill truncation: from the first ratio-1 layer on, a prompt computes only its last K tokens
    # (DeepSeek's engine: 140). 0: off. Exact for prompts of at most K tokens; see docs/models.md.
    prefill_truncation_tokens: int = 0
    # Expert-parallel load statistics (eplb/stats.py): tokens routed to each expert over this many steps, summed
    # over the ranks for the balancedness metrics and `deepinfer eplb`. 0: not recorded.
    eplb_window_size: int = 1000
    # EPLB (docs/eplb.md; expert parallelism only): rebalance live every eplb_step_interval steps, moving
    # eplb_layers_per_step layers per step; extra physical expert slots; a static placement file.
    enable_eplb: bool = False
    eplb_step_interval: int = 3000
    eplb_layers_per_step: int = 1
    num_redundant_experts: int = 0
    eplb_placement: str | None = None
    # publish prefix-cache events (stored / evicted block hashes) with the engine's outputs, for a DP router
    kv_events: bool = False
    # Prefill/decode disaggregation (deepinfer/disagg, docs/disaggregation.md): none | prefill | decode. A prefill
    # engine holds a finished prompt's cache for a decode engine to read (until it is released or the lease runs
    # out); a decode engine reads it by component name over the transfer backend (mooncake | dlslime | local).
    disaggregation_mode: str = "none"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_host: str = "127.0.0.1"  # where this engine's bootstrap service and transport listen
    disaggregation_bootstrap_port: int = 0  # prefill: the bootstrap service's port (0: any free port)
    disaggregation_lease_s: float = 30.0  # prefill: a held prompt cache nobody collects is freed after this
    disaggregation_transfer_timeout_s: float = 10.0  # decode: a handshake or read taking longer fails its request

    def __post_init__(self):
        _ = self.parallel  # validates the sizes
        self._check_disaggregation()
        if self.moe_comm not in ("allgather", "alltoall"):
            raise ValueError(f"moe_comm must be allgather or alltoall, got {self.moe_comm!r}")
        if self.distributed_workers not in ("spawn", "external"):
            raise ValueError(f"distributed_workers must be spawn or external, got {self.distributed_workers!r}")
        if self.two_batch_overlap:
            self._check_two_batch_overlap()
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0 (0: auto), got {self.cpu_threads}")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.max_cuda_graph_batch_size < 1:
            raise ValueError(f"max_cuda_graph_batch_size must be >= 1, got {self.max_cuda_graph_batch_size}")
        if self.grammar_closing_margin < -1:
            raise ValueError(f"grammar_closing_margin must be >= 0 (or -1: off), got {self.grammar_closing_margin}")
        if SpeculativeConfig.parse(self.speculative_config) is not None and self.deterministic:
            raise ValueError("speculative decoding cannot be combined with deterministic mode (verification "
                             "steps batch several tokens of a request, which deterministic mode rules out)")
        if self.eplb_window_size < 0:
            raise ValueError(f"eplb_window_size must be >= 0, got {self.eplb_window_size}")
        self._check_eplb()
        if self.prefill_truncation_tokens < 0:
            raise ValueError(f"prefill_truncation_tokens must be >= 0, got {self.prefill_truncation_tokens}")
        if self.quantization not in (None, *INT4_METHODS):
            raise ValueError(f"quantization must be one of {', '.join(INT4_METHODS)} (or unset: from the checkpoint), "
                             f"got {self.quantization!r}")
        if self.swa_restore not in ("replay", "snapshot", "auto"):
            raise ValueError(f"swa_restore must be replay, snapshot or auto, got {self.swa_restore!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {sorted(known)}")
        return cls(**kwargs)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def eplb(self) -> EplbConfig:
        return EplbConfig(self.enable_eplb, self.eplb_step_interval, self.eplb_layers_per_step,
                          self.num_redundant_experts, self.eplb_placement)

    def _check_eplb(self) -> None:
        eplb = self.eplb  # validates the numbers
        if eplb.active and not (self.enable_expert_parallel and self.parallel.world_size > 1):
            raise ValueError("enable_eplb, num_redundant_experts and eplb_placement need enable_expert_parallel "
                             "and more than one rank (they place experts over the expert-parallel ranks)")
        if eplb.enabled and self.eplb_window_size == 0:
            raise ValueError("enable_eplb needs the expert-load statistics (eplb_window_size > 0)")

    def _check_disaggregation(self) -> None:
        if self.disaggregation_mode not in ("none", "prefill", "decode"):
            raise ValueError(f"disaggregation_mode must be none, prefill or decode, got {self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in ("mooncake", "dlslime", "local"):
            raise ValueError("disaggregation_transfer_backend must be mooncake, dlslime or local, got "
                             f"{self.disaggregation_transfer_backend!r}")
        if self.disaggregation_lease_s <= 0 or self.disaggregation_transfer_timeout_s <= 0:
            raise ValueError("disaggregation_lease_s and disaggregation_transfer_timeout_s must be > 0")
        if self.disaggregation_mode != "none" and self.parallel.world_size > 1:
            raise ValueError("prefill/decode disaggregation runs single-process engines for now (one tensor- and "
                             "data-parallel rank each); scale out with more prefill and decode instances")

    def _check_two_batch_overlap(self) -> None:
        if not self.enable_expert_parallel or self.tensor_parallel_size != 1:
            raise ValueError("two_batch_overlap needs enable_expert_parallel and tensor_parallel_size 1 (it overlaps "
                             "the expert-parallel collectives; TP collectives cannot run on two threads)")
        if SpeculativeConfig.parse(self.speculative_config) is not None or self.deterministic:
            raise ValueError("two_batch_overlap cannot be combined with speculative decoding or deterministic mode")

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.data_parallel_size, self.tensor_parallel_size, self.enable_expert_parallel)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                               policy=self.scheduling_policy, async_scheduling=self.async_scheduling)
