"""Benchmark workloads and request arrival schedules.

Every generator takes an explicit ``seed`` and uses its own ``numpy.random.Generator``, so the same arguments
always give the same requests, independent of global random state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

# ShareGPT filter (the same thresholds vLLM's ShareGPT sampler uses): drop conversations whose prompt or
# reference completion is shorter than SHAREGPT_MIN_LEN tokens (too short to measure anything), whose prompt
# exceeds SHAREGPT_MAX_PROMPT_LEN, or whose prompt + completion exceeds SHAREGPT_MAX_TOTAL_LEN.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class BenchRequest(NamedTuple):
    """One request to send: prompt token ids and the number of tokens to generate (>= 1)."""

    prompt_token_ids: list[int]
    output_len: int


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive integer bounds of ``[L(1-r), L(1+r)]``; invariant ``1 <= lo <= hi``."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.ceil(length * (1.0 - range_ratio)))
    hi = max(lo, math.floor(length * (1.0 + range_ratio)))
    return lo, hi


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    """``n`` integers drawn uniformly from ``length_bounds(length, range_ratio)``."""
    lo, hi = length_bounds(length, range_ratio)
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    """``n`` token ids uniform in ``[0, vocab_size)``."""
    return [int(t) for t in rng.integers(0, vocab_size, size=n)]


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float = 0.0, vocab_size: int = 32000, seed: int = 0
) -> list[BenchRequest]:
    """Random-token prompts; input and output lengths each uniform in their ``length_bounds``."""
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, n, input_len, range_ratio)
    out_lens = sample_lengths(rng, n, output_len, range_ratio)
    return [BenchRequest(random_tokens(rng, i, vocab_size), o) for i, o in zip(in_lens, out_lens)]


def shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[BenchRequest]:
    """Groups of prompts that share a random ``prefix_len`` prefix and differ in a random suffix.

    Returned group by group; every prompt has exactly ``prefix_len + suffix_len`` tokens.
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_groups):
        prefix = random_tokens(rng, prefix_len, vocab_size)
        for _ in range(prompts_per_group):
            out.append(BenchRequest(prefix + random_tokens(rng, suffix_len, vocab_size), output_len))
    return out


def _first_turns(conversation: list[dict]) -> tuple[str, str] | None:
    """(first human turn, first gpt turn after it), or None when either is missing."""
    human = next((i for i, t in enumerate(conversation) if t.get("from") == "human"), None)
    if human is None:
        return None
    gpt = next((t["value"] for t in conversation[human + 1 :] if t.get("from") == "gpt"), None)
    return None if gpt is None else (conversation[human]["value"], gpt)


def _sharegpt_len_ok(prompt_len: int, output_len: int) -> bool:
    if prompt_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN:
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN


def sharegpt_requests(
    path: str | Path, n: int, seed: int, tokenizer_encode: Callable[[str], list[int]]
) -> list[BenchRequest]:
    """Up to ``n`` requests from a ShareGPT JSON file, in a seed-determined shuffled order.

    Prompt = first human turn; output length = token count of the first gpt turn after it. Entries failing
    ``_sharegpt_len_ok`` (see the SHAREGPT_* constants) are skipped; fewer than ``n`` are returned if the
    file runs out.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out: list[BenchRequest] = []
    for idx in np.random.default_rng(seed).permutation(len(data)):
        turns = _first_turns(data[idx].get("conversations", []))
        if turns is None:
            continue
        prompt_ids, out_len = tokenizer_encode(turns[0]), len(tokenizer_encode(turns[1]))
        if _sharegpt_len_ok(len(prompt_ids), out_len):
            out.append(BenchRequest(list(prompt_ids), out_len))
        if len(out) == n:
            break
    return out


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (s) for ``n`` requests; the first is at 0, the list is non-decreasing.

    Inter-arrival gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate and coefficient
    of variation 1/sqrt(burstiness). burstiness 1 is a Poisson process; < 1 is burstier, > 1 smoother.
    ``request_rate = inf`` sends everything at once (all zeros).
    """
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate}, {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]
