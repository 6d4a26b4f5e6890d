"""Cache bookkeeping: paged blocks (token-indexed state, shareable) and state slots (bounded state).

A block id names the same block in every paged tensor of every layer (one block table per
request covers MLA latents, V4 compressed entries and indexer keys alike). A state slot names a
request's row in every bounded-state tensor (V4 window and compressor rings). Only this module
knows which ids are free; the runner only sees the ids it is handed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


class BlockPool:
    """Reference-counted block ids. A block whose count drops to zero returns to the free list, unless it
    holds a cached prefix block: then it stays findable by its hash and is evicted least recently used
    first, only when a fresh block is needed."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # Prefix-cache events for a DP router (router/state.py), when someone drains them: ("stored", hash),
        # ("evicted", hash), ("cleared", None), in the order they happened. None: not recorded.
        self.events: list[tuple[str, bytes | None]] | None = None
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # cached block -> its chained hash
        self._block_of: dict[bytes, int] = {}  # chained hash -> cached block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        ids = [self._take() for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)
        block_hash = self._hash_of.pop(block)
        del self._block_of[block_hash]
        self._event("evicted", block_hash)
        return block

    def share(self, ids: list[int]) -> None:
        for b in ids:
            self._refs[b] += 1
            self._evictable.pop(b, None)

    def release(self, ids: list[int]) -> None:
        for b in ids:
            self._refs[b] -= 1
            assert self._refs[b] >= 0, f"block {b} released more often than held"
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # --- prefix cache ------------------------------------------------------------------------
    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def register(self, block: int, block_hash: bytes) -> None:
        """Make a full, held block findable; a hash already cached elsewhere keeps its first block."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash
            self._event("stored", block_hash)

    def reset_cache(self) -> None:
        """Forget every cached hash; unreferenced cached blocks become plain free blocks."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._event("cleared", None)

    def record_events(self) -> None:
        """Start recording prefix-cache events (a router needs the full history: call before serving)."""
        if self.events is None:
            self.events = []

    def drain_events(self) -> list[tuple[str, bytes | None]]:
        """The events since the last drain ([] when not recording)."""
        if self.events is None:
            return []
        out, self.events = self.events, []
        return out

    def _event(self, kind: str, block_hash: bytes | None) -> None:
        if self.events is not None:
            self.events.append((kind, block_hash))

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)


def chain_hashes(tokens: list[int], block_size: int, salt: str | None, previous: list[bytes],
                 images: tuple[tuple[int, int, str], ...] = ()) -> list[bytes]:
    """Hashes of every full block of `tokens`; block i's hash covers blocks 0..i and the salt, so a hit
    is always a whole-block prefix. `previous` (hashes already known) is extended, not recomputed.
    images: (offset, end, digest) of image spans; a block overlapping one also hashes its digest and offset
    (an image span's tokens are all the same id, so the content must come from the image)."""
    hashes = list(previous)
    seed = hashlib.blake2b((salt or "").encode(), digest_size=16).digest()
    for i in range(len(hashes), len(tokens) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        extra = "".join(f"|{a}:{d}" for a, b, d in images if a < hi and b > lo).encode()
        chunk = np.asarray(tokens[lo:hi], dtype=np.int64).tobytes()
        hashes.append(hashlib.blake2b((hashes[-1] if hashes else seed) + chunk + extra, digest_size=16).digest())
    return hashes


def prompt_digest(tokens: list[int]) -> str:
    """Names a prompt exactly (disaggregation checks both engines hold the same one)."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).hexdigest()


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
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, enable_prefix_caching: bool = False,
                 num_snapshot_slots: int = 0):
        self.block_size = block_size
        # Bounded-state snapshots at block boundaries live in state rows after the running slots, keyed by the
        # hash of the block that ends at the boundary, least recently used first.
        self.num_snapshot_slots = num_snapshot_slots
        self._snapshot_of: OrderedDict[bytes, int] = OrderedDict()
        self._free_snapshots = list(range(num_state_slots + num_snapshot_slots - 1, num_state_slots - 1, -1))
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached
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

    def allocate(self, request_id: str, total_tokens: int, prefix: list[int] | None = None) -> bool:
        """Ensure blocks cover `total_tokens` positions and the request has a state slot. A new request
        may start from cached `prefix` blocks (shared, not copied). On failure nothing changes."""
        held = self.blocks.get(request_id) or list(prefix or [])
        extra = self.blocks_needed(total_tokens) - len(held)
        needs_slot = request_id not in self.slots
        # cached prefix blocks that are currently unreferenced count as free until we take them
        evictable_in_prefix = 0 if request_id in self.blocks else sum(1 for b in held if self.pool.is_evictable(b))
        if (needs_slot and not self._free_slots) or extra > self.pool.num_free - evictable_in_prefix:
            return False
        if request_id not in self.blocks:
            self.pool.share(held)
            self.blocks[request_id] = held
        if extra > 0:
            held.extend(self.pool.allocate(extra))
        if needs_slot:
            self.slots[request_id] = self._free_slots.pop()
        return True

    # --- prefix cache ------------------------------------------------------------------------
    def cached_prefix(self, hashes: list[bytes], max_tokens: int) -> list[int]:
        """Blocks of the longest cached whole-block prefix covering at most `max_tokens` tokens."""
        blocks = []
        for h in hashes[: max_tokens // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def cache_full_blocks(self, request_id: str, hashes: list[bytes], num_computed: int) -> None:
        """Make the request's blocks whose positions are all computed findable by their hashes."""
        held = self.blocks.get(request_id, [])
        for i in range(min(num_computed // self.block_size, len(hashes), len(held))):
            self.pool.register(held[i], hashes[i])

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
        self._free_snapshots.extend(self._snapshot_of.values())
        self._snapshot_of.clear()

    def snapshot_for(self, block_hash: bytes) -> int | None:
        """State row holding the bounded state right after the block with this hash, if kept."""
        row = self._snapshot_of.get(block_hash)
        if row is not None:
            self._snapshot_of.move_to_end(block_hash)
        return row

    def claim_snapshot(self, block_hash: bytes) -> int | None:
        """A state row to snapshot into for this hash (evicting the least recently used); None if kept already."""
        if not self.num_snapshot_slots or block_hash in self._snapshot_of:
            return None
        row = self._free_snapshots.pop() if self._free_snapshots else self._snapshot_of.popitem(last=False)[1]
        self._snapshot_of[block_hash] = row
        return row

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past the first `num_tokens` positions (never cached: not computed)."""
        held = self.blocks.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if held is not None and len(held) > keep:
            self.pool.release(held[keep:])
            del held[keep:]

    def hold(self, request_id: str, key: str) -> tuple[list[int], int]:
        """Move a request's blocks and state slot to `key` (a prefill engine's sending hold); free(key) ends it."""
        self.blocks[key] = self.blocks.pop(request_id)
        self.slots[key] = self.slots.pop(request_id)
        return list(self.blocks[key]), self.slots[key]

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
