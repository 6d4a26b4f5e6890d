"""Checkpoint discovery, streaming, dequantisation and tensor-name canonicalisation.

`iter_checkpoint` is the one entry point the models use: it yields `(canonical_name, tensor, file_name)`
one shard at a time. Quantised weights leave here as float32 and their scale tensors are consumed, except those
`keep_quantized` accepts: they leave raw (fp8 / packed fp4, never dequantised), each followed at once by its scale
under the canonical name `<stem>.weight_scale_inv` (whatever the checkpoint's suffix), in the checkpoint's dtype.
`quantized_weights` tells from the headers alone which weights are quantised, so a model can swap in quantised
modules before loading (models/quantized.py).

Invariants:
  * every error is a `CheckpointError` naming the file and, when one is involved, the tensor;
  * a header pass over every shard runs before any tensor data is read, so pairing/naming problems
    (a weight without its scale, a missing shard, two tensors with one canonical name) fail fast;
  * at most one shard is open at a time; only a quantised weight or scale whose partner lives in a later
    shard is held back, until that partner arrives;
  * with `wanted`, a tensor whose canonical name is not wanted is never read (nor its scale, nor
    dequantised): a rank reads only the tensors it stores. The header pass still checks every tensor;
  * a kept-quantised weight's scale has the shape its weight and block imply and finite entries, as a dequantised
    one's (CheckpointError naming both tensors otherwise);
  * int4 (AWQ / GPTQ) weights are groups `X.qweight`, `X.qzeros`, `X.scales` (+ GPTQ's `X.g_idx`): the header pass
    checks that every member is there (their shapes are checked when read), they are read whole, and yielded once
    as the float32 `X.weight` they stand for
    (quantization/int4.py holds the layouts).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from deepinfer.quantization.int4 import awq_weight, gptq_dequantize, gptq_weight
from deepinfer.quantization.spec import Int4Spec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_BLOCK_SIZE = (128, 128)  # FP8 [out, in] block of one scale (DeepSeek-V3/V4 default)
FP4_GROUP = 32  # FP4 routed experts: one UE8M0 scale per 32 consecutive inputs of a row (MX layout)
MODEL_TYPES = ("deepseek_v4", "deepseek_v41", "deepseek_v32", "deepseek_v3", "deepseek_v2")

# safetensors header dtypes of weights that must come with a scale; I8/U8/F4 are packed FP4 (2 codes/byte).
_FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
_FP4_DTYPES = frozenset({"I8", "U8", "F4"})
_E8M0 = "F8_E8M0"
# Scale suffixes, replacing the weight's ".weight". All hold a multiplier: w = q * scale
# (DeepSeek's "weight_scale_inv" is the inverse of the quantisation scale, i.e. the dequant factor).
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".scale_inv", ".scale")

# E2M1 code -> value. Bit 3 is the sign; bits 2..1 the exponent (bias 1); bit 0 the mantissa:
# exponent 0 is subnormal (0, 0.5), else 2^(e-1) * (1 + m/2). Same table as the OCP MX spec and
# DeepSeek-V4's inference/convert.py FP4_TABLE.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and, if relevant, the tensor."""


KEPT_SCALE_SUFFIX = ".weight_scale_inv"  # the canonical name of a kept-quantised weight's scale: <stem> + this
# safetensors header dtype -> torch dtype, for the quantised weights and their scales
_TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
                 "F4": torch.float4_e2m1fn_x2, "F8_E8M0": torch.float8_e8m0fnu, "F32": torch.float32,
                 "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


@dataclass(frozen=True)
class QuantInfo:
    """How a checkpoint stores one quantised weight: `kind` "fp8" (block-scaled) or "mxfp4" (E2M1 packed two per
    byte along the input dim, one scale per 32 inputs), the weight's and its scale's torch dtypes."""

    kind: str
    dtype: torch.dtype
    scale_dtype: torch.dtype


