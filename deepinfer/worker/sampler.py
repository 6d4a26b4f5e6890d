"""Batched sampling: penalties, min_tokens, temperature, min-p / top-k / top-p, seeded sampling, logprobs.

Input is a float [N, V] logits tensor with one row per request sampled this step. Everything the
hot path branches on is a Python bool computed once in `SamplingBatch.build`, so `Sampler.__call__`
never synchronises with the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# Smallest exponential draw we divide by; keeps probs / q finite (q == 0 has probability ~0 anyway).
_MIN_EXP = 1e-10


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator: its draws depend only on `seed` and its own step count."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class LogprobsTensors:
    """Column 0 is the sampled (or target) token, columns 1..K the top-K tokens by raw logprob."""

    token_ids: torch.Tensor  # long [N, K+1]
    logprobs: torch.Tensor  # float32 [N, K+1]
    ranks: torch.Tensor  # long [N]: 1 + number of vocab entries with a strictly greater logprob


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # long [N]
    logprobs: LogprobsTensors | None = None


@dataclass
class SamplingBatch:
    """Per-row sampling state for one step. Row i of every tensor belongs to request i."""

    temperature: torch.Tensor  # float [N]; 1.0 on greedy rows so division is harmless
    greedy: torch.Tensor  # bool [N]
    top_k: torch.Tensor  # long [N]; vocab_size when disabled
    top_p: torch.Tensor  # float [N]
    min_p: torch.Tensor  # float [N]
    presence_penalty: torch.Tensor  # float [N]
    frequency_penalty: torch.Tensor  # float [N]
    repetition_penalty: torch.Tensor  # float [N]
    output_counts: torch.Tensor | None  # float [N, V] occurrences in the output; None without penalties
    prompt_mask: torch.Tensor | None  # bool [N, V] token occurs in the prompt; None without rep. penalty
    suppress_rows: torch.Tensor | None  # long [S]; (row, token) pairs masked to -inf for min_tokens
    suppress_tokens: torch.Tensor | None  # long [S]
    generators: list[torch.Generator | None]
    seeded_rows: list[int]  # random (non-greedy) rows that draw from their own generator
    all_greedy: bool
    any_random_unseeded: bool
    any_penalties: bool
    any_repetition_penalty: bool
    any_min_p: bool
    any_top_k: bool
    any_top_p: bool
    max_num_logprobs: int | None  # None: no row asked for logprobs
    # Structured outputs: rows [K] whose tokens are constrained, and their int32 bitmask [K, ceil(V/32)]
    # (bit j of word w allows token 32 w + j). None on batches without constraints (they pay nothing).
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_ids: list[list[int]], output_ids: list[list[int]],
              generators: list[torch.Generator | None], eos_token_ids: Sequence[int], vocab_size: int,
              device: torch.device | str = "cpu") -> SamplingBatch:
        assert len(params) == len(prompt_ids) == len(output_ids) == len(generators)
        greedy = [p.is_greedy for p in params]
        counts, prompt_mask = _penalty_tensors(params, prompt_ids, output_ids, vocab_size, device)
        rows, tokens = _suppressed_pairs(params, output_ids, eos_token_ids, vocab_size, device)
        return cls(
            **_row_floats(params, greedy, device), **_fast_path_flags(params, greedy, generators, vocab_size),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=_top_k_tensor(params, vocab_size, device),
            output_counts=counts, prompt_mask=prompt_mask, suppress_rows=rows, suppress_tokens=tokens,
            any_penalties=counts is not None, any_repetition_penalty=prompt_mask is not None,
            generators=list(generators),
        )


def _fast_path_flags(params: list[SamplingParams], greedy: list[bool], generators, vocab_size: int) -> dict:
    """Python-side flags (no device sync later); filters only count on rows that actually sample."""
    random_params = [p for p, g in zip(params, greedy) if not g]
    seeded = [i for i, g in enumerate(generators) if g is not None and not greedy[i]]
    logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
    return {
        "seeded_rows": seeded,
        "all_greedy": not random_params,
        "any_random_unseeded": len(seeded) < len(random_params),
        "any_min_p": any(p.min_p > 0 for p in random_params),
        "any_top_k": any(0 < p.top_k < vocab_size for p in random_params),
        "any_top_p": any(p.top_p < 1.0 for p in random_params),
        "max_num_logprobs": max(logprob_counts) if logprob_counts else None,
    }


def _row_floats(params: list[SamplingParams], greedy: list[bool], device) -> dict[str, torch.Tensor]:
    def col(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return {
        "temperature": col([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
        "top_p": col([p.top_p for p in params]),
        "min_p": col([p.min_p for p in params]),
        "presence_penalty": col([p.presence_penalty for p in params]),
        "frequency_penalty": col([p.frequency_penalty for p in params]),
        "repetition_penalty": col([p.repetition_penalty for p in params]),
    }


def _top_k_tensor(params: list[SamplingParams], vocab_size: int, device) -> torch.Tensor:
    # Invariant: 1 <= top_k <= vocab_size on every row; vocab_size means "keep everything".
    values = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    return torch.tensor(values, dtype=torch.long, device=device)


def _padded_ids(id_lists: list[list[int]], pad: int, device) -> torch.Tensor:
    """[N, max_len] long tensor; short rows padded with `pad` (a scratch column past the vocab)."""
    width = max((len(ids) for ids in id_lists), default=0)
    rows = [list(ids) + [pad] * (width - len(ids)) for ids in id_lists]
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(id_lists), width)


def _token_counts(id_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """float [N, V]: how often each token occurs in each row's list (scatter_add, no vocab loop)."""
    ids = _padded_ids(id_lists, vocab_size, device)
    counts = torch.zeros(len(id_lists), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _penalty_tensors(params, prompt_ids, output_ids, vocab_size, device):
    any_freq_presence = any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params)
    any_repetition = any(p.repetition_penalty != 1.0 for p in params)
    if not (any_freq_presence or any_repetition):
        return None, None
    counts = _token_counts(output_ids, vocab_size, device)
    prompt_mask = _token_counts(prompt_ids, vocab_size, device) > 0 if any_repetition else None
    return counts, prompt_mask


