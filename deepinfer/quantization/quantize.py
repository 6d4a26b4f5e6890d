"""`deepinfer quantize`: calibrate a float (or FP8 / FP4) DeepSeek checkpoint and write it as an AWQ int4 one.

Steps (each with a progress bar):
  1. load the model in float32 (eager) and run the calibration text through it, recording every linear's and
     every routed expert's inputs (calibrate.py);
  2. AWQ (method "awq"): for every place where an input-channel scale folds exactly into the producer of the
     input (folds.py: RMSNorm weights into the projections they feed, V3's value rows into o_proj, V4's wo_a into
     wo_b, up into down projections), search the scale on the first pass's inputs (awq.search_scale) and fold
     it; a kind of fold is kept only when the model's hidden states on four calibration windows stay unchanged,
     so a reader the table missed cannot be broken (V4's swiglu clamp does not commute with a scale: its
     up -> down folds are dropped whenever the clamp is reached). Then record the inputs
     again and run the clipping search (awq.search_clip) for every weight with recorded inputs. Method "rtn":
     round to nearest, no calibration;
  3. write the checkpoint: each quantised `X.weight` becomes `X.qweight`, `X.qzeros`, `X.scales` (AWQ GEMM
     layout, int4.awq_tensors), folded float tensors (norm weights, routers) come from the model, every other
     tensor is copied under its canonical name, config.json gets `quantization_config`, the other files of the
     checkpoint directory are copied, and quantization_report.json says what was done.

What is quantised: the 2-D weights of the main layers' nn.Linear modules and of the routed experts whose input
size is a multiple of the group size and output size a multiple of 8. Embeddings, the LM head, norms, routers,
mHC and MTP layers stay as they are (AutoAWQ's choice too). Weights the forward reads directly (no recorded
inputs: V4's grouped wo_a) are rounded to nearest; the report lists them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from deepinfer.config import ModelConfig
from deepinfer.distributed.model_parallel import ParallelExperts
from deepinfer.layers.moe import swiglu
from deepinfer.models.loader import INDEX_FILE, SINGLE_FILE, iter_checkpoint, quantized_weights
from deepinfer.models.quantized import V3_EXPERT_LEAVES, V4_EXPERT_LEAVES
from deepinfer.quantization import folds
from deepinfer.quantization.awq import SearchGrid, awq_quantize, output_error, search_scale
from deepinfer.quantization.calibrate import Activations, capture
from deepinfer.quantization.int4 import Int4Weight, awq_tensors, quantize_int4
from deepinfer.quantization.spec import PACK, Int4Spec

logger = logging.getLogger("deepinfer")
METHODS = ("awq", "rtn")
REPORT_FILE = "quantization_report.json"
FOLD_TOLERANCE = 1e-4  # per token, relative to its hidden state's norm: an exact fold changes it by rounding only
_COPIED_SKIP = {SINGLE_FILE, INDEX_FILE, "config.json", REPORT_FILE}


@dataclass
class Target:
    """One weight to quantise: its checkpoint stem (X of X.weight), float32 [out, in], recorded inputs [n, in]."""

    stem: str
    weight: torch.Tensor
    inputs: torch.Tensor | None
    search: str = "rtn"  # what was done: "rtn" | "clip" (a folded input scale shows in the report's folds)


def quantizable(weight: torch.Tensor, group: int) -> bool:
    return weight.dim() == 2 and weight.shape[1] % group == 0 and weight.shape[0] % PACK == 0


def _main_layer(path: str, cfg: ModelConfig) -> bool:
    parts = path.removeprefix("model.").split(".")
    return parts[0] == "layers" and int(parts[1]) < cfg.num_layers


def linear_targets(model: nn.Module, acts: Activations, cfg: ModelConfig, group: int) -> dict[str, Target]:
    found = {}
    for path, module in model.named_modules():
        if type(module) is nn.Linear and _main_layer(path, cfg) and quantizable(module.weight, group):
            found[path] = Target(path, module.weight.detach().float().clone(), acts.linear_inputs(path))
    return found


def expert_targets(model: nn.Module, acts: Activations, cfg: ModelConfig, group: int) -> dict[str, Target]:
    """Per-expert targets named as the checkpoint names them (V3: gate/up/down_proj, V4: w1/w3/w2)."""
    gate, up, down = V4_EXPERT_LEAVES if cfg.is_v4 else V3_EXPERT_LEAVES
    found = {}
    for path, experts in model.named_modules():
        if not isinstance(experts, ParallelExperts) or not _main_layer(path, cfg):
            continue
        inter = experts.w13.shape[1] // 2
        for e in range(experts.num_experts):
            x = acts.experts.get(path, [None] * experts.num_experts)[e]
            w13, w2 = experts.w13[e].detach().float(), experts.w2[e].detach().float()
            h = None if x is None or not len(x) else swiglu(x @ w13.t(), experts.limit)
            for leaf, w, inputs in ((gate, w13[:inter], x), (up, w13[inter:], x), (down, w2, h)):
                if quantizable(w, group):
                    found[f"{path}.{e}.{leaf}"] = Target(f"{path}.{e}.{leaf}", w.clone(), inputs)
    return found


def _head_input(model: nn.Module, run) -> torch.Tensor:
    """The hidden states entering the LM head during `run()` (what a fold must leave unchanged)."""
    head = getattr(model, "lm_head", None) or model.head
    seen = []
    handle = head.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().float().cpu()))
    try:
        run()
    finally:
        handle.remove()
    return torch.cat(seen)


def apply_folds(model: nn.Module, acts: Activations, cfg: ModelConfig, group: int, grid: SearchGrid,
                check, progress: bool = True) -> tuple[set[str], dict[str, int]]:
    """Search every fold's scale on the first pass's inputs, then fold kind by kind, keeping a kind only when the
    model's hidden states on `check()` stay within FOLD_TOLERANCE of before (every token, relative to its norm). Returns
    the parameter names changed and the folds kept per kind."""
    searched = _searched_folds(model, acts, cfg, group, grid, progress)
    before, changed, kept = _head_input(model, check), set(), {}
    for kind in dict.fromkeys(f.kind for f, _ in searched):
        of_kind = [(f, s) for f, s in searched if f.kind == kind]
        if _fold_exactly(model, of_kind, before, check):
            kept[kind] = len(of_kind)
            changed |= {n for f, _ in of_kind for n in f.names}
    return changed, kept


def _searched_folds(model: nn.Module, acts: Activations, cfg: ModelConfig, group: int, grid: SearchGrid,
                    progress: bool) -> list[tuple[folds.Fold, torch.Tensor]]:
    candidates = folds.norm_folds(model, cfg.is_v4) + folds.output_folds(model) + folds.up_down_folds(model)
    searched = []
    for fold in tqdm(candidates, desc="AWQ scale search", unit="fold", disable=not progress):
        x = folds.fold_inputs(fold, model, acts)
        if x is not None and len(x) and folds.foldable(fold, model, group):
            weights = torch.cat([w.detach().float() for w in fold.searched])
            searched.append((fold, search_scale(weights, x, group, grid)))
    return searched


def _fold_exactly(model: nn.Module, of_kind: list, before: torch.Tensor, check) -> bool:
    """Apply the folds; undo them (False) when some token's hidden state moves by more than FOLD_TOLERANCE."""
    for f, s in of_kind:
        f.apply(s)
    after = _head_input(model, check)
    change = float(((after - before).norm(dim=-1) / before.norm(dim=-1).clamp_min(1e-30)).max())
    exact = change <= FOLD_TOLERANCE
    for f, _ in of_kind:
        f.forget() if exact else f.undo()
    if not exact:
        logger.warning("AWQ: folding the %d %s scales changes the model's hidden states by %.2g (relative, per "
                       "token); not folded there", len(of_kind), of_kind[0][0].kind, change)
    return exact


