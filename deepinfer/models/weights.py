"""Copy checkpoint tensors into a model's parameters, stacking per-expert tensors.

Sharded models (tensor / expert parallelism): a parameter may carry ``load_shard``, a function from the full
checkpoint tensor to the slice this rank stores; a stacked expert module may define ``local_index(expert)``
(None: another rank holds it, the tensor is skipped) and ``shard_weight(tensor, half)``. So a rank copies only
its own slices, one checkpoint tensor at a time. ``wanted_names(model)`` tells the loader, before it reads
anything, which per-expert tensors the rank skips, so those are never read from disk nor dequantised.

Kept-quantised experts (models/quantized.py): a per-expert scale ``<prefix>.experts.N.<leaf>.weight_scale_inv``
goes into the stacked ``w13_scale`` / ``w2_scale`` exactly as its weight goes into ``w13`` / ``w2``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

# Per-expert checkpoint leaves -> (stacked parameter, which half of w13 or None for w2).
EXPERT_LEAVES = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None),
                 "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<idx>\d+)\.(?P<leaf>\w+)\.weight$")
_EXPERT_SCALE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<idx>\d+)\.(?P<leaf>\w+)\.weight_scale_inv$")
_STACKED = (".w13", ".w2", ".w13_scale", ".w2_scale")  # stacked expert tensors, filled expert by expert


def wanted_names(model: nn.Module) -> Callable[[str], bool]:
    """The `iter_checkpoint(wanted=...)` predicate for `model`: False only for a per-expert tensor
    (`<prefix>.experts.N.<leaf>.weight`) whose module at `<prefix>.experts` defines `local_index` and returns
    None for N (another rank holds expert N). Every other name, unknown ones included, is wanted, so the
    model's own loading still sees and rejects unknown names. Without such modules everything is wanted."""
    owners = {name: m for name, m in model.named_modules() if hasattr(m, "local_index")}

    def wanted(name: str) -> bool:
        m = _EXPERT.match(name)
        owner = owners.get(m["prefix"]) if m and m["leaf"] in EXPERT_LEAVES else None
        if owner is None or not _in_range(owner, int(m["idx"])):
            return True  # not a sharded expert's tensor; an out-of-range expert is left to loading to reject
        return owner.local_index(int(m["idx"])) is not None

    return wanted


def _in_range(module: nn.Module, expert: int) -> bool:
    """Whether a sharded expert module's layer has global expert `expert` (unknown count: assume yes)."""
    return expert < getattr(module, "num_experts", expert + 1)


