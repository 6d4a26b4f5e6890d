"""Expert selection for the DeepSeek-V2/V3 routers (float32 throughout).

noaux_tc (V3): sigmoid scores; selection uses scores + e_score_correction_bias, limited to the
  topk_group groups with the largest sum of their top-2 biased scores; weights are the unbiased
  scores of the chosen experts, renormalised when norm_topk_prob, then times routed_scaling_factor.
group_limited_greedy (V2): softmax scores, groups ranked by their best expert, no bias.
greedy (V2-Lite): plain top-k of the softmax scores.
V2 weights are either renormalised (norm_topk_prob and top_k > 1) or scaled, never both, as in
DeepSeek's V2 gate; every published V2 checkpoint has norm_topk_prob false (scaled only).
"""

from __future__ import annotations

import torch

from deepinfer.config import ModelConfig


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(f"scoring_func {scoring_func!r} is not supported for MLA models (sigmoid, softmax are)")


def group_mask(choice: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[T, E] bool: experts inside the topk_group best groups of each token."""
    grouped = choice.view(choice.shape[0], cfg.n_group, -1)
    if cfg.topk_method == "noaux_tc":
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_score = grouped.amax(dim=-1)
    keep = group_score.topk(cfg.topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape_as(choice)


def _renormalised(w: torch.Tensor) -> torch.Tensor:
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20)


def combine_weights(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Routing weights of the chosen experts from their (unbiased) scores."""
    scale = cfg.routed_scaling_factor
    if cfg.model_type == "deepseek_v2":
        return _renormalised(w) if cfg.norm_topk_prob and w.shape[-1] > 1 else w * scale
    return (_renormalised(w) if cfg.norm_topk_prob else w) * scale


def select_experts(logits: torch.Tensor, bias: torch.Tensor | None,
                   cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, K] int64, weights [T, K] float32) from router logits [T, E] (float32)."""
    scores = expert_scores(logits, cfg.scoring_func)
    choice = scores if bias is None else scores + bias
    if cfg.topk_method != "greedy" and cfg.topk_group < cfg.n_group:
        choice = choice.masked_fill(~group_mask(choice, cfg), float("-inf"))
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    return ids, combine_weights(scores.gather(1, ids), cfg)