def quantize_targets(targets: dict[str, Target], method: str, group: int, grid: SearchGrid,
                     progress: bool = True) -> dict[str, Int4Weight]:
    out = {}
    for stem, t in tqdm(targets.items(), desc=f"Quantising ({method})", unit="weight", disable=not progress):
        searched = method == "awq" and t.inputs is not None and len(t.inputs) > 0
        out[stem] = awq_quantize(t.weight, t.inputs, group, grid) if searched else quantize_int4(t.weight, group)
        t.search = "clip" if searched else "rtn"
    return out


def calibration_windows(text: str, tokenizer, samples: int, length: int) -> list[list[int]]:
    """Up to `samples` consecutive windows of `length` tokens of the text (ValueError when it has none)."""
    ids = tokenizer.encode(text)
    windows = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)][:samples]
    if not windows:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than one window of {length}")
    return windows


# --- writing -----------------------------------------------------------------------------------------------
class _ShardWriter:
    """Safetensors shards of at most `limit` bytes (one `model.safetensors` when everything fits in one)."""

    def __init__(self, out: Path, limit: int):
        self.out, self.limit, self.shards, self.current, self.size = out, limit, [], {}, 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.limit:
            self._flush()
        self.current[name], self.size = tensor.contiguous(), self.size + nbytes

    def _flush(self) -> None:
        path = self.out / f"shard-{len(self.shards):05d}.safetensors"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.current)))
        self.current, self.size = {}, 0

    def close(self) -> None:
        self._flush()
        if len(self.shards) == 1:
            self.shards[0][0].rename(self.out / SINGLE_FILE)
            return
        count, weight_map = len(self.shards), {}
        for i, (path, names) in enumerate(self.shards):
            final = self.out / f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            path.rename(final)
            weight_map.update({n: final.name for n in names})
        (self.out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def write_checkpoint(src: Path, out: Path, cfg: ModelConfig, quantized: dict[str, Int4Weight], spec: Int4Spec,
                     overrides: dict[str, torch.Tensor] | None = None, shard_bytes: int = 4 << 30,
                     progress: bool = True) -> None:
    """`src`'s tensors under canonical names with each quantised `X.weight` replaced by its AWQ triple and each
    `overrides` name by that tensor (in the checkpoint tensor's dtype), config.json with `spec`'s
    quantization_config, and the directory's other files (tokenizer, templates, drafts) copied."""
    overrides = overrides or {}
    out.mkdir(parents=True, exist_ok=True)
    writer, replaced = _ShardWriter(out, shard_bytes), set()
    stored = _float_dtype(cfg)
    source_quantized = set(quantized_weights(src, cfg.model_type))  # FP8 / FP4 in the source: written in `stored`
    for name, tensor, _ in iter_checkpoint(src, cfg.model_type, cfg.weight_block_size, progress=progress):
        stem = name.removesuffix(".weight")
        tensor = tensor.to(stored) if name in source_quantized else tensor
        if stem in quantized:
            replaced.add(stem)
            for leaf, part in awq_tensors(quantized[stem]).items():
                writer.add(f"{stem}.{leaf}", part)
        else:
            writer.add(name, overrides[name].to(tensor.dtype) if name in overrides else tensor)
            replaced.add(name)
    missing = (set(quantized) | set(overrides)) - replaced
    if missing:
        raise ValueError(f"{src}: no checkpoint tensor for {min(missing)}, a weight quantize changed")
    writer.close()
    _write_config(src, out, spec)
    _copy_rest(src, out)


def _float_dtype(cfg: ModelConfig) -> torch.dtype:
    """The checkpoint's own float dtype (config torch_dtype), for weights it stored FP8 / FP4 that stay float."""
    dtype = getattr(torch, cfg.hf_dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2 \
        else torch.bfloat16


def _write_config(src: Path, out: Path, spec: Int4Spec) -> None:
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = spec.to_config()
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def _copy_rest(src: Path, out: Path) -> None:
    for item in src.iterdir():
        if item.name in _COPIED_SKIP or item.suffix == ".safetensors":
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, out / item.name)


# --- the command ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "awq"
    group_size: int = 128
    calib: Path | None = None  # a local text file (required for awq)
    calib_samples: int = 32  # windows of calib_seq_len tokens
    calib_seq_len: int = 256
    grid: SearchGrid = SearchGrid()
    progress: bool = True


def _check(src: Path, cfg: ModelConfig, opts: QuantizeOptions) -> None:
    if opts.method not in METHODS:
        raise ValueError(f"--method {opts.method!r}: choose one of {', '.join(METHODS)}")
    if opts.method == "awq" and opts.calib is None:
        raise ValueError("--method awq needs calibration text: --calib FILE (a local UTF-8 text file)")
    if opts.calib is not None and not Path(opts.calib).is_file():
        raise ValueError(f"--calib {opts.calib}: no such file")
    if cfg.quantization is not None:
        raise ValueError(f"{src} is already a {cfg.quantization.method} int4 checkpoint")
    if cfg.is_v41:
        raise ValueError("AWQ quantisation of deepseek_v41 is not supported (its checkpoints ship FP8 / FP4)")
    if opts.group_size <= 0 or opts.group_size % PACK:
        raise ValueError(f"--group-size {opts.group_size}: need a positive multiple of {PACK}")
    if opts.calib_samples < 1 or opts.calib_seq_len < 2:
        raise ValueError(f"--calib-samples {opts.calib_samples} / --calib-seq-len {opts.calib_seq_len}: need at "
                         "least one window of at least 2 tokens")


def _check_out(src: Path, out: Path) -> None:
    if out.resolve() == src.resolve():
        raise ValueError(f"--out {out} is the source checkpoint; write to a new directory")
    if out.exists() and (any(out.glob("*.safetensors")) or (out / "config.json").exists()):
        raise ValueError(f"--out {out} already holds a checkpoint; choose a new or empty directory")


def quantize(src: str | Path, out: str | Path, opts: QuantizeOptions = QuantizeOptions()) -> dict:
    """Quantise the checkpoint at `src` into `out` (see the module docstring); returns the report it writes."""

    src, out, start = Path(src), Path(out), time.perf_counter()
    cfg = ModelConfig.from_hf(src)
    _check(src, cfg, opts)
    _check_out(src, out)
    llm = _float_engine(src)
    try:
        found = _calibrated_targets(llm, cfg, opts)
    finally:
        llm.shutdown()
    quantized = quantize_targets(found.targets, opts.method, opts.group_size, opts.grid, opts.progress)
    spec = Int4Spec("awq", opts.group_size, modules_to_not_convert=found.float_modules)
    write_checkpoint(src, out, cfg, quantized, spec, found.overrides, progress=opts.progress)
    report = _report(src, found, quantized, opts, time.perf_counter() - start)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return report


@dataclass
class _Found:
    targets: dict[str, Target]
    overrides: dict[str, torch.Tensor]
    windows: int = 0
    folds: dict[str, int] | None = None  # folds kept per kind
    rtn_error: dict[str, float] | None = None  # round-to-nearest's calibration error of each weight, unfolded
    float_modules: tuple[str, ...] = ()  # linear layers left float (quantization_config.modules_to_not_convert)


def _calibrated_targets(llm, cfg: ModelConfig, opts: QuantizeOptions) -> _Found:
    """The weights to quantise from the (for AWQ: calibrated and folded) model, and the float tensors changed."""
    model, group = llm.engine.model, opts.group_size
    if opts.method != "awq":
        acts = Activations()
        targets = {**linear_targets(model, acts, cfg, group), **expert_targets(model, acts, cfg, group)}
        return _Found(targets, {}, float_modules=_float_modules(model, cfg, targets))
    text = Path(opts.calib).read_text(encoding="utf-8", errors="replace")
    windows = calibration_windows(text, llm._require_tokenizer(), opts.calib_samples, opts.calib_seq_len)
    run = _runner(llm, windows, opts.progress)
    acts = capture(model, run)
    plain = {**linear_targets(model, acts, cfg, group), **expert_targets(model, acts, cfg, group)}
    rtn = {s: calibration_error(t, quantize_int4(t.weight, group)) for s, t in plain.items()}
    del plain
    changed, kept = apply_folds(model, acts, cfg, group, opts.grid, _runner(llm, windows[:4]), opts.progress)
    if kept:
        acts = capture(model, run)  # the folded model's inputs (divided by the folded scales)
    targets = {**linear_targets(model, acts, cfg, group), **expert_targets(model, acts, cfg, group)}
    return _Found(targets, _overrides(model, changed, targets), len(windows), kept, rtn,
                  _float_modules(model, cfg, targets))


def _float_modules(model: nn.Module, cfg: ModelConfig, targets: dict[str, Target]) -> tuple[str, ...]:
    """What other readers must not expect int4 for: the main layers' linears left float, and the MTP layers."""
    left = [p for p, m in model.named_modules() if type(m) is nn.Linear and _main_layer(p, cfg) and p not in targets]
    mtp = ["mtp."] if cfg.is_v4 else [f"model.layers.{cfg.num_layers + k}." for k in range(cfg.num_mtp_layers)]
    return tuple(sorted(left) + mtp)


def _float_engine(src: Path):
    """The model with every weight dequantised to float32 (FP8 / FP4 sources too, whatever the environment says),
    eager, without prefix caching (every calibration token runs through every layer)."""
    from deepinfer.engine.core import KEEP_QUANTIZED_ENV
    from deepinfer.llm import LLM

    saved = os.environ.get(KEEP_QUANTIZED_ENV)
    os.environ[KEEP_QUANTIZED_ENV] = "0"
    try:
        return LLM(model=src, dtype="float32", enforce_eager=True, enable_prefix_caching=False)
    finally:
        if saved is None:
            os.environ.pop(KEEP_QUANTIZED_ENV)
        else:
            os.environ[KEEP_QUANTIZED_ENV] = saved


def _runner(llm, windows: list[list[int]], progress: bool = False):
    from deepinfer.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": w} for w in windows]
    return lambda: llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=progress)


