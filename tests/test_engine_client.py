"""AsyncEngineClient against a real engine process on a tiny random V4 checkpoint: parity with the
offline LLM, concurrency, n > 1, rejections, aborts, step failures, a killed engine, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import time

import pytest
import torch
from tiny_models import fail_steps_scheduling, make_reference, save_reference

from deepinfer import LLM, SamplingParams
from deepinfer.engine.engine_proc import EngineLoop
from deepinfer.engine.messages import AddRequest, params_to_dict
from deepinfer.server.engine_client import AsyncEngineClient, EngineDeadError

ENGINE_KWARGS = dict(kv_cache_memory_bytes=32 * 2**20, max_num_seqs=8, load_progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_reference(make_reference("v4", seed=3), tmp_path_factory.mktemp("v4") / "model")


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def client(ckpt, loop):
    client = loop.run_until_complete(AsyncEngineClient.start(str(ckpt), ENGINE_KWARGS))
    yield client
    loop.run_until_complete(client.shutdown())


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, **ENGINE_KWARGS)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _collect(gen) -> list:
    return [out async for out in gen]


def _tokens(outputs, index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.new_token_ids]


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# --- serving ---------------------------------------------------------------------------------------
def test_ready_describes_the_engine(client):
    assert client.ready.vocab_size == 512 and client.ready.eos_token_ids == [1]
    assert client.ready.max_model_len == 4096 and client.ready.max_num_seqs == 8
    assert client.ready.num_blocks * client.ready.block_size == client.ready.kv_capacity_tokens


def test_greedy_tokens_and_logprobs_equal_offline_llm(client, llm, loop):
    prompt, params = _prompt(12, 1), GREEDY.clone(logprobs=2)
    outputs = loop.run_until_complete(_collect(client.generate("greedy", prompt, params)))
    expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert _tokens(outputs) == expected.token_ids
    assert [o.finish_reason for o in outputs] == [None] * 7 + ["length"]
    chosen = [entry for o in outputs for entry in o.logprobs]
    assert [e[0][0] for e in chosen] == expected.token_ids
    for (ids, lps, rank), ref in zip(chosen, expected.logprobs):
        assert lps[0] == pytest.approx(ref[ids[0]].logprob, abs=1e-4) and rank == ref[ids[0]].rank
    assert all(o.num_prompt_tokens == 12 for o in outputs) and client.num_in_flight == 0


def test_concurrent_requests_all_finish_with_their_own_tokens(client, llm, loop):
    prompts = [_prompt(3 + 2 * i, 10 + i) for i in range(8)]
    params = [GREEDY.clone(max_tokens=2 + i) for i in range(8)]

    async def run():
        return await asyncio.gather(*(_collect(client.generate(f"c{i}", p, sp))
                                      for i, (p, sp) in enumerate(zip(prompts, params))))

    results = loop.run_until_complete(run())
    expected = llm.generate(prompts, params, use_tqdm=False)
    for i, outputs in enumerate(results):
        assert _tokens(outputs) == expected[i].outputs[0].token_ids and len(_tokens(outputs)) == 2 + i
        assert outputs[-1].finish_reason == "length"


def test_n_samples_stream_under_the_parent_id(client, loop):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    outputs = loop.run_until_complete(_collect(client.generate("pair", _prompt(6, 3), params)))
    assert {o.request_id for o in outputs} == {"pair"} and {o.index for o in outputs} == {0, 1}
    for index in (0, 1):
        assert len(_tokens(outputs, index)) == 4
        assert [o.finish_reason for o in outputs if o.index == index][-1] == "length"


@pytest.mark.parametrize("bad_prompt, message", [
    (lambda ready: [5] * ready.max_model_len, "context"),
    (lambda ready: [3, ready.vocab_size], "outside the vocabulary"),
])
def test_bad_request_raises_while_a_concurrent_one_finishes(client, loop, bad_prompt, message):
    async def run():
        good = asyncio.create_task(_collect(client.generate("good", _prompt(5, 4), GREEDY)))
        with pytest.raises(ValueError, match=message):
            await _collect(client.generate("bad", bad_prompt(client.ready), GREEDY))
        return await good

    outputs = loop.run_until_complete(run())
    assert len(_tokens(outputs)) == 8 and outputs[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="ints"):
        loop.run_until_complete(_collect(client.generate("floats", [1.5, 2.0], GREEDY)))


def test_closing_or_cancelling_a_stream_aborts_it_and_frees_the_cache(client, loop):
    long = GREEDY.clone(max_tokens=500)

    async def run():
        await _wait_for(lambda: client.stats() is not None)
        generated_before = client.stats().generation_tokens_total
        gen = client.generate("closed", _prompt(20, 5), long)
        await gen.__anext__()
        consumer = asyncio.create_task(_collect(client.generate("cancelled", _prompt(20, 6), long)))
        await _wait_for(lambda: client.stats().num_running == 2)
        await gen.aclose()
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        closed_at = time.time()
        assert client.num_in_flight == 0
        await _wait_for(lambda: client.stats().timestamp > closed_at and client.stats().num_running == 0)
        return client.stats(), generated_before

    stats, generated_before = loop.run_until_complete(run())
    assert stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks and stats.kv_usage == 0.0
    assert stats.generation_tokens_total - generated_before < 2 * 500


def test_abort_ends_an_open_stream(client, loop):
    async def run():
        gen = client.generate("aborted", _prompt(8, 7), GREEDY.clone(max_tokens=500))
        first = await gen.__anext__()
        await client.abort("aborted")
        return [first] + await _collect(gen)

    outputs = loop.run_until_complete(run())
    assert outputs[-1].finish_reason == "abort" and client.num_in_flight == 0


# --- failures --------------------------------------------------------------------------------------
def test_step_exception_fails_only_the_scheduled_request(llm, monkeypatch):
    """In-process EngineLoop: the runner raises for any step that schedules "bad"."""
    core = llm.engine
    monkeypatch.setattr(core.scheduler, "config", dataclasses.replace(core.scheduler.config, max_num_seqs=1))
    fail_steps_scheduling(monkeypatch, core.runner, "bad")
    engine = EngineLoop(core)
    prompt = _prompt(9, 8)
    assert engine.add(AddRequest("bad", _prompt(7, 9), params_to_dict(GREEDY))) is None
    assert engine.add(AddRequest("ok", prompt, params_to_dict(GREEDY))) is None  # waits: one seq at a time
    failed = engine.step()
    assert [(o.request_id, o.finish_reason) for o in failed] == [("bad", "error")]
    assert "injected failure" in failed[0].error
    outputs = []
    while core.has_unfinished:
        outputs += engine.step()
    monkeypatch.undo()
    assert _tokens(outputs) == llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.groups == {} and engine.samples == {} and core.kv.num_free_blocks == core.layout.num_blocks


def test_aborting_one_sample_keeps_its_siblings_running(llm):
    """In-process EngineLoop: an n=2 request whose sample 0 is aborted (its choice hit a stop string)."""
    core = llm.engine
    engine = EngineLoop(core)
    params = params_to_dict(SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))
    assert engine.add(AddRequest("pair", _prompt(20, 10), params)) is None
    outputs = engine.step() + engine.step()
    engine.abort("pair", sample_index=0)
    assert "pair-0" not in core.scheduler.requests and "pair-1" in core.scheduler.requests
    while core.has_unfinished:
        outputs += engine.step()
    finished = [o for o in outputs if o.finish_reason is not None]
    assert [(o.index, o.finish_reason) for o in finished] == [(1, "length")]
    assert len(_tokens(outputs, 1)) == 12
    assert engine.groups == {} and core.kv.num_free_blocks == core.layout.num_blocks


def test_bad_model_path_fails_start_with_the_engine_reason(tmp_path, loop):
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="does not exist"):
        loop.run_until_complete(AsyncEngineClient.start(str(tmp_path / "missing"), ENGINE_KWARGS))
    assert set(multiprocessing.active_children()) <= before


def test_shutdown_stops_the_engine_and_ends_open_streams(ckpt, loop):
    async def run():
        client = await AsyncEngineClient.start(str(ckpt), ENGINE_KWARGS)
        consumer = asyncio.create_task(_collect(client.generate("open", _prompt(8, 11), GREEDY.clone(max_tokens=500))))
        await _wait_for(lambda: client.num_in_flight == 1 and client.stats() is not None)
        await client.shutdown()
        return client, await asyncio.wait_for(consumer, 5)

    client, outputs = loop.run_until_complete(run())
    assert outputs[-1].finish_reason == "error" and not client.dead_event.is_set()
    assert client.process.exitcode == 0 and client.process not in multiprocessing.active_children()


def test_killed_engine_ends_streams_with_an_error_and_sets_dead(client, loop):
    """Last test using the module's client: it kills its engine."""
    async def run():
        gen = client.generate("doomed", _prompt(8, 12), GREEDY.clone(max_tokens=500))
        outputs = [await gen.__anext__()]
        client.process.kill()
        outputs += await asyncio.wait_for(_collect(gen), 5)
        await asyncio.wait_for(client.dead_event.wait(), 5)
        with pytest.raises(EngineDeadError):
            await _collect(client.generate("late", [5, 6], GREEDY))
        await client.shutdown()
        return outputs

    outputs = loop.run_until_complete(run())
    assert outputs[-1].finish_reason == "error" and "exit" in outputs[-1].error and client.dead
    assert client.process not in multiprocessing.active_children()


def test_the_start_up_allowance_covers_compiling_unless_the_engine_runs_eagerly(monkeypatch):
    from deepinfer.server.engine_client import COMPILE_ALLOWANCE_S, LOAD_ALLOWANCE_S, startup_allowance

    assert startup_allowance({"enforce_eager": True}) == LOAD_ALLOWANCE_S
    assert startup_allowance({"enforce_eager": False}) == LOAD_ALLOWANCE_S + COMPILE_ALLOWANCE_S
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
    assert startup_allowance({}) == LOAD_ALLOWANCE_S
