"""DeepSeek-V4.1: engine vs DeepSeek's reference code on the tiny goldens (tests/golden/v41), config parsing,
checkpoint errors.

The goldens come from the reference on its only schedule (one prefill from position 0, then one token per step),
with stable top-k and each layer reading its own kv source's index keys (tests/golden/v41/README.md). The
engine reproduces every full logits vector within 1e-4 (measured: 0.0, bit-identical) on that schedule and on
every other path here -- ragged batches, chunked prefill at odd budgets, preemption with recompute, prefix-cache
hits with bounded replay -- because it keeps the reference's rounding points and gives each request the GEMM
shapes of its own schedule (models/deepseek_v41.per_request_linear).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from v41_golden import GOLDEN, golden_threads, load_golden, run_to_end  # noqa: F401  (autouse: the goldens' threads)

from deepinfer import LLM, SamplingParams
from deepinfer.config import ConfigError, ModelConfig
from deepinfer.models.loader import CheckpointError

CONFIGS = ("a", "b")
LOGIT_TOL = 1e-4  # log-prob tolerance the issue sets; measured 0.0 on this suite


def _golden(name: str):
    return load_golden(name)


def _llm(name: str, **options) -> LLM:
    return LLM(str(GOLDEN / name), load_progress=False, **options)


def _run(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[dict, dict]:
    """Greedy tokens and each sampled row's log-probs [vocab] by request, through the engine's own steps."""
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    return run_to_end(llm)


def _check(name: str, llm: LLM, which: list[int]) -> float:
    g, tensors = _golden(name)
    prompts = [g["prompts"][i] for i in which]
    steps = len(g["tracks"]["fixed"]["tokens"][0])
    tokens, rows = _run(llm, prompts, steps)
    worst = 0.0
    for k, i in enumerate(which):
        assert tokens[str(k)] == g["tracks"]["fixed"]["tokens"][i], f"prompt {i}"
        ref = tensors[f"fixed.p{i}.logits"].log_softmax(-1)
        assert len(rows[str(k)]) == steps
        for s, lp in enumerate(rows[str(k)]):
            worst = max(worst, (lp - ref[s]).abs().max().item())
    assert worst <= LOGIT_TOL
    return worst


@pytest.mark.parametrize("name", CONFIGS)
def test_reference_schedule_matches_deepseek_reference(name):
    llm = _llm(name, max_num_seqs=1, enable_prefix_caching=False)
    for i in range(3):
        _check(name, llm, [i])


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("budget", [7, 13])
def test_ragged_batch_with_odd_chunked_prefill_matches(name, budget):
    _check(name, _llm(name, max_num_batched_tokens=budget, enable_prefix_caching=False), [0, 1, 2])


@pytest.mark.parametrize("name", CONFIGS)
def test_preemption_and_recompute_match(name):
    probe = _llm(name, max_num_seqs=3, block_size=16)
    layout = probe.engine.layout
    llm = _llm(name, max_num_seqs=3, block_size=16, enable_prefix_caching=False,
               kv_cache_memory_bytes=3 * layout.bytes_per_slot + 12 * layout.bytes_per_block)
    _check(name, llm, [0, 1, 2])
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("restore", ["replay", "snapshot"])
def test_prefix_hit_matches(name, restore):
    """A hit rebuilds the window rings by bounded replay, or restores them from the snapshot a step left at the
    block boundary (warm-up: exactly the first 96 tokens of the 101-token prompt)."""
    g, _ = _golden(name)
    llm = _llm(name, block_size=16, enable_prefix_caching=True, swa_restore=restore)
    warm = g["prompts"][2] if restore == "replay" else g["prompts"][2][:96]
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=1), use_tqdm=False)
    hits = llm.engine.kv.prefix_hits
    _check(name, llm, [2, 1])
    assert llm.engine.kv.prefix_hits - hits == 96  # the 101-token prompt's six full blocks
    assert llm.engine.scheduler.num_snapshot_restores == (restore == "snapshot")


@pytest.mark.parametrize("name", CONFIGS)
def test_async_scheduling_gives_the_reference_tokens(name):
    g, _ = _golden(name)
    llm = _llm(name, async_scheduling=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in g["prompts"]],
                            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == g["tracks"]["fixed"]["tokens"]


def test_two_level_indexer_and_engram_are_exercised():
    """The goldens' long prompts make the candidate blocks select (more entries than blocks x block size) and
    Engram runs at two layers, so the parity above covers both."""
    cfg = ModelConfig.from_hf(GOLDEN / "a")
    v41 = cfg.v41
    long_prompt = max(len(p) for p in _golden("a")[0]["prompts"])
    ratio = cfg.compress_ratios[v41.candidate_source_layer]
    assert long_prompt // ratio > v41.candidate_topk_blocks * v41.candidate_block_size
    assert len(v41.engram.layer_ids) == 2 and v41.dspark is not None


# --- config -------------------------------------------------------------------------------------------------
OFFICIAL_TEXT = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
    "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20, "max_position_embeddings": 1048576, "rope_theta": 10000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], "compress_rope_theta": 160000,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
    "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3}
OFFICIAL = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
            "text_config": OFFICIAL_TEXT,
            "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024}}


def test_official_config_roles():
    cfg = ModelConfig.from_dict(OFFICIAL)
    v41 = cfg.v41
    assert cfg.is_v41 and cfg.num_layers == 40 and len(cfg.mtp_compress_ratios) == 3
    assert cfg.weight_block_size == (32, 32) and v41.quantized and v41.has_vision
    assert [v41.kv_source_of(i) for i in (2, 7, 8, 19, 20, 39)] == [2, 2, 8, 14, 20, 20]
    assert [v41.index_source_of(i) for i in (3, 21, 27, 39)] == [2, 20, 24, 36]
    assert not v41.uses_candidates(20) and v41.uses_candidates(24)
    assert cfg.rope_compress.theta == 160000 and cfg.rope_compress.is_yarn and not cfg.rope_main.is_yarn
    assert v41.engram.num_hash_columns == 24 and v41.dspark.target_layer_ids == (37, 38, 39)


def _with(**text) -> dict:
    return {**OFFICIAL, "text_config": {**OFFICIAL_TEXT, **text}}


@pytest.mark.parametrize("raw, message", [
    (_with(compress_ratios=[0, 0] + [2] * 18 + [1] * 20), "compress_ratios has 40 entries"),
    (_with(kv_source_layer_ids=[2, 8, 14]), "ratio 1 but reads kv source 14 of ratio 2"),
    (_with(index_source_layer_ids=[8, 14, 20]), "no kv source and index source"),
    (_with(candidate_topk_blocks=4), "cannot always hold index_topk"),
    (_with(engram_num_embeddings=[1]), "one table size per engram layer"),
    ({**OFFICIAL, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "not the official layout"),
    ({k: v for k, v in OFFICIAL.items() if k != "text_config"}, "needs a text_config"),
])
def test_bad_configs_fail_clearly(raw, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_float32_is_refused():
    with pytest.raises(ConfigError, match="bfloat16"):
        _llm("a", dtype="float32")


# --- checkpoint errors ------------------------------------------------------------------------------------
def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "a", dst, ignore=shutil.ignore_patterns("golden*"))
    return dst


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    path = _copy(tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        LLM(str(path), load_progress=False)


def test_engram_vocab_mismatch_is_a_clear_error(tmp_path):
    path = _copy(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["engram_compressed_vocab_size"] += 1
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="compressed Engram ids"):
        LLM(str(path), load_progress=False)


# --- prefill truncation -----------------------------------------------------------------------------------
def _late_rows(llm: LLM) -> list[int]:
    """Rows the last layer sees per step (the first truncated layer is an earlier one)."""
    layer, seen = llm.engine.model.layers[-1], []
    forward = layer.forward
    layer.forward = lambda streams, *a: seen.append(streams.shape[0]) or forward(streams, *a)
    return seen


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_truncation_is_exact_within_its_bound(name):
    """The last prompt token's window chain through the truncated layers reaches (late - 1)(W - 1) tokens back, so
    keeping that many plus one is exact -- while the late layers really skip the rest of the prompt."""
    cfg = ModelConfig.from_hf(GOLDEN / name)
    start = cfg.compress_ratios.index(1)
    keep = (cfg.num_layers - start - 1) * (cfg.sliding_window - 1) + 1
    llm = _llm(name, prefill_truncation_tokens=keep, enable_prefix_caching=False, max_num_batched_tokens=512)
    seen = _late_rows(llm)
    _check(name, llm, [2])
    assert seen[0] == keep < 101 and all(n == 1 for n in seen[1:])
    assert llm.engine.model.truncate_from == start


def test_prefill_truncation_shorter_than_its_bound_runs_and_skips():
    llm = _llm("a", prefill_truncation_tokens=16, enable_prefix_caching=False, max_num_batched_tokens=13)
    seen = _late_rows(llm)
    g, _ = _golden("a")
    out = llm.generate([{"prompt_token_ids": g["prompts"][2]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert sum(seen[:-3]) == 16  # chunks of 13: the late layers saw only the prompt's last 16 tokens


@pytest.mark.parametrize("options, message", [
    ({"prefill_truncation_tokens": 8}, "at least the window"),
    ({"prefill_truncation_tokens": -1}, ">= 0"),
])
def test_prefill_truncation_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        _llm("a", **options)


def test_prefill_truncation_refuses_prompt_logprobs():
    llm = _llm("a", prefill_truncation_tokens=16)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)


# --- KV cache ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_packed_kv_cache_is_bit_identical_and_smaller(name):
    """kv_cache_dtype fp8 stores the FP8 / FP4 QDQ points' codes and scales: the same values on read."""
    llm = _llm(name, kv_cache_dtype="fp8", block_size=16, max_num_batched_tokens=13)
    _check(name, llm, [0, 1, 2])
    _check(name, llm, [2])  # a prefix hit over packed blocks
    plain = _llm(name, block_size=16)
    assert llm.engine.layout.bytes_per_block * 3 < plain.engine.layout.bytes_per_block


