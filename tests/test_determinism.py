"""Deterministic mode: one request's full logits (bitwise) and seeded temperature-1 tokens are the same
alone, among 31 other random requests, at another batch position, with another prefill chunk size and
after a preemption. Bundled default model, a tiny V4, a tiny V3 and a tiny V3.2. The default mode runs the same
scenarios; whether it differs is recorded by benchmarks/determinism.py, nothing is asserted about it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer import SamplingParams
from deepinfer.config import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.layers.batch_invariant import position_seed, token_meta
from deepinfer.llm import default_model_path

TARGET = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
BLOCK = {"default": 16, "v4": 16, "v3": 8, "v32": 8}


@pytest.fixture(scope="module", params=list(BLOCK))
def ckpt(request, tmp_path_factory):
    kind = request.param
    if kind == "default":
        return kind, default_model_path()
    return kind, save_reference(make_reference(kind, seed=7), tmp_path_factory.mktemp(kind))


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path, kind: str, deterministic: bool, **options) -> EngineCore:
    args = dict(block_size=BLOCK[kind], load_progress=False, kv_cache_memory_bytes=32 * 2**20,
                max_num_batched_tokens=256, deterministic=deterministic, seed=0)
    return EngineCore(path, EngineArgs(**{**args, **options}))


def run_scenario(path, kind: str, scenario: str, deterministic: bool) -> tuple[list[int], torch.Tensor, int]:
    """(target tokens, target logits [8, V] of every sampled position, tokens the target had generated when
    it was first preempted (-1: never))."""
    options = {"chunk": {"max_num_batched_tokens": 7}}.get(scenario, {})
    if scenario == "preempt":
        budget = _budget_for_blocks(path, kind, 96 // BLOCK[kind])
        options = {"kv_cache_memory_bytes": budget, "max_num_batched_tokens": 64}
    engine = _engine(path, kind, deterministic, **options)
    vocab = engine.model_config.vocab_size
    target = _tokens(37, 99, vocab)
    others = [(f"o{i}", _tokens(5 + 3 * i % 23, i, vocab),
               SamplingParams(temperature=0.8, seed=i, max_tokens=3 + i % 6, ignore_eos=True)) for i in range(31)]
    if scenario == "preempt":  # a neighbour admitted first outgrows its blocks while the target decodes
        others = [("o0", _tokens(44, 5, vocab), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]
    if scenario in ("batch", "preempt"):
        for rid, prompt, params in others:
            engine.add_request(rid, prompt, params)
    engine.add_request("target", target, TARGET)
    if scenario == "position":
        for rid, prompt, params in others:
            engine.add_request(rid, prompt, params)
    rows = _capture(engine)
    req, generated_at_preemption = engine.scheduler.requests["target"], -1
    while engine.has_unfinished:
        engine.step()
        if req.num_preemptions and generated_at_preemption < 0:
            generated_at_preemption = len(req.output_token_ids)
    return list(req.output_token_ids), torch.stack(rows), generated_at_preemption


def _capture(engine: EngineCore) -> list[torch.Tensor]:
    rows, sample = [], engine.runner._sample

    def capturing(out, logits, sample_rows, result):
        rows.extend(logits[i].clone() for i, (req, _) in enumerate(sample_rows) if req.request_id == "target")
        return sample(out, logits, sample_rows, result)

    engine.runner._sample = capturing
    return rows


def _budget_for_blocks(path, kind: str, blocks: int) -> int:
    layout = _engine(path, kind, True).layout
    return layout.state_rows * layout.bytes_per_slot + blocks * layout.bytes_per_block


_ALONE: dict[str, tuple] = {}


@pytest.mark.parametrize("scenario", ["batch", "position", "chunk", "preempt"])
def test_deterministic_mode_is_batch_invariant(ckpt, scenario):
    kind, path = ckpt
    if kind not in _ALONE:
        _ALONE[kind] = run_scenario(path, kind, "alone", True)
    alone_tokens, alone_logits, _ = _ALONE[kind]
    tokens, logits, generated_at_preemption = run_scenario(path, kind, scenario, True)
    assert torch.equal(logits, alone_logits)
    assert tokens == alone_tokens
    assert len(tokens) == TARGET.max_tokens
    if scenario == "preempt":  # preempted mid-decode: later logits come from recomputing its own outputs
        assert 0 < generated_at_preemption < TARGET.max_tokens


def test_token_meta_depends_only_on_its_request():
    from deepinfer.layers.metadata import ForwardMeta

    long = torch.long
    meta = ForwardMeta(input_ids=torch.arange(5), positions=torch.tensor([3, 4, 5, 0, 1]),
                       token_req=torch.tensor([0, 0, 0, 1, 1]), block_table=torch.tensor([[7, 8, 9], [2, 0, 0]]),
                       state_slots=torch.tensor([4, 1]), logits_indices=torch.tensor([2, 4]),
                       query_start=[0, 3, 5], seq_starts=[3, 0], seq_lens=[6, 2], block_size=2,
                       paged_write_from=[5, 0])
    one = token_meta(meta, 1)
    assert one.positions.tolist() == [4] and one.seq_starts == [4] and one.seq_lens == [5]
    assert one.block_table.tolist() == [[7, 8, 9]] and one.state_slots.tolist() == [4]
    assert one.paged_write_from == [5]  # below the shared prefix: read, never written
    other = token_meta(meta, 4)
    assert other.block_table.tolist() == [[2]] and other.token_req.dtype == long
    assert other.paged_write_from == [1]


def test_position_seed_separates_requests_and_positions():
    seeds = {position_seed(s, k, p) for s in (0, 1) for k in ("a", "b") for p in (0, 1, 2)}
    assert len(seeds) == 12
    assert position_seed(3, "a", 5) == position_seed(3, "a", 5) < 2**63


def test_serve_and_llm_accept_the_flag():
    from deepinfer import cli

    args = cli.build_parser().parse_args(["serve", "--deterministic", "--async-scheduling"])
    kwargs = cli.engine_kwargs(args)
    assert kwargs["deterministic"] is True and kwargs["async_scheduling"] is True
    assert EngineArgs.from_kwargs(deterministic=True).deterministic