# --- discovery ------------------------------------------------------------------------------------------
def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory, in load order.

    `model.safetensors` wins; else the shards of `model.safetensors.index.json` (validated); else every
    `*.safetensors` in the directory, sorted. A path to one `.safetensors` file is that file.
    """
    return _discover(Path(path))[0]


def _discover(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """(files, weight_map of the index when the files come from one)."""
    if root.is_file() and root.suffix == ".safetensors":
        return [root], None
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE], None
    if (root / INDEX_FILE).is_file():
        weight_map = read_index(root / INDEX_FILE)
        return _indexed_shards(root, weight_map), weight_map
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
    return files, None


def tensor_files(path: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the headers only."""
    return {name: entry.file for name, entry in _scan(_discover(Path(path))[0]).items()}


def read_index(index_path: Path) -> dict[str, str]:
    """The `weight_map` (tensor name -> shard file name) of a safetensors index json."""
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: not a readable JSON index ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: no 'weight_map' object of tensor name -> shard file name")
    return weight_map


def _indexed_shards(root: Path, weight_map: dict[str, str]) -> list[Path]:
    for tensor, shard in sorted(weight_map.items()):
        if not (root / shard).is_file():
            raise CheckpointError(f"{root / INDEX_FILE}: shard {shard} is missing (it holds {tensor})")
    if not weight_map:
        raise CheckpointError(f"{root / INDEX_FILE}: empty weight_map")
    return [root / shard for shard in sorted(set(weight_map.values()))]


# --- names ----------------------------------------------------------------------------------------------
def _compressor_renames(hf: str, official: str) -> dict[str, str]:
    return {f"{hf}.position_bias": f"{official}.ape", f"{hf}.kv_proj.weight": f"{official}.wkv.weight",
            f"{hf}.gate_proj.weight": f"{official}.wgate.weight",
            f"{hf}.kv_norm.weight": f"{official}.norm.weight"}


