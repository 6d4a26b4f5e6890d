"""Where an AWQ input scale folds exactly, and folding it into a loaded model in place.

A `Fold` is one input x shared by some weights (the consumers, each [..., in], multiplied by s along their
last dim) and one producer that divides x by s: an RMSNorm's weight (x = norm(h) * weight) or the up
projection's rows of a swiglu MLP (x = silu(gate) * up). The model computes the same function afterwards, in
exact arithmetic, when the consumers listed are all of x's readers; `verified_folds` checks that on the model
and drops every fold kind that changes its output.

Fold tables by family (module paths relative to a layer, checked against the model; absent ones skipped):
  V2 / V3 / V3.2: input_layernorm -> q_a_proj (q_proj), kv_a_proj_with_mqa (and V3.2's indexer wk, weights_proj);
    q_a_layernorm -> q_b_proj (and the indexer's wq_b);
    kv_a_layernorm -> kv_b_proj (absorbed attention reads the cached latent only through kv_b's weight);
    post_attention_layernorm -> router, routed experts' gate/up, shared experts' / dense MLP's gate/up.
  V4: attn_norm -> wq_a, wkv, the compressors' wkv / wgate, the indexer's weights_proj; q_norm -> wq_b and the
    indexer's wq_b; ffn_norm -> router, routed experts' w1/w3, shared expert's w1/w3.
  Up -> down: each MLP / shared expert / routed expert (exact without a swiglu clamp; with V4's clamp only while
    the clamp is not reached, which the verification decides).
  Value -> output: V3's kv_b_proj value rows -> o_proj (attention mixes values linearly, per channel); V4's
    wo_a rows -> wo_b (the grouped wo_a's output feeds wo_b only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.distributed.model_parallel import ParallelExperts

_V3_NORMS = {
    "input_layernorm": ("self_attn.q_a_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa",
                        "self_attn.indexer.wk", "self_attn.indexer.weights_proj"),  # V3.2's DSA indexer reads it too
    "self_attn.q_a_layernorm": ("self_attn.q_b_proj", "self_attn.indexer.wq_b"),
    "self_attn.kv_a_layernorm": ("self_attn.kv_b_proj",),
    "post_attention_layernorm": ("mlp.gate", "mlp.experts", "mlp.shared_experts.gate_proj",
                                 "mlp.shared_experts.up_proj", "mlp.gate_proj", "mlp.up_proj"),
}
_V4_NORMS = {
    "attn_norm": ("attn.wq_a", "attn.wkv", "attn.compressor.wkv", "attn.compressor.wgate",
                  "attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate", "attn.indexer.weights_proj"),
    "attn.q_norm": ("attn.wq_b", "attn.indexer.wq_b"),
    "ffn_norm": ("ffn.gate", "ffn.experts", "ffn.shared_experts.w1", "ffn.shared_experts.w3"),
}
_UP_DOWN = (("mlp.up_proj", "mlp.down_proj"), ("mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"),
            ("ffn.shared_experts.w3", "ffn.shared_experts.w2"))


@dataclass
class Fold:
    kind: str  # the table entry, e.g. "input_layernorm" (verification drops whole kinds)
    divide: torch.Tensor  # producer view: [in] (norm weight) or [in, D] (up rows), divided by s along dim 0
    consumers: list[torch.Tensor]  # parameter views [..., in], multiplied by s along the last dim
    searched: list[torch.Tensor]  # the consumers that will be quantised, [rows, in] each (the search's loss)
    inputs: str  # module path whose recorded inputs are x (a consumer nn.Linear), or "experts:<path>:<e>"
    names: list[str]  # parameter names the fold changes (the writer copies them from the model)
    lead: int = 1  # leading dims of `divide` that s (flattened) spans: 2 for V3's [heads, v, latent] value rows

    def apply(self, s: torch.Tensor) -> None:
        """Fold s in, keeping the previous values for `undo` (bit-exact restore)."""
        self._saved = [t.detach().clone() for t in (self.divide, *self.consumers)]
        with torch.no_grad():
            shape = (*self.divide.shape[: self.lead], *[1] * (self.divide.dim() - self.lead))
            self.divide.div_(s.view(shape).to(self.divide.dtype))
            for w in self.consumers:
                w.mul_(s.to(w.dtype))

    def undo(self) -> None:
        with torch.no_grad():
            for t, saved in zip((self.divide, *self.consumers), self._saved):
                t.copy_(saved)
        self.forget()

    def forget(self) -> None:
        self._saved = []


def _layers(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if p.removeprefix("model.").count(".") == 1
            and p.removeprefix("model.").startswith("layers.")]


def _param(model: nn.Module, path: str) -> tuple[str, torch.Tensor] | None:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    weight = getattr(module, "w13", None) if isinstance(module, ParallelExperts) else getattr(module, "weight", None)
    return None if weight is None else (f"{path}.w13" if isinstance(module, ParallelExperts) else f"{path}.weight",
                                        weight)


def norm_folds(model: nn.Module, v4: bool) -> list[Fold]:
    folds = []
    for layer in _layers(model):
        for norm, readers in (_V4_NORMS if v4 else _V3_NORMS).items():
            fold = _norm_fold(model, layer, norm, readers)
            if fold is not None:
                folds.append(fold)
    return folds


def _norm_fold(model: nn.Module, layer: str, norm: str, readers: tuple[str, ...]) -> Fold | None:
    producer = _param(model, f"{layer}.{norm}")
    found = [(r, p) for r in readers if (p := _param(model, f"{layer}.{r}")) is not None]
    linear = [r for r, _ in found if type(model.get_submodule(f"{layer}.{r}")) is nn.Linear]
    if producer is None or not linear:
        return None
    searched = [p[1].reshape(-1, p[1].shape[-1]) for r, p in found if r.rpartition(".")[2] != "gate"]  # routers
    names = [producer[0], *(p[0] for _, p in found)]
    return Fold(norm, producer[1], [p[1] for _, p in found], searched, f"{layer}.{linear[0]}", names)


def up_down_folds(model: nn.Module) -> list[Fold]:
    """Dense MLP / shared expert pairs, then every routed expert's (w13's up rows -> w2)."""
    folds = []
    for layer in _layers(model):
        for up, down in _UP_DOWN:
            u, d = _param(model, f"{layer}.{up}"), _param(model, f"{layer}.{down}")
            if u is not None and d is not None:
                folds.append(Fold("up->down", u[1], [d[1]], [d[1]], f"{layer}.{down}", [u[0], d[0]]))
        folds += _expert_folds(model, layer)
    return folds


def output_folds(model: nn.Module) -> list[Fold]:
    folds = []
    for layer in _layers(model):
        v3 = _param(model, f"{layer}.self_attn.kv_b_proj")
        if v3 is not None and (o := _param(model, f"{layer}.self_attn.o_proj")) is not None:
            attn = model.get_submodule(f"{layer}.self_attn")
            values = v3[1].view(attn.heads, attn.nope + attn.v_dim, -1)[:, attn.nope:]
            folds.append(Fold("v->o", values, [o[1]], [o[1]], f"{layer}.self_attn.o_proj", [v3[0], o[0]], lead=2))
        wo_a, wo_b = _param(model, f"{layer}.attn.wo_a"), _param(model, f"{layer}.attn.wo_b")
        if wo_a is not None and wo_b is not None:
            folds.append(Fold("wo_a->wo_b", wo_a[1], [wo_b[1]], [wo_b[1]], f"{layer}.attn.wo_b", [wo_a[0], wo_b[0]]))
    return folds


def _expert_folds(model: nn.Module, layer: str) -> list[Fold]:
    folds = []
    for path, experts in model.get_submodule(layer).named_modules(prefix=layer):
        if isinstance(experts, ParallelExperts):
            inter = experts.w13.shape[1] // 2
            folds += [Fold("up->down", experts.w13[e, inter:], [experts.w2[e]], [experts.w2[e]],
                           f"experts:{path}:{e}", [f"{path}.w13", f"{path}.w2"]) for e in range(experts.num_experts)]
    return folds


def fold_inputs(fold: Fold, model: nn.Module, acts) -> torch.Tensor | None:
    """x of `fold` from the first calibration pass: a linear's recorded inputs, or an expert's swiglu input."""
    if not fold.inputs.startswith("experts:"):
        return acts.linear_inputs(fold.inputs)
    _, path, e = fold.inputs.split(":")
    experts, e = model.get_submodule(path), int(e)
    x = acts.experts.get(path, [None] * (e + 1))[e]
    if x is None or not len(x):
        return None
    from deepinfer.layers.moe import swiglu

    return swiglu(x @ experts.w13[e].detach().float().t(), experts.limit)


def foldable(fold: Fold, model: nn.Module, group: int) -> bool:
    """The searched weights split into groups, and stacked experts it touches are quantised whole (the writer
    writes them only as int4 targets, per expert)."""
    if fold.consumers[0].shape[-1] % group:
        return False
    stacked = {n.rpartition(".")[0] for n in fold.names if n.endswith((".w13", ".w2"))}
    return all(_whole(model.get_submodule(path), group) for path in stacked)


def _whole(experts: ParallelExperts, group: int) -> bool:
    inter, dim = experts.w13.shape[1] // 2, experts.w13.shape[2]
    return dim % group == 0 and inter % group == 0 and inter % 8 == 0 and dim % 8 == 0
