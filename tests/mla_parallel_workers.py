"""WorkerGroup targets for tests/test_mla_parallel.py (spawned ranks import this module by name).

A rank builds ModelParallel.from_groups over its layout, loads the full tiny checkpoint (keeping only its slices)
and runs its replica's Script: a ragged prefill (the last prompt in two chunks, its second chunk alongside the
first decode of the others), greedy decode steps (the absorbed path) and, with `mtp`, an MTP forward over the
first step. Every rank calls parallel.finish_step() after every step, as the engine does; an idle replica
(Script None) calls only that, as many times as the busy one has steps. The parent runs the same scripts
through a single-process model (`run_script` with parallel None) and compares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from paged_mla import PagedRun

import deepinfer.distributed.backend as backend
from deepinfer.config import ModelConfig
from deepinfer.distributed.model_parallel import ModelParallel, ParallelExperts
from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.models.loader import iter_checkpoint

GROUP_TIMEOUT_S = 30  # a collective that waits longer fails the rank instead of hanging the test


@dataclass(frozen=True)
class Script:
    prompts: tuple[tuple[int, ...], ...]
    decode_steps: int = 3
    mtp: bool = False  # also run MTP layer 0 over the first step's rows

    @property
    def num_steps(self) -> int:
        return 2 + self.decode_steps  # prefill, second chunk + first decode, decodes


@dataclass(frozen=True)
class Case:
    path: str
    comm_kind: str  # the MoE comm of an EP world (unused without EP)
    scripts: tuple[Script | None, ...]  # one per DP replica


def prompts(seed: int, lengths: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(tuple(torch.randint(3, 512, (n,), generator=g).tolist()) for n in lengths)


def load(path: str, parallel: ModelParallel | None = None) -> DeepseekV3ForCausalLM:
    cfg = ModelConfig.from_hf(path)
    model = DeepseekV3ForCausalLM(cfg, parallel=parallel)
    model.load_weights(iter_checkpoint(path, cfg.model_type))
    return model


def _first_chunks(script: Script) -> list[tuple[int, list[int]]]:
    *whole, last = script.prompts
    return [(r, list(p)) for r, p in enumerate(whole)] + [(len(whole), list(last[:len(last) // 2]))]


def _next_chunks(script: Script, step: int, tokens: dict[int, int]) -> list[tuple[int, list[int]]]:
    """Step >= 1: one greedy token per request that finished its prompt; the rest of the last prompt at step 1."""
    last = len(script.prompts) - 1
    chunks = [(r, [tokens[r]]) for r in sorted(tokens)]
    if step == 1:
        chunks.append((last, list(script.prompts[last][len(script.prompts[last]) // 2:])))
    return chunks


def _mtp_logits(model, meta, hidden) -> torch.Tensor:
    """MTP layer 0 over the step's rows (the next-token ids are the step's own ids rolled by one)."""
    with torch.no_grad():
        return model.compute_logits(model.mtp_forward(0, hidden, torch.roll(meta.input_ids, -1), meta))


def run_script(model: DeepseekV3ForCausalLM, script: Script) -> dict:
    """Logits [n, V] of every step, the greedy tokens and the MTP logits (None without mtp)."""
    if script.mtp:
        model.build_mtp()  # every TP rank of the replica (EP ranks built it in load_weights)
    run, out = PagedRun(model, include_mtp=script.mtp), {"logits": [], "tokens": [], "mtp": None, "rounds": []}
    chunks, tokens = _first_chunks(script), {}
    for step in range(script.num_steps):
        meta, hidden = run.forward(chunks)
        with torch.no_grad():
            logits = model.compute_logits(hidden)
        if script.mtp and step == 0:
            out["mtp"] = _mtp_logits(model, meta, hidden)
        out["rounds"].append(model.parallel.finish_step())
        out["logits"].append(logits)
        ends = {rid: meta.query_start[i + 1] - 1 for i, (rid, _) in enumerate(chunks)}
        done = [rid for rid in ends if step > 0 or rid < len(script.prompts) - 1]
        tokens = {rid: int(logits[ends[rid]].argmax()) for rid in done}
        out["tokens"].append(tokens)
        chunks = _next_chunks(script, step + 1, tokens)
    return out


def idle(model: DeepseekV3ForCausalLM, steps: int) -> dict:
    """An idle DP replica: only finish_step, once per step of the busy one; returns the rounds it joined."""
    return {"rounds": [model.parallel.finish_step() for _ in range(steps)]}


def expert_numel(model: DeepseekV3ForCausalLM) -> int:
    """Routed-expert parameter elements of the main layers on this rank."""
    return sum(p.numel() for m in model.model.modules() if isinstance(m, ParallelExperts) for p in m.parameters())


def _run_case(rank: int, layout, groups, case: Case) -> dict:
    cfg = ModelConfig.from_hf(case.path)
    model = load(case.path, ModelParallel.from_groups(groups, cfg.n_routed_experts, case.comm_kind))
    mine = case.scripts[layout.dp_rank(rank)]
    busy = next(s for s in case.scripts if s is not None)
    out = idle(model, busy.num_steps) if mine is None else run_script(model, mine)
    return out | {"expert_numel": expert_numel(model), "tags": len(model.parallel._experts)}


def run_cases(rank: int, layout, cases: list[Case]) -> list[dict]:
    """Every case in sequence over one set of groups (a model per case), one intra-op thread like the parent."""
    torch.set_num_threads(1)
    groups = backend.build_groups(layout, GROUP_TIMEOUT_S)
    return [_run_case(rank, layout, groups, case) for case in cases]
