"""Speculative verification: which draft tokens the target accepts, and the token that follows them.

For a request with D draft tokens x_1..x_D the target scored D + 1 positions: row j (0..D) is the
target's distribution p_j for the token after the j-th draft (row 0: after the last real token).

- Greedy rows accept x_j while x_j == argmax p_{j-1}; the first mismatch is replaced by that argmax,
  and if all D are accepted the bonus token argmax p_D follows. The tokens equal plain greedy decoding.
- Random rows use rejection sampling: x_j is accepted with probability min(1, p(x_j) / q(x_j)), where q
  is the draft distribution (one-hot when the proposer drafts deterministically). The first rejection
  is replaced by a sample of the residual max(p - q, 0) (normalised); after D acceptances a bonus token
  is sampled from p_D. Every emitted token is then distributed exactly as plain sampling from p.

Draws come from the request's own generator when it has one (seeded requests are reproducible
whatever else shares the batch), else from the default generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIN_EXP = 1e-10


@dataclass
class Verdict:
    accepted: int  # leading drafts accepted
    tokens: list[int]  # accepted drafts followed by the correction or bonus token


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> Verdict:
    """logits [D + 1, V] (processed) of one request; exact greedy acceptance."""
    best = logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return Verdict(n, drafts[:n] + [best[n]])


def verify_random(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None,
                  draft_probs: torch.Tensor | None = None) -> Verdict:
    """probs [D + 1, V] target distributions (after temperature / top-k / top-p); draft_probs [D, V] or None
    for deterministic drafts. Lossless rejection sampling."""
    d = len(drafts)
    idx = torch.arange(d, device=probs.device)
    x = torch.tensor(drafts, dtype=torch.long, device=probs.device)
    p_x = probs[idx, x]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[idx, x]
    u = _uniform(d, generator, probs.device)
    accept = (u * q_x < p_x).tolist()
    n = next((j for j, ok in enumerate(accept) if not ok), d)
    if n == d:
        return Verdict(d, drafts + [_sample(probs[d], generator)])
    return Verdict(n, drafts[:n] + [_sample(_residual(probs[n], n, drafts, draft_probs), generator)])


def _residual(p: torch.Tensor, j: int, drafts: list[int], draft_probs: torch.Tensor | None) -> torch.Tensor:
    """max(p - q, 0), normalised; q is one-hot at the rejected draft when draft_probs is None."""
    if draft_probs is None:
        res = p.clone()
        res[drafts[j]] = 0.0
    else:
        res = (p - draft_probs[j]).clamp_min(0.0)
    total = res.sum()
    # A reject implies p(x) < q(x), so some other token has p > q; a zero residual means rounding only.
    return res / total if total > 0 else p


def _uniform(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, device=gen_device).to(device)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Exponential race: argmax(p / e), e ~ Exp(1), picks token i with probability p_i."""
    gen_device = generator.device if generator is not None else probs.device
    e = torch.empty(probs.shape, device=gen_device).exponential_(generator=generator).to(probs.device)
    return int((probs / e.clamp_min(_MIN_EXP)).argmax())
