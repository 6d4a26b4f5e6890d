"""Int4 (AWQ / GPTQ) checkpoints: the layouts, the loader, packed int4 layers, and the AWQ searches.

The checkpoints here are written by this file's own writers, built from the layouts' definitions (AutoAWQ's GEMM
packing order, AutoGPTQ's row packing with zero - 1), independent of deepinfer's packers: each replaces a tiny
transformers checkpoint's projection and expert weights by random codes, zero points and float16 scales, and a
float twin holds the values those stand for, (q - z) * s. Loading the int4 checkpoint must match the twin
exactly, packed in memory or dequantised at load.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.config import ConfigError, ModelConfig
from deepinfer.engine.core import KEEP_QUANTIZED_ENV
from deepinfer.layers.int4_linear import Int4Linear
from deepinfer.models.loader import CheckpointError, iter_checkpoint
from deepinfer.quantization.awq import SearchGrid, fake_quantize, output_error, search_clip, search_scale
from deepinfer.quantization.int4 import (
    awq_tensors,
    awq_weight,
    gptq_dequantize,
    pack_int32,
    quantize_int4,
    unpack_int32,
)
from deepinfer.quantization.spec import Int4Spec

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # from AutoAWQ's GEMM packer: nibble j of a word holds output 8c + ORDER[j]


# --- independent writers, from the layouts' definitions -------------------------------------------------------
def _words(nibbles: np.ndarray) -> np.ndarray:
    """int32 words of [..., 8] nibble values, nibble j at bits 4j."""
    word = np.zeros(nibbles.shape[:-1], dtype=np.uint64)
    for j in range(8):
        word |= nibbles[..., j].astype(np.uint64) << np.uint64(4 * j)
    return word.astype(np.uint32).view(np.int32)


def awq_pack(q: np.ndarray) -> np.ndarray:
    """[rows, out] values -> int32 [rows, out / 8]: word c's nibble j is column 8c + AWQ_ORDER[j]."""
    rows, out = q.shape
    return _words(np.stack([q[:, [8 * c + AWQ_ORDER[j] for c in range(out // 8)]] for j in range(8)], -1))


def gptq_pack_rows(q: np.ndarray) -> np.ndarray:
    """[in, out] -> int32 [in / 8, out]: row r's nibble j is input 8r + j."""
    return _words(np.stack([q[j::8] for j in range(8)], -1))


def gptq_pack_cols(q: np.ndarray) -> np.ndarray:
    """[G, out] -> int32 [G, out / 8]: nibble j of word c is column 8c + j."""
    return _words(q.reshape(q.shape[0], -1, 8))


def random_int4(out: int, cols: int, gen: np.random.Generator, g_idx: np.ndarray | None = None):
    """(codes [in, out], zeros [G, out], float16 scales [G, out]) and the float [out, in] they stand for; input i
    is in group g_idx[i] (default i // GROUP)."""
    g = cols // GROUP
    codes, zeros = gen.integers(0, 16, (cols, out)), gen.integers(1, 16, (g, out))  # GPTQ v1 stores zero - 1
    scales = (0.002 + 0.004 * gen.random((g, out))).astype(np.float16)
    rows = np.arange(cols) // GROUP if g_idx is None else g_idx
    weight = (codes - zeros[rows]) * scales[rows].astype(np.float32)
    return codes, zeros, scales, torch.from_numpy(weight.T.astype(np.float32)).contiguous()


def _int4_candidate(name: str, t: torch.Tensor) -> bool:
    parts = name.split(".")
    return (t.dim() == 2 and parts[-1] == "weight" and parts[-2] != "gate" and "layers" in parts
            and t.shape[1] % GROUP == 0 and t.shape[0] % 8 == 0 and "kv_b_proj" not in name)


def write_int4(src, int4_dir, float_dir, method: str = "awq", seed: int = 0, act_order: bool = True) -> set[str]:
    """The int4 checkpoint and its float twin of tiny checkpoint `src`; returns the int4 stems."""
    gen, int4, twin, stems = np.random.default_rng(seed), {}, {}, set()
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if not _int4_candidate(name, t):
                int4[name] = twin[name] = t
                continue
            stem = name.removesuffix(".weight")
            g_idx = None if method == "awq" else _act_order(t.shape[1], gen) if act_order else \
                (np.arange(t.shape[1]) // GROUP).astype(np.int32)
            codes, zeros, scales, twin[name] = random_int4(t.shape[0], t.shape[1], gen, g_idx)
            int4 |= _layout(stem, codes, zeros, scales, g_idx)
            stems.add(stem)
    config = json.loads((src / "config.json").read_text())
    for out, tensors, quant in ((int4_dir, int4, _quant_config(method)), (float_dir, twin, None)):
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**config, **({"quantization_config": quant} if quant else {})}))
    return stems


def _quant_config(method: str) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False}


def _act_order(cols: int, gen: np.random.Generator) -> np.ndarray:
    """GPTQ's act order: groups formed over a permutation of the inputs, so g_idx is not monotonic."""
    g_idx = np.empty(cols, dtype=np.int32)
    g_idx[gen.permutation(cols)] = np.arange(cols) // GROUP
    return g_idx


def _layout(stem, codes, zeros, scales, g_idx) -> dict[str, torch.Tensor]:
    t = torch.from_numpy
    if g_idx is None:  # AWQ
        return {f"{stem}.qweight": t(awq_pack(codes)), f"{stem}.qzeros": t(awq_pack(zeros)),
                f"{stem}.scales": t(scales)}
    return {f"{stem}.qweight": t(gptq_pack_rows(codes)), f"{stem}.qzeros": t(gptq_pack_cols(zeros - 1)),
            f"{stem}.scales": t(scales), f"{stem}.g_idx": t(g_idx)}


# --- layouts --------------------------------------------------------------------------------------------------
def test_pack_unpack_roundtrip_and_awq_layout_bit_exact():
    gen = np.random.default_rng(1)
    codes = torch.from_numpy(gen.integers(0, 16, (5, 64))).to(torch.uint8)
    assert torch.equal(unpack_int32(pack_int32(codes)), codes)
    q, z, s, weight = random_int4(48, 64, gen)
    tensors = {"qweight": torch.from_numpy(awq_pack(q)), "qzeros": torch.from_numpy(awq_pack(z)),
               "scales": torch.from_numpy(s)}
    w = awq_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], GROUP)
    assert torch.equal(w.dequantize(), weight)  # the independent writer's values, exactly
    again = awq_tensors(w)
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)  # and back to the same words, bit for bit


