"""The DP routing policy (deepinfer/router/policy.py, pure) and the router's bookkeeping (router/state.py)."""

from __future__ import annotations

import pytest

from deepinfer.engine.kv_cache import BlockPool, chain_hashes
from deepinfer.router.policy import NoReplica, RouterConfig, matched_blocks, route
from deepinfer.router.state import RouterState

CACHE = RouterConfig("cache_aware", balance_abs_tokens=100, balance_rel=2.0)


def blocks(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return chain_hashes(tokens, 4, salt, [])


SYSTEM_A, SYSTEM_B = list(range(100, 116)), list(range(200, 216))  # 4 blocks each


def test_matched_blocks_stop_at_the_first_missing_block():
    h = blocks(SYSTEM_A)
    holders = {h[0]: {0, 1}, h[1]: {0, 1}, h[2]: {1}, h[3]: {0, 1}}
    assert matched_blocks(h, holders, [0, 1, 2]) == {0: 2, 1: 4, 2: 0}


def test_longest_prefix_wins():
    h = blocks(SYSTEM_A + [1, 2, 3, 4])
    holders = {x: {1} for x in h[:4]} | {h[0]: {0, 1}}
    d = route(h, [0, 1, 2], {0: 0, 1: 50, 2: 0}, holders, CACHE)
    assert (d.replica, d.reason, d.matched_blocks) == (1, "prefix", 4)


def test_uneven_load_overrides_hits():
    h = blocks(SYSTEM_A)
    holders = {x: {1} for x in h}
    d = route(h, [0, 1], {0: 10, 1: 500}, holders, CACHE)  # gap 490 > 100 and 500 > 2 x 10
    assert (d.replica, d.reason, d.matched_blocks) == (0, "imbalance", 0)
    assert route(h, [0, 1], {0: 300, 1: 500}, holders, CACHE).replica == 1  # 500 < 2 x 300: hits win


def test_ties_go_to_the_sticky_replica_else_the_least_loaded():
    h = blocks([7] * 8)
    assert route(h, [0, 1, 2], {0: 5, 1: 3, 2: 9}, {}, CACHE).replica == 1
    d = route(h, [0, 1, 2], {0: 5, 1: 3, 2: 9}, {}, CACHE, sticky=2)
    assert (d.replica, d.reason) == (2, "sticky")
    holders = {h[0]: {0}}
    assert route(h, [0, 1, 2], {0: 5, 1: 3, 2: 9}, holders, CACHE, sticky=2).replica == 0  # a hit beats sticky


def test_round_robin_and_least_loaded_ignore_hits():
    h = blocks(SYSTEM_A)
    holders = {x: {2} for x in h}
    rr = RouterConfig("round_robin")
    assert [route(h, [0, 1, 2], {0: 0, 1: 0, 2: 0}, holders, rr, turn=t).replica for t in range(4)] == [0, 1, 2, 0]
    d = route(h, [2, 0, 1], {0: 4, 1: 1, 2: 0}, holders, RouterConfig("least_loaded"))
    assert (d.replica, d.reason, d.matched_blocks) == (2, "least_loaded", 4)


def test_no_healthy_replica_and_bad_config():
    with pytest.raises(NoReplica):
        route([], [], {}, {}, CACHE)
    with pytest.raises(ValueError, match="policy"):
        RouterConfig("random")
    with pytest.raises(ValueError, match="balance"):
        RouterConfig(balance_rel=0.5)


def test_state_bumps_between_refreshes_and_keeps_tenants_together():
    """Two system prompts, many users: each tenant's requests land where its prefix went first, while load
    stays even; a refresh replaces the optimistic load."""
    state = RouterState(RouterConfig("cache_aware", balance_abs_tokens=1000, balance_rel=2.0), [0, 1])
    first_a = state.choose(blocks(SYSTEM_A + [1, 1, 1, 1]), 20)
    first_b = state.choose(blocks(SYSTEM_B + [2, 2, 2, 2]), 20)
    assert first_a.replica != first_b.replica  # the second went to the less loaded (optimistic bump)
    for user in range(5):
        assert state.choose(blocks(SYSTEM_A + [user] * 4), 20).replica == first_a.replica
        assert state.choose(blocks(SYSTEM_B + [user] * 4), 20).replica == first_b.replica
    assert state.loads == {0: 120, 1: 120}
    state.report_load(0, 5)
    assert state.loads[0] == 5


def test_state_events_health_and_sticky_keys():
    state = RouterState(CACHE, [0, 1, 2])
    h = blocks(SYSTEM_A)
    state.stored(1, h)
    assert state.choose(h, 4).replica == 1
    state.evicted(1, h[2:])
    assert matched_blocks(h, state.holders, [1])[1] == 2
    state.set_healthy(1, False)  # leaves rotation: forgets its blocks and sticky keys
    assert 1 not in {state.choose(h, 4).replica for _ in range(3)}
    assert all(1 not in rs for rs in state.holders.values())
    state.set_healthy(1, True)
    conversation = [state.choose(blocks([9] * 3), 1, sticky_key="conv-7").replica for _ in range(4)]
    assert len(set(conversation)) == 1  # no full block to hit: the conversation stays put
    state.cleared(conversation[0])
    assert all(conversation[0] not in rs for rs in state.holders.values())


def test_block_pool_events_feed_the_router():
    """A replica's pool records stored / evicted / cleared hashes; the router's view follows them."""
    pool, state = BlockPool(2), RouterState(CACHE, [0, 1])
    assert pool.drain_events() == []  # not recording: nothing kept
    pool.record_events()
    h = blocks(SYSTEM_A)
    a, b = pool.allocate(2)
    pool.register(a, h[0])
    pool.register(b, h[1])
    pool.release([a, b])
    state.apply_events(0, pool.drain_events())
    assert matched_blocks(h, state.holders, [0, 1]) == {0: 2, 1: 0}
    pool.allocate(1)  # evicts the least recently used cached block, h[0]
    events = pool.drain_events()
    assert events == [("evicted", h[0])]
    state.apply_events(0, events)
    assert matched_blocks(h, state.holders, [0])[0] == 0 and state.holders[h[1]] == {0}
    pool.reset_cache()
    state.apply_events(0, pool.drain_events())
    assert state.holders == {}
