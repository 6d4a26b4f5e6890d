"""Speculative decoding is lossless: greedy outputs are token-identical with and without each proposer
(bundled model, tiny V4 with MTP weights, tiny V3), in mixed batches, with chunked prefill, prefix-cache
hits, preemption and across compression boundaries; sampled outputs follow the same distribution."""

from __future__ import annotations

import itertools
import json
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig, SpeculativeConfig
from deepinfer.engine.kv_cache import BlockPool
from deepinfer.llm import default_model_path
from deepinfer.models.deepseek_v4 import _HC_RENAMES, DeepseekV4ForCausalLM
from deepinfer.models.dspark import DSparkConfig, DSparkDrafter
from deepinfer.models.mla_mtp import MLAMTPLayer
from deepinfer.spec.base import Draft, ProposeBatch, Proposer
from deepinfer.spec.policy import StepTimeProfile

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tokens(outputs) -> list[list[int]]:
    """Every sample's tokens (one list per request when n == 1)."""
    return [o.outputs[0].token_ids if len(o.outputs) == 1 else [c.token_ids for c in o.outputs] for o in outputs]


def _free_everything(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == llm.engine.layout.num_blocks and kv.num_free_slots == kv.num_state_slots
    assert not kv.blocks and not kv.slots


# --- checkpoints ---------------------------------------------------------------------------------
def _add_shard(path, tensors: dict[str, torch.Tensor]) -> None:
    """model.safetensors -> shard 1, `tensors` -> shard 2, with an index listing both."""
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    (path / "model.safetensors").rename(path / shards[0])
    save_file(tensors, path / shards[1])
    names = {n: shards[0] for n in load_file(path / shards[0])} | {n: shards[1] for n in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))


def _random_(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.05 * torch.randn(p.shape, generator=g))


def _with_v3_mtp(plain, path, seed: int = 6):
    """A transformers-saved V3 checkpoint plus a random MTP layer as `model.layers.{N}.*` (HF names, one
    tensor per expert, and the duplicated embedding / head copies real checkpoints carry)."""
    shutil.copytree(plain, path)
    cfg = ModelConfig.from_hf(plain)
    layer = MLAMTPLayer(cfg, 0, torch.float32, "cpu")
    _random_(layer, seed)
    prefix, tensors = f"model.layers.{cfg.num_layers}.", {}
    for name, t in layer._targets().items():
        if name == "mlp.experts.w13":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter].clone()
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name == "mlp.experts.w2":
            tensors.update({f"{prefix}mlp.experts.{e}.down_proj.weight": t[e].clone() for e in range(t.shape[0])})
        else:
            tensors[prefix + name] = t.detach().clone()
    main = load_file(plain / "model.safetensors")
    tensors[prefix + "embed_tokens.weight"] = main["model.embed_tokens.weight"]
    tensors[prefix + "shared_head.head.weight"] = main["lm_head.weight"]
    _add_shard(path, tensors)
    return path


def _with_mtp(plain, path, seed: int = 5):
    """A copy of a transformers-saved V4 checkpoint plus random `mtp.0.*` tensors under official names."""
    shutil.copytree(plain, path)
    donor = DeepseekV4ForCausalLM(ModelConfig.from_hf(plain))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, p in donor.mtp[0].state_dict().items():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
            if name.endswith("ffn.experts.w13"):
                inter = p.shape[1] // 2
                for e in range(p.shape[0]):
                    tensors[f"mtp.0.ffn.experts.{e}.w1.weight"] = p[e, :inter].clone()
                    tensors[f"mtp.0.ffn.experts.{e}.w3.weight"] = p[e, inter:].clone()
            elif name.endswith("ffn.experts.w2"):
                tensors.update({f"mtp.0.ffn.experts.{e}.w2.weight": p[e].clone() for e in range(p.shape[0])})
            else:
                official = {v: k for k, v in _HC_RENAMES.items()}.get(name, name)
                tensors["mtp.0." + official] = p.clone()
    _add_shard(path, tensors)
    return path


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    plain = save_reference(make_reference("v4", seed=11), tmp_path_factory.mktemp("v4") / "plain")
    return _with_mtp(plain, tmp_path_factory.mktemp("v4mtp") / "model")


@pytest.fixture(scope="module")
def v3_plain(tmp_path_factory):
    return save_reference(make_reference("v3", seed=12), tmp_path_factory.mktemp("v3") / "model")