def _suppressed_pairs(params, output_ids, eos_token_ids, vocab_size, device):
    """(rows, tokens) to mask while a request has fewer than min_tokens outputs.

    EOS is suppressed only when it would stop the request (not ignore_eos); stop_token_ids always.
    """
    rows, tokens = [], []
    for i, (p, out) in enumerate(zip(params, output_ids)):
        if len(out) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        banned = sorted(t for t in banned if 0 <= t < vocab_size)
        rows += [i] * len(banned)
        tokens += banned
    if not rows:
        return None, None
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    return as_long(rows), as_long(tokens)


def plain_greedy(params: SamplingParams, num_outputs: int) -> bool:
    """Whether the sampler would only take a row's argmax: greedy, no penalties, no logprobs and min_tokens met
    (a batch of such rows without a grammar needs no SamplingBatch: its tokens are logits.argmax(-1))."""
    return (params.is_greedy and params.logprobs is None and num_outputs >= params.min_tokens
            and params.repetition_penalty == 1.0 and params.frequency_penalty == 0 and params.presence_penalty == 0)


# ---------------------------------------------------------------------------------------- processing


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """In place. Repetition (HF-style, prompt or output), then frequency and presence (output only)."""
    counts = batch.output_counts
    if batch.any_repetition_penalty:
        seen = batch.prompt_mask | (counts > 0)
        penalty = batch.repetition_penalty[:, None].expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, scaled, logits))
    logits -= batch.frequency_penalty[:, None] * counts
    logits -= batch.presence_penalty[:, None] * (counts > 0).float()
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: tokens whose bit is 0 get -inf on the constrained rows."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    logits[rows] = logits[rows].masked_fill_(~allowed, _NEG_INF)
    return logits


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.suppress_rows is not None:
        logits[batch.suppress_rows, batch.suppress_tokens] = _NEG_INF
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p * (the row's highest probability)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's top_k tokens, then the smallest prefix (by prob) whose mass reaches top_p.

    top-p acts on the distribution renormalised after top-k; the most likely token always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        position = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(position[None, :] >= top_k[:, None], _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Drop a token once the strictly-more-likely tokens already reach top_p; rows with top_p = 1
        # are exempt so float rounding in the cumsum can never trim their tail.
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(-1, order, sorted_logits)


def random_sample(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Exponential race: argmax(p / q), q ~ Exp(1), picks token i with probability p_i.

    A seeded row draws exactly V values from its own generator per call, so its tokens do not
    depend on which other rows share the batch; other rows share one draw from the default generator.
    """
    q = torch.empty_like(probs)
    if batch.any_random_unseeded:
        q.exponential_()
    else:
        q.fill_(1.0)  # only seeded and greedy rows: keep the (discarded) greedy rows finite
    for row in batch.seeded_rows:
        _draw_exponential(q[row], batch.generators[row])
    return probs.div_(q.clamp_min_(_MIN_EXP)).argmax(dim=-1)


def _draw_exponential(out: torch.Tensor, generator: torch.Generator) -> None:
    """Fills `out` from `generator`; a CPU generator serving a GPU row draws on the CPU and copies."""
    if generator.device == out.device:
        out.exponential_(generator=generator)
    else:
        draw = torch.empty(out.shape, dtype=out.dtype, device=generator.device)
        out.copy_(draw.exponential_(generator=generator), non_blocking=True)


# ---------------------------------------------------------------------------------------- logprobs


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprob and rank of `token_ids` [N] plus the top-k entries of `logprobs` [N, V]."""
    token_ids = token_ids.long()[:, None]
    chosen = logprobs.gather(-1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(k, logprobs.shape[-1])
    if k == 0:
        return LogprobsTensors(token_ids=token_ids, logprobs=chosen, ranks=ranks)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return LogprobsTensors(token_ids=torch.cat([token_ids, top_ids], dim=1),
                           logprobs=torch.cat([chosen, top_values], dim=1), ranks=ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Row p of `logits` predicts target_ids[p] (the prompt token at position p + 1)."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_ids, k)


# ---------------------------------------------------------------------------------------- sampler


class Sampler:
    """logits [N, V] + SamplingBatch -> one token per row (and raw logprobs when asked)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # Invariant: `logits` (the caller's tensor) is never modified; we work on an fp32 copy.
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        processed = self.process(logits.to(torch.float32, copy=True), batch)
        sampled = self.sample(processed, batch)
        if raw_logprobs is None:
            return SamplerOutput(sampled=sampled)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, sampled, batch.max_num_logprobs))

    def process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """In place: grammar masks, penalties and min_tokens suppression (shared by greedy and random rows)."""
        if batch.grammar_rows is not None:
            apply_token_bitmask(logits, batch.grammar_rows, batch.grammar_bitmask)
        if batch.any_penalties:
            apply_penalties(logits, batch)
        return apply_min_tokens(logits, batch)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        probs = self.filtered_probs(logits, batch)
        random_tokens = random_sample(probs, batch)
        return torch.where(batch.greedy, greedy_tokens, random_tokens)

    def filtered_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, then min-p, then top-k / top-p; returns the probabilities to sample from."""
        logits.div_(batch.temperature[:, None])
        if batch.any_min_p:
            apply_min_p(logits, batch.min_p)
        if batch.any_top_k or batch.any_top_p:
            top_k = batch.top_k if batch.any_top_k else None
            top_p = batch.top_p if batch.any_top_p else None
            apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1)