def tensor_ranges(model: nn.Module):
    """For iter_checkpoint(ranges=...): the block to read of a checkpoint tensor whose parameter stores one
    contiguous block of it along one dimension (a TP split: load_shard), or None (read it whole)."""
    params = dict(model.named_parameters())

    def ranges(name: str, full_shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        shard = getattr(params.get(name), "load_shard", None)
        return None if shard is None else contiguous_block(shard, full_shape)
    return ranges


def contiguous_block(shard, full_shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The slices `shard` cuts from a tensor of `full_shape`, when that is one contiguous block along one dim.

    Probed with an index vector along each dim in turn (other dims of size 1, so nothing full-size is made): a
    shard that cuts along another dim fails on it or keeps it whole."""
    for dim, size in enumerate(full_shape):
        probe = torch.arange(size).view([size if d == dim else 1 for d in range(len(full_shape))])
        try:
            picked = shard(probe).reshape(-1)
        except (ValueError, RuntimeError, IndexError):
            continue
        if picked.numel() == size:
            continue
        start = int(picked[0]) if picked.numel() else 0
        if not torch.equal(picked, torch.arange(start, start + picked.numel())):
            return None
        return tuple(slice(start, start + picked.numel()) if d == dim else slice(None) for d in range(len(full_shape)))
    return None


def _checkpoint_error(message: str) -> Exception:
    from deepinfer.models.loader import CheckpointError

    return CheckpointError(message)


def _target(model: nn.Module, params: dict[str, torch.Tensor], name: str,
            tensor: torch.Tensor) -> tuple[str, torch.Tensor, tuple, torch.Tensor | None]:
    """(parameter name, parameter, index into it, the tensor as this rank stores it or None to skip it) for a
    checkpoint tensor."""
    scale = _EXPERT_SCALE.match(name)
    m = scale or _EXPERT.match(name)
    if m and m["leaf"] in EXPERT_LEAVES:
        stacked, half = EXPERT_LEAVES[m["leaf"]]
        pname = f"{m['prefix']}.{stacked}{'_scale' if scale else ''}"
        if pname in params:
            return _expert_target(model.get_submodule(m["prefix"]), pname, params[pname], int(m["idx"]), half,
                                  tensor)
    if name in params:
        param = params[name]
        shard = getattr(param, "load_shard", None)
        cut = shard is None or hasattr(tensor, "checkpoint_shape")  # the loader read only the block
        return name, param, (), tensor if cut else shard(tensor)
    raise KeyError(name)


def _expert_target(module: nn.Module, pname: str, param: torch.Tensor, expert: int, half: int | None,
                   tensor: torch.Tensor):
    sharded = hasattr(module, "local_index")
    if not (_in_range(module, expert) if sharded else expert < param.shape[0]):
        raise KeyError(f"{pname}[{expert}]")  # an expert the layer does not have: an unknown tensor
    if sharded:
        local = module.local_index(expert)
        if local is None:
            return pname, param, (), None
        expert, tensor = local, module.shard_weight(tensor, half)
    if half is None:
        return pname, param, (expert,), tensor
    inter = param.shape[1] // 2
    return pname, param, (expert, slice(half * inter, (half + 1) * inter)), tensor


def assign_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor, str]],
                   optional_prefixes: tuple[str, ...] = ()) -> set[str]:
    """Copy every tensor into the model; unknown names, bad shapes and missing tensors raise.

    The parameters under an optional prefix may be absent all together (then they keep their values),
    but not in part. Returns the optional prefixes that were loaded.
    """
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    filled = _copy_all(model, params, weights)
    absent = tuple(p for p in optional_prefixes if not any(n.startswith(p) for n in filled))
    _check_complete(model, {n: p for n, p in params.items() if not n.startswith(absent)}, filled)
    return set(optional_prefixes) - set(absent)


def _copy_all(model: nn.Module, params: dict, weights: Iterable[tuple[str, torch.Tensor, str]]) -> dict[str, int]:
    """Copy each tensor into its parameter; returns how many tensors went into each parameter."""
    filled: dict[str, int] = {}
    with torch.no_grad():
        for name, tensor, source in weights:
            try:
                pname, param, index, tensor = _target(model, params, name, tensor)
            except KeyError:
                raise _checkpoint_error(f"{source}: unknown tensor {name!r} for {type(model).__name__}") from None
            if tensor is None:  # another rank's expert
                filled.setdefault(pname, 0)
                continue
            dst = param[index] if index else param
            if tuple(dst.shape) != tuple(tensor.shape):
                raise _checkpoint_error(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                        f"expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(dst.dtype))
            filled[pname] = filled.get(pname, 0) + 1
    return filled


def _check_complete(model: nn.Module, params: dict, filled: dict[str, int]) -> None:
    missing = [n for n, p in params.items() if n not in filled and p.numel()]  # empty: e.g. a rank without experts
    partial = [n for n, p in params.items() if n.endswith(_STACKED) and n in filled
               and filled[n] < p.shape[0] * (2 if n.endswith((".w13", ".w13_scale")) else 1)]
    if missing or partial:
        shown = ", ".join((missing + partial)[:5])
        raise _checkpoint_error(f"checkpoint is missing {len(missing) + len(partial)} tensor(s) for "
                                f"{type(model).__name__}: {shown}{' ...' if len(missing) + len(partial) > 5 else ''}")
