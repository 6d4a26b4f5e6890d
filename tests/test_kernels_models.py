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
    """Ragged prefill chunks then decode steps: window, CSA (indexer kernel top-k) and HCA layers, the fused MoE,
    MTP included."""
    model = _v4()
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (40, 27)]
    splits = [[21, 9], [12, 14], [1, 1], [1, 1], [1, 0], [1, 1]]
    want = _steps(model, seqs, splits)
    _force_kernels(monkeypatch)
    got = _steps(model, seqs, splits)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _force_kernels(monkeypatch) -> None:
    from deepinfer.layers import moe
    from deepinfer.models import deepseek_v3

    for module in (deepseek_v4, deepseek_v3, moe):
        monkeypatch.setattr(module, "triton_enabled", lambda t: True)


def _mla(kind: str):
    from tiny_models import V3_TINY, V32_TINY

    from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM

    raw = {"v3": {**V3_TINY, "model_type": "deepseek_v3"}, "v32": {**V32_TINY, "model_type": "deepseek_v32"}}[kind]
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(raw), dtype=torch.float32, device="cpu").eval()
    randomise(model, seed=5)
    return model


def _mla_logits(model, seqs) -> list[torch.Tensor]:
    """A ragged prefill, then decode steps (several requests with one new token each)."""
    from paged_mla import PagedRun

    run = PagedRun(model, seed=3)
    out = run.step([(0, seqs[0][:13]), (1, seqs[1][:5])])
    for i in range(4):
        out += run.step([(0, [seqs[0][13 + i]]), (1, [seqs[1][5 + i]]), (2, [seqs[2][i]])])
    return out


@pytest.mark.parametrize("kind", ["v3", pytest.param("v32", marks=pytest.mark.slow)])
def test_mla_kernel_paths_match_torch_paths(monkeypatch, kind):
    """MLA paged decode (V3), the fused MoE, and the DSA indexer's decode selection (V3.2)."""
    model = _mla(kind)
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(3, 512, (20,), generator=g).tolist() for _ in range(3)]
    want = _mla_logits(model, seqs)
    _force_kernels(monkeypatch)
    got = _mla_logits(model, seqs)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
