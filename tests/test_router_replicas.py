"""`--data-parallel-replicas`: several engine processes behind one client (deepinfer/router/replicas.py).

A shared-prefix multi-tenant workload (3 system prompts, 4 users each, tenants interleaved) on 2 replicas:
greedy tokens equal one engine's, the cache-aware router keeps >= 90 % of one engine's prefix-cache hit rate,
round-robin measurably less (it splits every tenant over both replicas); a killed replica fails only its own
in-flight requests while the other keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from test_server import tiny_checkpoint

from deepinfer.router.policy import RouterConfig
from deepinfer.router.replicas import ReplicatedEngineClient
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.engine_client import ReplicaLost

KWARGS = dict(kv_cache_memory_bytes=16 * 2**20, max_num_seqs=8, load_progress=False, block_size=16)
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory))


def workload() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    systems = [torch.randint(3, 500, (48,), generator=g).tolist() for _ in range(3)]  # 3 blocks each
    return [system + torch.randint(3, 500, (8,), generator=g).tolist() for _ in range(4) for system in systems]


async def _tokens(client, i: int, prompt: list[int]) -> list[int]:
    tokens = []
    async for out in client.generate(f"r{i}", prompt, PARAMS):
        tokens += out.new_token_ids
        assert out.finish_reason in (None, "length"), out
    return tokens


async def _run(ckpt: str, replicas: int, policy: str) -> tuple[list, float]:
    """Sequential requests (each after the previous ends, as users taking turns); (tokens, hit rate)."""
    client = await ReplicatedEngineClient.start(ckpt, KWARGS, replicas, RouterConfig(policy))
    try:
        tokens = [await _tokens(client, i, p) for i, p in enumerate(workload())]
        for _ in range(100):  # the engines report stats when they go idle
            stats = client.stats()
            if stats is not None and None not in client.engine_stats().values() and stats.prefix_queries >= 12 * 48:
                break
            await asyncio.sleep(0.1)
        return tokens, stats.prefix_hits / stats.prefix_queries
    finally:
        await client.shutdown()


@pytest.fixture(scope="module")
def single(ckpt):
    return asyncio.run(_run(ckpt, 1, "cache_aware"))


def test_cache_aware_keeps_the_hit_rate_and_the_tokens(ckpt, single):
    tokens, rate = asyncio.run(_run(ckpt, 2, "cache_aware"))
    assert tokens == single[0]
    assert rate >= 0.9 * single[1] > 0


@pytest.mark.slow  # test_cache_aware_keeps_the_hit_rate_and_the_tokens runs by default
def test_round_robin_splits_tenants_and_loses_hits(ckpt, single):
    tokens, rate = asyncio.run(_run(ckpt, 2, "round_robin"))
    assert tokens == single[0]
    cache_aware_floor = 0.9 * single[1]
    assert rate < cache_aware_floor - 0.05


def test_killed_replica_fails_only_its_requests(ckpt):
    async def scenario():
        client = await ReplicatedEngineClient.start(ckpt, KWARGS, 2, RouterConfig("round_robin"))
        try:
            long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
            streams = [client.generate(f"long{i}", [5, 6, 7, i], long) for i in range(2)]
            firsts = [await s.__anext__() for s in streams]  # both running, one per replica
            victim = client._owner["long0"]
            os.kill(client.clients[victim].process.pid, signal.SIGKILL)
            with pytest.raises(ReplicaLost, match="was lost"):  # the victim's request fails (503 in the server)
                async for _ in streams[0]:
                    pass
            for _ in range(50):
                if victim not in client.state.healthy:
                    break
                await asyncio.sleep(0.02)
            assert client.state.healthy == {1 - victim} and not client.dead
            last = firsts[1]
            async for out in streams[1]:
                last = out
            assert last.finish_reason == "length"  # the survivor's runs to its end
            after = await _tokens(client, 99, [9, 9, 9])  # routed to the survivor
            assert len(after) == 2
            for _ in range(300):  # a fresh engine process takes the lost one's place
                if client.state.healthy == {0, 1}:
                    break
                await asyncio.sleep(0.1)
            assert client.state.healthy == {0, 1} and client.restarts == 1
            assert [len(await _tokens(client, 100 + i, [4, 4, i])) for i in range(2)] == [2, 2]
            assert client.router_stats.routed[victim] >= 2  # it serves again
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_hung_replica_leaves_rotation_and_unstarted_requests_retry(ckpt):
    """SIGSTOP one replica: within the hang timeout it is given up (killed, restarted later); its running
    request fails, and a request routed to it that had produced nothing yet completes on the other."""
    async def scenario():
        client = await ReplicatedEngineClient.start(ckpt, KWARGS, 2, RouterConfig("round_robin"))
        try:
            long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
            running = client.generate("long0", [5, 6, 7], long)
            await running.__anext__()
            victim = client._owner["long0"]
            os.kill(client.clients[victim].process.pid, signal.SIGSTOP)
            client.state.turn = victim  # round-robin: the next request goes to the hung replica too
            started = time.monotonic()
            retried = asyncio.create_task(_tokens(client, 1, [8, 8, 8]))
            with pytest.raises(ReplicaLost, match="hung"):
                async for _ in running:
                    pass
            assert time.monotonic() - started < 2.0  # the hang timeout (1.5 s) plus at most two health ticks
            assert len(await retried) == 2  # went to the hung replica, got nothing, retried on the other
            assert victim not in client.state.healthy or client.restarts == 1
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_server_with_replicas_streams_the_tokens_of_one_engine(ckpt, tmp_path):
    """`deepinfer serve --data-parallel-replicas 2` through the official client: the same completions as one
    engine (streamed and not, n = 2), per-replica and router metrics."""
    import httpx
    import openai
    from test_server import running_server

    from deepinfer import LLM

    prompts = ["hello world", "the quick brown fox", "hello world, again"]
    llm = LLM(ckpt, **KWARGS)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True), use_tqdm=False)]
    llm.shutdown()
    flags = ["--data-parallel-replicas", "2", "--kv-cache-memory-bytes", str(16 * 2**20), "--block-size", "16"]
    with running_server(ckpt, tmp_path / "server.log", *flags) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        common = dict(model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        got = [client.completions.create(prompt=p, **common).choices[0].text for p in prompts]
        streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompts[1], stream=True,
                                                                                 **common))
        two = client.completions.create(prompt=prompts[0], n=2, **common)
        assert got == want and streamed == want[1] and [c.text for c in two.choices] == [want[0]] * 2
        metrics = ""
        for _ in range(50):
            metrics = httpx.get(server.url + "/metrics").text
            if 'deepinfer:kv_cache_total_blocks{engine="1"}' in metrics:
                break
            time.sleep(0.1)
        for engine in ("0", "1"):  # every engine series once per replica, under vLLM's `engine` label
            assert f'deepinfer:kv_cache_total_blocks{{engine="{engine}"}}' in metrics
            assert f'deepinfer:router_engine_healthy{{engine="{engine}"}} 1.0' in metrics
        routed = sum(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("deepinfer:router_requests_total{"))
        assert routed == len(prompts) + 2  # the completions above (n = 2 is one engine request)