@pytest.mark.parametrize("name, kv_dtype", [(n, k) for n in CONFIGS for k in ("auto", "fp8")])
def test_analytic_footprint_equals_allocated(name, kv_dtype):
    from deepinfer.engine.kv_accounting import footprint

    llm = _llm(name, kv_cache_dtype=kv_dtype, block_size=16, kv_cache_memory_bytes=4 * 2**20)
    fp = footprint(llm.engine.model_config, torch.bfloat16, kv_dtype)
    assert fp.bytes_per_token == pytest.approx(llm.engine.layout.bytes_per_token)
    assert fp.bytes_per_sequence == llm.engine.layout.bytes_per_slot


def test_v41_flash_kv_bytes_per_token():
    """V4.1-Flash: three ratio-2 sources and one ratio-1 source of 512-wide entries + 128-wide index keys:
    3,200 B per token as bf16, 890 B packed (FP4 E2M1 + scales), against V4-Flash's 6,880 (test_kv_accounting)."""
    from deepinfer.engine.kv_accounting import footprint

    cfg = ModelConfig.from_dict(OFFICIAL)
    assert footprint(cfg, torch.bfloat16).bytes_per_token == pytest.approx(3200)
    assert footprint(cfg, torch.bfloat16, "fp8").bytes_per_token == pytest.approx(890)


