"""DeepSeek-V4.1's own DSpark head (models/dspark_v41.py, spec/dspark_v41.py) against DeepSeek's reference goldens
(tests/golden/v41/{a,b}), and as a speculative-decoding proposer through the engine."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from v41_golden import GOLDEN, golden_threads, load_golden  # noqa: F401  (autouse: the goldens' threads)

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine.core import load_model
from deepinfer.layers.metadata import ForwardMeta
from deepinfer.spec.base import Draft, ProposeBatch, ProposeItem, Proposer
from deepinfer.spec.dspark_v41 import V41DSparkProposer

BLOCK = 16


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


@pytest.fixture(scope="module", params=["a", "b"])
def loaded(request):
    path = GOLDEN / request.param
    cfg = ModelConfig.from_hf(path)
    model = load_model(path, cfg, torch.bfloat16, torch.device("cpu"))
    return request.param, model, *load_golden(request.param)


def _drive(model, proposer, prompt: list[int], steps: int):
    """The reference schedule (prefill from 0, then one token per step), consuming every validated position
    into the DSpark rings; yields (step, tokens, logits, confidence logits) of the draft after each decode step."""
    specs = model.kv_cache_spec(BLOCK, include_mtp=True)
    model.bind_kv_cache({s.name: torch.zeros((32 if s.kind == "paged" else 2, *s.shape), dtype=s.dtype)
                         for s in specs})
    toks, blocks, start = list(prompt), list(range(16)), 0
    for s in range(steps):
        ids = toks[start:]
        n = len(ids)
        meta = ForwardMeta(_long(ids), _long(range(start, start + n)), _long([0] * n), _long([blocks]), _long([1]),
                           _long([n - 1]), [0, n], [start], [start + n], BLOCK, prompt_lens=[len(prompt)])
        with torch.inference_mode():
            hidden, taps = model(meta, return_mtp_input=True)
            nxt = int(model.compute_logits(hidden[meta.logits_indices])[-1].argmax())
            toks.append(nxt)
            item = ProposeItem("r", toks, start, n, list(range(n)), blocks, 1, 0, 0)
            proposer.propose(ProposeBatch([item], taps, BLOCK))  # max_drafts 0: consume only
            if s:
                yield (s - 1, *proposer.draft(_long([nxt]), _long([len(toks) - 2]), _long([1])))
        start = len(toks) - 1


def test_drafts_match_the_reference(loaded):
    """Drafts, draft logits and confidence bit for bit the reference's (at the goldens' thread count)."""
    name, model, g, gl = loaded
    ds = model.config.v41.dspark
    proposer = V41DSparkProposer(model, ds.block_size)
    for i, prompt in enumerate(g["prompts"]):
        for step, tokens, logits, conf in _drive(model, proposer, prompt, 12):
            assert tokens[0].tolist() == gl[f"fixed.p{i}.dspark_tokens"][step].tolist(), (i, step)
            assert torch.equal(logits[0], gl[f"fixed.p{i}.dspark_logits"][step]), (i, step)
            assert torch.equal(conf[0], gl[f"fixed.p{i}.dspark_confidence"][step]), (i, step)


def test_proposer_drafts_are_bounded_and_confidence_is_a_probability(loaded):
    _, model, g, _ = loaded
    ds = model.config.v41.dspark
    proposer = V41DSparkProposer(model, 2)
    for _ in _drive(model, proposer, g["prompts"][0], 2):
        pass
    toks = g["prompts"][0] + [7, 9]
    item = ProposeItem("r", toks, len(toks) - 2, 1, [0], list(range(16)), 1, 0, 5)
    taps = torch.zeros(1, model.config.hidden_size * len(ds.target_layer_ids), dtype=torch.bfloat16)
    draft = proposer.propose(ProposeBatch([item], taps, BLOCK))["r"]
    assert len(draft.token_ids) == 2 and all(0.0 < c < 1.0 for c in draft.confidence)
    with pytest.raises(ValueError, match="block"):
        V41DSparkProposer(model, ds.block_size + 1)


def _run(name: str, spec: dict | None, prompts, params, batched: bool):
    llm = LLM(model=str(GOLDEN / name), max_num_batched_tokens=512, load_progress=False, speculative_config=spec)
    try:
        if batched:
            out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        else:
            out = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        return out, (llm.engine.scheduler.spec_stats if spec else None)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name,k", [pytest.param("a", 2, marks=pytest.mark.slow),
                                    pytest.param("b", 3, marks=pytest.mark.slow), ("b", 1)])
def test_greedy_is_identical_with_dspark(name, k):
    g = load_golden(name)[0]
    prompts = [{"prompt_token_ids": p} for p in g["prompts"]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    spec = {"method": "dspark", "num_speculative_tokens": k}
    for batched in (False, True):  # batched: against the plain engine with the same batch
        base, _ = _run(name, None, prompts, params, batched)
        out, stats = _run(name, spec, prompts, params, batched)
        assert out == base, batched
        assert stats.num_draft_tokens > 0 and stats.mean_accepted_length >= 1.0
    if not batched:
        assert base == g["tracks"]["fixed"]["tokens"]


def test_acceptance_is_reported():
    """The seeded heads are untrained: on b (k = 3, 3 prompts x 24 tokens) 2 of 372 drafts are accepted."""
    g = load_golden("b")[0]
    prompts = [{"prompt_token_ids": p} for p in g["prompts"]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out, stats = _run("b", {"method": "dspark", "num_speculative_tokens": 3}, prompts, params, True)
    assert [len(o) for o in out] == [24] * 3
    assert stats.num_accepted_tokens > 0 and stats.mean_accepted_length > 1.0
    assert stats.drafted_per_pos[0] == stats.num_drafts and len(stats.drafted_per_pos) == 3


def test_sampling_with_dspark_runs():
    g = load_golden("b")[0]
    prompts = [{"prompt_token_ids": p} for p in g["prompts"]]
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    out, stats = _run("b", {"method": "dspark", "num_speculative_tokens": 2}, prompts, params, True)
    assert [len(o) for o in out] == [10, 10, 10] and stats.num_draft_tokens > 0


def test_dspark_without_the_head_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    src = GOLDEN / "a"
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items() if not k.startswith("mtp.")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="DSpark head"):
        LLM(model=str(tmp_path), load_progress=False, speculative_config={"method": "dspark",
                                                                          "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="block"):
        LLM(model=str(src), load_progress=False, speculative_config={"method": "dspark", "num_speculative_tokens": 3})


class _Rejected(Proposer):
    """Drafts two tokens the target (almost surely) rejects."""

    def propose(self, batch: ProposeBatch) -> dict[str, Draft]:
        return {it.request_id: Draft([5, 6], [0.5, 0.5]) for it in batch.items if it.max_drafts >= 2}


def test_backbone_is_lossless_under_rejected_drafts(monkeypatch):
    import deepinfer.engine.core as core

    g = load_golden("a")[0]
    prompts = [{"prompt_token_ids": p} for p in g["prompts"]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base, _ = _run("a", None, prompts, params, True)
    monkeypatch.setattr(core, "build_proposer", lambda *a, **k: _Rejected())
    out, _ = _run("a", {"method": "ngram", "num_speculative_tokens": 2}, prompts, params, True)
    assert out == base


@pytest.mark.slow
def test_confidence_scheduled_verify_length_is_lossless():
    """verify_policy adaptive: the DSpark confidence head's probabilities set each request's verify length."""
    g = load_golden("b")[0]
    prompts = [{"prompt_token_ids": p} for p in g["prompts"]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    spec = {"method": "dspark", "num_speculative_tokens": 3, "verify_policy": "adaptive"}
    base, _ = _run("b", None, prompts, params, True)
    llm = LLM(model=str(GOLDEN / "b"), max_num_seqs=4, load_progress=False, speculative_config=spec)  # calibrates 1-4
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == base
    finally:
        llm.shutdown()
