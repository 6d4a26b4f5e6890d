"""The bundled model's training tool, run for a few tiny steps: it trains, checkpoints, resumes exactly,
and exports a checkpoint that the engine serves."""

from __future__ import annotations

import json

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.training.train import TrainConfig, train


def _config(out, steps: int) -> TrainConfig:
    return TrainConfig(out=out, batch=2, seq_len=32, max_steps=steps, warmup=1, save_every=1, vocab_size=512,
                       max_corpus_bytes=150_000)


def test_train_resume_and_serve(tmp_path):
    final = train(_config(tmp_path, 2))
    log = json.loads((tmp_path / "loss_log.json").read_text())
    assert [e["step"] for e in log] == [1, 2] and all(len(e["mtp"]) == 1 for e in log)
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
    train(_config(tmp_path, 3), resume=True)
    resumed = json.loads((tmp_path / "loss_log.json").read_text())
    assert [e["step"] for e in resumed] == [1, 2, 3] and resumed[:2] == log
    llm = LLM(final, load_progress=False, kv_cache_memory_bytes=16 * 2**20)
    assert llm.engine.model.mtp_loaded
    out = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_same_seed_same_first_steps(tmp_path):
    a = train(_config(tmp_path / "a", 2))
    (tmp_path / "b").mkdir()
    for item in ("tokenizer", "data"):  # share the tokenised data so only training is compared
        (tmp_path / "b" / item).symlink_to(tmp_path / "a" / item)
    b = train(_config(tmp_path / "b", 2))
    la = json.loads((tmp_path / "a" / "loss_log.json").read_text())
    lb = json.loads((tmp_path / "b" / "loss_log.json").read_text())
    assert [e["loss"] for e in la] == [e["loss"] for e in lb]
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
