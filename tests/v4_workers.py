"""WorkerGroup targets for test_v4_parallel.py (spawned workers import this module by name, like tp_workers.py).

Every rank loads the same full checkpoint twice: as the sharded model its ModelParallel describes, and as the
single-process model (parallel=None, the reference). Both run with one intra-op thread, so the reference's GEMM
bits are the ones a single process would get. A rank runs its DP replica's sequences (or idles) through Run
steps, calling parallel.finish_step() at the end of every step as the engine does, and returns logits, greedy
tokens and what it stores of the experts; the parent compares.
"""

from __future__ import annotations

import torch
from tp_workers import counting_collectives
from v4_runs import Run, load_v4

import deepinfer.distributed.backend as backend
from deepinfer.distributed.model_parallel import ModelParallel, ParallelExperts
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

GROUP_TIMEOUT_S = 30  # a collective that waits longer fails the rank instead of hanging the test
PROMPTS = {0: (23, 9, 40), 1: (17, 31)}  # DP replica -> prompt lengths (ragged)
DECODE_STEPS = 3
# scenario -> (does replica 0 run MTP, does replica 1 run MTP); None: that replica is idle
SCENARIOS = {"dp": (True, True), "idle": (False, None), "mtp_extra": (True, False)}


def prompts(replica: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(50 + replica)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPTS[replica]]


def _step(run: Run, counts: list[int], mtp: bool) -> list[torch.Tensor]:
    """Logits [T, V] of every row: the main model's, then (mtp) each MTP layer's."""
    model = run.model
    hidden = run.step(counts) if mtp else [model(run.meta(counts))]
    return [model.compute_logits(h) for h in hidden]


def generate(model: DeepseekV4ForCausalLM, seqs: list[list[int]], mtp: bool) -> dict:
    """One ragged prefill of all prompts, then DECODE_STEPS greedy decode steps (the main head's argmax); each
    step's greedy token fills a placeholder (0) after the prompt, so 1 + DECODE_STEPS tokens come out."""
    run = Run(model, [s + [0] * (1 + DECODE_STEPS) for s in seqs])
    steps, rounds, counts = [], [], [len(s) for s in seqs]
    for _ in range(1 + DECODE_STEPS):
        steps.append(_step(run, counts, mtp))
        rounds.append(model.parallel.finish_step())
        counts = _append_greedy(run, steps[-1][0], counts)
    return {"logits": steps, "tokens": [s[len(p):] for s, p in zip(run.seqs, seqs)], "rounds": rounds}


def _append_greedy(run: Run, logits: torch.Tensor, counts: list[int]) -> list[int]:
    """Write each sequence's next token (argmax at its last row) into its placeholder; next step decodes it."""
    ends = torch.tensor(counts).cumsum(0) - 1
    for r, token in enumerate(logits[ends].argmax(-1).tolist()):
        run.seqs[r][run.done[r]] = token
    return [1] * len(counts)


def idle(model: DeepseekV4ForCausalLM) -> dict:
    """An idle DP replica: the engine only calls finish_step, once per step of the busy replica."""
    return {"rounds": [model.parallel.finish_step() for _ in range(1 + DECODE_STEPS)]}


def _stored_slices(mine: ParallelExperts, full: ParallelExperts) -> bool:
    """mine holds exactly its slices (shard_weight) of its experts (local) of the full layer's weights."""
    inter = full.w13.shape[1] // 2
    for i, e in enumerate(mine.local):
        w13 = torch.cat([mine.shard_weight(full.w13[e, :inter], 0), mine.shard_weight(full.w13[e, inter:], 1)])
        if not (torch.equal(mine.w13[i], w13) and torch.equal(mine.w2[i], mine.shard_weight(full.w2[e], None))):
            return False
    return True


def _cache_layout(model: DeepseekV4ForCausalLM) -> list[tuple]:
    return [(s.name, s.kind, s.shape, s.dtype) for s in model.kv_cache_spec(16, include_mtp=True)]


def expert_storage(model: DeepseekV4ForCausalLM, ref: DeepseekV4ForCausalLM) -> dict:
    """Expert elements this rank stores vs the full model's, the experts it holds and whether they are its
    slices of the checkpoint's (per ParallelExperts, in construction order: main layers then MTP); whether its
    cache layout is the single-process one."""
    mine = [m for m in model.modules() if isinstance(m, ParallelExperts)]
    full = [m for m in ref.modules() if isinstance(m, ParallelExperts)]
    return {"numel": sum(m.w13.numel() + m.w2.numel() for m in mine),
            "full_numel": sum(m.w13.numel() + m.w2.numel() for m in full),
            "local": [(m.local.start, m.local.stop) for m in mine],
            "exact": all(_stored_slices(a, b) for a, b in zip(mine, full)),
            "params": sum(p.numel() for p in model.parameters()),
            "full_params": sum(p.numel() for p in ref.parameters()),
            "same_cache": _cache_layout(model) == _cache_layout(ref)}


def collectives_per_forward(model: DeepseekV4ForCausalLM) -> dict[str, int]:
    """The all_reduce / all_gather calls of one main forward plus compute_logits (then the step's finish)."""
    run = Run(model, prompts(0)[:1])
    with torch.no_grad(), counting_collectives() as counts:
        model.compute_logits(model(run.meta([5])))
    model.parallel.finish_step()
    return dict(counts)


def _scenario(model, ref, replica: int, plan: tuple) -> dict:
    """This replica's part of a scenario: its sequences on the sharded and the reference model, or idling."""
    mtp = plan[replica]
    if mtp is None:
        return idle(model)
    with torch.no_grad():
        return {"sharded": generate(model, prompts(replica), mtp), "ref": generate(ref, prompts(replica), mtp)}


def v4_world(rank: int, layout, path: str, comm_kinds: list[str], scenarios: list[str]) -> dict:
    """Every scenario for every MoE comm kind (a fresh sharded model each), in one world."""
    torch.set_num_threads(1)
    groups = backend.build_groups(layout, GROUP_TIMEOUT_S)
    ref, replica = load_v4(path), layout.dp_rank(rank)
    out = {}
    for kind in comm_kinds:
        model = load_v4(path, ModelParallel.from_groups(groups, ref.config.n_routed_experts, kind))
        out[kind] = {"storage": expert_storage(model, ref), "collectives": collectives_per_forward(model)}
        out[kind] |= {name: _scenario(model, ref, replica, SCENARIOS[name]) for name in scenarios}
    return out
