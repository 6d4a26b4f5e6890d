"""The models' Triton paths (what CUDA runs) against their torch paths, end to end on tiny random models: the
kernels are forced on and run under Triton's interpreter on CPU."""

import pytest
import torch

pytest.importorskip("triton")

from tiny_models import V4_TINY  # noqa: E402
from v4_runs import Run, randomise  # noqa: E402

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.models import deepseek_v4  # noqa: E402
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402


def _v4() -> DeepseekV4ForCausalLM:
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(ModelConfig.from_dict({**V4_TINY, "model_type": "deepseek_v4"})).eval()
    randomise(model, seed=3)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.attn_sink.copy_(torch.randn(layer.attn.attn_sink.shape))
    return model


def _steps(model, seqs, splits) -> list[torch.Tensor]:
    run = Run(model, seqs)
    with torch.no_grad():
        return [h for counts in splits for h in run.step(counts)]


def test_v4_kernel_path_matches_torch_path(monkeypatch):
    """Ragged prefill chunks then decode steps: window, CSA top-k and HCA layers, MTP included."""
    model = _v4()
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (40, 27)]
    splits = [[21, 9], [12, 14], [1, 1], [1, 1], [1, 0], [1, 1]]
    want = _steps(model, seqs, splits)
    monkeypatch.setattr(deepseek_v4, "triton_enabled", lambda t: True)
    got = _steps(model, seqs, splits)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
