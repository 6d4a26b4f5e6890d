"""Async scheduling: step N+1 is scheduled (with placeholder tokens) while step N computes on a worker
thread. Outputs must equal synchronous scheduling token for token (greedy) under chunked prefill,
preemption, EOS, stop ids, stop strings, max_tokens, n > 1 and aborts; no KV block leaks."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_models import fail_steps_scheduling, make_reference, save_reference, write_tokenizer

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineArgs, SchedulerConfig
from deepinfer.engine.core import EngineCore
from deepinfer.engine.engine_proc import EngineLoop
from deepinfer.engine.kv_cache import KVCacheManager
from deepinfer.engine.messages import AddRequest, params_to_dict
from deepinfer.engine.outputs import RunnerOutput
from deepinfer.engine.scheduler import Scheduler
from deepinfer.request import Request
from deepinfer.server.engine_client import AsyncEngineClient

OPTIONS = dict(block_size=16, max_num_batched_tokens=48, load_progress=False, max_num_seqs=12)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = save_reference(make_reference("v4", seed=11), tmp_path_factory.mktemp("v4") / "model")
    write_tokenizer(path)
    return path


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _budget(ckpt, tokens: int) -> int:
    """A KV budget that holds `tokens` tokens: small enough that the workload preempts."""
    layout = EngineCore(ckpt, EngineArgs(**OPTIONS)).layout
    return layout.state_rows * layout.bytes_per_slot + tokens // 16 * layout.bytes_per_block


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(14):
        prompts.append(_prompt(3 + 7 * i % 45, i))
        p = SamplingParams(temperature=0, max_tokens=4 + 3 * i % 17, ignore_eos=i % 5 != 0)
        if i % 5 == 3:
            p = p.clone(n=2, logprobs=2)
        elif i % 5 == 4:
            p = p.clone(min_tokens=3, repetition_penalty=1.3)
        params.append(p)
    return prompts, params


def _with_stops(params: list[SamplingParams], probe) -> list[SamplingParams]:
    """Stop ids and stop strings taken from the middle of a first run's outputs, so they do trigger."""
    out = []
    for i, (p, done) in enumerate(zip(params, probe)):
        ids, text = done.outputs[0].token_ids, done.outputs[0].text
        if i % 5 == 1:
            p = p.clone(stop_token_ids=[ids[len(ids) // 2]])
        elif i % 5 in (0, 2):
            middle = [c for c in text[len(text) // 3:] if c.isprintable() and c != "\ufffd"]
            p = p.clone(stop=[middle[0]]) if middle else p
        out.append(p)
    return out


def _summary(outputs) -> list:
    return [[(o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in out.outputs] for out in outputs]


def test_llm_outputs_equal_synchronous(ckpt):
    budget = _budget(ckpt, 160)
    sync = LLM(ckpt, kv_cache_memory_bytes=budget, **OPTIONS)
    asy = LLM(ckpt, kv_cache_memory_bytes=budget, async_scheduling=True, **OPTIONS)
    prompts, params = _workload()
    params = _with_stops(params, sync.generate(prompts, params, use_tqdm=False))
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = asy.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    reasons = [o.stop_reason for out in expected for o in out.outputs]
    assert sum(isinstance(r, int) for r in reasons) >= 2 and sum(isinstance(r, str) for r in reasons) >= 2
    assert sync.engine.scheduler.num_preemptions > 0 and asy.engine.scheduler.num_preemptions > 0
    for llm in (sync, asy):
        assert llm.engine.kv.num_free_blocks == llm.engine.layout.num_blocks
        assert not llm.engine.has_unfinished
    asy.engine.shutdown()


def _run_with_aborts(engine: EngineCore, abort_after: dict[str, int]) -> dict[str, tuple[list[int], str]]:
    """Step to completion; abort a request as soon as it has `abort_after[id]` output tokens."""
    done = {}
    while engine.has_unfinished:
        for req in engine.step():
            if not req.is_finished and len(req.output_token_ids) >= abort_after.get(req.request_id, 1 << 30):
                engine.abort(req.request_id)
            if req.is_finished:
                done[req.request_id] = (list(req.output_token_ids), req.status.value)
    return done


@pytest.mark.parametrize("deterministic", [False, True])
def test_engine_aborts_equal_synchronous(ckpt, deterministic):
    results = []
    for async_scheduling in (False, True):
        engine = EngineCore(ckpt, EngineArgs(**OPTIONS, async_scheduling=async_scheduling,
                                             deterministic=deterministic, kv_cache_memory_bytes=32 * 2**20))
        for i in range(8):
            engine.add_request(f"r{i}", _prompt(5 + 4 * i, 50 + i),
                               SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        results.append(_run_with_aborts(engine, {"r1": 1, "r4": 3, "r6": 9}))
        assert engine.kv.num_free_blocks == engine.layout.num_blocks
        engine.shutdown()
    assert results[0] == results[1]
    assert results[1]["r4"] == (results[1]["r4"][0][:3], "abort") and len(results[1]["r4"][0]) == 3


def test_engine_process_path_equals_synchronous_llm(ckpt):
    """Through the engine process; one prompt (110 tokens, 48-token budget) is chunked and asks for
    prompt logprobs, whose rows must arrive once each, in order, although the scheduler runs ahead."""
    kwargs = dict(OPTIONS, kv_cache_memory_bytes=32 * 2**20)
    prompts = [_prompt(6 + 5 * i, 80 + i) for i in range(5)] + [_prompt(110, 90)]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)] * 5 + [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)]
    offline = LLM(ckpt, **kwargs).generate(prompts, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in offline]

    async def main():
        client = await AsyncEngineClient.start(str(ckpt), dict(kwargs, async_scheduling=True))
        try:
            async def one(i):
                return [out async for out in client.generate(f"q{i}", prompts[i], params[i])]
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            await client.shutdown()

    streams = asyncio.run(main())
    assert [[t for out in stream for t in out.new_token_ids] for stream in streams] == expected
    rows = [row for out in streams[-1] for row in out.prompt_logprobs or []]
    assert [ids[0] for ids, _, _ in rows] == prompts[-1][1:]
    want = [entry for entry in offline[-1].prompt_logprobs if entry is not None]
    assert [lps[0] for _, lps, _ in rows] == pytest.approx([e[t].logprob for e, t in zip(want, prompts[-1][1:])])


def test_failed_forward_fails_its_requests_and_the_rest_run(ckpt, monkeypatch):
    """Engine-process loop, async: a forward that raises fails the requests of that step and of the step
    queued behind it; a request admitted later runs normally; nothing leaks."""
    core = EngineCore(ckpt, EngineArgs(**dict(OPTIONS, max_num_seqs=1), async_scheduling=True,
                                       kv_cache_memory_bytes=32 * 2**20))
    fail_steps_scheduling(monkeypatch, core.runner, "bad")
    loop = EngineLoop(core)
    params = params_to_dict(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert loop.add(AddRequest("bad", _prompt(7, 9), params)) is None
    assert loop.add(AddRequest("ok", _prompt(9, 8), params)) is None
    outputs = []
    while core.has_unfinished:
        outputs += loop.step()
    finished = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert finished == {"bad": "error", "ok": "length"}
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "ok") == 6
    assert core.kv.num_free_blocks == core.layout.num_blocks and loop.groups == {}
    core.shutdown()


# --- scheduler unit behaviour (no model) ----------------------------------------------------------
def _scheduler() -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, async_scheduling=True)
    return Scheduler(config, KVCacheManager(16, 4, 4), max_model_len=64)


def _request(rid: str, n: int, max_tokens: int) -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens,
                   eos_token_ids=(1,))


def test_scheduler_schedules_a_placeholder_before_the_token_is_known():
    sched = _scheduler()
    a, b = _request("a", 6, 5), _request("b", 3, 1)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [s.num_new_tokens for s in first.scheduled] == [6, 3]
    assert a.num_pending == 1 and a.num_computed_tokens == 6
    second = sched.schedule()  # step 1 still in flight: a decodes its unknown token; b is done by length
    assert [(s.request.request_id, s.start, s.placeholder) for s in second.scheduled] == [("a", 6, True)]
    sched.update(first, RunnerOutput(sampled={"a": 9, "b": 1}))
    assert a.output_token_ids == [9] and b.is_finished and a.num_pending == 1
    sched.update(second, RunnerOutput(sampled={"a": 1}))  # EOS
    assert a.is_finished and not sched.has_unfinished
    assert sched.kv.num_free_blocks == 16


def test_scheduler_discards_tokens_of_requests_finished_in_flight():
    sched = _scheduler()
    a = _request("a", 4, 8)
    sched.add(a)
    first = sched.schedule()
    second = sched.schedule()
    sched.update(first, RunnerOutput(sampled={"a": 1}))  # EOS: the queued step's token must not appear
    assert a.is_finished and sched.kv.num_free_blocks == 16
    assert sched.update(second, RunnerOutput(sampled={"a": 42})) == []
    assert a.output_token_ids == [1]
