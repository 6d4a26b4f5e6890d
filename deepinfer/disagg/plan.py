"""Which byte ranges a request's transfer reads: a pure function of the two layouts and the request's block
ids and state slots on each side.

- paged components: every block past the decode side's prefix-cache hit, block by block;
- state components (position-indexed rings): only the live positions, the last min(n, span_prefill,
  span_decode) before position n, each moved from its ring row on one side to its ring row on the other.
Runs that are contiguous on both sides merge into one range.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.disagg.layout import Component, components


@dataclass(frozen=True)
class Span:
    name: str  # component
    local_offset: int  # bytes into the decode side's tensor
    remote_offset: int  # bytes into the prefill side's tensor
    nbytes: int


@dataclass(frozen=True)
class Side:
    """One engine's copy of a request: its block ids (logical order) and state slot."""

    blocks: list[int]
    slot: int


def plan_reads(decode: dict, prefill: dict, num_tokens: int, local: Side, remote: Side,
               skip_blocks: int = 0) -> list[Span]:
    """The ranges that give the decode side the request's cache after its first `num_tokens` positions;
    `skip_blocks` leading blocks are already there (a prefix-cache hit)."""
    theirs = components(prefill)
    spans: list[Span] = []
    for name, mine in components(decode).items():
        if mine.kind == "paged":
            spans += _paged(name, mine, num_tokens, decode["block_size"], local, remote, skip_blocks)
        else:
            spans += _ring(name, mine, theirs[name], num_tokens, local.slot, remote.slot)
    return merged(spans)


def _paged(name: str, comp: Component, num_tokens: int, block_size: int, local: Side, remote: Side,
           skip: int) -> list[Span]:
    used = -(-num_tokens // block_size)
    size = comp.row_bytes
    return [Span(name, local.blocks[i] * size, remote.blocks[i] * size, size) for i in range(skip, used)]


def _ring(name: str, mine: Component, theirs: Component, num_tokens: int, slot: int, remote_slot: int) -> list[Span]:
    live = min(num_tokens, mine.shape[0], theirs.shape[0])
    size = mine.entry_bytes
    return [Span(name, (slot * mine.shape[0] + p % mine.shape[0]) * size,
                 (remote_slot * theirs.shape[0] + p % theirs.shape[0]) * size, size)
            for p in range(num_tokens - live, num_tokens)]


def merged(spans: list[Span]) -> list[Span]:
    """Adjacent spans of one component that continue on both sides become one."""
    out: list[Span] = []
    for s in spans:
        last = out[-1] if out else None
        if (last is not None and last.name == s.name and last.local_offset + last.nbytes == s.local_offset
                and last.remote_offset + last.nbytes == s.remote_offset):
            out[-1] = Span(s.name, last.local_offset, last.remote_offset, last.nbytes + s.nbytes)
        else:
            out.append(s)
    return out


def total_bytes(spans: list[Span]) -> int:
    return sum(s.nbytes for s in spans)
