"""Tiny random DeepSeek checkpoints saved with transformers, and transformers as the oracle.

Oracle caveat (see shared reference notes): the Lightning Indexer's scores (V4 and V3.2) tie exactly (ReLU),
and torch.topk breaks ties differently between prefill and decode, so stock transformers is not
self-consistent. The oracle patches the indexer's top-k to a stable sort (lower index first),
which is the tie-break deepinfer implements.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% else %}" + ASSISTANT + "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% if thinking %}<think>{% else %}</think>{% endif %}"
    "{% endif %}"
)

V4_TINY = dict(
    vocab_size=512, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25, q_lora_rank=64, o_groups=2, o_lora_rank=32,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=16, index_n_heads=4, index_head_dim=32, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20,
    swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=4096, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)

# A second layout: HCA first, two hash layers, narrower window, more groups, top-3 indexer.
V4_TINY_B = {**V4_TINY, "num_hidden_layers": 5, "sliding_window": 8, "o_groups": 4, "o_lora_rank": 16,
             "index_topk": 3, "num_experts_per_tok": 3,
             "layer_types": ["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
                             "compressed_sparse_attention", "heavily_compressed_attention"],
             "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
             "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}}

V3_TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    rope_interleave=True,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
    max_position_embeddings=10240, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)

# V3.2: V3's MLA + the DSA lightning indexer; top-6 of the context, far below the test prompt lengths.
V32_TINY = {**{k: v for k, v in V3_TINY.items() if k not in ("rope_interleave", "num_nextn_predict_layers")},
            "index_n_heads": 4, "index_head_dim": 32, "index_topk": 6}

V2_TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=2,
    num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
    routed_scaling_factor=16.0, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)


def _randomise_buffers(model, cfg, seed: int) -> None:
    """Real checkpoints carry non-trivial sinks, biases, tid2eid and mHC bases; zeros hide bugs."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "tid2eid"):
                e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                mod.tid2eid.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(cfg.vocab_size)]))
            for name in ("e_score_correction_bias",):
                if hasattr(mod, name):
                    getattr(mod, name).copy_(0.01 * torch.randn(getattr(mod, name).shape, generator=g))
            if hasattr(mod, "sinks"):
                mod.sinks.copy_(torch.randn(mod.sinks.shape, generator=g))
            if hasattr(mod, "position_bias"):
                mod.position_bias.copy_(0.5 * torch.randn(mod.position_bias.shape, generator=g))
            if type(mod).__name__ == "DeepseekV32Indexer":  # LayerNorm's default 1 / 0 would hide a missing norm
                mod.k_norm.weight.copy_(1 + 0.3 * torch.randn(mod.k_norm.weight.shape, generator=g))
                mod.k_norm.bias.copy_(0.3 * torch.randn(mod.k_norm.bias.shape, generator=g))
            if isinstance(getattr(mod, "base", None), torch.nn.Parameter):
                mod.base.copy_(0.5 * torch.randn(mod.base.shape, generator=g))


def make_reference(kind: str, seed: int = 0, **overrides):
    """A transformers model (eval, fp32, eager) of the given tiny config."""
    import transformers as tf

    table = {"v4": (tf.DeepseekV4Config, tf.DeepseekV4ForCausalLM, V4_TINY),
             "v4b": (tf.DeepseekV4Config, tf.DeepseekV4ForCausalLM, V4_TINY_B),
             "v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, V3_TINY),
             "v32": (tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM, V32_TINY),
             "v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, V2_TINY)}
    config_cls, model_cls, base = table[kind]
    torch.manual_seed(seed)
    cfg = config_cls(**{**base, **overrides})
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).float().eval()
    _randomise_buffers(model, cfg, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = cfg.pad_token_id
    return model


def save_reference(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@contextlib.contextmanager
def stable_indexer_topk():
    """Within transformers' V4 and V3.2 indexers, top-k keeps the lower index among equal scores."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

    indexers = (v4.DeepseekV4Indexer, v32.DeepseekV32Indexer)
    originals, original_topk = [cls.forward for cls in indexers], torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    def patched(original_forward):
        def forward(self, *args, **kwargs):
            torch.Tensor.topk = stable_topk
            try:
                return original_forward(self, *args, **kwargs)
            finally:
                torch.Tensor.topk = original_topk
        return forward

    for cls, original in zip(indexers, originals):
        cls.forward = patched(original)
    try:
        yield
    finally:
        for cls, original in zip(indexers, originals):
            cls.forward = original


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' single-sequence greedy decoding (the oracle), with the stable indexer tie-break."""
    with torch.no_grad(), stable_indexer_topk():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """Full-forward logits [len(tokens), V] of one unpadded sequence."""
    with torch.no_grad(), stable_indexer_topk():
        return model(torch.tensor([tokens])).logits[0].float()


def write_tokenizer(path):
    """Byte-level BPE with BOS=0 / EOS=1 like the tiny model; vocab 300 < the model's 512."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, how are you today", "the quick brown fox"] * 10, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def fail_steps_scheduling(monkeypatch, runner, request_id: str) -> None:
    """Make `runner.execute` raise for every step that schedules `request_id` (others run normally)."""
    execute = runner.execute

    def failing_execute(out):
        if any(s.request.request_id == request_id for s in out.scheduled):
            raise RuntimeError("injected failure")
        return execute(out)

    monkeypatch.setattr(runner, "execute", failing_execute)
