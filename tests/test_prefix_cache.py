"""Prefix caching: hits are exact (V4 bounded replay, V3/V2 MLA), hit rates, eviction, salt isolation."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_cache import BlockPool, KVCacheManager, chain_hashes

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BLOCK = {"v4": 16, "v4b": 8, "v3": 8, "v2": 8}


@pytest.fixture(scope="module", params=list(BLOCK))
def ckpt(request, tmp_path_factory):
    kind = request.param
    return kind, save_reference(make_reference(kind, seed=5), tmp_path_factory.mktemp(kind))


def _llm(kind, path, caching: bool, **options) -> LLM:
    return LLM(path, block_size=BLOCK[kind], enable_prefix_caching=caching, load_progress=False,
               kv_cache_memory_bytes=32 * 2**20, **options)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_capturing_logits(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of one request run alone, and the logits row of every token it sampled."""
    rows = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: rows.append(compute(h)) or rows[-1]
    try:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.engine.model.compute_logits = compute
    return out, torch.cat([r[-1:] for r in rows if r.shape[0]])


@pytest.mark.parametrize("restore", ["replay", "snapshot"])
@pytest.mark.parametrize("shared", ["block_aligned", "mid_block"])
def test_hit_is_exact(ckpt, shared, restore):
    kind, path = ckpt
    system = _tokens(120, 1)
    keep = 96 if shared == "block_aligned" else 101
    prompt = system[:keep] + _tokens(9, 2)
    on, off = _llm(kind, path, True, swa_restore=restore), _llm(kind, path, False)
    # Snapshots exist where a step ended: warming up with exactly the 96-token prefix leaves one at the hit.
    on.generate([system if restore == "replay" else system[:96]], GREEDY, use_tqdm=False)
    hits_before = on.engine.kv.prefix_hits
    tokens_on, logits_on = _run_capturing_logits(on, prompt)
    tokens_off, logits_off = _run_capturing_logits(off, prompt)
    assert on.engine.kv.prefix_hits - hits_before == (keep // BLOCK[kind]) * BLOCK[kind]
    bounded_state = on.engine.scheduler.replay_tokens > 0
    assert on.engine.scheduler.num_snapshot_restores == (restore == "snapshot" and bounded_state)
    assert tokens_on == tokens_off
    assert (logits_on - logits_off).abs().max().item() < 1e-5


def test_replaying_fewer_than_layers_times_window_is_inexact(tmp_path):
    """Rebuilding V4's windows needs num_layers * (W - 1) tokens; one window's worth is measurably wrong."""
    path = save_reference(make_reference("v4", seed=5), tmp_path / "v4")
    system = _tokens(160, 3)
    prompt = system[:128] + _tokens(7, 4)
    off = _llm("v4", path, False)
    _, reference = _run_capturing_logits(off, prompt)
    exact, short = _llm("v4", path, True), _llm("v4", path, True)
    window = short.engine.model_config.sliding_window
    assert exact.engine.scheduler.replay_tokens == short.engine.model_config.num_layers * (window - 1)
    short.engine.scheduler.replay_tokens = window - 1
    drift = {}
    for name, llm in (("exact", exact), ("short", short)):
        llm.generate([system], GREEDY, use_tqdm=False)
        _, logits = _run_capturing_logits(llm, prompt)
        drift[name] = (logits - reference).abs().max().item()
    assert drift["exact"] < 1e-5 and drift["short"] > 1e-3


def test_shared_system_prompt_hit_rate_and_outputs(tmp_path):
    """64 requests: a 128-token system prompt (8 blocks) + distinct questions, all under 512 tokens."""
    path = save_reference(make_reference("v4", seed=6), tmp_path / "v4")
    system = _tokens(128, 7)
    prompts = [system + _tokens(12, 100 + i) for i in range(64)]
    on, off = _llm("v4", path, True, max_num_seqs=16), _llm("v4", path, False, max_num_seqs=16)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = on.generate(prompts[:1], params, use_tqdm=False)
    queries_before, hits_before = on.engine.kv.prefix_queries, on.engine.kv.prefix_hits
    rest = on.generate(prompts[1:], params, use_tqdm=False)
    shareable = 63 * len(system)
    assert on.engine.kv.prefix_hits - hits_before >= 0.9 * shareable
    assert on.engine.kv.prefix_queries - queries_before == sum(len(p) for p in prompts[1:])
    expected = off.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in expected]


