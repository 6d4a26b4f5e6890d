"""benchmarks/v4_official.py: a V4 checkpoint in DeepSeek's original layout (official names and config keys, MXFP4
routed experts) serves exactly what the transformers-layout checkpoint with the same (FP4-rounded) weights does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.llm import default_model_path
from deepinfer.models.loader import dequantize_fp4

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
v4_official = pytest.importorskip("v4_official")
transformers = pytest.importorskip("transformers")


def test_mxfp4_rounds_to_the_nearest_code_of_a_power_of_two_scale():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 3
    w[1, :32] = 0  # an all-zero group
    packed, scale = v4_official.quantize_mxfp4(w)
    assert packed.shape == (16, 32) and scale.shape == (16, 2) and scale.dtype == torch.float8_e8m0fnu
    back = dequantize_fp4(packed, scale)
    step = scale.float().repeat_interleave(32, 1) * 2  # the widest E2M1 gap (4 -> 6) at the group's scale
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert (back.abs().reshape(16, 2, 32).amax(-1) <= 6 * scale.float()).all()  # the scale fits the group's max
    assert torch.equal(back[1, :32], torch.zeros(32))
    assert torch.equal(dequantize_fp4(*v4_official.quantize_mxfp4(back)), back)  # codes are fixed points


def _generate(path: Path) -> tuple[list[int], list[float]]:
    llm = LLM(str(path), dtype="float32", enforce_eager=True, load_progress=False, max_num_seqs=4,
              kv_cache_memory_bytes=64 * 2**20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": list(range(20, 180))}], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def test_official_layout_serves_what_the_transformers_layout_does(tmp_path):
    official = v4_official.build(tmp_path / "official", default_model_path())
    torch.manual_seed(0)  # build's seed: the same random weights, experts rounded as build rounds them
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**v4_official.V4_HD512)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, out, in]
                p.copy_(torch.stack([dequantize_fp4(*v4_official.quantize_mxfp4(w)) for w in p]))
    model.save_pretrained(tmp_path / "hf")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / file).write_bytes((default_model_path() / file).read_bytes())
    assert sorted(p.name for p in official.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                          "tokenizer_config.json"]
    assert _generate(official) == _generate(tmp_path / "hf")
