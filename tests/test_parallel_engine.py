"""The multi-rank engine (deepinfer/distributed): outputs identical to one process, rank lifetime, faults.

Layouts run as real rank processes over gloo on this CPU. The single-process engine with the same options is
the reference (it is itself checked against transformers in test_parity.py).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from dist_workers import torchrun_nodes
from test_spec_decode import _with_mtp, _with_v3_mtp
from tiny_models import make_reference, save_reference, write_tokenizer

from deepinfer import LLM, SamplingParams
from deepinfer.config import SchedulerConfig
from deepinfer.distributed.dp_engine import pick_replica
from deepinfer.distributed.executor import RanksFailed
from deepinfer.distributed.launcher import free_port
from deepinfer.distributed.plan import MirrorBook, PlanEncoder
from deepinfer.engine.kv_cache import KVCacheManager
from deepinfer.engine.outputs import RunnerOutput
from deepinfer.engine.scheduler import Scheduler
from deepinfer.models.dspark import DSparkConfig, DSparkDrafter

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=10, ignore_eos=True)
# Odd chunk budget (prefills split at odd points), prefix caching on, a small cache.
OPTIONS = dict(block_size=16, max_num_batched_tokens=7, max_num_seqs=4, kv_cache_memory_bytes=16 * 2**20,
               load_progress=False, distributed_timeout_s=30.0)
# The DeepSeek layout (attention DP + EP) for the feature tests; the matrix below covers the others.
LAYOUTS = {"dp2+ep": dict(data_parallel_size=2, enable_expert_parallel=True),
           "dp2+ep tbo": dict(data_parallel_size=2, enable_expert_parallel=True, two_batch_overlap=True),
           "dp2+ep async": dict(data_parallel_size=2, enable_expert_parallel=True, async_scheduling=True)}
TORCHRUN_LAYOUT = dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
SPEC_LAYOUT = dict(data_parallel_size=2, enable_expert_parallel=True)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def rank_pids(llm: LLM) -> list[int]:
    executor = llm.engine.executor
    return [executor.ranks[r].pid for r in sorted(executor.ranks)]


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    """Tiny V4 with MTP weights (official names) and a tokenizer."""
    plain = save_reference(make_reference("v4", seed=21), tmp_path_factory.mktemp("v4par") / "plain")
    path = _with_mtp(plain, tmp_path_factory.mktemp("v4parmtp") / "model")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference(v4_ckpt):
    llm = LLM(v4_ckpt, **OPTIONS)
    yield llm
    llm.shutdown()


# --- pure parts -------------------------------------------------------------------------------------
def test_pick_replica_prefers_the_least_loaded():
    assert pick_replica([(2, 10), (1, 50)]) == 1
    assert pick_replica([(1, 5), (1, 9)]) == 0
    assert pick_replica([(0, 0), (0, 0)]) == 0


def _scheduler(blocks: int = 32) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=5, max_model_len=256)
    return Scheduler(cfg, KVCacheManager(blocks, 4, 4, True), 256)


def test_mirrors_follow_the_scheduler_through_chunks_outputs_and_finishes():
    """Ranks rebuild each step's ScheduledRequests (same fields, same token history) from deltas alone."""
    from deepinfer.request import Request

    sched, encoder, book = _scheduler(), PlanEncoder(), MirrorBook()
    reqs = [Request(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=3), 3) for i, n in enumerate([7, 2])]
    for req in reqs:
        sched.add(req)
    for step in range(12):
        out = sched.schedule()
        if out.is_empty:
            break
        plan = encoder.encode(out, set(sched.requests))
        rebuilt = book.decode(plan)
        for a, b in zip(out.scheduled, rebuilt.scheduled):
            assert (a.num_new_tokens, a.block_ids, a.start, a.samples, a.write_from) == \
                (b.num_new_tokens, b.block_ids, b.start, b.samples, b.write_from)
            assert a.request.token_ids(0, a.request.num_tokens) == b.request.token_ids(0, b.request.num_tokens)
        sampled = {s.request.request_id: 100 + step for s in out.scheduled if s.samples}
        sched.update(out, RunnerOutput(sampled=sampled))
    assert not sched.has_unfinished
    book.decode(encoder.encode(sched.schedule(), set(sched.requests)))
    assert book.requests == {} and encoder.synced == {}  # finished requests' mirrors are dropped


