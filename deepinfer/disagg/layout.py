"""What an engine's KV cache holds, as a handshake describes it, and the check that two engines' caches can
exchange a request. Components are keyed by name (`layers.3.compressor.entries`), never by address."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

LAYOUT_VERSION = 1


class LayoutMismatch(ValueError):
    """The prefill and decode engines' caches cannot exchange a request; the message says what differs."""


@dataclass(frozen=True)
class Component:
    """One cache tensor: `rows` rows (blocks for paged, state rows for state) of `shape` each. A state
    component is a position-indexed ring: its first dimension is the ring span (row = position % span)."""

    kind: str  # "paged" | "state"
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    rows: int

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * element_size(self.dtype)

    @property
    def entry_bytes(self) -> int:
        """Bytes of one ring position (state) or one block (paged)."""
        return self.row_bytes // self.shape[0] if self.kind == "state" else self.row_bytes


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def model_digest(config) -> str:
    """The same model config on both sides (a frozen dataclass: its repr is its value)."""
    return hashlib.blake2b(repr(config).encode(), digest_size=8).hexdigest()


def describe(specs, num_blocks: int, state_rows: int, block_size: int, digest: str, tp: int = 1, dp: int = 1) -> dict:
    """The handshake's layout (msgpack-ready) of cache tensors described by CacheTensorSpecs."""
    comps = {s.name: {"kind": s.kind, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."),
                      "rows": num_blocks if s.kind == "paged" else state_rows} for s in specs}
    return {"version": LAYOUT_VERSION, "model": digest, "block_size": block_size, "tp": tp, "dp": dp,
            "components": comps}


def components(layout: dict) -> dict[str, Component]:
    return {name: Component(c["kind"], tuple(c["shape"]), c["dtype"], c["rows"])
            for name, c in layout["components"].items()}


def check_compatible(decode: dict, prefill: dict) -> None:
    """LayoutMismatch unless every component the decode engine holds exists on the prefill engine with the same
    kind, dtype and entry shape (ring spans may differ: they map by position), and the models, block sizes and
    parallel shapes agree. Components only the prefill engine holds (a drafter it runs) are not sent."""
    for key, what in (("version", "layout versions"), ("model", "model configs"), ("block_size", "block sizes"),
                      ("tp", "tensor-parallel sizes"), ("dp", "data-parallel sizes")):
        if decode.get(key) != prefill.get(key):
            raise LayoutMismatch(f"the prefill and decode engines' {what} differ (prefill {prefill.get(key)!r}, "
                                 f"decode {decode.get(key)!r})")
    remote = components(prefill)
    for name, mine in components(decode).items():
        _check_component(name, mine, remote.get(name))


def _check_component(name: str, mine: Component, theirs: Component | None) -> None:
    if theirs is None:
        raise LayoutMismatch(f"the decode engine's cache has {name!r}, which the prefill engine does not compute "
                             "(start both with the same model and --speculative-config)")
    if mine.dtype != theirs.dtype:
        raise LayoutMismatch(f"{name!r} is {theirs.dtype} on the prefill engine but {mine.dtype} on the decode "
                             "engine (start both with the same --dtype and --kv-cache-dtype)")
    same = mine.shape == theirs.shape if mine.kind == "paged" else mine.shape[1:] == theirs.shape[1:]
    if mine.kind != theirs.kind or not same:
        raise LayoutMismatch(f"{name!r} is {theirs.kind} {list(theirs.shape)} on the prefill engine but "
                             f"{mine.kind} {list(mine.shape)} on the decode engine")
