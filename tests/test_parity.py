"""Greedy tokens and logits of deepinfer vs transformers on tiny random checkpoints (fp32).

The oracle is transformers' single-sequence greedy decoding (no padding) with the Lightning
Indexer's ties broken by lower index (see tiny_models.stable_indexer_topk). Every scenario must
reproduce the oracle's tokens exactly: each prompt alone, all prompts in one ragged batch with
chunked prefill at odd chunk sizes, and under forced preemption with recompute.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_reference, reference_greedy, reference_logits, save_reference

from deepinfer import LLM, SamplingParams

NEW_TOKENS = 64
PROMPT_LENGTHS = {"v4": (5, 17, 40, 70), "v4b": (3, 23, 50), "v3": (4, 19, 45), "v2": (6, 33),
                  "v32": (5, 19, 45)}  # V3.2: longer than its indexer's top-6, so selection is sparse
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=list(PROMPT_LENGTHS))
def case(request, tmp_path_factory):
    kind = request.param
    ref = make_reference(kind, seed=7)
    path = save_reference(ref, tmp_path_factory.mktemp(kind))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS[kind]]
    oracle = [reference_greedy(ref, p, NEW_TOKENS) for p in prompts]
    return kind, ref, path, prompts, oracle


def _llm(path, **options) -> LLM:
    block = 8 if "v4" not in str(path) else 16
    return LLM(path, block_size=block, load_progress=False, **options)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_prompt_alone_matches_transformers(case):
    _, _, path, prompts, oracle = case
    llm = _llm(path, max_num_seqs=1)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == oracle


@pytest.mark.parametrize("budget", [7, 13])
def test_ragged_batch_with_odd_chunked_prefill_matches(case, budget):
    _, _, path, prompts, oracle = case
    llm = _llm(path, max_num_batched_tokens=budget)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == oracle


def test_preemption_and_recompute_match(case):
    _, _, path, prompts, oracle = case
    probe = _llm(path, max_num_seqs=4)
    per_block = probe.engine.layout.bytes_per_block
    per_slot = probe.engine.layout.bytes_per_slot
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    block = probe.engine.layout.block_size
    # Room for the longest request plus a little: the others must be preempted and recomputed.
    blocks = -(-longest // block) + 2
    llm = _llm(path, max_num_seqs=4, kv_cache_memory_bytes=4 * per_slot + blocks * per_block)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == oracle
    assert llm.engine.scheduler.num_preemptions > 0


def test_logits_match_within_1e4_in_mixed_batches(case):
    """Every sampled row's full logits vector vs transformers' full forward at that position."""
    _, ref, path, prompts, oracle = case
    llm = _llm(path, max_num_batched_tokens=11)
    captured = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    rows_seen, worst = 0, 0.0
    full = {str(i): reference_logits(ref, p + o[:24]) for i, (p, o) in enumerate(zip(prompts, oracle))}
    while llm.engine.has_unfinished:
        llm.engine.step()
        out, logits = llm.engine.last_scheduled, captured[-1]
        sampled = [s for s in out.scheduled if s.samples]
        for row, s in enumerate(sampled):
            pos = s.start + s.num_new_tokens - 1
            worst = max(worst, (logits[row] - full[s.request.request_id][pos]).abs().max().item())
            rows_seen += 1
    assert rows_seen == 24 * len(prompts)
    assert worst < 1e-4