# --- parity ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow if "async" in name else ())
                                        for name in LAYOUTS])  # async runs by default in the matrix and server
def parallel_llm(request, v4_ckpt):
    llm = LLM(v4_ckpt, **OPTIONS, **LAYOUTS[request.param])
    yield llm
    llm.shutdown()


def test_ragged_batch_matches_one_process(parallel_llm, reference):
    prompts = _prompts(1, [13, 5, 30, 1, 22])
    assert _tokens(parallel_llm.generate(prompts, GREEDY, use_tqdm=False)) == \
        _tokens(reference.generate(prompts, GREEDY, use_tqdm=False))


def test_one_request_leaves_a_replica_idle(parallel_llm, reference):
    prompt = _prompts(2, [19])
    assert _tokens(parallel_llm.generate(prompt, GREEDY, use_tqdm=False)) == \
        _tokens(reference.generate(prompt, GREEDY, use_tqdm=False))


def test_prefix_hits_and_seeded_samples_match(parallel_llm, reference):
    """A shared 32-token prefix (two full blocks) is a hit the second time; seeded n=2 sampling draws the same
    tokens as one process (each rank's mirror has the request's own generator)."""
    base = _prompts(3, [40])[0]
    prompts = [base[:32] + [7, 8, 9], base[:32] + [11]]
    params = SamplingParams(n=2, temperature=1.0, top_k=20, seed=7, max_tokens=8, ignore_eos=True)
    for _ in range(2):
        got = _tokens(parallel_llm.generate(prompts, params, use_tqdm=False))
        assert got == _tokens(reference.generate(prompts, params, use_tqdm=False))
    hits = sum(core.kv.prefix_hits for core in parallel_llm.engine.replicas)
    # async scheduling finds no hit here in one process either (it hashes a block only once its tokens are known)
    assert hits > 0 or parallel_llm.engine.args.async_scheduling


def test_preemption_matches(v4_ckpt, reference):
    """Six cache blocks per replica for requests of up to four: requests are preempted and recomputed."""
    layout = reference.engine.layout
    budget = OPTIONS["max_num_seqs"] * layout.bytes_per_slot + 6 * layout.bytes_per_block
    options = {**OPTIONS, "kv_cache_memory_bytes": budget, "max_num_batched_tokens": 64}
    prompts = _prompts(7, [20, 25, 18, 30, 22, 27])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(v4_ckpt, **options) as ref, LLM(v4_ckpt, **options, data_parallel_size=2) as llm:
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == \
            _tokens(ref.generate(prompts, params, use_tqdm=False))
        assert all(core.scheduler.num_preemptions > 0 for core in _replicas(llm))


def test_structured_outputs_match(parallel_llm, reference):
    """The driver fills the grammar bitmask; the ranks sample under it."""
    from deepinfer import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(choice=["hello world", "the fox"]))
    prompts = _prompts(8, [6, 9])
    got = [o.outputs[0].text for o in parallel_llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].text for o in reference.generate(prompts, params, use_tqdm=False)]
    assert all(t in ("hello world", "the fox") for t in got)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculative_decoding_is_lossless(v4_ckpt, reference, method):
    """Drafts on every rank (MTP runs its layer sharded like the rest); greedy tokens equal plain decoding."""
    spec = {"method": method, "num_speculative_tokens": 2}
    prompts = _prompts(9, [12, 4, 20])
    with LLM(v4_ckpt, **OPTIONS, **SPEC_LAYOUT, speculative_config=spec) as llm:
        got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        drafts = sum(core.scheduler.spec_stats.num_draft_tokens for core in _replicas(llm))
    assert got == _tokens(reference.generate(prompts, GREEDY, use_tqdm=False))
    assert drafts > 0


