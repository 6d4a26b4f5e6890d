"""V4's tiled prompt attention (models/v4_plan.tile_plan, layers/attention.tiled_sink_attention) against the
row-by-row path it replaces for prompt chunks: the same keys per query, the same attention, the same model
outputs. (tests/test_parity.py checks both paths against transformers: its prompts of 17-70 tokens are tiled.)"""

from __future__ import annotations

import pytest
import torch
from ragged_steps import ragged_step
from tiny_models import make_reference, save_reference

import deepinfer.models.v4_plan as v4_plan
from deepinfer import LLM, SamplingParams
from deepinfer.layers.attention import sink_attention, tiled_sink_attention
from deepinfer.layers.gather import take_rows
from deepinfer.models.v4_plan import tile_plan, window_plan

STEPS = [([0, 5, 40, 3], [40, 1, 33, 20]),  # fresh prompt, a decode, a chunk after a full window, a short chunk
         ([0], [7]), ([100], [64]), ([2, 9], [1, 1])]


@pytest.mark.parametrize("starts,news", STEPS)
@pytest.mark.parametrize("rows", [4, 8])
def test_tiles_attend_exactly_each_querys_window(starts, news, rows):
    """Every real tile row sees the keys the window plan gives its token, in position order; tokens of requests
    with fewer than min_queries queries are left to the row path, and every token is covered once."""
    window = 16
    meta = ragged_step(starts, news, block_size=16)
    plan = window_plan(meta, window)
    tiles = tile_plan(meta, plan.source, window, rows=rows, min_queries=rows // 2)
    source = torch.randn(plan.source.ring_rows.numel() + meta.num_tokens, 3)
    if tiles is None:
        assert all(n < rows // 2 for n in news)
        return
    covered = torch.cat([tiles.real_tokens, tiles.others]).sort().values
    assert torch.equal(covered, torch.arange(meta.num_tokens))
    keys = take_rows(source, tiles.key_idx)  # [nt, K, 3]
    flat_valid = tiles.key_valid.flatten(0, 1)
    for row, token in zip(tiles.real_rows.tolist(), tiles.real_tokens.tolist()):
        tile = row // rows
        assert tiles.tokens.flatten()[row] == token
        mine = keys[tile][flat_valid[row]]
        expected = source[plan.key_idx[token]][plan.key_valid[token]]
        assert torch.equal(mine, expected)


def _per_row_reference(q, tokens, keys, valid, extra, extra_valid, sinks, scale):
    """sink_attention over each tile row's keys, gathered per row."""
    nt, b = tokens.shape
    row_keys = keys[:, None].expand(nt, b, *keys.shape[1:])
    if extra is not None:
        extra = extra[:, None].expand(nt, b, *extra.shape[1:]) if extra.dim() == 3 else extra
        row_keys, valid = torch.cat([row_keys, extra], 2), torch.cat([valid, extra_valid], 2)
    return sink_attention(q[tokens.flatten()], row_keys.flatten(0, 1), valid.flatten(0, 1), sinks, scale)


@pytest.mark.parametrize("extra_kind", [None, "tile", "row"])
def test_tiled_sink_attention_matches_sink_attention(extra_kind):
    gen = torch.Generator().manual_seed(0)
    t, h, d, nt, b, k, e = 20, 3, 8, 4, 5, 9, 6
    q = torch.randn(t, h, d, generator=gen)
    tokens = torch.randint(0, t, (nt, b), generator=gen)
    keys = torch.randn(nt, k, d, generator=gen)
    valid = torch.rand(nt, b, k, generator=gen) > 0.4
    valid[0, 0] = False  # a row with no window key
    extra = extra_valid = None
    if extra_kind is not None:
        shape = (nt, e, d) if extra_kind == "tile" else (nt, b, e, d)
        extra, extra_valid = torch.randn(*shape, generator=gen), torch.rand(nt, b, e, generator=gen) > 0.5
        extra_valid[0, 0] = False  # ... and no entry: sink only, output 0
    sinks = torch.randn(h, generator=gen)
    got = tiled_sink_attention(q, tokens, keys, valid, extra, extra_valid, sinks, 0.3)
    want = _per_row_reference(q, tokens, keys, valid, extra, extra_valid, sinks, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if extra_kind is not None:
        assert torch.count_nonzero(got[0]) == 0


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    return save_reference(make_reference("v4"), tmp_path_factory.mktemp("v4tiles"))


def _run(path, monkeypatch, min_queries: int, **options):
    monkeypatch.setattr(v4_plan, "MIN_TILED_QUERIES", min_queries)
    llm = LLM(str(path), block_size=16, load_progress=False, **options)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (70, 5, 33, 48)]
    prompts.append(prompts[0][:40] + prompts[3][:9])  # a cached prefix of the first, when caching is on
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("options", [{"max_num_batched_tokens": 37},
                                     {"enable_prefix_caching": True, "max_num_seqs": 2}],
                         ids=["odd-chunks", "prefix-cache"])
def test_model_outputs_equal_the_row_path(v4_path, monkeypatch, options):
    """Mixed steps of prompt chunks (some continuing a ring, some after a cached prefix) and decodes: tiled and
    row-by-row give the same tokens, and logprobs within float32 rounding."""
    tiled, rows = _run(v4_path, monkeypatch, 4, **options), _run(v4_path, monkeypatch, 10**9, **options)
    for a, b in zip(tiled, rows):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got = [lp for lp in a.prompt_logprobs[1:]] + a.outputs[0].logprobs
        want = [lp for lp in b.prompt_logprobs[1:]] + b.outputs[0].logprobs
        for x, y in zip(got, want):
            assert x.keys() == y.keys()
            for token in x:
                assert abs(x[token].logprob - y[token].logprob) < 1e-4
