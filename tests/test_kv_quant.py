"""KV-cache quantisation: per-entry scaled fp8/int8 storage stays within each format's rounding bound of
the unquantised cache, for V4's compressed entries and indexer keys and for MLA latents."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.layers.kv_quant import quantize, storage_dtype


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantize_error_is_within_the_format_bound(dtype):
    x = torch.randn(64, 48) * torch.logspace(-2, 2, 64)[:, None]
    q, scale = quantize(x, dtype)
    err = (q.float() * scale - x).abs()
    if dtype == torch.int8:  # rounding to a grid of step `scale`
        bound = scale / 2
    else:  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus half the subnormal step
        bound = x.abs() * 2**-4 + scale * 2**-10
    assert torch.all(err <= bound * (1 + 1e-6) + 1e-12)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_paged_pool_round_trip(dtype):
    from deepinfer.layers.kv_quant import PagedPool

    cache = {"p": torch.zeros(4, 8, 16, dtype=dtype), "p_scale": torch.zeros(4, 8, 1)}
    pool = PagedPool.of(cache, "p", 16, torch.float32)
    rows, values = torch.tensor([3, 17, 30]), torch.randn(3, 16)
    pool.write(rows, values)
    expected_q, expected_scale = quantize(values, dtype)
    assert torch.equal(pool.read(rows), expected_q.float() * expected_scale)
    assert pool.read(torch.tensor([0])).abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_reading_whole_blocks_equals_reading_their_rows(dtype):
    """read_blocks (fixed-shape MLA steps off CUDA) gives the rows read() gives for the same positions."""
    from deepinfer.layers.kv_quant import PagedPool

    cache = {"p": torch.zeros(5, 4, 16, dtype=dtype)}
    if dtype != torch.float32:
        cache["p_scale"] = torch.zeros(5, 4, 1)
    pool = PagedPool.of(cache, "p", 16, torch.float32)
    pool.write(torch.arange(20), torch.randn(20, 16))
    table = torch.tensor([[3, 0, 4], [1, 1, 2]])
    rows = (table[:, :, None] * 4 + torch.arange(4)).flatten(1)
    assert torch.equal(pool.read_blocks(table, 4), pool.read(rows))


def test_unknown_kv_cache_dtype_is_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        storage_dtype("fp4", torch.float32)


@pytest.mark.parametrize("kind", ["v4", "v3"])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantised_pools_match_unquantised_within_bound(tmp_path, kind, kv_dtype):
    path = save_reference(make_reference(kind, seed=9), tmp_path / kind)
    prompt = torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {}
    for name in ("auto", kv_dtype):
        llm = LLM(path, kv_cache_dtype=name, block_size=16, load_progress=False, enable_prefix_caching=False,
                  kv_cache_memory_bytes=8 * 2**20)
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        runs[name] = llm.engine
    ref, quant = runs["auto"], runs[kv_dtype]
    assert quant.layout.bytes_per_token < ref.layout.bytes_per_token / 2
    compared = 0
    paged = [n for n in ref.runner.cache if f"{n}_scale" in quant.runner.cache]
    first_layer = min(int(n.split(".")[1]) for n in paged)
    # Only the first layer with paged pools sees identical inputs in both runs; later layers' inputs already
    # carry the (bounded, measured in benchmarks/kv_quant.py) effect of quantised reads upstream.
    for name in (n for n in paged if int(n.split(".")[1]) == first_layer):
        tensor, scale = ref.runner.cache[name], quant.runner.cache[f"{name}_scale"]
        rows = tensor.shape[0]  # same budget, so the quantised engine has more blocks; ids are handed out alike
        stored, scale = quant.runner.cache[name][:rows], scale[:rows]
        assert stored.dtype == storage_dtype(kv_dtype, torch.float32)
        exact, restored = tensor.float(), stored.float() * scale
        written = exact.abs().amax(dim=-1) > 0  # the 70-token prefill wrote these entries
        err = (restored - exact).abs()[written]
        step = scale.expand_as(stored)[written]
        bound = step / 2 if kv_dtype == "int8" else exact.abs()[written] * 2**-4 + step * 2**-10
        assert written.any() and torch.all(err <= bound * (1 + 1e-5) + 1e-7), name
        compared += 1
    assert compared > 0
