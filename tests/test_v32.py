"""DeepSeek-V3.2 (MLA + the DSA lightning indexer) against transformers' DeepseekV32ForCausalLM (fp32).

The tiny checkpoint's indexer keeps the top 6 positions, far fewer than the prompts (5 is the one shorter
prompt: everything is selected there). ReLU makes index scores tie exactly, and torch.topk orders ties
differently from prompt to decode, so the oracle runs with the stable tie-break deepinfer implements (lower
position first; tiny_models.stable_indexer_topk).
"""

from __future__ import annotations

import mla_parallel_workers as workers
import pytest
import torch
from mla_parallel_workers import Case, Script
from paged_mla import PagedRun
from test_mla_parallel import assert_matches, reference, run_world
from tiny_models import V32_TINY, make_reference, reference_greedy, reference_logits, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.config import ConfigError, ModelConfig, ParallelConfig
from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.models.loader import iter_checkpoint

NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 19, 45)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
TOPK = V32_TINY["index_topk"]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    ref = make_reference("v32", seed=7)
    path = save_reference(ref, tmp_path_factory.mktemp("v32"))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    oracle = [reference_greedy(ref, p, NEW_TOKENS) for p in prompts]
    return ref, path, prompts, oracle


@pytest.fixture(scope="module")
def model(case):
    _, path, _, _ = case
    m = DeepseekV3ForCausalLM(ModelConfig.from_hf(path))
    m.load_weights(iter_checkpoint(path, "deepseek_v32"))
    return m


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---------------------------------------------------------------- config and cache


def test_config_and_cache_spec(case, model):
    cfg = model.config
    assert (cfg.model_type, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == ("deepseek_v32", 4, 32, TOPK)
    assert cfg.has_dsa_indexer and cfg.rope_interleave and cfg.topk_method == "noaux_tc"
    assert not ModelConfig.from_hf(case[1]).is_v4
    specs = {s.name: s for s in model.kv_cache_spec(8)}
    assert specs["layers.2.index_k"].shape == (8, 32) and specs["layers.2.index_k"].kind == "paged"
    assert specs["layers.2.mla"].shape == (8, 32 + 16)


@pytest.mark.parametrize("change, message", [
    ({"mlp_layer_types": ["sparse", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"index_head_dim": 8}, "index_head_dim"),
])
def test_unsupported_v32_configs_name_the_problem(case, change, message):
    raw = {**case[0].config.to_dict(), **change}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


# ---------------------------------------------------------------- model over a paged cache


def test_prefill_and_decode_logits_match_transformers(case, model):
    ref, _, prompts, _ = case
    for p in prompts:
        want = reference_logits(ref, p)
        assert (PagedRun(model).step([(0, p)])[0] - want).abs().max().item() < 1e-4
        run = PagedRun(model, seed=2)  # 3 tokens of prefill, then token by token (absorbed decode)
        stepwise = torch.cat([run.step([(0, p[:3])])[0]] + [run.step([(0, [t])])[0] for t in p[3:]])
        assert (stepwise - want).abs().max().item() < 1e-4


def test_selection_is_sparse_and_prefill_then_decode_selects_like_one_prefill(case, model):
    """The top-k really restricts attention (all-positions attention differs), and prefill(n) + decode
    gives what prefill(n + 1) gives, bit for bit in the selection (logits within 1e-5)."""
    _, _, prompts, _ = case
    p = prompts[2]
    sparse = PagedRun(model).step([(0, p)])[0]
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    for idx in indexers:
        idx.topk = 10**6
    try:
        dense = PagedRun(model).step([(0, p)])[0]
    finally:
        for idx in indexers:
            idx.topk = TOPK
    assert (dense - sparse).abs().max().item() > 1e-2
    for n in (TOPK, 20, len(p) - 1):
        run = PagedRun(model, seed=5)
        run.step([(0, p[:n])])
        last = run.step([(0, [p[n]])])[0][-1]
        assert (last - sparse[n]).abs().max().item() < 1e-5


# ---------------------------------------------------------------- through the engine


def _llm(path, **options) -> LLM:
    return LLM(path, block_size=8, load_progress=False, **options)


# Alone, ragged at odd chunk budgets, preemption and mixed-batch logits: tests/test_parity.py (its "v32" case).


def test_engine_prefix_caching_hits_and_keeps_tokens(case):
    _, path, prompts, oracle = case
    llm = _llm(path, enable_prefix_caching=True, max_num_batched_tokens=13)
    assert _tokens(llm.generate([prompts[2]], GREEDY, use_tqdm=False)) == [oracle[2]]
    before = llm.engine.kv.prefix_hits
    assert _tokens(llm.generate([prompts[2]], GREEDY, use_tqdm=False)) == [oracle[2]]
    assert llm.engine.kv.prefix_hits - before >= 8 * (len(prompts[2]) // 8 - 1) > 0


# ---------------------------------------------------------------- tensor parallel


def test_tp2_matches_one_process(case):
    """Heads split over 2 ranks, the indexer replicated: the same selection on both, logits within 1e-4."""
    _, path, _, _ = case
    script = Script(workers.prompts(3, (15, 5, 22)), decode_steps=4)
    ref = reference(path, script)
    out = run_world(ParallelConfig(1, 2), [Case(str(path), "allgather", (script,))])
    for rank in range(2):
        assert_matches(out[rank][0], ref)