def test_dspark_drafts_on_every_rank(tmp_path):
    """DSpark's drafter is small and runs whole on every rank; greedy tokens equal plain decoding."""
    torch.manual_seed(0)
    DSparkDrafter(DSparkConfig(256, 8192, num_draft_tokens=4)).save(tmp_path)
    prompts = ["def f(x):", "hello there"]
    options = dict(load_progress=False, kv_cache_memory_bytes=2**25)
    want = _tokens(LLM(**options).generate(prompts, GREEDY, use_tqdm=False))
    spec = {"method": "dspark", "num_speculative_tokens": 3, "model": str(tmp_path)}
    with LLM(**options, **SPEC_LAYOUT, speculative_config=spec) as llm:
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
        assert sum(core.scheduler.spec_stats.num_draft_tokens for core in _replicas(llm)) > 0


def _replicas(llm: LLM) -> list:
    return getattr(llm.engine, "replicas", [llm.engine])


def test_rank_stats(parallel_llm, reference):
    """Each routed expert lives on exactly one rank (MTP layer's included); the EP collectives moved bytes."""
    stats = parallel_llm.engine.executor.rank_stats()
    experts = sum(p.numel() * p.element_size() for n, p in reference.engine.model.named_parameters()
                  if n.endswith((".experts.w13", ".experts.w2")))
    assert [s.rank for s in stats] == list(range(len(stats)))
    assert sum(s.expert_param_bytes for s in stats) == experts
    assert all(s.steps > 0 and s.peak_rss_bytes > 0 and s.moe_payload_bytes > 0 for s in stats)
    assert all(s.param_bytes - s.expert_param_bytes == stats[0].param_bytes - stats[0].expert_param_bytes
               for s in stats)  # TP 1: the rest is replicated


# --- the matrix: every model family x layout --------------------------------------------------------
EP2 = dict(data_parallel_size=2, enable_expert_parallel=True)
MATRIX_LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "dp2+ep": EP2,
    "dp2+ep alltoall": {**EP2, "moe_comm": "alltoall"},
    "dp2xtp2+ep": {**EP2, "tensor_parallel_size": 2},
    "tp2 async": dict(tensor_parallel_size=2, async_scheduling=True),
}
# Routed expert counts that do not divide the EP sizes 2 and 4 (V3/V2: 3 groups of 3 for group-limited routing).
ODD_EXPERTS = {"v4": dict(n_routed_experts=7), "v4b": dict(n_routed_experts=7),
               "v3": dict(n_routed_experts=9, n_group=3, topk_group=2),
               "v2": dict(n_routed_experts=9, n_group=3, topk_group=2),
               "v32": dict(n_routed_experts=9, n_group=3, topk_group=2)}
# dp x tp runs by default in test_v4_parallel.py; the rest of the matrix is slow
FAST = {("v4", "dp2+ep"), ("v3", "dp2+ep alltoall"), ("v2", "tp2"), ("v4", "tp2 async")}
MATRIX = [pytest.param(kind, name, id=f"{kind}-{name}",
                       marks=() if (kind, name) in FAST else pytest.mark.slow)
          for kind in ODD_EXPERTS for name in MATRIX_LAYOUTS]


@pytest.fixture(scope="module")
def family_ckpts(tmp_path_factory):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"par-{kind}")
            cache[kind] = save_reference(make_reference(kind, seed=31, **ODD_EXPERTS[kind]), path)
        return cache[kind]
    return get


