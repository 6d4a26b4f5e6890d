"""DeepSeek-V3.2 sparse attention (DSA): the lightning indexer that picks, per query, the positions MLA attends to.

Per new token t the indexer has H_I query heads q[t, h] (wq_b of the compressed query q_a_layernorm(q_a_proj(x)))
and one key k[t] = LayerNorm(wk(x)) of index_head_dim, both rotated with half-split RoPE on their first
qk_rope_head_dim dims (the MLA rope's cos/sin). A query at position p scores every position s <= p as

    I(p, s) = sum_h w[p, h] * relu(q[p, h] . k[s] / sqrt(index_head_dim)),  w = weights_proj(x) / sqrt(H_I)

(float32 throughout; weights_proj is kept in float32) and attends to the index_topk best (all of them when
there are fewer). Ties -- ReLU makes exact zeros common -- keep the lower position: a stable descending sort,
the same in prefill and decode, so prefill(n) then decode selects what prefill(n + 1) does.

The keys live in a paged cache tensor of their own per layer (one index_head_dim entry per token, model dtype),
written for the new tokens before any query scores, like the latent entries. The indexer is replicated on every
TP rank (it is small and every rank needs the full selection for its heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.layers.batch_invariant import batch_invariant_enabled
from deepinfer.layers.kv_quant import PagedPool
from deepinfer.layers.rotary import rotate_halves

# transformers' DeepseekV32Indexer: nn.LayerNorm(index_head_dim, eps=1e-6) on the key
_K_NORM_EPS = 1e-6
# prefill scores [rows, H_I, L] float32 are built this many elements at a time at most
_SCORE_CHUNK = 1 << 26


class Indexer(nn.Module):
    """Checkpoint names under `self_attn.indexer`: wq_b, wk, k_norm (weight, bias), weights_proj."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope = cfg.qk_rope_head_dim
        skip = nn.utils.skip_init
        self.wq_b = skip(nn.Linear, cfg.q_lora_rank, self.heads * self.dim, bias=False, dtype=dtype, device=device)
        self.wk = skip(nn.Linear, cfg.hidden_size, self.dim, bias=False, dtype=dtype, device=device)
        self.k_norm = nn.LayerNorm(self.dim, eps=_K_NORM_EPS, dtype=dtype, device=device)
        self.weights_proj = skip(nn.Linear, cfg.hidden_size, self.heads, bias=False, dtype=torch.float32,
                                 device=device)
        self.scale = self.dim ** -0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x.split([self.rope, self.dim - self.rope], dim=-1)
        return torch.cat([rotate_halves(rot, cos, sin), rest], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, dim]: the cache entry of each new token."""
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries [T, H_I, dim] and float32 head weights [T, H_I]."""
        q = self.wq_b(q_resid).view(x.shape[0], self.heads, self.dim)
        w = self.weights_proj(x.float()) * self.heads ** -0.5
        return self._rope(q, cos, sin), w

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """The attended positions [B, L] (bool) of B queries q [B, H_I, dim] with weights w [B, H_I] over keys
        [L, dim] (shared) or [B, L, dim]; allowed [B, L] marks each query's causal context."""
        length = allowed.shape[-1]
        if length <= self.topk:  # every allowed position is selected: nothing to score
            return allowed
        keys_t = keys.float().transpose(-1, -2)
        scores = torch.cat([self._scores(q[i:i + n], w[i:i + n], keys_t if keys.dim() == 2 else keys_t[i:i + n])
                            for i, n in self._chunks(q.shape[0], length)])
        scores = scores.masked_fill(~allowed, float("-inf"))
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : self.topk]
        return torch.zeros_like(allowed).scatter_(-1, best, True) & allowed

    def _chunks(self, rows: int, length: int) -> list[tuple[int, int]]:
        step = max(1, _SCORE_CHUNK // max(1, self.heads * length))
        return [(i, min(step, rows - i)) for i in range(0, rows, step)]

    def _scores(self, q: torch.Tensor, w: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
        """[B, L] index scores: relu(q . k * scale) per head, weighted and summed over heads."""
        per_head = F.relu(torch.matmul(q.float(), keys_t) * self.scale)  # [B, H_I, L]
        return torch.matmul(w[:, None, :], per_head).squeeze(1)

    def select_decode(self, q: torch.Tensor, w: torch.Tensor, cache: PagedPool, slots: torch.Tensor,
                      valid: torch.Tensor) -> torch.Tensor:
        """[R, L] for one query per request over its cached keys at `slots` [R, L] (valid [R, L])."""
        if valid.shape[-1] <= self.topk:
            return valid
        if batch_invariant_enabled():  # each query alone over exactly its own context, padded back
            out = torch.zeros_like(valid)
            for r in range(q.shape[0]):
                n = int(valid[r].sum())
                out[r, :n] = self.select(q[r:r + 1], w[r:r + 1], cache.read(slots[r:r + 1, :n]), valid[r:r + 1, :n])
            return out
        keys = cache.read(slots).masked_fill(~valid[..., None], 0)  # padded slots may hold NaN
        return self.select(q, w, keys, valid)

    def select_prefill(self, q: torch.Tensor, w: torch.Tensor, cache: PagedPool,
                       ctx_slots: torch.Tensor) -> torch.Tensor:
        """[n, L] for the n last positions of a context of L (causal) read from `ctx_slots` [L]."""
        n, length = q.shape[0], ctx_slots.shape[0]
        pos = torch.arange(length, device=ctx_slots.device)
        causal = pos[None] <= pos[length - n:, None]
        if length <= self.topk:
            return causal
        return self.select(q, w, cache.read(ctx_slots), causal)
