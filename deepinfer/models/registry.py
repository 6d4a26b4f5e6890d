"""model_type -> model class."""

from __future__ import annotations

import importlib

from torch import nn

from deepinfer.config import ConfigError, ModelConfig

_MODELS = {
    "deepseek_v4": ("deepinfer.models.deepseek_v4", "DeepseekV4ForCausalLM"),
    "deepseek_v41": ("deepinfer.models.deepseek_v41", "DeepseekV41ForCausalLM"),
    "deepseek_v32": ("deepinfer.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "deepseek_v3": ("deepinfer.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "deepseek_v2": ("deepinfer.models.deepseek_v3", "DeepseekV3ForCausalLM"),
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    if config.model_type not in _MODELS:
        raise ConfigError(f"no model implementation for model_type {config.model_type!r}")
    module, name = _MODELS[config.model_type]
    return getattr(importlib.import_module(module), name)


def default_block_size(config: ModelConfig) -> int:
    """V4: a multiple of every compress ratio (128 for V4-Flash); V4.1 and MLA: 64 tokens."""
    if not config.is_v4:
        return 64
    size = 16
    for ratio in set(config.compress_ratios) - {0}:
        size = size * ratio // _gcd(size, ratio)
    return size


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