# Official top-level names, keyed by the names transformers uses (after the "model." prefix is dropped).
_V4_TOP = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           **{f"hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")}}
# Official names inside `layers.N.` / `mtp.K.`, keyed by the alternatives: the official checkpoint's
# `attn.norm` (main-attention KV norm) and transformers' in-memory module names.
_V4_BLOCK_RENAMES = {
    "attn.norm.weight": "attn.kv_norm.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{m}_hc.{p}": f"hc_{m}_{p}" for m in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "self_attn.sinks": "attn.attn_sink",
    **{f"self_attn.{hf}.weight": f"attn.{off}.weight" for hf, off in (
        ("q_a_proj", "wq_a"), ("q_a_norm", "q_norm"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"),
        ("kv_norm", "kv_norm"), ("o_a_proj", "wo_a"), ("o_b_proj", "wo_b"))},
    **_compressor_renames("self_attn.compressor", "attn.compressor"),
    **_compressor_renames("self_attn.compressor.indexer", "attn.indexer.compressor"),
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    **{f"mlp.shared_experts.{hf}.weight": f"ffn.shared_experts.{w}.weight" for hf, w in (
        ("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))},
}
_V4_BLOCK = re.compile(r"((?:layers|mtp)\.\d+)\.(.+)")
_V4_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|down|up)_proj\.weight")
_EXPERT_W = {"gate": "w1", "down": "w2", "up": "w3"}


def canonical_name(name: str, model_type: str) -> str:
    """The name deepinfer's models expect. Only renames: unknown names come back (nearly) unchanged.

    deepseek_v4: DeepSeek's official names (`embed.weight`, `layers.N.attn.kv_norm.weight`, `mtp.K.*`, ...)
    from official, transformers-saved (`model.` prefix) or transformers in-memory names.
    deepseek_v41: DeepSeek's official names, unchanged (its checkpoints ship only those).
    deepseek_v32 / deepseek_v3 / deepseek_v2: the HF names, unchanged.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; expected one of {MODEL_TYPES}")
    return _canonical_v4(name) if model_type == "deepseek_v4" else name


def _canonical_v4(name: str) -> str:
    name = name.removeprefix("model.")
    if name in _V4_TOP:
        return _V4_TOP[name]
    block = _V4_BLOCK.fullmatch(name)
    return f"{block[1]}.{_v4_block_leaf(block[2])}" if block else name


def _v4_block_leaf(leaf: str) -> str:
    if leaf in _V4_BLOCK_RENAMES:
        return _V4_BLOCK_RENAMES[leaf]
    expert = _V4_HF_EXPERT.fullmatch(leaf)
    return f"ffn.experts.{expert[1]}.{_EXPERT_W[expert[2]]}.weight" if expert else leaf


# --- dequantisation -------------------------------------------------------------------------------------
def quantization_block_size(raw_config: dict) -> tuple[int, int]:
    """`quantization_config.weight_block_size` of a raw HF config dict; (128, 128) when absent."""
    quant = raw_config.get("quantization_config") or {}
    size = quant.get("weight_block_size") or DEFAULT_BLOCK_SIZE
    valid = isinstance(size, (list, tuple)) and len(size) == 2
    if not valid or not all(isinstance(s, int) and s > 0 for s in size):
        raise CheckpointError(f"config.json: quantization_config.weight_block_size must be two positive "
                              f"integers, got {size!r}")
    return int(size[0]), int(size[1])


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor as float32. UE8M0 (`float8_e8m0fnu`) byte b is 2^(b-127); torch's cast does exactly
    that (byte 255, the format's NaN, becomes NaN and is rejected by the caller)."""
    return scale.float()


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor,
                         block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """float32 `weight * scale`, scale[i, j] covering rows [i*bo, (i+1)*bo) x cols [j*bi, (j+1)*bi).

    Edge blocks of a shape that is not a multiple of the block are partial (ceil-sized scale grid).
    """
    _require_2d(weight)
    return _apply_block_scale(weight.float(), scale, block_size)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """float32 [out, in] from E2M1 codes packed two per byte ([out, in/2], int8/uint8/float4_e2m1fn_x2)
    and per-row scales over `group` consecutive inputs ([out, ceil(in/group)]).

    Nibble order: input 2i is the LOW nibble (bits 0..3) and input 2i+1 the HIGH nibble of byte i, as
    DeepSeek-V4's official inference/convert.py `cast_e2m1fn_to_e4m3fn` unpacks it
    (stack([TABLE[x & 0x0F], TABLE[x >> 4]], -1).flatten) -- also the OCP MX / torch float4_e2m1fn_x2
    and transformers' integrations/mxfp4.py convention.
    """
    _require_2d(packed)
    codes = packed.view(torch.uint8)
    pairs = torch.stack((codes & 0x0F, codes >> 4), dim=-1)  # [..., i, 0] is input 2i
    values = torch.tensor(_E2M1_VALUES)[pairs.long()].flatten(-2)
    return _apply_block_scale(values, scale, (1, group))


def _apply_block_scale(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = values.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale.shape) != grid:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight shape {(rows, cols)} "
                         f"with {block[0]}x{block[1]} blocks (expected {grid})")
    factors = scale_to_float(scale)
    if not torch.isfinite(factors).all():
        raise ValueError("scale has non-finite entries")
    padded = _pad(values, grid[0] * block[0], grid[1] * block[1])
    padded.view(grid[0], block[0], grid[1], block[1]).mul_(factors[:, None, :, None])
    return padded[:rows, :cols].contiguous()


def _pad(values: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`values` zero-padded to [rows, cols]; the tensor itself when no padding is needed."""
    if values.shape == (rows, cols):
        return values
    padded = values.new_zeros(rows, cols)
    padded[: values.shape[0], : values.shape[1]] = values
    return padded


def _require_2d(weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"quantised weight must be 2-D, got shape {tuple(weight.shape)}")


# --- header pass ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str  # safetensors header dtype, e.g. "F8_E4M3"
    nbytes: int  # bytes of its data in the file (from the header's data_offsets)


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{file}: corrupt or unreadable safetensors file ({e})") from e


def _scan(files: list[Path]) -> dict[str, _Entry]:
    """Every tensor's file, dtype and size, from the headers only. A name in two files is an error."""
    entries: dict[str, _Entry] = {}
    for file in files:
        with _open(file) as f:
            sizes = _data_sizes(file)
            for name in f.keys():
                if name in entries:
                    raise CheckpointError(f"{file}: tensor {name} is also in {entries[name].file}")
                entries[name] = _Entry(file, f.get_slice(name).get_dtype(), sizes[name])
    return entries


def _data_sizes(file: Path) -> dict[str, int]:
    """Tensor name -> data bytes, from the JSON header (u64 little-endian length, then the JSON) that
    safe_open has already validated."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {n: e["data_offsets"][1] - e["data_offsets"][0] for n, e in header.items() if n != "__metadata__"}


def _check_index(root: Path, weight_map: dict[str, str], entries: dict[str, _Entry]) -> None:
    """Every tensor the index lists is in the shard it names."""
    for tensor, shard in weight_map.items():
        if tensor not in entries or entries[tensor].file.name != shard:
            raise CheckpointError(f"{root / shard}: tensor {tensor}, listed here by {INDEX_FILE}, "
                                  "is not in this shard")


def _scale_stem(name: str) -> str | None:
    """`X` for a name `X<scale suffix>`, else None."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _is_quantised(name: str, entry: _Entry) -> bool:
    return name.endswith(".weight") and entry.dtype in _FP8_DTYPES | _FP4_DTYPES


def _find_scale(weight: str, entries: dict[str, _Entry]) -> str:
    stem = weight[: -len(".weight")]
    found = [stem + s for s in _SCALE_SUFFIXES if stem + s in entries]
    if len(found) != 1:
        problem = "has several scales: " + ", ".join(found) if found else (
            "has no scale tensor (looked for " + ", ".join(stem + s for s in _SCALE_SUFFIXES) + ")")
        raise CheckpointError(f"{entries[weight].file}: quantised weight {weight} "
                              f"({entries[weight].dtype}) {problem}")
    return found[0]


def _pair_quantised(entries: dict[str, _Entry]) -> dict[str, str]:
    """Quantised weight name -> its scale name; a scale-like tensor without a quantised weight is an error.

    `.scale` is ambiguous (transformers' in-memory `attn_hc.scale` is a plain float tensor): it is a quant
    scale when it is UE8M0 or when a quantised `.weight` claims it.
    """
    pairs = {w: _find_scale(w, entries) for w, e in entries.items() if _is_quantised(w, e)}
    claimed = set(pairs.values())
    for name, entry in entries.items():
        stem = _scale_stem(name)
        if stem is None or name in claimed or (name.endswith(".scale") and entry.dtype != _E8M0):
            continue
        weight = f"{stem}.weight"
        why = f"is {entries[weight].dtype}, not quantised" if weight in entries else "is missing"
        raise CheckpointError(f"{entry.file}: scale tensor {name} has no quantised weight: {weight} {why}")
    return pairs


def _check_unique(entries: dict[str, _Entry], hidden: set[str], model_type: str,
                  int4: dict[str, frozenset[str]] | None = None) -> None:
    """No two yielded tensors share a canonical name (e.g. both `attn.norm` and `attn.kv_norm`). `hidden`: the
    tensors not yielded themselves (scales, int4 members); `int4`: the weights the int4 members make."""
    seen: dict[str, str] = {}
    made = {w: (entries[min(ms)].file, min(ms)) for w, ms in (int4 or {}).items()}
    plain = ((n, (e.file, n)) for n, e in entries.items() if n not in hidden)
    for name, (file, shown) in [*plain, *made.items()]:
        canon = canonical_name(name, model_type)
        if canon in seen:
            raise CheckpointError(f"{file}: tensors {seen[canon]} and {shown} both map to {canon}")
        seen[canon] = shown


def quantized_weights(path: str | os.PathLike, model_type: str) -> dict[str, QuantInfo]:
    """Canonical name -> QuantInfo of every quantised weight of the checkpoint at `path`, from the headers only
    (the same discovery, pairing and naming checks as `iter_checkpoint`); empty for an unquantised checkpoint."""
    files, _ = _discover(Path(path))
    entries = _scan(files)
    return {canonical_name(w, model_type): _quant_info(entries[w], entries[s])
            for w, s in _pair_quantised(entries).items()}


def _quant_info(weight: _Entry, scale: _Entry) -> QuantInfo:
    kind = "fp8" if weight.dtype in _FP8_DTYPES else "mxfp4"
    return QuantInfo(kind, _TORCH_DTYPES[weight.dtype], _TORCH_DTYPES.get(scale.dtype, torch.float32))


def kept_scale_name(weight_name: str) -> str:
    """`<stem>.weight_scale_inv` of a weight named `<stem>.weight`: how a kept weight's scale is yielded."""
    return weight_name.removesuffix(".weight") + KEPT_SCALE_SUFFIX


# --- int4 (AWQ / GPTQ) groups ---------------------------------------------------------------------------
_INT4_LEAVES = ("qweight", "qzeros", "scales")  # every int4 weight X has X.qweight, X.qzeros, X.scales
_INT4_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def _int4_groups(entries: dict[str, _Entry], spec: Int4Spec | None) -> dict[str, frozenset[str]]:
    """`X.weight` -> its int4 members for every `X.qweight` of the checkpoint (GPTQ: with X.g_idx when present);
    CheckpointError for a member without its qweight, a missing member, or int4 tensors without an int4 config."""
    stems = {n.removesuffix(".qweight") for n in entries if n.endswith(".qweight")}
    for name, entry in entries.items():
        if name.endswith(_INT4_SUFFIXES) and name.rpartition(".")[0] not in stems:
            raise CheckpointError(f"{entry.file}: int4 tensor {name} has no {name.rpartition('.')[0]}.qweight")
    if stems and spec is None:
        name = min(stems) + ".qweight"
        raise CheckpointError(f"{entries[name].file}: {name} is an int4 (AWQ / GPTQ) tensor, but config.json has no "
                              "quantization_config with quant_method 'awq' or 'gptq'")
    return {f"{stem}.weight": _int4_members(stem, entries, spec) for stem in sorted(stems)}


def _int4_members(stem: str, entries: dict[str, _Entry], spec: Int4Spec) -> frozenset[str]:
    names = [f"{stem}.{leaf}" for leaf in _INT4_LEAVES]
    missing = [n for n in names if n not in entries]
    file = entries[f"{stem}.qweight"].file
    if missing:
        raise CheckpointError(f"{file}: int4 ({spec.method}) weight {stem} lacks {', '.join(missing)}")
    if f"{stem}.weight" in entries:
        raise CheckpointError(f"{file}: {stem} has both a float .weight and int4 tensors")
    g_idx = [f"{stem}.g_idx"] if spec.method == "gptq" and f"{stem}.g_idx" in entries else []
    return frozenset(names + g_idx)


def _int4_weight(parts: dict[str, torch.Tensor], spec: Int4Spec):
    if spec.method == "awq":
        return awq_weight(parts["qweight"], parts["qzeros"], parts["scales"], spec.group_size)
    return gptq_weight(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), spec.group_size,
                       spec.zeros_minus_one)


def _collect(name: str, tensor: torch.Tensor, file: Path, plan: _Plan,
             pending: dict[str, dict[str, tuple[torch.Tensor, Path]]]) -> list[tuple[str, torch.Tensor, Path]]:
    """Buffer an int4 member; once its weight's members are all in, [(weight, float32 weight, qweight's file)]."""
    weight = plan.group_of[name]
    got = pending.setdefault(weight, {})
    got[name] = (tensor, file)
    if len(got) < len(plan.members[weight]):
        return []
    del pending[weight]
    stem, canon = weight.removesuffix(".weight"), canonical_name(weight, plan.model_type)
    parts, file = {n.removeprefix(stem + "."): t for n, (t, _) in got.items()}, got[stem + ".qweight"][1]
    return [(canon, _int4_dequantize(stem, parts, plan, canon, file), file)]


def _int4_dequantize(stem: str, parts: dict[str, torch.Tensor], plan: _Plan, canon: str, file: Path) -> torch.Tensor:
    spec = plan.int4
    try:
        weight = _int4_weight(parts, spec)
        if weight is None:  # GPTQ act order: groups not consecutive, dequantised here
            return gptq_dequantize(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                                   spec.group_size, spec.zeros_minus_one)
    except ValueError as e:
        raise CheckpointError(f"{file}: int4 {spec.method} weight {stem} (group size {spec.group_size}): {e}") from e
    if plan.int4_sink is not None and parts["scales"].dtype == torch.float16:  # kept scales are float16
        plan.int4_sink[canon] = weight
    return weight.dequantize()


# --- streaming ------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    files: list[Path]
    model_type: str
    block: tuple[int, int]
    partner: dict[str, str]  # quantised weight <-> its scale, both directions
    weights: frozenset[str]  # the quantised weights (keys of `partner` that are not scales)
    read: dict[str, _Entry]  # the tensors to read: wanted ones and the scales of wanted quantised weights
    keep: Callable[[str], bool] | None = None  # canonical weight name -> yield it raw with its scale
    int4: Int4Spec | None = None  # the int4 layout of `group_of`'s members (config.json quantization_config)
    group_of: dict[str, str] = field(default_factory=dict)  # int4 member (X.qweight, ...) -> X.weight
    members: dict[str, frozenset[str]] = field(default_factory=dict)  # X.weight -> its int4 members
    int4_sink: dict | None = None  # canonical X.weight -> its Int4Weight (AWQ), for layers kept packed


def _plan(path: str | os.PathLike, model_type: str, block: tuple[int, int],
          wanted: Callable[[str], bool] | None, int4: Int4Spec | None = None) -> _Plan:
    root = Path(path)
    files, weight_map = _discover(root)
    entries = _scan(files)
    if weight_map is not None:
        _check_index(root, weight_map, entries)
    pairs = _pair_quantised(entries)
    members = _int4_groups(entries, int4)
    group_of = {m: w for w, ms in members.items() for m in ms}
    _check_unique(entries, set(pairs.values()) | set(group_of), model_type, members)
    partner = {**pairs, **{s: w for w, s in pairs.items()}}
    read = _to_read(entries, pairs, group_of, model_type, wanted)
    return _Plan(files, model_type, block, partner, frozenset(pairs), read, int4=int4, group_of=group_of,
                 members=members)


def _to_read(entries: dict[str, _Entry], pairs: dict[str, str], group_of: dict[str, str], model_type: str,
             wanted: Callable[[str], bool] | None) -> dict[str, _Entry]:
    """The entries to read: a scale goes with its weight, an int4 member with the weight it makes, everything
    else by its canonical name."""
    if wanted is None:
        return entries
    weight_of = {**{s: w for w, s in pairs.items()}, **group_of}
    return {n: e for n, e in entries.items() if wanted(canonical_name(weight_of.get(n, n), model_type))}


def iter_checkpoint(path: str | os.PathLike, model_type: str, block_size: tuple[int, int] | None = None,
                    progress: bool = False, wanted: Callable[[str], bool] | None = None,
                    ranges: Callable[[str, tuple[int, ...]], tuple[slice, ...] | None] | None = None,
                    keep_quantized: Callable[[str], bool] | None = None, int4: Int4Spec | None = None,
                    int4_sink: dict | None = None) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield `(canonical_name, tensor, file_name)` for every tensor of the checkpoint at `path` whose
    canonical name `wanted` accepts (default: all).

    Quantised weights come out float32 (FP8 with `block_size` blocks, default (128, 128), see
    `quantization_block_size`; FP4 experts with 1x32 groups); their scales are not yielded. An unwanted
    tensor is not read from disk, nor is its scale, nor is it dequantised. The progress bar counts the bytes
    of the tensors read. `file_name` is the base name of the (weight's) shard. Discovery, header and pairing
    errors (over every tensor, wanted or not) are raised by this call, before any tensor data is read; read
    errors while iterating.

    `ranges(canonical_name, full_shape)` may name the block of an unquantised tensor a sharded model stores
    (weights.tensor_ranges): only that block is read, and the tensor yielded carries `checkpoint_shape`, the
    full shape it was cut from (so it is not cut again). Quantised tensors are read whole.

    `keep_quantized(canonical_name)` (default: none) picks quantised weights to keep as stored: such a weight is
    yielded raw (float8 / packed int8-uint8-float4 codes), immediately followed by its scale, raw too, named
    `kept_scale_name(name)`; the scale's shape (the `block_size` grid for FP8, [out, ceil(in / 32)] for FP4) and
    finiteness are checked as dequantisation would. Other quantised weights are dequantised as above.

    `int4` (the checkpoint's AWQ / GPTQ layout, ModelConfig.quantization): every `X.qweight` with its `X.qzeros`,
    `X.scales` (and GPTQ's `X.g_idx`) is yielded once, as the float32 `X.weight` it dequantises to (canonical
    name); its members are read whole, and a missing member, a shape that does not fit the group size or int4
    tensors without `int4` are CheckpointErrors naming the tensor. With `int4_sink` (a dict), the Int4Weight of
    each weight in consecutive groups (AWQ; GPTQ without act order) is also stored there under its canonical name
    (quantization/kept.py keeps those layers packed).
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; expected one of {MODEL_TYPES}")
    block = tuple(block_size) if block_size is not None else DEFAULT_BLOCK_SIZE
    plan = _plan(path, model_type, block, wanted, int4)
    plan.keep, plan.int4_sink = keep_quantized, int4_sink
    return _stream(plan, progress, ranges)


def _stream(plan: _Plan, progress: bool, ranges=None) -> Iterator[tuple[str, torch.Tensor, str]]:
    used = {e.file for e in plan.read.values()}
    files = [f for f in plan.files if f in used]  # a shard with nothing wanted is not opened
    bar = tqdm(total=sum(e.nbytes for e in plan.read.values()), unit="B", unit_scale=True,
               desc=f"Loading {len(files)} shard(s)", disable=not progress)
    pending: dict[str, tuple[torch.Tensor, Path]] = {}  # pair halves whose partner has not arrived yet
    groups: dict[str, dict[str, tuple[torch.Tensor, Path]]] = {}  # int4 weights with members still to come
    for file in files:
        bar.set_postfix_str(file.name)
        for name, tensor in _read_shard(file, plan, ranges):
            bar.update(plan.read[name].nbytes)
            for item in _items(name, tensor, file, plan, pending, groups):
                yield item[0], item[1], item[2].name
    bar.close()
    if pending:  # unreachable while the header pass is right; kept as the pairing invariant's guard
        name, (_, file) = next(iter(pending.items()))
        raise CheckpointError(f"{file}: {name} never met its partner {plan.partner[name]}")
    if groups:  # likewise: the header pass found every member
        raise CheckpointError(f"int4 weight {next(iter(groups))} is incomplete")


def _items(name: str, tensor: torch.Tensor, file: Path, plan: _Plan, pending, groups):
    """What reading `name` lets the stream yield: a plain tensor at once, pair and group members once whole."""
    if name in plan.group_of:
        return _collect(name, tensor, file, plan, groups)
    if name in plan.partner:
        return _match(name, tensor, file, plan, pending)
    return [(canonical_name(name, plan.model_type), tensor, file)]


def _read_shard(file: Path, plan: _Plan, ranges=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `file` that are in `plan.read`, in the file's order; the others' data is never touched."""
    with _open(file) as f:
        for name in f.keys():
            if name in plan.read:
                yield name, _get_tensor(f, file, name, _block(f, name, plan, ranges))


def _block(handle, name: str, plan: _Plan, ranges) -> tuple[slice, ...] | None:
    """The block of a plain (unquantised) tensor the model stores, when it names one."""
    if ranges is None or name in plan.partner or name in plan.group_of:
        return None
    return ranges(canonical_name(name, plan.model_type), tuple(handle.get_slice(name).get_shape()))


def _get_tensor(handle, file: Path, name: str, block: tuple[slice, ...] | None = None) -> torch.Tensor:
    try:
        if block is None:
            return handle.get_tensor(name)
        part = handle.get_slice(name)
        tensor = part[block]
        tensor.checkpoint_shape = tuple(part.get_shape())  # a block of this full tensor: never cut again
        return tensor
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{file}: tensor {name} cannot be read ({e})") from e


def _match(name: str, tensor: torch.Tensor, file: Path, plan: _Plan,
           pending: dict[str, tuple[torch.Tensor, Path]]) -> list[tuple[str, torch.Tensor, Path]]:
    """Buffer the first half of a (weight, scale) pair (nothing to yield); on the second, the items to yield
    under canonical names: [(weight, float32 weight, file)], or for a kept weight [(weight, raw weight, its
    file), (its kept scale name, raw scale, the scale's file)]."""
    partner = plan.partner[name]
    if partner not in pending:
        pending[name] = (tensor, file)
        return []
    other, other_file = pending.pop(partner)
    if name in plan.weights:
        return _pair_items(name, tensor, file, partner, other, other_file, plan)
    return _pair_items(partner, other, other_file, name, tensor, file, plan)


def _pair_items(weight_name: str, weight: torch.Tensor, weight_file: Path, scale_name: str, scale: torch.Tensor,
                scale_file: Path, plan: _Plan) -> list[tuple[str, torch.Tensor, Path]]:
    canon = canonical_name(weight_name, plan.model_type)
    if plan.keep is None or not plan.keep(canon):
        return [(canon, _dequantize(weight_name, weight, scale_name, scale, plan.block, weight_file), weight_file)]
    _check_kept(weight_name, weight, scale_name, scale, plan.block, weight_file)
    return [(canon, weight, weight_file), (kept_scale_name(canon), scale, scale_file)]


def kept_scale_shape(shape: tuple[int, int], dtype: torch.dtype, block_size: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a stored 2-D quantised weight: FP8 [ceil(out/bo), ceil(in/bi)]; packed FP4 [out, in/2]
    (two codes a byte) has one scale per FP4_GROUP unpacked inputs, [out, ceil(2 * (in/2) / 32)]."""
    rows, cols = shape
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return math.ceil(rows / block_size[0]), math.ceil(cols / block_size[1])
    return rows, math.ceil(2 * cols / FP4_GROUP)


def _check_kept(weight_name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor,
                block_size: tuple[int, int], file: Path) -> None:
    """The checks dequantisation makes (2-D weight, scale grid, finite scales), without dequantising."""
    grid = kept_scale_shape(tuple(weight.shape), weight.dtype, block_size) if weight.dim() == 2 else None
    if grid is None:
        problem = f"quantised weight must be 2-D, got shape {tuple(weight.shape)}"
    elif tuple(scale.shape) != grid:
        problem = (f"scale shape {tuple(scale.shape)} does not match weight shape {tuple(weight.shape)} "
                   f"({weight.dtype}, FP8 block {block_size}, FP4 group {FP4_GROUP}): expected {grid}")
    elif not torch.isfinite(scale_to_float(scale)).all():
        problem = "scale has non-finite entries"
    else:
        return
    raise CheckpointError(f"{file}: {weight_name} with {scale_name}: {problem}")


def _dequantize(weight_name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor,
                block_size: tuple[int, int], file: Path) -> torch.Tensor:
    try:
        if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return dequantize_fp8_block(weight, scale, block_size)
        return dequantize_fp4(weight, scale)
    except ValueError as e:
        raise CheckpointError(f"{file}: {weight_name} with {scale_name}: {e}") from e