@pytest.mark.parametrize("name", CONFIGS)
def test_checkpoint_bytes_model_matches_the_checkpoint(name):
    """models/v41_memory.py (docs/models.md's memory model) against the bytes the goldens' checkpoints hold."""
    import struct

    from deepinfer.models.v41_memory import checkpoint_bytes

    raw = (GOLDEN / name / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    found = {"backbone": 0, "engram_tables": 0, "dspark": 0}
    for tensor, entry in header.items():
        if tensor != "__metadata__":
            kind = ("engram_tables" if ".engram.embed." in tensor else
                    "dspark" if tensor.startswith("mtp.") else "backbone")
            found[kind] += entry["data_offsets"][1] - entry["data_offsets"][0]
    assert checkpoint_bytes(ModelConfig.from_hf(GOLDEN / name)) == found


def test_engram_tables_are_memory_mapped_and_rows_exact():
    """The tables stay FP8 in a private map of the checkpoint file (not parameters, not copied); a lookup
    dequantises just the rows asked for, exactly as value * 2^scale per 32."""
    llm = _llm("a")
    model = llm.engine.model
    assert not any("engram.embed" in n for n, _ in model.named_parameters())
    full = load_file(str(GOLDEN / "a" / "model.safetensors"))
    for layer, table in model.engram_tables.items():
        assert table.weight.dtype == torch.float8_e4m3fn
        ids = torch.randint(0, table.num_rows, (5, 3))
        w, s = full[f"layers.{layer}.engram.embed.weight"], full[f"layers.{layer}.engram.embed.scale"]
        expect = (w[ids].float().unflatten(-1, (-1, 32)) * s[ids].float().unsqueeze(-1)).flatten(-2).bfloat16()
        assert torch.equal(table.rows(ids), expect)
