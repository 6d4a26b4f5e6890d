"""Cache bookkeeping: paged blocks (token-indexed state, shareable) and state slots (bounded state).

A block id names the same block in every paged tensor of every layer (one block table per
request covers MLA latents, V4 compressed entries and indexer keys alike). A state slot names a
request's row in every bounded-state tensor (V4 window and compressor rings). Only this module
knows which ids are free; the runner only sees the ids it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass


class BlockPool:
    """Reference-counted block ids; a block returns to the free list when its count drops to zero."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        for b in ids:
            self._refs[b] += 1

    def release(self, ids: list[int]) -> None:
        for b in ids:
            self._refs[b] -= 1
            assert self._refs[b] >= 0, f"block {b} released more often than held"
            if self._refs[b] == 0:
                self._free.append(b)


@dataclass
class ForkCopy:
    """After a step: child's last (partial) block and state slot become copies of the parent's."""

    parent_id: str
    child_id: str
    src_block: int | None
    dst_block: int | None
    src_slot: int
    dst_slot: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._free_slots = list(range(num_state_slots - 1, -1, -1))
        self.num_state_slots = num_state_slots
        self.blocks: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens could ever fit (used to reject up front)."""
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def allocate(self, request_id: str, total_tokens: int) -> bool:
        """Ensure blocks cover `total_tokens` positions and the request has a state slot."""
        held = self.blocks.setdefault(request_id, [])
        extra = self.blocks_needed(total_tokens) - len(held)
        needs_slot = request_id not in self.slots
        if (needs_slot and not self._free_slots) or extra > self.pool.num_free:
            if not held:
                del self.blocks[request_id]
            return False
        if extra > 0:
            held.extend(self.pool.allocate(extra))
        if needs_slot:
            self.slots[request_id] = self._free_slots.pop()
        return True

    def free(self, request_id: str) -> None:
        self.pool.release(self.blocks.pop(request_id, []))
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> ForkCopy | None:
        """Child shares the parent's full blocks for the first `num_tokens` positions; the partial
        last block and the state slot are copied after the step. None when out of space."""
        parent = self.blocks[parent_id][: self.blocks_needed(num_tokens)]
        full = num_tokens // self.block_size
        partial = len(parent) - full
        if not self._free_slots or partial > self.pool.num_free:
            return None
        own = self.pool.allocate(partial) or []
        self.pool.share(parent[:full])
        self.blocks[child_id] = parent[:full] + own
        self.slots[child_id] = self._free_slots.pop()
        src = parent[full] if partial else None
        return ForkCopy(parent_id, child_id, src, own[0] if own else None, self.slots[parent_id], self.slots[child_id])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / max(self.pool.num_blocks, 1)
