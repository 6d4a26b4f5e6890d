"""The bundled default model: size budget, load time, transformers agreement, default wiring."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import reference_greedy

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine.core import load_model
from deepinfer.llm import default_model_path
from deepinfer.tokenizer import Tokenizer

ASSETS = default_model_path()
SIZE_BUDGET = 25 * 2**20
CODE_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():",
                "class Stack:\n    def push(self, item):"]


def test_shipped_files_exist_and_fit_the_budget():
    names = {p.name for p in ASSETS.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in ASSETS.iterdir()) <= SIZE_BUDGET


def test_loads_in_under_five_seconds():
    start = time.perf_counter()
    config = ModelConfig.from_hf(ASSETS)
    model = load_model(ASSETS, config, torch.float32, torch.device("cpu"))
    Tokenizer.from_dir(ASSETS)
    assert time.perf_counter() - start < 5.0
    assert config.is_v4 and config.num_mtp_layers >= 1 and model.mtp_loaded


def test_config_exercises_every_v4_component():
    config = ModelConfig.from_hf(ASSETS)
    kinds = {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert kinds <= set(config.layer_kinds)
    assert any(config.hash_layers) and not all(config.hash_layers)
    assert config.hc_mult > 1 and config.o_groups > 1


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=64 * 2**20, load_progress=False)


def test_llm_without_a_model_uses_the_bundled_one(capsys):
    LLM(kv_cache_memory_bytes=16 * 2**20, load_progress=False)
    assert "bundled default model" in capsys.readouterr().out.splitlines()[0]


def test_transformers_loads_it_and_greedy_tokens_match(llm):
    """transformers' DeepseekV4ForCausalLM reads the shipped files (ignoring MTP) and agrees token for token."""
    import transformers as tf

    ref = tf.DeepseekV4ForCausalLM.from_pretrained(ASSETS, dtype=torch.float32, attn_implementation="eager").eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 2
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in CODE_PROMPTS]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, ours):
        assert out.outputs[0].token_ids == reference_greedy(ref, ids, 32)


def test_generates_python_code(llm):
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert len(text.strip()) > 10 and "\n" in text
