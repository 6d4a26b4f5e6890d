"""The analytic KV footprint equals what the engine allocates, and matches the published V4-Flash figure."""

from __future__ import annotations

import pytest
import torch
from test_config import OFFICIAL_V4
from tiny_models import make_reference, save_reference

from deepinfer import LLM
from deepinfer.config import ModelConfig
from deepinfer.engine.kv_accounting import footprint

V4_FLASH = {**OFFICIAL_V4, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "head_dim": 512,
            "qk_rope_head_dim": 64, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
            "sliding_window": 128, "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0],
            "num_hash_layers": 3, "vocab_size": 129280}


@pytest.mark.parametrize("kind", ["v4", "v4b", "v3", "v32"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_analytic_footprint_equals_allocated(tmp_path, kind, kv_dtype):
    path = save_reference(make_reference(kind), tmp_path / kind)
    llm = LLM(path, kv_cache_dtype=kv_dtype, block_size=16, load_progress=False, kv_cache_memory_bytes=8 * 2**20)
    layout = llm.engine.layout
    fp = footprint(llm.engine.model_config, llm.engine.dtype, kv_dtype)
    assert fp.bytes_per_token == pytest.approx(layout.bytes_per_token)
    assert fp.bytes_per_sequence == layout.bytes_per_slot


def test_v4_flash_bytes_per_token_match_the_published_figure():
    """V4-Flash in bf16: CSA 5,376 + indexer 1,344 + HCA 160 = 6,880 B per token (reference notes)."""
    cfg = ModelConfig.from_dict(V4_FLASH)
    assert cfg.layer_kinds.count("compressed_sparse_attention") == 21
    fp = footprint(cfg, torch.bfloat16)
    assert fp.bytes_per_token == pytest.approx(6880)
    assert footprint(cfg, torch.bfloat16, "fp8").bytes_per_token < fp.bytes_per_token / 1.9
    budget = 80 * 2**30
    assert fp.max_sequences(131072, budget) == budget // (fp.bytes_per_sequence + 131072 * 6880)
