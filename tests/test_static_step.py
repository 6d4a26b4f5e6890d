"""Fixed-shape steps (what CUDA graphs replay) against the ordinary forward: same rows, same cache state,
padding rows confined to the scratch block and slot. Each runs on the Triton kernels (the interpreter on CPU)
and on their torch references (what torch.compile traces off CUDA, worker/compiled_step.py)."""

import pytest
import torch

pytest.importorskip("triton")

from test_kernels_models import _force_kernels, _v4  # noqa: E402
from v4_runs import BLOCK  # noqa: E402

from deepinfer.layers.metadata import ForwardMeta  # noqa: E402
from deepinfer.layers.static_step import StaticStep  # noqa: E402

NUM_BLOCKS, SLOTS = 12, 3  # the scratch block / slot are the rows past these


def _caches(model):
    specs = model.kv_cache_spec(BLOCK)
    return {s.name: torch.zeros(((NUM_BLOCKS if s.kind == "paged" else SLOTS) + 1, *s.shape), dtype=s.dtype)
            for s in specs}


def _meta(seqs, tables, slots, starts, counts, block_size: int = BLOCK) -> ForwardMeta:
    pos = [list(range(s, s + c)) for s, c in zip(starts, counts)]
    qs = [0]
    for c in counts:
        qs.append(qs[-1] + c)
    return ForwardMeta(
        input_ids=torch.tensor([seqs[r][p] for r, ps in enumerate(pos) for p in ps]),
        positions=torch.tensor([p for ps in pos for p in ps]),
        token_req=torch.tensor([r for r, ps in enumerate(pos) for _ in ps]), block_table=torch.tensor(tables),
        state_slots=torch.tensor(slots), logits_indices=torch.tensor(qs[1:]) - 1, query_start=qs,
        seq_starts=list(starts), seq_lens=[s + c for s, c in zip(starts, counts)], block_size=block_size)


def _padded(meta: ForwardMeta, batch: int) -> StaticStep:
    real = StaticStep.from_meta(meta)
    static = StaticStep.empty(batch, real.tokens_per_req, 4, BLOCK, SLOTS, NUM_BLOCKS, meta.device)
    static.copy_from(real)
    return static


PATHS = ["triton", "torch"]


def _use(path: str, monkeypatch) -> None:
    if path == "triton":
        _force_kernels(monkeypatch)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("per_step", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_v4_static_step_matches_forward(monkeypatch, per_step, path):
    """Decode (1 token) and verify-like (2 tokens) steps, padded from 2 requests to 4 rows."""
    model = _v4()
    _use(path, monkeypatch)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 512, (60,), generator=g).tolist() for _ in range(2)]
    tables, slots = [[3, 7, 1, 9], [5, 0, 11, 2]], [2, 0]
    eager, static = _caches(model), _caches(model)
    starts = [27, 14]
    for cache in (eager, static):
        model.bind_kv_cache(cache)
        with torch.no_grad():
            model(_meta(seqs, tables, slots, [0, 0], starts))
    for _ in range(6):
        meta = _meta(seqs, tables, slots, starts, [per_step] * 2)
        with torch.no_grad():
            model.bind_kv_cache(eager)
            want = model(meta)
            model.bind_kv_cache(static)
            got = model.forward_static(_padded(meta, 4), NUM_BLOCKS)
        torch.testing.assert_close(got[:meta.num_tokens], want, rtol=1e-4, atol=1e-5)
        starts = [s + per_step for s in starts]
    for name, tensor in eager.items():
        rows = NUM_BLOCKS if name.endswith(("entries", "scale")) else SLOTS
        torch.testing.assert_close(static[name][:rows], tensor[:rows], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind,per_step", [("v3", 1), pytest.param("v32", 1, marks=pytest.mark.slow),
                                           pytest.param("v3", 2, marks=pytest.mark.slow)])
def test_mla_static_step_matches_forward(monkeypatch, kind, per_step, path):
    """MLA decode (V3), with the DSA indexer (V3.2), and a 2-token step (each token an absorbed query where
    the ordinary forward expands a prefill chunk: equal within float32 rounding)."""
    from paged_mla import BLOCK as MLA_BLOCK
    from test_kernels_models import _mla

    model = _mla(kind)
    _use(path, monkeypatch)
    model.grow_rope(64)
    specs = model.kv_cache_spec(MLA_BLOCK)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 512, (40,), generator=g).tolist() for _ in range(2)]
    tables, slots = [[3, 7, 1, 9, 4, 10, 6, 8], [5, 0, 11, 2, 13, 12, 14, 15]], [0, 1]
    blocks = 16
    eager, static = ({s.name: torch.zeros((blocks + 1, *s.shape), dtype=s.dtype) for s in specs} for _ in range(2))
    starts = [17, 9]
    for cache in (eager, static):
        model.bind_kv_cache(cache)
        with torch.no_grad():
            model(_meta(seqs, tables, slots, [0, 0], starts, MLA_BLOCK))
    for _ in range(4):
        meta = _meta(seqs, tables, slots, starts, [per_step] * 2, MLA_BLOCK)
        real = StaticStep.from_meta(meta)
        padded = StaticStep.empty(3, per_step, 8, MLA_BLOCK, 2, blocks, meta.device)
        padded.copy_from(real)
        with torch.no_grad():
            model.bind_kv_cache(eager)
            want = model.compute_logits(model(meta))
            model.bind_kv_cache(static)
            got = model.compute_logits(model.forward_static(padded, blocks))
        torch.testing.assert_close(got[:meta.num_tokens], want, rtol=1e-4, atol=1e-4)
        starts = [s + per_step for s in starts]
    for name, tensor in eager.items():
        torch.testing.assert_close(static[name][:blocks], tensor[:blocks], rtol=1e-4, atol=1e-5, msg=name)
