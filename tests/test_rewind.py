"""Rolling back V4's bounded state: position-indexed rings with `num_lookahead_tokens` spare positions make
recomputing after a rejected draft exact; without the spare positions it is measurably wrong."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer.config import ModelConfig
from deepinfer.layers.metadata import ForwardMeta
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.loader import iter_checkpoint

BLOCK = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_reference(make_reference("v4", seed=4), tmp_path_factory.mktemp("v4"))


def _model(path, lookahead: int) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(ModelConfig.from_hf(path))
    model.load_weights(iter_checkpoint(path, "deepseek_v4"))
    model.num_lookahead_tokens = lookahead
    specs = model.kv_cache_spec(BLOCK)
    model.bind_kv_cache({s.name: torch.zeros((16 if s.kind == "paged" else 1, *s.shape), dtype=s.dtype)
                         for s in specs})
    return model.eval()


@torch.no_grad()
def _step(model, tokens: list[int], start: int) -> torch.Tensor:
    """Compute `tokens` at positions start.. for one request (slot 0, blocks 0..15); logits of every row."""
    n = len(tokens)
    meta = ForwardMeta(torch.tensor(tokens), torch.arange(start, start + n), torch.zeros(n, dtype=torch.long),
                       torch.arange(16)[None], torch.tensor([0]), torch.arange(n), [0, n], [start], [start + n], BLOCK)
    return model.compute_logits(model(meta))


def _rolled_back_run(model, prompt, accepted, rejected) -> torch.Tensor:
    _step(model, prompt, 0)
    _step(model, rejected, len(prompt))  # drafts that verification rejects
    return _step(model, accepted, len(prompt))  # roll back: recompute from the same position


@pytest.mark.parametrize("k", [1, 3, 6])
def test_rollback_of_k_tokens_is_exact_with_k_lookahead(ckpt, k):
    g = torch.Generator().manual_seed(k)
    prompt, accepted, rejected = (torch.randint(3, 512, (n,), generator=g).tolist() for n in (45, k, k))
    straight = _model(ckpt, 0)
    _step(straight, prompt, 0)
    expected = _step(straight, accepted, len(prompt))
    got = _rolled_back_run(_model(ckpt, k), prompt, accepted, rejected)
    assert (got - expected).abs().max().item() < 1e-5


def test_rollback_without_lookahead_is_detected_as_inexact(ckpt):
    g = torch.Generator().manual_seed(0)
    prompt, accepted, rejected = (torch.randint(3, 512, (n,), generator=g).tolist() for n in (45, 6, 6))
    straight = _model(ckpt, 0)
    _step(straight, prompt, 0)
    expected = _step(straight, accepted, len(prompt))
    got = _rolled_back_run(_model(ckpt, 0), prompt, accepted, rejected)
    assert (got - expected).abs().max().item() > 1e-3
