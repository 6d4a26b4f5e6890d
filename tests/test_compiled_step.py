"""Compiled decode steps off CUDA (worker/compiled_step.py): torch.compile of the fixed-shape forward gives
the eager engine's greedy tokens and, within float32 rounding, its log-probabilities; after the start-up
warm-up nothing recompiles (a recompile is an error here); a model the compiler cannot take runs eagerly."""

import functools
import logging

import pytest
import torch
from tiny_models import make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineArgs
from deepinfer.worker import compiled_step
from deepinfer.worker.compiled_step import use_compiled_steps

OPTIONS = dict(block_size=16, load_progress=False, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return save_reference(make_reference("v4", seed=11), tmp_path_factory.mktemp("v4") / "model")


def _prompts(n: int) -> list[list[int]]:
    return [torch.randint(3, 300, (k,), generator=torch.Generator().manual_seed(k)).tolist() for k in (9, 21, 5)][:n]


def _generate(path, eager: bool, n: int, monkeypatch, **options):
    """Greedy tokens and top-3 logprobs of n prompts, the batch size of every compiled step, and the
    compiled steps (None when eager)."""
    llm = LLM(str(path), enforce_eager=eager, **{**OPTIONS, **options})
    steps, calls = llm.engine.runner.graphs, []
    if steps is not None:
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        run = steps.run
        steps.run = lambda meta: calls.append(meta.num_reqs) or run(meta)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=3) for m in (12, 5, 9)][:n]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(n)], params, use_tqdm=False)
    lps = [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]
    return [o.outputs[0].token_ids for o in outs], lps, calls, steps


def _assert_same(want, got) -> None:
    assert got[0] == want[0]  # greedy tokens identical
    for w_req, g_req in zip(want[1], got[1]):
        for w, g in zip(w_req, g_req):
            assert w.keys() == g.keys()
            torch.testing.assert_close(torch.tensor(list(g.values())), torch.tensor(list(w.values())),
                                       rtol=1e-4, atol=1e-4)


def test_compiled_decode_matches_eager_v4(v4, monkeypatch):
    """One stream (one graph: the batch-1 specialisation), every decode step compiled."""
    want = _generate(v4, True, 1, monkeypatch, max_num_seqs=1)
    got = _generate(v4, False, 1, monkeypatch, max_num_seqs=1)
    _assert_same(want, got)
    assert want[2] == [] and got[2] == [1] * 11
    calls = got[3].fn
    assert calls.guarded <= 2 and calls.direct >= 9  # guards checked once per key (verified_calls.py)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}, {"max_num_batched_tokens": 16}],
                         ids=["sync", "async", "chunked"])
def test_compiled_batches_match_eager_v4(v4, monkeypatch, options):
    """Batches of 3, 2 and 1 as requests finish: the dynamic-batch graph and the batch-1 one, no recompile;
    chunked: steps mixing decodes with a prefill chunk compile their decodes."""
    want = _generate(v4, True, 3, monkeypatch, max_num_seqs=4, **options)
    got = _generate(v4, False, 3, monkeypatch, max_num_seqs=4, **options)
    _assert_same(want, got)
    assert {3, 2, 1} <= set(got[2])


@pytest.mark.slow
def test_compiled_mla_decode_matches_eager(tmp_path, monkeypatch):
    """DeepSeek-V3 (MLA absorbed decode over the paged latent cache, sorted MoE traced densely)."""
    path = save_reference(make_reference("v3", seed=2), tmp_path / "v3")
    want = _generate(path, True, 3, monkeypatch, max_num_seqs=4)
    got = _generate(path, False, 3, monkeypatch, max_num_seqs=4)
    _assert_same(want, got)
    assert {3, 2, 1} <= set(got[2])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_compiled_verify_steps_match_eager(v4, tmp_path, monkeypatch, method):
    """With speculation, verify steps of k + 1 tokens are compiled too (MTP: with the hidden streams its drafter
    reads); greedy tokens equal the eager engine's, and no step recompiles."""
    from test_spec_decode import _with_mtp

    path = _with_mtp(v4, tmp_path / "mtp")
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 15, 19)]
    prompts = [{"prompt_token_ids": p * 3} for p in _prompts(3)]  # repeats: n-gram drafts find matches
    runs, query_lens, steps = [], [], None
    for eager in (True, False):
        llm = LLM(str(path), enforce_eager=eager, speculative_config={"method": method, "num_speculative_tokens": 3},
                  **{**OPTIONS, "max_num_seqs": 4})
        if not eager:
            monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
            steps = llm.engine.runner.graphs
            steps.run = functools.partial(_recording, steps.run, query_lens)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1] and llm.engine.scheduler.spec_stats.num_drafts > 0
    assert steps.fn.direct > steps.fn.guarded
    assert 4 in query_lens or method == "ngram"  # n-gram drafts vary in length: uneven steps run eagerly