def test_gptq_layout_with_act_order():
    gen = np.random.default_rng(2)
    g_idx = _act_order(64, gen)
    q, z, s, weight = random_int4(16, 64, gen, g_idx)
    got = gptq_dequantize(torch.from_numpy(gptq_pack_rows(q)), torch.from_numpy(gptq_pack_cols(z - 1)),
                          torch.from_numpy(s), torch.from_numpy(g_idx), GROUP)
    assert torch.equal(got, weight)


def test_round_to_nearest_is_within_half_a_step_inside_the_range():
    w = torch.randn(16, 128)
    q = quantize_int4(w, GROUP)
    step = q.scales.repeat_interleave(GROUP, 1)
    err = (q.dequantize() - w).abs() / step
    # only a group's extremes can land past code 15 / 0 (the zero point is rounded): at most one step there
    assert int(q.codes.max()) <= 15 and float(err.max()) <= 1.0 and float((err > 0.5 + 1e-4).float().mean()) < 0.02


def test_awq_searches_never_lose_to_round_to_nearest_and_win_with_outliers():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen)
    x[:, :4] *= 30  # a few outlier input channels, as real activations have
    w = torch.randn(64, 128, generator=gen) * 0.02
    rtn = output_error(w, fake_quantize(w, GROUP), x)
    s = search_scale(w, x, GROUP)
    scaled = output_error(w, fake_quantize(w * s, GROUP) / s, x)
    clipped = output_error(w, fake_quantize(w, GROUP, search_clip(w, x, GROUP)), x)
    assert scaled < 0.8 * rtn and clipped <= rtn
    flat = torch.randn(512, 128, generator=gen)
    assert output_error(w, fake_quantize(w * (s2 := search_scale(w, flat, GROUP, SearchGrid())), GROUP) / s2, flat) \
        <= output_error(w, fake_quantize(w, GROUP), flat)


# --- checkpoints ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["v3", "v4"])
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    save_reference(make_reference(request.param), root / "src")
    stems = write_int4(root / "src", root / "awq", root / "twin")
    return request.param, root, stems