@pytest.fixture(scope="module")
def v3_ckpt(v3_plain, tmp_path_factory):
    return _with_v3_mtp(v3_plain, tmp_path_factory.mktemp("v3mtp") / "model")


class OracleProposer(Proposer):
    """Drafts the reference greedy continuation with deterministic corruptions, so every acceptance
    length (0..k) and rollback point occurs, including across compression-window boundaries."""

    def __init__(self, refs: list[tuple[list[int], list[int]]], k: int, vocab: int):
        self.refs, self.k, self.vocab = refs, k, vocab

    def propose(self, batch: ProposeBatch) -> dict[str, Draft]:
        out = {}
        for item in batch.items:
            prompt, ref = next((p, r) for p, r in self.refs if item.history[:len(p)] == p)
            done = len(item.history) - len(prompt)
            drafts = ref[done:done + min(self.k, item.max_drafts)]
            bad = random.Random(done).randrange(self.k + 2)  # first corrupted draft; >= len: all correct
            drafts = [t if i < bad else (t + 1) % self.vocab for i, t in enumerate(drafts)]
            if drafts:
                out[item.request_id] = Draft(drafts, [0.9] * len(drafts))
        return out


# --- greedy parity: bundled model ---------------------------------------------------------------
CODE = ["def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = ",
        "import os\n\nfor root, dirs, files in os.walk(path):\n    for name in files:\n        ",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
        "x = [i * i for i in range(10)]\nprint(", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"]


def _bundled(spec: dict | None, **kw) -> LLM:
    options = dict(kv_cache_memory_bytes=16 * 2**20, load_progress=False, max_num_seqs=8,
                   max_num_batched_tokens=48) | kw
    return LLM(None, speculative_config=spec, **options)


class _FixedProfile(StepTimeProfile):
    """10 ms + 1 ms per batched token, whatever the machine measures."""

    def record(self, num_tokens: int, seconds: float) -> None:
        pass

    def line(self) -> tuple[float, float]:
        return 0.010, 0.001


def _mixed_params() -> list[SamplingParams]:
    return [SamplingParams(**GREEDY, max_tokens=40), SamplingParams(**GREEDY, max_tokens=7),
            SamplingParams(**GREEDY, max_tokens=33, repetition_penalty=1.3, presence_penalty=0.4),
            SamplingParams(temperature=0.0, max_tokens=25, min_tokens=20),
            SamplingParams(**GREEDY, max_tokens=30, frequency_penalty=0.5)]


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    """An untrained DSpark drafter for the bundled model (drafts are mostly rejected: rollback paths)."""
    path = tmp_path_factory.mktemp("dspark")
    torch.manual_seed(0)
    DSparkDrafter(DSparkConfig(256, 8192, num_draft_tokens=4)).save(path)
    return path


@pytest.fixture(scope="module")
def bundled_reference():
    llm = _bundled(None)
    first = _tokens(llm.generate(CODE, _mixed_params(), use_tqdm=False))
    again = _tokens(llm.generate([p + "    " for p in CODE], _mixed_params(), use_tqdm=False))
    return first, again


@pytest.mark.parametrize("method", ["mtp", "ngram", "dspark", pytest.param("mtp-adaptive", marks=pytest.mark.slow)])
def test_bundled_greedy_is_identical_with_speculation(bundled_reference, method):
    """Mixed batch (lengths, penalties, min_tokens, chunked prefill under a 48-token budget), then the
    same prompts extended so they hit the prefix cache. Adaptive: drafting switches on and off."""
    policy = "adaptive" if method.endswith("adaptive") else "fixed"
    llm = _bundled({"method": method.split("-")[0], "num_speculative_tokens": 3,  # dspark: the shipped drafter
                    "verify_policy": policy})
    if policy == "adaptive":  # timing-independent: drafting switches on and off, verify lengths vary
        modes = itertools.cycle([True, True, True, False, False])
        llm.engine.scheduler.gate.choose = lambda num_requests: next(modes)
        llm.engine.scheduler.step_profile = _FixedProfile()
    first = _tokens(llm.generate(CODE, _mixed_params(), use_tqdm=False))
    hits = llm.engine.kv.prefix_hits
    again = _tokens(llm.generate([p + "    " for p in CODE], _mixed_params(), use_tqdm=False))
    assert (first, again) == bundled_reference
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert llm.engine.kv.prefix_hits > hits
    _free_everything(llm)


def test_adaptive_calibration_times_both_modes_and_leaves_nothing_behind():
    llm = _bundled({"method": "ngram", "num_speculative_tokens": 3, "verify_policy": "adaptive"}, max_num_seqs=4)
    sched = llm.engine.scheduler
    assert sched.gate.frozen and set(sched.gate.times) == {(b, m) for b in (1, 2, 3) for m in (True, False)}
    assert all(t > 0 for t in sched.gate.times.values())
    assert len({n for n, _ in sched.step_profile.samples}) >= 3  # drafting steps of several sizes
    assert not sched.requests and not sched.running and not sched.waiting and sched.forced_drafting is None
    assert sched.spec_stats.num_drafts == 0 and sched.num_preemptions == 0
    _free_everything(llm)
    llm.generate(CODE[:2], SamplingParams(**GREEDY, max_tokens=8), use_tqdm=False)
    _free_everything(llm)


def test_bundled_greedy_is_identical_under_preemption():
    """40 blocks of 16 tokens cannot hold 10 requests of ~80 tokens: preempted requests drop their drafts
    and recompute, and every block comes back."""
    prompts, params = CODE * 2, SamplingParams(**GREEDY, max_tokens=48)
    runs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
        llm = _bundled(spec, enable_prefix_caching=False, max_num_seqs=10)
        llm.engine.kv.pool = BlockPool(40)
        runs.append(_tokens(llm.generate(prompts, params, use_tqdm=False)))
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.pool.num_free == 40
    assert runs[0] == runs[1]


# --- greedy parity: tiny V4 (MTP, ngram, oracle) and V3 ------------------------------------------
def _tiny(path, spec, **kw) -> LLM:
    return LLM(path, block_size=16, max_num_batched_tokens=40, load_progress=False, max_num_seqs=6,
               kv_cache_memory_bytes=32 * 2**20, speculative_config=spec, **kw)


def _tiny_batch(vocab: int = 512):
    # lengths straddle the CSA (4) and HCA (16) windows; outputs cross several of both
    prompts = [_prompt(n, seed) for seed, n in enumerate([13, 15, 16, 31, 5, 47])]
    params = [SamplingParams(**GREEDY, max_tokens=m) for m in (40, 34, 20, 37, 45)]
    return prompts, params + [SamplingParams(**GREEDY, max_tokens=18, n=2)]  # n > 1: forked samples


@pytest.mark.parametrize("kind, method", [(k, m) for k in ("v4", "v3") for m in ("oracle", "ngram", "mtp")]
                         + [pytest.param("v4-snapshot", "mtp", marks=pytest.mark.slow)])
def test_tiny_greedy_is_identical_with_speculation(kind, method, v4_ckpt, v3_ckpt):
    """Prefix hits restore V4 bounded state by replay, or (v4-snapshot) from boundary snapshots."""
    path = v3_ckpt if kind == "v3" else v4_ckpt
    restore = {"swa_restore": "snapshot"} if kind == "v4-snapshot" else {}
    prompts, params = _tiny_batch()
    base = _tiny(path, None, **restore)
    expected = _tokens(base.generate(prompts, params, use_tqdm=False))
    first = [e if isinstance(e[0], int) else e[0] for e in expected]  # greedy samples of n = 2 agree
    extended = [p + e[:20] for p, e in zip(prompts, first)]  # prefix hits on whole blocks
    expected_ext = _tokens(base.generate(extended, params, use_tqdm=False))
    spec = _tiny(path, {"method": "ngram" if method == "oracle" else method, "num_speculative_tokens": 4}, **restore)
    if method == "oracle":
        refs = list(zip(prompts, first)) + list(zip(extended, [e if isinstance(e[0], int) else e[0]
                                                              for e in expected_ext]))
        spec.engine.runner.proposer = OracleProposer(refs, 4, 512)
    assert _tokens(spec.generate(prompts, params, use_tqdm=False)) == expected
    assert _tokens(spec.generate(extended, params, use_tqdm=False)) == expected_ext
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_drafts > 0
    if method == "oracle":  # every acceptance length happened
        assert stats.num_accepted_tokens > 0 and len(stats.accepted_per_pos) == 4
        assert stats.accepted_per_pos[3] > 0 and stats.accepted_per_pos[0] < stats.num_drafts
    assert spec.engine.kv.prefix_hits > 0
    assert spec.engine.scheduler.num_snapshot_restores > 0 or not restore
    _free_everything(spec)


# --- options ---------------------------------------------------------------------------------------
def test_speculative_config_is_validated():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').num_speculative_tokens == 2
    for bad, match in [({"method": "eagle"}, "method"), ({"method": "mtp", "num_speculative_tokens": 0}, "in"),
                       ({"method": "mtp", "k": 3}, "unknown"), ("{", "JSON"), ({}, "method"),
                       ({"method": "mtp", "verify_policy": "magic"}, "verify_policy")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)


def test_untrained_dspark_drafter_is_lossless_too(bundled_reference, random_drafter):
    llm = _bundled({"method": "dspark", "num_speculative_tokens": 4, "model": str(random_drafter)})
    assert _tokens(llm.generate(CODE, _mixed_params(), use_tqdm=False)) == bundled_reference[0]
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0


def test_shipped_dspark_drafter_is_small_and_loads():
    path = default_model_path() / "dspark"
    assert sum(f.stat().st_size for f in path.iterdir()) < 4 * 2**20
    assert DSparkDrafter.load(path).cfg.num_draft_tokens == 4


def test_dspark_weight_format_round_trips_and_is_checked(random_drafter, tmp_path):
    drafter = DSparkDrafter.load(random_drafter)
    assert drafter.cfg == DSparkConfig(256, 8192, num_draft_tokens=4)
    assert json.loads((random_drafter / "dspark.json").read_text())["format"] == "deepinfer-dspark"
    with pytest.raises(ValueError, match="trained for"):
        _bundled({"method": "dspark", "num_speculative_tokens": 5, "model": str(random_drafter)})
    with pytest.raises(ValueError, match="no DSpark drafter"):
        _bundled({"method": "dspark", "model": str(tmp_path)})
    (tmp_path / "dspark.json").write_text(DSparkConfig(256, 8192, num_draft_tokens=2).to_json())
    shutil.copy(random_drafter / "dspark.safetensors", tmp_path)
    with pytest.raises(ValueError, match="do not match"):
        DSparkDrafter.load(tmp_path)


def test_mtp_without_mtp_weights_is_a_clear_error(v3_plain):
    with pytest.raises(ValueError, match="MTP weights"):
        _tiny(v3_plain, {"method": "mtp"})


def test_v3_mtp_layer_loads_every_tensor_and_names_a_missing_one(v3_ckpt, tmp_path):
    llm = _tiny(v3_ckpt, {"method": "mtp"})
    model = llm.engine.model
    assert len(model.mtp) == 1 and model.mtp[0].eh_proj.weight.abs().sum() > 0
    assert {"mtp.0.mla"} <= set(llm.engine.runner.cache)
    broken = tmp_path / "broken"
    shutil.copytree(v3_ckpt, broken)
    shard = broken / "model-00002-of-00002.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.3.eh_proj.weight"]
    save_file(tensors, shard)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.3.eh_proj.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="eh_proj"):
        _tiny(broken, {"method": "mtp"})