def test_cache_salt_isolates_tenants(ckpt):
    kind, path = ckpt
    llm = _llm(kind, path, True)
    prompt = _tokens(64, 8)
    llm.engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    while llm.engine.has_unfinished:
        llm.engine.step()
    for rid, salt, expect_hit in (("b", "tenant-b", False), ("c", None, False), ("d", "tenant-a", True)):
        before = llm.engine.kv.prefix_hits
        llm.engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
        while llm.engine.has_unfinished:
            llm.engine.step()
        assert (llm.engine.kv.prefix_hits > before) == expect_hit, rid


def test_eviction_pressure_then_reuse_is_correct(ckpt):
    kind, path = ckpt
    block = BLOCK[kind]
    on = LLM(path, block_size=block, enable_prefix_caching=True, load_progress=False, max_num_seqs=2,
             kv_cache_memory_bytes=_budget(path, kind, blocks=40))
    off = _llm(kind, path, False)
    prompts = [_tokens(100, 20 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    again = [prompts[0], prompts[5], prompts[0]]
    got = on.generate(prompts + again, params, use_tqdm=False)
    want = off.generate(prompts + again, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert on.engine.kv.num_free_blocks == on.engine.layout.num_blocks
    assert on.engine.kv.pool.num_cached <= on.engine.layout.num_blocks


def _budget(path, kind: str, blocks: int) -> int:
    probe = _llm(kind, path, False, max_num_seqs=2)
    return 2 * probe.engine.layout.bytes_per_slot + blocks * probe.engine.layout.bytes_per_block


# --- the pool itself -------------------------------------------------------------------------------
def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, h in ((a, b"ha"), (b, b"hb"), (c, b"hc")):
        pool.register(block, h)
    pool.release([b])
    pool.release([a])  # a became unreferenced after b
    assert pool.num_free == 2 and pool.lookup(b"hb") == b
    pool.share([b])  # a hit re-references b: no longer evictable
    assert pool.allocate(1) == [a] and pool.lookup(b"ha") is None
    assert pool.allocate(1) is None


def test_reset_forgets_hashes_and_frees_unreferenced_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=2, num_state_slots=2, enable_prefix_caching=True)
    hashes = chain_hashes([5, 6, 7, 8], 2, None, [])
    assert kv.allocate("r", 4)
    kv.cache_full_blocks("r", hashes, 4)
    kv.free("r")
    assert kv.cached_prefix(hashes, 4) and kv.num_free_blocks == 4
    kv.reset_prefix_cache()
    assert kv.cached_prefix(hashes, 4) == [] and kv.pool.num_cached == 0 and kv.num_free_blocks == 4


def test_hashes_chain_over_blocks_and_salt():
    a = chain_hashes([1, 2, 3, 4, 5], 2, None, [])
    assert len(a) == 2 and chain_hashes([1, 2, 3, 4], 2, None, a[:1]) == a
    assert chain_hashes([9, 9, 3, 4], 2, None, [])[1] != a[1]  # block 1's hash depends on block 0
    assert chain_hashes([1, 2, 3, 4], 2, "salt", [])[0] != a[0]


def test_sharing_a_single_full_block_is_a_hit(ckpt):
    """No minimum beyond one block: V4's block size is only the least common multiple of its ratios."""
    kind, path = ckpt
    llm = _llm(kind, path, True)
    block = llm.engine.layout.block_size
    first = _tokens(block + 3, 30)
    llm.generate([first], GREEDY, use_tqdm=False)
    before = llm.engine.kv.prefix_hits
    llm.generate([first[:block] + _tokens(5, 31)], GREEDY, use_tqdm=False)
    assert llm.engine.kv.prefix_hits - before == block
