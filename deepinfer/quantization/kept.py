"""Keeping an AWQ checkpoint's int4 weights packed in memory after loading (one process).

`keep_int4(model, sink, leaves)` swaps, after `load_weights`, every bias-free nn.Linear whose checkpoint weight
was int4 (`sink`: canonical X.weight -> Int4Weight, filled by the loader's int4_sink) for an Int4Linear, and
stores a routed-expert layer packed (ParallelExperts.keep_int4) when all its E x 3 matrices were int4 with one
group size. The dequantised float weights the loader produced are dropped, so steady-state memory is the packed
one; while loading, the float weight of each layer exists too (peak: the float model plus the packed codes).

Invariants: a layer is swapped only if its forward reads the weight through the module (not `READ_AS_WEIGHT`:
V3's absorbed kv_b_proj and V4's grouped wo_a read `.weight` as a matrix, V3's MTP layers the LM head's); swapped
layers compute exactly what the dequantised layers computed (layers/int4_linear.py). V3's MTP layers are built
after loading from float tensors and stay dequantised.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.distributed.model_parallel import ParallelExperts
from deepinfer.layers.int4_linear import Int4Linear, group_params
from deepinfer.quantization.int4 import Int4Weight

READ_AS_WEIGHT = ("kv_b_proj", "attn.wo_a", "lm_head")  # lm_head: MTP layers read its weight


def keep_int4(model: nn.Module, sink: dict[str, Int4Weight], leaves: tuple[str, str, str]) -> int:
    """Swap the layers `sink` covers (see the module docstring); returns how many modules now hold int4."""
    swapped = 0
    for path, module in list(model.named_modules()):
        if type(module) is nn.Linear and f"{path}.weight" in sink and module.bias is None \
                and not path.endswith(READ_AS_WEIGHT):
            parent, _, attr = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, Int4Linear(sink[f"{path}.weight"], module.weight.device))
            swapped += 1
        elif isinstance(module, ParallelExperts):
            swapped += _keep_experts(module, path, sink, leaves)
    return swapped


def _keep_experts(experts: ParallelExperts, path: str, sink: dict[str, Int4Weight], leaves) -> int:
    found = [[sink.get(f"{path}.{e}.{leaf}.weight") for leaf in leaves] for e in range(experts.num_experts)]
    weights = [w for per in found for w in per]
    if None in weights or len({w.group for w in weights}) != 1:
        return 0  # partly int4 or mixed groups: stays dequantised
    w13 = _stacked([(g, u) for g, u, _ in found])
    w2 = _stacked([(d,) for _, _, d in found])
    experts.keep_int4(w13, w2, weights[0].group)
    return 1


def _stacked(per_expert: list[tuple[Int4Weight, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [E, N, K], params [E, N, G, 2]) of experts whose matrices (gate then up, or down) stack by rows."""
    codes = torch.stack([torch.cat([w.codes for w in parts]) for parts in per_expert])
    params = torch.stack([torch.cat([group_params(w.scales, w.zeros) for w in parts]) for parts in per_expert])
    return codes, params