def _generate(path, keep: str):
    os.environ[KEEP_QUANTIZED_ENV] = keep
    try:
        llm = LLM(model=path, dtype="float32", enforce_eager=True, load_progress=False,
                  kv_cache_memory_bytes=8 * 2**20)
        out = llm.generate([[3, 5, 7, 9, 11, 13, 15, 17]], SamplingParams(max_tokens=12, logprobs=3, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        packed = [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear)]
        experts = [m for m in llm.engine.model.modules() if getattr(m, "quant", None) == "int4"]
        llm.shutdown()
        return out.token_ids, [{k: v.logprob for k, v in d.items()} for d in out.logprobs], packed, experts
    finally:
        os.environ.pop(KEEP_QUANTIZED_ENV, None)


def test_int4_checkpoint_matches_its_float_twin_exactly(tiny):
    kind, root, stems = tiny
    twin = _generate(root / "twin", "1")
    packed = _generate(root / "awq", "1")
    loaded = _generate(root / "awq", "0")
    assert packed[:2] == twin[:2] and loaded[:2] == twin[:2]  # tokens and logprobs, bit for bit
    assert packed[2] and packed[3] and not loaded[2] and not loaded[3]
    numel = sum(m.in_features * m.out_features for m in packed[2])
    assert sum(m.memory_bytes() for m in packed[2]) == numel // 2 + 4 * numel // GROUP  # 0.5 B a weight, 4 a group


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_checkpoint_matches_its_float_twin(tmp_path, act_order):
    save_reference(make_reference("v3"), tmp_path / "src")
    write_int4(tmp_path / "src", tmp_path / "gptq", tmp_path / "twin", method="gptq", act_order=act_order)
    got, twin = _generate(tmp_path / "gptq", "1"), _generate(tmp_path / "twin", "1")
    assert got[:2] == twin[:2]
    assert bool(got[2]) != act_order  # consecutive groups stay packed; act order is dequantised at load


def _rewrite(src, dst, edit) -> None:
    dst.mkdir()
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    config = json.loads((src / "config.json").read_text())
    tensors, config = edit(tensors, config)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))


def _load_all(path):
    config = ModelConfig.from_hf(path)
    return list(iter_checkpoint(path, config.model_type, int4=config.quantization))


def test_bad_int4_checkpoints_name_the_tensor(tiny, tmp_path):
    _, root, stems = tiny
    stem = min(stems)
    cases = {
        "missing": (lambda t, c: ({n: v for n, v in t.items() if n != f"{stem}.qzeros"}, c), f"{stem}.qzeros"),
        "group": (lambda t, c: (t, {**c, "quantization_config": {**c["quantization_config"], "group_size": 64}}),
                  f"{stem} (group size 64): qzeros"),
        "no config": (lambda t, c: (t, {k: v for k, v in c.items() if k != "quantization_config"}),
                      "quantization_config"),
    }
    for label, (edit, expected) in cases.items():
        _rewrite(root / "awq", tmp_path / label.replace(" ", "_"), edit)
        with pytest.raises(CheckpointError, match=re.escape(expected)):
            _load_all(tmp_path / label.replace(" ", "_"))


def test_bad_int4_configs_are_clear(tiny, tmp_path):
    _, root, _ = tiny
    raw = json.loads((root / "awq" / "config.json").read_text())
    for quant, message in (({"bits": 8}, "bits"), ({"group_size": 7}, "group_size"), ({"version": "gemv"}, "GEMM")):
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_dict({**raw, "quantization_config": {**raw["quantization_config"], **quant}})
    with pytest.raises(ValueError, match="quantization='gptq' was requested, but the model is a awq checkpoint"):
        LLM(model=root / "awq", quantization="gptq", load_progress=False)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(model=root / "awq", quantization="int3", load_progress=False)


def test_int4_spec_round_trips_its_config():
    from deepinfer.quantization.spec import int4_spec

    for spec in (Int4Spec("awq", 128, modules_to_not_convert=("gate",)), Int4Spec("gptq", 64, zeros_minus_one=False)):
        assert int4_spec(spec.to_config()) == spec
    assert int4_spec({"quant_method": "fp8", "weight_block_size": [128, 128]}) is None
