"""BlockPool ref counting and KVCacheManager block / state-slot bookkeeping (no tensors involved)."""

from __future__ import annotations

from collections import Counter

import pytest

from deepinfer.engine.kv_cache import BlockPool, ForkCopy, KVCacheManager


def pool_snapshot(pool: BlockPool) -> tuple[list[int], list[int]]:
    return sorted(pool._free), list(pool._refs)


def kv_snapshot(kv: KVCacheManager) -> tuple:
    return (pool_snapshot(kv.pool), {k: list(v) for k, v in kv.blocks.items()}, dict(kv.slots),
            sorted(kv._free_slots))


def assert_consistent(kv: KVCacheManager) -> None:
    """Ref counts equal the number of holders, the free list is exactly the unheld blocks, slots unique."""
    held = Counter(b for ids in kv.blocks.values() for b in ids)
    assert kv.pool._refs == [held.get(b, 0) for b in range(kv.pool.num_blocks)]
    assert sorted(kv.pool._free) == [b for b in range(kv.pool.num_blocks) if not held.get(b)]
    slots = list(kv.slots.values())
    assert sorted(slots + kv._free_slots) == list(range(kv.num_state_slots))


# --- BlockPool -----------------------------------------------------------------------------------
def test_pool_allocate_gives_distinct_blocks_with_one_ref():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(a) == 3 and len(b) == 5
    assert sorted(a + b) == list(range(8))
    assert pool.num_free == 0
    assert all(pool._refs[i] == 1 for i in a + b)
    assert pool.allocate(0) == []


def test_pool_share_and_release_follow_ref_counts():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.share(ids)
    pool.share(ids[:1])
    assert [pool._refs[i] for i in ids] == [3, 2]
    pool.release(ids)
    assert pool.num_free == 2, "blocks still held must not return to the free list"
    pool.release(ids)
    assert pool.num_free == 3 and pool._refs[ids[0]] == 1
    pool.release(ids[:1])
    assert pool.num_free == 4 and pool._refs == [0, 0, 0, 0]
    with pytest.raises(AssertionError, match="released more often"):
        pool.release(ids[:1])


def test_pool_allocation_failure_leaves_state_unchanged():
    pool = BlockPool(4)
    held = pool.allocate(3)
    before = pool_snapshot(pool)
    assert pool.allocate(2) is None
    assert pool_snapshot(pool) == before
    assert pool.allocate(1) is not None
    pool.release(held)
    assert pool.num_free == 3


def test_pool_reuses_released_blocks():
    pool = BlockPool(2)
    a = pool.allocate(2)
    pool.release(a[:1])
    again = pool.allocate(1)
    assert again == a[:1] and pool._refs[a[0]] == 1


# --- KVCacheManager.allocate / free --------------------------------------------------------------
def test_allocate_grows_blocks_with_tokens_and_keeps_one_slot():
    kv = KVCacheManager(num_blocks=8, block_size=16, num_state_slots=4)
    assert kv.allocate("a", 1)
    assert len(kv.blocks["a"]) == 1
    slot = kv.slots["a"]
    for tokens, blocks in [(16, 1), (17, 2), (32, 2), (40, 3), (10, 3), (128, 8)]:
        assert kv.allocate("a", tokens)
        assert len(kv.blocks["a"]) == blocks, f"{tokens} tokens"
        assert kv.slots["a"] == slot
        assert kv.num_free_slots == 3
        assert_consistent(kv)
    assert kv.num_free_blocks == 0 and kv.usage() == 1.0
    kv.free("a")
    assert kv.num_free_blocks == 8 and kv.num_free_slots == 4 and kv.usage() == 0.0
    assert not kv.blocks and not kv.slots


def test_allocate_keeps_existing_block_ids_in_order():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_state_slots=2)
    assert kv.allocate("a", 5)
    first = list(kv.blocks["a"])
    assert kv.allocate("b", 4)
    assert kv.allocate("a", 13)
    assert kv.blocks["a"][:2] == first
    assert not set(kv.blocks["a"]) & set(kv.blocks["b"])
    assert_consistent(kv)


def test_allocate_fails_cleanly_when_out_of_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4, num_state_slots=4)
    assert kv.allocate("a", 12)
    before = kv_snapshot(kv)
    assert not kv.allocate("b", 8), "a new request that does not fit"
    assert kv_snapshot(kv) == before
    assert "b" not in kv.blocks and "b" not in kv.slots
    assert not kv.allocate("a", 20), "a growing request that does not fit"
    assert kv_snapshot(kv) == before
    assert kv.allocate("b", 4)
    assert_consistent(kv)