def _recording(run, query_lens: list, meta):
    query_lens.append(meta.num_tokens // meta.num_reqs)
    return run(meta)


def test_a_model_the_compiler_cannot_take_runs_eagerly(v4, monkeypatch, caplog):
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    def broken(self, step, scratch_block, return_mtp_input=False):
        raise NotImplementedError("no static forward here")

    monkeypatch.setattr(DeepseekV4ForCausalLM, "forward_static", broken)
    torch._dynamo.reset()  # an earlier test's compiled step would otherwise serve this engine from the cache
    monkeypatch.setattr(logging.getLogger("deepinfer"), "propagate", True)  # deepinfer's logger keeps to itself
    want = _generate(v4, True, 1, monkeypatch, max_num_seqs=1)
    got = _generate(v4, False, 1, monkeypatch, max_num_seqs=1)
    assert got[0] == want[0] and got[2] == []
    assert "steps run eagerly" in caplog.text


def test_compiled_steps_are_declined_where_they_do_not_apply():
    model = torch.nn.Module()
    model.forward_static = lambda *a: None
    cpu = torch.device("cpu")
    assert use_compiled_steps(model, EngineArgs(enforce_eager=False), cpu)
    assert not use_compiled_steps(model, EngineArgs(enforce_eager=False), torch.device("cuda"))  # CUDA graphs
    for off in (dict(enforce_eager=True), dict(deterministic=True), dict(kv_cache_dtype="fp8")):
        assert not use_compiled_steps(model, EngineArgs(**{"enforce_eager": False, **off}), cpu), off
    assert not use_compiled_steps(torch.nn.Linear(2, 2), EngineArgs(enforce_eager=False), cpu)
    assert compiled_step.DEFAULT_CACHE_DIR.name == "inductor"


def test_warm_keys_cover_every_graph_at_every_thread_count():
    from deepinfer.worker.threads import StepThreads

    steps = object.__new__(compiled_step.CompiledSteps)  # only the fields warm_keys reads (nothing compiled)
    steps.query_lens, steps.max_batch = (1, 4), 8
    steps.threads = StepThreads(max_threads=2, small_step_tokens=2)
    assert steps.warm_keys() == [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 4, 2), (2, 4, 2)]  # 4 tokens: all
    steps.threads, steps.max_batch = StepThreads(max_threads=1, small_step_tokens=2), 1  # served on 2 cores
    assert steps.warm_keys() == [(1, 1, 1), (1, 4, 1)]
    steps.threads = None
    assert steps.warm_keys() == [(1, 1, None), (1, 4, None)]


@pytest.mark.slow
def test_no_graph_is_compiled_after_start_up(v4):
    """Steps run at several intra-op thread counts (worker/threads.py: one thread for a lone decode, all of them
    beside a prompt chunk) and torch.compile guards on the count: start-up compiles each graph at each count, so a
    first step of one request, of two, of three, and a step mixing decodes with a prompt chunk compile nothing
    (before, a first single-request generate recompiled for tens of seconds)."""
    from torch._dynamo.utils import counters

    llm = LLM(str(v4), enforce_eager=False, **{**OPTIONS, "max_num_seqs": 4, "max_num_batched_tokens": 16})
    threads = llm.engine.runner.threads
    assert llm.engine.runner.graphs.warm_keys() == [(b, 1, t) for b in (1, 2) for t in threads.counts(b)]
    compiled = counters["stats"]["unique_graphs"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for n in (1, 2, 3):
        llm.generate([{"prompt_token_ids": p} for p in _prompts(n)], params, use_tqdm=False)
    assert counters["stats"]["unique_graphs"] == compiled


def test_a_sliced_block_table_reaches_the_graph_with_standard_strides():
    """A mixed step's decodes carry a slice of the step's table; the graph guards on its strides (a slice would
    recompile, as speculation's mixed steps did), so the step hands it over with standard strides."""
    from deepinfer.layers.static_step import StaticStep

    steps = object.__new__(compiled_step.CompiledSteps)  # only what _call reads (nothing compiled)
    steps.scratch_block, steps.fn = 0, lambda *args: args[2]
    full = torch.arange(15).reshape(3, 5)
    for table in (full[0:1, :3], full[:, :3]):
        rows = table.shape[0]
        step = StaticStep(torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long), table,
                          torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long), 1, 16)
        seen = steps._call(step)
        assert seen.stride() == (3, 1) and torch.equal(seen, table)


