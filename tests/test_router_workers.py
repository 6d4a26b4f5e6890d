"""The pieces of `deepinfer router` that need no server: the worker-side event log, the router's view of a
worker's polled state (instances, incomplete answers, hung engines), SSE framing and the cache salt."""

from __future__ import annotations

import asyncio

from deepinfer.router.http import _sse_events
from deepinfer.router.policy import RouterConfig
from deepinfer.router.prompts import cache_salt, prompt_tokens
from deepinfer.router.workers import WorkerPool
from deepinfer.server.app import key_namespace
from deepinfer.server.router_state import EventLog

H = [bytes([i]) * 16 for i in range(8)]


def test_event_log_numbers_events_and_says_when_some_were_dropped():
    log = EventLog(capacity=4)
    log.append([("stored", H[0]), ("stored", H[1])])
    assert log.since(0) == (True, [(1, "stored", H[0].hex()), (2, "stored", H[1].hex())])
    assert log.since(2) == (True, [])
    log.append([("evicted", H[0]), ("cleared", None), ("stored", H[2])])  # 5 events, 4 kept: 2..5
    assert log.since(1) == (True, [(2, "stored", H[1].hex()), (3, "evicted", H[0].hex()), (4, "cleared", None),
                                   (5, "stored", H[2].hex())])
    complete, events = log.since(0)  # event 1 is gone
    assert not complete and [n for n, *_ in events] == [2, 3, 4, 5]
    assert log.since(4) == (True, [(5, "stored", H[2].hex())])


def _state(instance="a", events=(), last=0, complete=True, alive=True, silent=0.1, load=0) -> dict:
    return {"instance": instance, "block_size": 16, "prefix_cache_isolation": "none", "kv_events": True,
            "alive": alive, "engine_silent_s": silent, "load_tokens": load, "num_requests": 0, "last_event": last,
            "complete": complete, "events": [[k, h.hex() if h else None] for k, h in events]}


def test_worker_state_joins_applies_events_and_forgets_on_a_new_instance():
    async def run():
        pool = WorkerPool(["http://a", "http://b"], RouterConfig())
        w = pool.workers[0]
        assert not pool.state.healthy  # nobody before a first good poll
        pool._apply(w, _state())  # a first answer: the instance is learnt, nothing applied yet
        assert w.instance == "a" and w.last_event == 0
        pool._apply(w, _state(events=[("stored", H[0]), ("stored", H[1])], last=2, load=70))
        assert pool.state.healthy == {0} and pool.state.loads[0] == 70 and w.last_event == 2
        assert pool.state.holders[H[1]] == {0}
        pool._apply(w, _state(events=[("evicted", H[0])], last=3))
        assert H[0] not in pool.state.holders
        pool._apply(w, _state(events=[("stored", H[3])], last=9, complete=False))  # some dropped: forget first
        assert H[1] not in pool.state.holders and pool.state.holders[H[3]] == {0}
        pool._apply(w, _state(instance="b"))  # restarted: its blocks are forgotten, events asked again from 0
        assert not pool.state.holders and w.last_event == 0 and w.instance == "b"
        await pool.http.aclose()

    asyncio.run(run())


def test_a_hung_or_dead_engine_takes_its_worker_out_and_sets_lost():
    async def run():
        pool = WorkerPool(["http://a"], RouterConfig(), hang_timeout_s=1.5)
        w = pool.workers[0]
        pool._apply(w, _state())
        pool._apply(w, _state(events=[("stored", H[0])], last=1))
        lost = w.lost
        pool._apply(w, _state(last=1, silent=1.6))
        assert not pool.state.healthy and lost.is_set() and "hung" in w.reason and not pool.state.holders
        pool._apply(w, _state(last=1))  # talking again: back, with a fresh event
        assert pool.state.healthy == {0} and not w.lost.is_set()
        pool._apply(w, _state(last=1, alive=False))
        assert not pool.state.healthy and "dead" in pool.reasons()
        await pool.http.aclose()

    asyncio.run(run())


def test_sse_events_are_reassembled_from_arbitrary_chunks():
    async def chunks():
        for c in [b"data: {\"a\"", b": 1}\n", b"\ndata: [DO", b"NE]\n\n"]:
            yield c

    async def collect():
        return [e async for e in _sse_events(chunks())]

    assert asyncio.run(collect()) == [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]


def test_cache_salt_follows_the_servers_isolation():
    body = {"cache_salt": "s"}
    assert cache_salt(body, "Bearer k", "none") == "s"
    assert cache_salt({}, None, "none") is None
    assert cache_salt(body, "Bearer k", "key") == f"{key_namespace('k')}:s"  # as Serving.cache_salt
    assert cache_salt({}, None, "key") == ":"


def test_prompt_tokens_of_token_id_prompts_and_unreadable_bodies():
    assert prompt_tokens(None, "/v1/completions", {"model": "m", "prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_tokens(None, "/v1/completions", {"model": "m", "prompt": [[1, 2], [3]]}) == [1, 2]
    assert prompt_tokens(None, "/v1/completions", {"model": "m", "prompt": "text"}) is None  # no tokenizer
    assert prompt_tokens(None, "/v1/completions", {"prompt": 5}) is None  # the server answers the 400
    assert prompt_tokens(None, "/v1/chat/completions", {"messages": []}) is None