@pytest.mark.parametrize("kind, layout", MATRIX)
def test_layout_matches_one_process(family_ckpts, kind, layout):
    """Ragged batch at an odd chunk budget, a lone request (one DP replica idle), then a shared-prefix batch
    twice (prefix-cache hits): greedy tokens equal the single-process engine's."""
    ckpt = family_ckpts(kind)
    base = _prompts(11, [40])[0]
    batches = [_prompts(12, [13, 5, 30, 1, 22]), _prompts(13, [19]),
               [base[:32] + [7, 8, 9], base[:32] + [11], base[:33]]]
    with LLM(ckpt, **OPTIONS) as ref:
        want = [_tokens(ref.generate(b, GREEDY, use_tqdm=False)) for b in batches + batches[-1:]]
    with LLM(ckpt, **OPTIONS, **MATRIX_LAYOUTS[layout]) as llm:
        got = [_tokens(llm.generate(b, GREEDY, use_tqdm=False)) for b in batches + batches[-1:]]
        hits = sum(core.kv.prefix_hits for core in _replicas(llm))
    assert got == want
    assert hits > 0 or "async" in layout  # see test_prefix_hits_and_seeded_samples_match


MTP_CELLS = [pytest.param("v4", "tp2", id="v4-tp2"),
             pytest.param("v3", "dp2+ep", id="v3-dp2+ep", marks=pytest.mark.slow),
             pytest.param("v3", "tp2", id="v3-tp2", marks=pytest.mark.slow),
             pytest.param("v4b", "dp2+ep alltoall", id="v4b-dp2+ep-alltoall", marks=pytest.mark.slow),
             pytest.param("v4", "dp2xtp2+ep", id="v4-dp2xtp2+ep", marks=pytest.mark.slow),
             pytest.param("v3", "dp2xtp2+ep", id="v3-dp2xtp2+ep", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def mtp_ckpts(family_ckpts, tmp_path_factory):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            add = _with_v3_mtp if kind == "v3" else _with_mtp
            cache[kind] = add(family_ckpts(kind), tmp_path_factory.mktemp(f"par-{kind}-mtp") / "model")
        return cache[kind]
    return get


@pytest.mark.parametrize("kind, layout", MTP_CELLS)
def test_mtp_speculation_in_layout_matches_one_process(mtp_ckpts, kind, layout):
    """MTP drafts on every rank (its layer sharded like the others); greedy tokens equal one process's."""
    ckpt = mtp_ckpts(kind)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    prompts = _prompts(14, [12, 3, 21, 8])
    with LLM(ckpt, **OPTIONS) as ref:
        want = _tokens(ref.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(ckpt, **OPTIONS, **MATRIX_LAYOUTS[layout], speculative_config=spec) as llm:
        got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        accepted = sum(core.scheduler.spec_stats.num_accepted_tokens for core in _replicas(llm))
        drafted = sum(core.scheduler.spec_stats.num_draft_tokens for core in _replicas(llm))
    assert got == want
    assert drafted > 0 and accepted >= 0


# --- lifetime --------------------------------------------------------------------------------------
def test_ranks_stop_on_shutdown_with_and_garbage_collection(v4_ckpt):
    llm = LLM(v4_ckpt, **OPTIONS, data_parallel_size=2)
    pids = rank_pids(llm)
    llm.shutdown()
    assert _wait_gone(pids) == []
    with LLM(v4_ckpt, **OPTIONS, data_parallel_size=2) as llm:
        pids = rank_pids(llm)
        assert all(_alive(p) for p in pids)
    assert _wait_gone(pids) == []
    llm = LLM(v4_ckpt, **OPTIONS, data_parallel_size=2)
    pids = rank_pids(llm)
    del llm
    gc.collect()
    assert _wait_gone(pids) == []


@pytest.mark.slow  # test_ranks_stop_on_shutdown_with_and_garbage_collection runs by default
def test_ranks_stop_at_interpreter_exit(v4_ckpt):
    script = textwrap.dedent(f"""
        from deepinfer import LLM
        if __name__ == "__main__":
            llm = LLM({str(v4_ckpt)!r}, load_progress=False, kv_cache_memory_bytes=2**24, data_parallel_size=2)
            ex = llm.engine.executor
            print(" ".join(str(i.pid) for i in ex.ranks.values()), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and _wait_gone(pids) == []


# --- faults ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig, rank, match, bound_s", [
    (signal.SIGKILL, 1, "rank 1", 20),  # the launcher's monitor sees the death at once
    (signal.SIGSTOP, 0, "rank 0|did not answer", 15),  # no answer, no heartbeat: the step deadline fires
], ids=["killed", "hung"])
def test_a_failed_rank_fails_the_engine_in_bounded_time(v4_ckpt, sig, rank, match, bound_s):
    """Mid-generation on DP 2 + EP (the peer is inside expert collectives with it); later calls fail at once."""
    llm = LLM(v4_ckpt, **{**OPTIONS, "distributed_timeout_s": 4.0}, **EP2)
    pids = rank_pids(llm)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    threading.Timer(1.5, os.kill, (pids[rank], sig)).start()
    started = time.monotonic()
    with pytest.raises(RanksFailed, match=match):
        llm.generate(_prompts(4, [9, 12, 5]), long, use_tqdm=False)
    assert time.monotonic() - started < bound_s
    with pytest.raises(RanksFailed):
        llm.generate(_prompts(5, [4]), GREEDY, use_tqdm=False)
    llm.shutdown()
    assert _wait_gone(pids) == []


# --- torchrun ----------------------------------------------------------------------------------------
@pytest.mark.slow  # test_torchrun_ranks_exit_when_their_driver_dies runs torchrun by default
def test_two_torchrun_nodes_of_two_ranks_serve_the_engine(v4_ckpt, reference):
    """`torchrun` starts the ranks (2 "nodes" x 2 on loopback); the LLM is the driver they connect to."""
    driver, layout = free_port(), TORCHRUN_LAYOUT
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in layout.items()]
    args = ["deepinfer.distributed.worker", "--driver", f"127.0.0.1:{driver}", "--model", str(v4_ckpt),
            "--no-load-progress", f"--kv-cache-memory-bytes={16 * 2**20}", "--block-size=16", *flags]
    with torchrun_nodes(2, 2, args, {**os.environ, "OMP_NUM_THREADS": "1"}) as nodes:
        llm = LLM(v4_ckpt, load_progress=False, kv_cache_memory_bytes=16 * 2**20, block_size=16,
                  distributed_workers="external", driver_address=f"127.0.0.1:{driver}", **layout)
        prompts = _prompts(6, [11, 3, 17])
        got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        llm.shutdown()
        outs = [n.communicate(timeout=60)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    assert got == _tokens(reference.generate(prompts, GREEDY, use_tqdm=False))


def test_torchrun_ranks_exit_when_their_driver_dies(v4_ckpt, tmp_path):
    """A torchrun rank has no parent to watch: the driver's connection dropping ends it."""
    driver = free_port()
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from deepinfer import LLM
        if __name__ == "__main__":
            llm = LLM({str(v4_ckpt)!r}, load_progress=False, kv_cache_memory_bytes=2**24, block_size=16,
                      data_parallel_size=2, distributed_workers="external", driver_address="127.0.0.1:{driver}")
            print("ready", flush=True)
            time.sleep(600)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["deepinfer.distributed.worker", "--driver", f"127.0.0.1:{driver}", "--model", str(v4_ckpt),
            "--no-load-progress", f"--kv-cache-memory-bytes={2**24}", "--block-size=16", "--data-parallel-size=2"]
    with torchrun_nodes(1, 2, args, env, capture=False) as (node,):
        owner = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert owner.stdout.readline().strip() == "ready"
            owner.kill()
            node.wait(timeout=30)  # the ranks exit (with an error), then torchrun does
        finally:
            owner.kill()