def test_logprob_requests_do_not_speculate_and_still_match(v4_ckpt):
    prompts, _ = _tiny_batch()
    params = [SamplingParams(**GREEDY, max_tokens=12, logprobs=2), SamplingParams(**GREEDY, max_tokens=12)]
    base = _tiny(v4_ckpt, None).generate(prompts[:2], params, use_tqdm=False)
    spec = _tiny(v4_ckpt, {"method": "mtp"}).generate(prompts[:2], params, use_tqdm=False)
    assert _tokens(spec) == _tokens(base)
    assert len(spec[0].outputs[0].logprobs) == 12
    for a, b in zip(spec[0].outputs[0].logprobs, base[0].outputs[0].logprobs):
        assert a.keys() == b.keys()


# --- sampling is lossless in distribution ---------------------------------------------------------
def _chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularised upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _homogeneity_p(a: dict, b: dict) -> tuple[float, float]:
    """Two-sample chi-square test of equal distributions (rare outcomes pooled), and the total variation."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    cells, pooled = [], [0, 0]
    for k in keys:
        ca, cb = a.get(k, 0), b.get(k, 0)
        if (ca + cb) * min(na, nb) / (na + nb) >= 5:
            cells.append((ca, cb))
        else:
            pooled = [pooled[0] + ca, pooled[1] + cb]
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for ca, cb in cells:
        tot = ca + cb
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    tv = 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in keys)
    return _chi2_sf(stat, max(len(cells) - 1, 1)), tv


def _draws(llm: LLM, prompt: str, n: int, seed0: int) -> dict:
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=seed0 + i)
              for i in range(n)]
    counts: dict = {}
    for out in llm.generate([prompt] * n, params, use_tqdm=False):
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


DRAWS, DRAW_PROMPT = 800, "def fibonacci(n):\n    if n <"


@pytest.fixture(scope="module")
def plain_draws():
    llm = LLM(None, kv_cache_memory_bytes=16 * 2**20, load_progress=False, max_num_seqs=64)
    return _draws(llm, DRAW_PROMPT, DRAWS, 0)


@pytest.mark.parametrize("method", ["mtp", pytest.param("ngram", marks=pytest.mark.slow)])
def test_speculative_sampling_matches_plain_sampling_in_distribution(method, plain_draws):
    """800 seeded draws of a 3-token continuation (top-k 4: at most 64 outcomes) with and without
    speculation. Both are samples of one distribution: a chi-square homogeneity test must not reject
    (p > 0.001) and the total variation must stay under the sampling-noise bound for this many draws
    (E TV <= sqrt(K / N) per pair of samples, plus a 3-sigma deviation term)."""
    n, base = DRAWS, plain_draws
    llm = LLM(None, kv_cache_memory_bytes=16 * 2**20, load_progress=False, max_num_seqs=64,
              speculative_config={"method": method, "num_speculative_tokens": 2})
    spec = _draws(llm, DRAW_PROMPT, n, 10_000)
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both accept and reject paths ran
    p_value, tv = _homogeneity_p(base, spec)
    k = len(set(base) | set(spec))
    assert p_value > 1e-3, (p_value, base, spec)
    assert tv < (k / n) ** 0.5 + 3 * (2 / n) ** 0.5, tv


@pytest.mark.slow
def test_the_distribution_test_detects_a_lossy_verifier(monkeypatch, plain_draws):
    """Control: a verifier that accepts every draft (not lossless) fails the same test."""
    import deepinfer.worker.model_runner as runner_mod
    from deepinfer.worker.rejection import Verdict

    monkeypatch.setattr(runner_mod, "verify_random", lambda probs, drafts, gen, q=None: Verdict(
        len(drafts), drafts + [int(probs[len(drafts)].argmax())]))
    llm = LLM(None, kv_cache_memory_bytes=16 * 2**20, load_progress=False, max_num_seqs=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    p_value, _ = _homogeneity_p(plain_draws, _draws(llm, DRAW_PROMPT, DRAWS, 10_000))
    assert p_value < 1e-3


def test_speculation_runs_synchronous_steps_and_rejects_deterministic_mode(v4_ckpt):
    with pytest.raises(ValueError, match="deterministic"):
        _tiny(v4_ckpt, {"method": "ngram"}, deterministic=True)
    prompts, params = _tiny_batch()
    llm = _tiny(v4_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, async_scheduling=True)
    assert not llm.engine.args.async_scheduling and llm.engine._worker is None
    expected = _tokens(_tiny(v4_ckpt, None).generate(prompts[:2], params[:2], use_tqdm=False))
    assert _tokens(llm.generate(prompts[:2], params[:2], use_tqdm=False)) == expected


def _drafts_seen(llm: LLM) -> list[tuple[bool, int]]:
    """(constrained?, drafts verified) of every scheduled request of every step from now on."""
    seen, schedule = [], llm.engine.scheduler.schedule

    def spy():
        out = schedule()
        seen.extend((s.request.grammar is not None, s.num_drafts) for s in out.scheduled)
        return out

    llm.engine.scheduler.schedule = spy
    return seen


def test_grammar_constrained_requests_speculate_and_match_plain_decoding():
    """Constrained requests verify only the drafts their grammar accepts, under one mask per verified
    position (the matcher advances through the drafts and rolls back); outputs equal the non-speculative
    engine's, the constraints hold, and both constrained and free requests really carried drafts."""
    literal = "for root, dirs, files in os.walk(path):"  # in the prompt, so prompt lookup drafts it
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": re.escape(literal)}),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": r"[a-z_]+\(\d{1,3}\)"}),
              SamplingParams(**GREEDY, max_tokens=24)]
    prompts = [CODE[1], CODE[0], CODE[1]]
    expected = _bundled(None).generate(prompts, params, use_tqdm=False)
    llm = _bundled({"method": "ngram", "num_speculative_tokens": 3})
    seen = _drafts_seen(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(expected)
    assert outputs[0].outputs[0].text == literal and outputs[0].outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"[a-z_]+\(\d{1,3}\)", outputs[1].outputs[0].text)
    assert any(n > 0 for constrained, n in seen if constrained)
    assert any(n > 0 for constrained, n in seen if not constrained)
