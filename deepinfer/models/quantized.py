"""Weights kept quantised in memory (the CUDA path): device memory for them equals the checkpoint's.

Dense projections whose checkpoint weight is FP8 block-scaled become ``FP8BlockLinear`` (same shape, fp8 weight +
float32 ``weight_scale_inv``); a MoE layer's routed experts whose checkpoint matrices are all FP8 (V3) or all
packed FP4 (V4) are stored quantised in ``ParallelExperts`` (``keep_quantized``), and ``layers.moe.routed_experts``
runs them through ``kernels.fused_moe`` on CUDA or its torch reference elsewhere.

Use (what the models' ``keep_quantized_weights`` and ``engine.core.load_model`` do)::

    kept = keep_quantized_modules(model, loader.quantized_weights(path, model_type), block, leaves)
    model.load_weights(iter_checkpoint(path, model_type, block, keep_quantized=kept.__contains__))

Invariants:
  * modules are swapped before any weight is copied, and only when every checkpoint weight the module stands for
    is quantised (one dense FP8 weight; all E x 3 expert matrices with the same QuantInfo), so a kept module
    receives raw checkpoint tensors only, and the names returned are exactly those the loader must keep raw;
  * module paths map to checkpoint names through ``name_of`` (identity for the main models);
  * ``excluded`` names module-path suffixes whose ``.weight`` the model's forward reads as a float matrix (V3's
    absorbed ``kv_b_proj``, V4's grouped ``wo_a``): they stay ``nn.Linear`` and their weights are dequantised;
  * one process only: a sharded model (TP / EP) is refused with a ValueError, nothing swapped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from torch import nn

from deepinfer.distributed.model_parallel import ModelParallel, ParallelExperts, quantized_expert_shapes
from deepinfer.layers.quant_linear import FP8BlockLinear
from deepinfer.models.loader import QuantInfo

logger = logging.getLogger("deepinfer")

V3_EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")  # checkpoint leaves of one expert: gate, up, down
V4_EXPERT_LEAVES = ("w1", "w3", "w2")


def _same(path: str) -> str:
    return path


def keep_quantized_modules(root: nn.Module, quantized: Mapping[str, QuantInfo], block: tuple[int, int],
                           expert_leaves: tuple[str, str, str], parallel: ModelParallel,
                           name_of: Callable[[str], str] = _same, excluded: tuple[str, ...] = ()) -> set[str]:
    """Swap `root`'s modules for quantised storage where the checkpoint (`quantized`: canonical weight name ->
    QuantInfo, loader.quantized_weights) allows; returns the checkpoint weight names now stored quantised."""
    if not parallel.is_single:
        raise ValueError("weights kept quantised need a single process: tensor / expert parallelism with "
                         "kept-quantised weights is not supported (load the checkpoint dequantised)")
    kept: set[str] = set()
    for path, module in list(root.named_modules()):
        if type(module) is nn.Linear and not (excluded and path.endswith(excluded)):
            name = f"{name_of(path)}.weight"
            kept |= _swap_linear(root, path, name, quantized.get(name), block)
        elif isinstance(module, ParallelExperts):
            kept |= _keep_experts(module, name_of(path), quantized, block, expert_leaves)
    return kept


def _swap_linear(root: nn.Module, path: str, name: str, info: QuantInfo | None, block: tuple[int, int]) -> set[str]:
    """Replace the bias-free nn.Linear at `path` (checkpoint weight `name`) by an FP8BlockLinear of its shape when
    that weight is FP8."""
    linear = root.get_submodule(path)
    if info is None or info.kind != "fp8" or linear.bias is not None:
        return set()
    layer = FP8BlockLinear(linear.in_features, linear.out_features, block, device=linear.weight.device,
                           weight_dtype=info.dtype)
    parent, _, attr = path.rpartition(".")
    setattr(root.get_submodule(parent), attr, layer)
    return {name}


def _keep_experts(experts: ParallelExperts, prefix: str, quantized: Mapping[str, QuantInfo],
                  block: tuple[int, int], leaves: tuple[str, str, str]) -> set[str]:
    """Store `experts` quantised when all its checkpoint matrices (`<prefix>.<e>.<leaf>.weight`) are, alike."""
    names = {f"{prefix}.{e}.{leaf}.weight" for e in range(experts.num_experts) for leaf in leaves}
    infos = {quantized.get(name) for name in names}
    if len(infos) != 1 or None in infos:
        return set()  # unquantised or mixed: loaded dequantised, as without keeping
    info = infos.pop()
    _, two_i, dim = experts.w13.shape
    if quantized_expert_shapes(info.kind, experts.num_experts, two_i // 2, dim, block) is None:
        logger.warning("%s: %s experts (intermediate %d, hidden %d) do not stack with block %s; loading them "
                       "dequantised", prefix, info.kind, two_i // 2, dim, tuple(block))
        return set()
    experts.keep_quantized(info.kind, block, info.dtype, info.scale_dtype)
    return names
