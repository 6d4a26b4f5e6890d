"""The DSpark training tool: self-distillation data are the target's own greedy continuations, drafter
positions train only inside them, training resumes exactly where it stopped and exports a loadable drafter."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.llm import default_model_path
from deepinfer.models.dspark import DSparkDrafter
from deepinfer.training.train_dspark import DSparkTrainConfig, WindowSampler, train


def _config(tmp_path, **kw) -> DSparkTrainConfig:
    options = dict(data="generated", gen_sequences=4, prompt_len=8, gen_tokens=12, batch=2, positions=8, max_steps=2,
                   save_every=1, max_corpus_bytes=20_000, init=str(default_model_path() / "dspark")) | kw
    return DSparkTrainConfig(out=tmp_path / "run", **options)


def test_generated_data_are_greedy_continuations_and_training_resumes(tmp_path):
    cfg = _config(tmp_path)
    train(cfg, export=tmp_path / "export")
    seqs = np.load(cfg.out / "data" / "generated_4x8+12.npy")
    assert seqs.shape == (4, 20)
    llm = LLM(load_progress=False, kv_cache_memory_bytes=16 * 2**20)
    greedy = llm.generate([{"prompt_token_ids": s[:8].tolist()} for s in seqs],
                          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in greedy] == seqs[:, 8:].tolist()
    log = json.loads((cfg.out / "log.json").read_text())
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["ce"]) for r in log)
    exported = DSparkDrafter.load(tmp_path / "export")
    assert exported.cfg.num_draft_tokens == 4 and (cfg.out / "training.png").stat().st_size > 0
    train(replace(cfg, max_steps=3), resume=True)
    assert [r["step"] for r in json.loads((cfg.out / "log.json").read_text())] == [1, 2, 3]


def test_generated_windows_train_only_inside_the_continuations(tmp_path):
    cfg = _config(tmp_path, positions=1000)
    sampler = WindowSampler(cfg, torch.Generator().manual_seed(0))
    window, rows = sampler.sample()
    assert window.shape == (2, 20) and sampler.seq_len == 20 - 1 - 4
    # anchor t >= prompt_len - 1: the drafted tokens t + 2 .. are generated ones; every such anchor is used
    assert sorted((rows % sampler.seq_len).tolist()) == sorted(list(range(7, 15)) * 2)
