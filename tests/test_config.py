"""HF config conversion: official V4 keys and transformers' folded keys give the same ModelConfig;
unsupported model types and features fail with a message naming them."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import V4_TINY

from deepinfer.config import ConfigError, EngineArgs, ModelConfig, resolve_dtype

# The tiny V4 config written with DeepSeek's official keys instead of transformers' folded ones.
OFFICIAL_V4 = {
    **{k: v for k, v in V4_TINY.items()
       if k not in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters")},
    "model_type": "deepseek_v4",
    "compress_ratios": [0, 4, 16, 4, 0],  # last entry: the MTP layer (sliding, as in V4-Flash)
    "num_hash_layers": 1,
    "qk_rope_head_dim": 16,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
}


def _transformers_style() -> dict:
    import transformers as tf

    return tf.DeepseekV4Config(**V4_TINY).to_dict()


def _comparable(cfg: ModelConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("extra", "hf_dtype", "mtp_layer_kinds",
                                                                              "mtp_compress_ratios")}


def test_official_and_transformers_keys_agree():
    official = ModelConfig.from_dict(OFFICIAL_V4)
    folded = ModelConfig.from_dict(_transformers_style())
    assert _comparable(official) == _comparable(folded)
    assert official.layer_kinds == ("sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention", "compressed_sparse_attention")
    assert official.compress_ratios == (0, 4, 16, 4) and official.hash_layers == (True, False, False, False)
    assert official.mtp_layer_kinds == ("sliding_attention",)
    assert official.rope_compress.is_yarn and official.rope_compress.attention_factor == 1.0
    assert not official.rope_main.is_yarn and official.rope_dim == 16


@pytest.mark.parametrize("raw, message", [
    ({"model_type": "llama"}, "llama"),
    ({"model_type": "deepseek_v3", "index_topk": 8}, "deepseek_v32"),
    ({**OFFICIAL_V4, "compress_ratios": [0, 4, 16, 128, 0]}, "HCA"),
    ({**OFFICIAL_V4, "dspark": {"block_size": 5}}, "V4.1"),
    ({**OFFICIAL_V4, "engram": True}, "engram"),
    ({**OFFICIAL_V4, "compress_ratios": [0, 4, 16, 4, 0, 0, 0]}, "V4.1"),
])
def test_unsupported_configs_name_the_problem(raw, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_missing_or_corrupt_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)


def test_config_is_frozen():
    cfg = ModelConfig.from_dict(OFFICIAL_V4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 3


def test_dtype_auto_is_bf16_on_cpus_with_native_bf16_and_checkpoint_dtype_on_cuda(monkeypatch, tmp_path):
    import torch

    from deepinfer import config

    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setenv("DEEPINFER_CPU_BF16", "1")
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("auto", "float32", "cpu") == torch.float32  # a float32 checkpoint stays float32
    assert resolve_dtype("auto", "float16", "cpu") == torch.float32
    monkeypatch.setenv("DEEPINFER_CPU_BF16", "0")
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32
    monkeypatch.setenv("DEEPINFER_CPU_BF16", "1")
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32
    assert resolve_dtype("auto", "bfloat16", "cuda") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8")


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    from deepinfer.config import cpu_has_native_bf16

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 sse\n")
    assert cpu_has_native_bf16(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni\n")
    assert not cpu_has_native_bf16.__wrapped__(str(info))
    assert not cpu_has_native_bf16(str(tmp_path / "absent"))


def test_engine_args_reject_unknown_options():
    with pytest.raises(ValueError, match="max_num_seq"):
        EngineArgs.from_kwargs(max_num_seq=4)