def _overrides(model: nn.Module, changed: set[str], targets: dict[str, Target]) -> dict[str, torch.Tensor]:
    """The folded float parameters the writer takes from the model instead of the checkpoint: every changed
    name but the int4 targets' own weights and stacked experts (written per expert as targets)."""
    state = model.state_dict()
    return {n: state[n].detach().cpu() for n in changed
            if n.removesuffix(".weight") not in targets and not n.endswith((".w13", ".w2"))}


def _report(src: Path, found: _Found, quantized: dict[str, Int4Weight], opts: QuantizeOptions,
            seconds: float) -> dict:
    searches: dict[str, int] = {}
    for t in found.targets.values():
        searches[t.search] = searches.get(t.search, 0) + 1
    numel = sum(w.codes.numel() for w in quantized.values())
    packed = sum(w.nbytes() for w in quantized.values())
    return {"source": src.name, "method": opts.method, "group_size": opts.group_size,
            "calibration": {"windows": found.windows, "tokens_per_window": opts.calib_seq_len if found.windows else 0},
            "weights_quantized": len(quantized), "searches": searches, "scales_folded": found.folds or {},
            "calibration_error_vs_rtn": _error_ratios(found, quantized),
            "rtn_weights": sorted(s for s, t in found.targets.items() if t.search == "rtn") if found.windows else [],
            "quantized_bf16_bytes": 2 * numel, "quantized_int4_bytes": packed,
            "bf16_over_int4": round(2 * numel / max(packed, 1), 3), "seconds": round(seconds, 1)}


def _error_ratios(found: _Found, quantized: dict[str, Int4Weight]) -> dict:
    """AWQ's calibration output error over round-to-nearest's, per weight with recorded inputs (both on the
    function the unfolded weight computes: a folded weight sees the folded inputs)."""
    ratios = []
    for stem, rtn in (found.rtn_error or {}).items():
        awq = calibration_error(found.targets[stem], quantized[stem]) if stem in found.targets else math.nan
        if rtn > 0 and not math.isnan(awq):
            ratios.append(awq / rtn)
    if not ratios:
        return {}
    ratios.sort()
    return {"weights": len(ratios), "mean": round(sum(ratios) / len(ratios), 4),
            "median": round(ratios[len(ratios) // 2], 4), "max": round(ratios[-1], 4)}


def calibration_error(target: Target, quantized: Int4Weight) -> float:
    """Output MSE of the stored weight on the target's calibration inputs (nan without inputs)."""
    if target.inputs is None or not len(target.inputs):
        return float("nan")
    return output_error(target.weight, quantized.dequantize(), target.inputs)