class _ToyEngine:
    """A compiled method whose graph depends on its instance (a Python loop over `n`), as each engine's does."""

    def __init__(self, n: int, own: bool):
        self.n = n
        method = compiled_step._own_code(self._forward) if own else self._forward
        self.fn = torch.compile(method, dynamic=True, fullgraph=True)

    def _forward(self, x):
        for _ in range(self.n):
            x = x * 2
        return x


def test_each_engine_compiles_into_its_own_cache():
    """Dynamo keeps at most recompile_limit (8) graphs per code object: ten engines sharing one method's code fail
    the ninth compile (an engine then ran eagerly); with a code object each, all ten compile and give their own
    results."""
    limit = torch._dynamo.config.recompile_limit
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for n in range(limit + 2):
            _ToyEngine(n, own=False).fn(torch.ones(2))
    outs = [_ToyEngine(n, own=True).fn(torch.ones(2)) for n in range(limit + 2)]
    assert [o[0].item() for o in outs] == [2.0**n for n in range(limit + 2)]


def test_broken_artifact_names_only_a_library_in_the_cache(tmp_path):
    cache, elsewhere = tmp_path / "cache", tmp_path / "other"
    (cache / "ab").mkdir(parents=True)
    elsewhere.mkdir()
    lib, build = cache / "ab" / "cabc.main.so", cache / "ab" / "cabc.main_CxxBuild"
    lib.touch()
    build.mkdir()
    (elsewhere / "x.so").touch()
    error = ImportError(f"{lib}: file too short")
    assert compiled_step.broken_artifact(RuntimeError(f"InductorError: ImportError: {error}"), cache) == lib
    try:
        try:
            raise error
        except ImportError as inner:
            raise RuntimeError("backend='inductor' raised:") from inner
    except RuntimeError as wrapped:
        assert compiled_step.broken_artifact(wrapped, cache) == lib  # named by the exception it was raised from
    assert compiled_step.broken_artifact(ImportError(f"{elsewhere / 'x.so'}: file too short"), cache) is None
    assert compiled_step.broken_artifact(ImportError(f"{cache / 'ab' / 'gone.so'}: no such file"), cache) is None
    assert compiled_step.broken_artifact(ValueError("no library named here"), cache) is None
    (cache / "ab" / "good.so").write_bytes(b"\x7fELF" + bytes(60))
    assert compiled_step.unloadable_libraries(cache) == [lib]
    assert compiled_step.broken_libraries(ValueError("a compile error naming no library"), cache) == [lib]
    compiled_step.remove_artifact(lib)
    assert not lib.exists() and not build.exists()


_COMPILE_AND_REPORT = """
import logging, sys
from deepinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], enforce_eager=False, max_num_seqs=1, block_size=16, load_progress=False, dtype="float32")
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("FAILED" if llm.engine.runner.graphs.failed else "COMPILED", out[0].outputs[0].token_ids)
"""


@pytest.mark.slow
def test_an_interrupted_build_in_the_compile_cache_is_repaired(v4, tmp_path):
    """Every library of a first start's compile cut to nothing (what processes killed mid-build leave): the
    next start removes what does not load, compiles again and runs compiled, with the same tokens."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def start():
        done = subprocess.run([sys.executable, "-c", _COMPILE_AND_REPORT, str(v4)], env=env, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1], done.stderr

    first, _ = start()
    libraries = list((tmp_path / "inductor").rglob("*.so"))
    assert first.startswith("COMPILED") and libraries
    for lib in libraries:
        lib.write_bytes(b"")
    second, log = start()
    assert second == first and "do not load (an interrupted build?)" in log
