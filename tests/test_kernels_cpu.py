"""The C++ CPU kernels (kernels/cpu, built on first use) against their torch references, alone, under
torch.compile (the op's fake shapes), and in a DeepSeek-V3 engine (greedy tokens and log-probabilities with the
kernels loaded = with the torch paths).

Pools start all NaN: only rows of positions below a request's seq_len are written and block-table padding names a
spare NaN block, so a stray read shows up in the output."""

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.kernels import cpu_kernels
from deepinfer.kernels.mla_decode import mla_decode_reference
from deepinfer.layers.batch_invariant import batch_invariant
from deepinfer.layers.lm_head import LMHead, logits_linear

if not cpu_kernels.load(progress=False):
    pytest.skip("the CPU kernels could not be built here (no C++ compiler or ninja)", allow_module_level=True)


def _case(lens, heads, latent, rope, page, dtype, seed=0):
    """(q [R, H, D], pool [N, D] NaN outside context rows, block table with a NaN padding block)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page) for n in lens]
    ids = torch.randperm(sum(blocks) + 2, generator=gen).tolist()
    pad, rows, at = ids[-1], [], 0
    for b in blocks:
        rows.append(ids[at:at + b] + [pad] * (max(max(blocks), 1) - b))
        at += b
    table = torch.tensor(rows, dtype=torch.int64)
    pool = torch.full((len(ids) * page, latent + rope), float("nan"), dtype=dtype)
    for r, n in enumerate(lens):
        slots = [int(table[r, p // page]) * page + p % page for p in range(n)]
        pool[slots] = torch.randn(n, latent + rope, generator=gen).to(dtype)
    return torch.randn(len(lens), heads, latent + rope, generator=gen).to(dtype), pool, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,latent,rope,page", [(4, 32, 8, 16), (5, 24, 8, 4), (1, 512, 64, 64), (9, 64, 16, 8)])
def test_mla_decode_matches_reference(dtype, heads, latent, rope, page):
    """Ragged lengths (one empty, partial last blocks, tiles cut by block ends), head counts not a multiple of the
    head group, widths not a multiple of the vector width."""
    lens = [1, 3 * page + 5, 0, 2 * page, 37]
    q, pool, table = _case(lens, heads, latent, rope, page, dtype)
    seq_lens = torch.tensor(lens)
    want = mla_decode_reference(q, pool, None, table, seq_lens, latent, 0.3, block_size=page)
    got = cpu_kernels.mla_decode(q, pool, table, seq_lens, page, latent, 0.3)
    assert got.dtype == dtype and got.shape == want.shape and not got.isnan().any()
    assert (got[2] == 0).all()  # nothing to attend: zeros
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_mla_decode_under_torch_compile():
    """Traced through its fake (shapes only), called as an op by the compiled code."""
    lens = [7, 20]
    q, pool, table = _case(lens, 4, 32, 8, 8, torch.float32)
    fn = torch.compile(lambda q, p, t, n: cpu_kernels.mla_decode(q, p, t, n, 8, 32, 0.3).sum(-1), fullgraph=True)
    want = mla_decode_reference(q, pool, None, table, torch.tensor(lens), 32, 0.3, block_size=8).sum(-1)
    torch.testing.assert_close(fn(q, pool, table, torch.tensor(lens)), want, rtol=1e-5, atol=1e-5)


def test_mla_decode_rejects_what_it_does_not_serve():
    q, pool, table = _case([4], 4, 32, 8, 8, torch.float32)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu_kernels.mla_decode(q.bfloat16(), pool, table, torch.tensor([4]), 8, 32, 0.3)
    with pytest.raises(RuntimeError, match="one table row per query"):
        cpu_kernels.mla_decode(q, pool, table, torch.tensor([4, 4]), 8, 32, 0.3)


def test_v3_engine_same_with_and_without_the_kernels(tmp_path, monkeypatch):
    """Eager decode steps of a V3 engine take the kernels when they are loaded (MLA decode and the LM head);
    tokens and log-probabilities as with the torch paths (batches of 3, 2, 1 as requests finish)."""
    path = save_reference(make_reference("v3", seed=2), tmp_path / "v3")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 21, 5)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=3) for m in (12, 5, 9)]

    def run():
        llm = LLM(str(path), enforce_eager=True, block_size=16, load_progress=False, dtype="float32", device="cpu")
        outs = llm.generate(prompts, params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                [[lp.logprob for d in o.outputs[0].logprobs for lp in d.values()] for o in outs])

    calls, head_calls = [], []
    kernel, head_kernel = cpu_kernels.mla_decode, cpu_kernels.rows_linear
    monkeypatch.setattr(cpu_kernels, "mla_decode", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    monkeypatch.setattr(cpu_kernels, "rows_linear", lambda x, w: head_calls.append(x.shape[0]) or head_kernel(x, w))
    tokens, logprobs = run()
    assert {3, 2, 1} <= set(calls)
    assert {3, 2, 1} <= set(head_calls)  # the LM head of every decode step
    monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    want_tokens, want_logprobs = run()
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 128, 8192), (3, 300, 4097), (4, 5, 3), (0, 64, 10), (2, 64, 1)])
def test_rows_linear_matches_f_linear(dtype, m, k, n):
    """Widths with a tail past the vector width, vocabularies not a multiple of the 4 segments (or smaller
    than 4 rows), no rows at all; a transposed (non-contiguous) weight view."""
    gen = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    got = cpu_kernels.rows_linear(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    want = torch.nn.functional.linear(x.float(), w.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k ** 0.5)
    torch.testing.assert_close(cpu_kernels.rows_linear(x, w.t().contiguous().t()), got, rtol=0, atol=0)


def test_rows_linear_row_does_not_depend_on_the_batch():
    """Each element is one dot in a fixed order: a row's logits are bit-identical alone, in a batch, and on
    one thread or two."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 96, generator=gen), torch.randn(5000, 96, generator=gen)
    batch = cpu_kernels.rows_linear(x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in range(4):
            assert torch.equal(cpu_kernels.rows_linear(x[i:i + 1], w)[0], batch[i])
    finally:
        torch.set_num_threads(threads)


def test_logits_linear_dispatch(monkeypatch):
    """The kernel for a few rows of a 2-D float32 input; F.linear for more rows, for bfloat16, for autograd
    (gradients flow) and in batch-invariant mode. LMHead is an nn.Linear whose product goes the same way."""
    calls = []
    kernel = cpu_kernels.rows_linear
    monkeypatch.setattr(cpu_kernels, "rows_linear", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    head = LMHead(16, 40, bias=False)
    few, many = torch.randn(cpu_kernels.ROWS_LINEAR_MAX_ROWS, 16), torch.randn(cpu_kernels.ROWS_LINEAR_MAX_ROWS + 1, 16)
    with torch.no_grad():
        torch.testing.assert_close(head(few), torch.nn.functional.linear(few, head.weight))
        head(many)
        logits_linear(few.bfloat16(), head.weight.bfloat16())
        with batch_invariant():
            logits_linear(few, head.weight)
    assert calls == [cpu_kernels.ROWS_LINEAR_MAX_ROWS]
    head(few).sum().backward()  # parameters require grad: the autograd path
    assert calls == [cpu_kernels.ROWS_LINEAR_MAX_ROWS] and head.weight.grad is not None


def test_rows_linear_under_torch_compile():
    x, w = torch.randn(2, 24), torch.randn(33, 24)
    fn = torch.compile(lambda x, w: cpu_kernels.rows_linear(x, w) * 2, fullgraph=True)
    torch.testing.assert_close(fn(x, w), 2 * torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
