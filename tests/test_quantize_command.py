"""`deepinfer quantize`: AWQ and round-to-nearest int4 checkpoints of the bundled model and tiny V2 / V3 / V4.

What is checked: the written checkpoint reloads (packed int4 in memory) and serves; every AWQ scale fold is
exact (the command keeps a fold kind only when the model's output is unchanged, so all kinds being kept means
all were exact); AWQ is closer than round-to-nearest to the unquantised model on held-out text (KL and
top-1 agreement, the bundled model: trained, so its activations have the structure AWQ exploits) and on the
calibration inputs (every model); the packed weights are 3.5-4x smaller than bf16 at group 128.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main
from deepinfer.layers.int4_linear import Int4Linear
from deepinfer.llm import default_model_path
from deepinfer.quantization.quantize import REPORT_FILE, QuantizeOptions, quantize
from deepinfer.training.corpus import iter_documents


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n".join(iter_documents("train", max_bytes=300_000)))
    return path


@pytest.fixture(scope="module")
def heldout():
    tok = LLM(load_progress=False, kv_cache_memory_bytes=8 * 2**20, enforce_eager=True).get_tokenizer()
    ids = tok.encode("\n".join(iter_documents("heldout", max_bytes=60_000)))
    return [ids[i:i + 256] for i in range(0, len(ids) - 256, 256)][:8]


def _logprobs(path, windows) -> list[torch.Tensor]:
    """Every held-out position's log-softmax row (the step's logits: [sampled row, positions 0 .. n - 2])."""
    llm = LLM(model=path, dtype="float32", enforce_eager=True, enable_prefix_caching=False, load_progress=False,
              kv_cache_memory_bytes=16 * 2**20)
    rows, compute = [], llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]
    out = []
    for w in windows:
        rows.clear()
        llm.generate([w], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        out.append(torch.cat(rows)[1:len(w)].float().log_softmax(-1))
    llm.shutdown()
    return out


def _closeness(rows, base) -> tuple[float, float]:
    kl = torch.cat([(b.exp() * (b - a)).sum(-1) for a, b in zip(rows, base)]).mean()
    top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(rows, base)]).float().mean()
    return float(kl), float(top1)


def test_awq_is_closer_than_round_to_nearest_on_the_bundled_model(tmp_path, calib, heldout):
    src = default_model_path()
    awq = quantize(src, tmp_path / "awq", QuantizeOptions("awq", 128, calib, 16, 256, progress=False))
    rtn = quantize(src, tmp_path / "rtn", QuantizeOptions("rtn", 128, None, progress=False))
    assert awq["scales_folded"] == {"attn_norm": 4, "attn.q_norm": 4, "ffn_norm": 4, "wo_a->wo_b": 4}
    assert awq["weights_quantized"] == rtn["weights_quantized"] == 140
    assert awq["calibration_error_vs_rtn"]["mean"] < 0.9
    assert 3.5 <= awq["bf16_over_int4"] <= 4.0
    base = _logprobs(src, heldout)
    (kl_awq, top1_awq), (kl_rtn, top1_rtn) = _closeness(_logprobs(tmp_path / "awq", heldout), base), \
        _closeness(_logprobs(tmp_path / "rtn", heldout), base)
    assert kl_awq < 0.95 * kl_rtn and top1_awq >= top1_rtn, (kl_awq, kl_rtn, top1_awq, top1_rtn)


@pytest.mark.parametrize("kind", ["v3", "v2", "v4"])
def test_quantize_tiny_models_folds_exactly_and_reloads(tmp_path, calib, kind):
    save_reference(make_reference(kind, vocab_size=8192), tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / name, tmp_path / "src" / name)
    report = quantize(tmp_path / "src", tmp_path / "awq", QuantizeOptions("awq", 32, calib, 8, 128, progress=False))
    kinds = {"v4": {"attn_norm", "attn.q_norm", "ffn_norm", "wo_a->wo_b"}}.get(
        kind, {"input_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm", "post_attention_layernorm",
               "v->o", "up->down"})
    # none of these dropped: each left the model's output unchanged (V4's up -> down depends on its clamp)
    assert kinds <= set(report["scales_folded"]) <= kinds | {"up->down"}
    assert report["calibration_error_vs_rtn"]["mean"] < 1.0
    quant = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]
    skipped = quant.pop("modules_to_not_convert")
    assert quant == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    mtp = {"v3": "model.layers.3.", "v4": "mtp."}.get(kind)  # the MTP layers stay float
    assert (mtp in skipped) if mtp else not any(s.startswith("model.layers.3") for s in skipped)
    llm = LLM(model=tmp_path / "awq", quantization="awq", dtype="float32", load_progress=False,
              kv_cache_memory_bytes=8 * 2**20, enforce_eager=True)
    assert any(isinstance(m, Int4Linear) for m in llm.engine.model.modules())
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    llm.shutdown()


def test_cli(tmp_path, capsys):
    assert main(["quantize", "--method", "awq", "--out", str(tmp_path / "x")]) == 2
    assert "--calib FILE" in capsys.readouterr().err
    assert main(["quantize", "--method", "rtn", "--out", str(tmp_path / "rtn")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == "rtn" and summary["weights_quantized"] == 140
    assert (tmp_path / "rtn" / REPORT_FILE).exists() and (tmp_path / "rtn" / "tokenizer.json").exists()
    assert main(["generate", "--model", str(tmp_path / "rtn"), "--max-tokens", "4", "def main():"]) == 0
    assert main(["quantize", "--method", "awq", "--calib", str(tmp_path / "none.txt"), "--out",
                 str(tmp_path / "y")]) == 2
    assert main(["quantize", "--method", "rtn", "--out", str(tmp_path / "z"), str(tmp_path / "rtn")]) == 2
    assert "already a awq int4 checkpoint" in capsys.readouterr().err
    assert main(["quantize", "--method", "rtn", "--out", str(tmp_path / "rtn")]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["quantize", "--method", "awq", "--calib", str(tmp_path / "rtn" / "tokenizer.json"),
                 "--calib-seq-len", "1", "--out", str(tmp_path / "w")]) == 2
    assert "at least one window" in capsys.readouterr().err


def test_fp8_source_keeps_its_float_dtype_for_what_stays_float(tmp_path):
    """An FP8 checkpoint's weights that are not quantised (at group 128: those with 64 or 32 inputs) are written
    in the checkpoint's float dtype, not as the float32 the loader dequantises them to."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from deepinfer.layers.quant_linear import quantize_fp8_block

    save_reference(make_reference("v3"), tmp_path / "src")
    with safe_open(str(tmp_path / "src" / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    fp8 = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.1.") and name.endswith("proj.weight"):
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_block(t, (128, 128))
        else:
            fp8[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    (tmp_path / "fp8").mkdir()
    save_file(fp8, str(tmp_path / "fp8" / "model.safetensors"))
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config |= {"torch_dtype": "bfloat16",
               "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    quantize(tmp_path / "fp8", tmp_path / "rtn", QuantizeOptions("rtn", 128, progress=False))
    with safe_open(str(tmp_path / "rtn" / "model.safetensors"), "pt") as f:
        kept = [f.get_tensor(n) for n in f.keys() if n.startswith("model.layers.1.") and n.endswith("proj.weight")]
        assert kept and all(t.dtype == torch.bfloat16 for t in kept)  # q_b_proj, kv_b_proj, the experts' down_proj
        assert not [n for n in f.keys() if n.endswith("weight_scale_inv")]
        assert any(n.startswith("model.layers.1.") and n.endswith(".qweight") for n in f.keys())


def test_packed_layers_equal_the_loaders_values_in_bf16():
    from deepinfer.quantization.int4 import quantize_int4

    w = quantize_int4(torch.randn(64, 256) * 3, 128)
    assert torch.equal(Int4Linear(w).dequantized_weight(torch.bfloat16), w.dequantize().to(torch.bfloat16))