def test_allocate_fails_cleanly_when_out_of_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_state_slots=1)
    assert kv.allocate("a", 4)
    before = kv_snapshot(kv)
    assert not kv.allocate("b", 4)
    assert kv_snapshot(kv) == before
    kv.free("a")
    assert kv.allocate("b", 4)
    assert kv.slots == {"b": 0}
    assert_consistent(kv)


def test_free_unknown_request_is_a_no_op():
    kv = KVCacheManager(num_blocks=2, block_size=4, num_state_slots=1)
    kv.free("nobody")
    assert kv.num_free_blocks == 2 and kv.num_free_slots == 1


def test_blocks_needed_and_can_hold():
    kv = KVCacheManager(num_blocks=4, block_size=16, num_state_slots=1)
    assert [kv.blocks_needed(n) for n in (0, 1, 16, 17, 64)] == [0, 1, 1, 2, 4]
    assert kv.can_hold(64) and not kv.can_hold(65)


# --- fork ------------------------------------------------------------------------------------------
def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=16, num_state_slots=4)
    assert kv.allocate("p", 40)  # two full blocks and 8 tokens in a third
    parent = list(kv.blocks["p"])
    copy = kv.fork("p", "c", 40)
    child = kv.blocks["c"]
    assert child[:2] == parent[:2]
    assert child[2] not in parent
    assert [kv.pool._refs[b] for b in parent] == [2, 2, 1]
    assert kv.pool._refs[child[2]] == 1
    assert copy == ForkCopy("p", "c", src_block=parent[2], dst_block=child[2],
                            src_slot=kv.slots["p"], dst_slot=kv.slots["c"])
    assert kv.slots["c"] != kv.slots["p"]
    assert kv.num_free_blocks == 4 and kv.num_free_slots == 2
    assert_consistent(kv)

    copy2 = kv.fork("p", "c2", 40)
    assert [kv.pool._refs[b] for b in parent] == [3, 3, 1]
    assert copy2.dst_block not in (parent[2], child[2])
    assert_consistent(kv)

    kv.free("c")
    assert [kv.pool._refs[b] for b in parent] == [2, 2, 1]
    kv.free("p")
    assert kv.blocks["c2"][:2] == parent[:2] and [kv.pool._refs[b] for b in parent[:2]] == [1, 1]
    kv.free("c2")
    assert kv.num_free_blocks == 8 and kv.num_free_slots == 4
    assert not kv.blocks and not kv.slots
    assert kv.pool._refs == [0] * 8


def test_fork_of_block_aligned_prompt_shares_everything():
    kv = KVCacheManager(num_blocks=4, block_size=16, num_state_slots=2)
    assert kv.allocate("p", 32)
    copy = kv.fork("p", "c", 32)
    assert kv.blocks["c"] == kv.blocks["p"]
    assert copy.src_block is None and copy.dst_block is None
    assert (copy.src_slot, copy.dst_slot) == (kv.slots["p"], kv.slots["c"])
    assert kv.num_free_blocks == 2
    assert_consistent(kv)
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 4 and kv.num_free_slots == 2


def test_fork_only_covers_the_requested_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=16, num_state_slots=2)
    assert kv.allocate("p", 64)
    parent = kv.blocks["p"]
    copy = kv.fork("p", "c", 20)
    assert len(kv.blocks["c"]) == 2 and kv.blocks["c"][0] == parent[0]
    assert copy.src_block == parent[1] and copy.dst_block == kv.blocks["c"][1]
    assert [kv.pool._refs[b] for b in parent] == [2, 1, 1, 1]
    assert_consistent(kv)


@pytest.mark.parametrize("short_of", ["slot", "block"])
def test_fork_without_room_returns_none_and_changes_nothing(short_of):
    slots, blocks = (1, 8) if short_of == "slot" else (4, 3)
    kv = KVCacheManager(num_blocks=blocks, block_size=16, num_state_slots=slots)
    assert kv.allocate("p", 40)
    before = kv_snapshot(kv)
    assert kv.fork("p", "c", 40) is None
    assert kv_snapshot(kv) == before
    assert "c" not in kv.blocks and "c" not in kv.slots


def test_fork_of_aligned_prompt_needs_no_free_block():
    kv = KVCacheManager(num_blocks=2, block_size=16, num_state_slots=2)
    assert kv.allocate("p", 32)
    assert kv.num_free_blocks == 0
    assert kv.fork("p", "c", 32) is not None
    assert_consistent(kv)
