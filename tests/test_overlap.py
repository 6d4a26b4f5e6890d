"""Two-batch overlap's pure parts: where a step splits, and a micro-batch as a batch of its own (the model run
on the two halves one after the other gives the tokens of the whole batch)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineArgs
from deepinfer.distributed.overlap import split_point, sub_meta


def test_split_point_balances_tokens_over_whole_requests():
    assert split_point([5]) == 1  # one request: the second micro-batch is empty
    assert split_point([1, 1]) == 1
    assert split_point([10, 1, 1, 1]) == 1
    assert split_point([1, 1, 1, 10]) == 3
    assert split_point([3, 3, 3, 3]) == 2
    assert split_point([]) == 0


def test_two_batch_overlap_options_are_checked():
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        EngineArgs(two_batch_overlap=True, data_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineArgs(two_batch_overlap=True, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="speculative"):
        EngineArgs(two_batch_overlap=True, data_parallel_size=2, enable_expert_parallel=True,
                   speculative_config={"method": "ngram"})


@pytest.fixture(scope="module", params=["v4", "v3"])
def ckpt(request, tmp_path_factory):
    return save_reference(make_reference(request.param, seed=9), tmp_path_factory.mktemp(request.param))


def test_halves_run_apart_give_the_batch_tokens(ckpt):
    """Chunked prefill and decode of a ragged batch, the model called on sub_meta halves in turn."""
    options = dict(load_progress=False, kv_cache_memory_bytes=16 * 2**20, max_num_batched_tokens=9, block_size=16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 15, 2, 11)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(ckpt, **options)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    split = LLM(ckpt, **options)
    model, calls = split.engine.model, []

    def halves(meta):
        r = split_point(meta.query_lens())
        calls.append(r < meta.num_reqs)
        parts = [sub_meta(meta, 0, r)] + ([sub_meta(meta, r, meta.num_reqs)] if r < meta.num_reqs else [])
        return torch.cat([model(part) for part in parts])

    split.engine.runner.forward = halves
    assert [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)] == want
    assert any(calls)  # some steps really ran as two micro-batches
