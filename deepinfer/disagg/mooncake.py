"""Mooncake Transfer Engine backend: every cache tensor is registered memory; reads are batched one-sided
transfers (`batch_transfer_sync_read`) from the peer's segment, found by P2P handshake (no metadata server)."""

from __future__ import annotations

import torch

from deepinfer.disagg.plan import Span
from deepinfer.disagg.transport import KVTransport, TransferError, byte_view

PROTOCOL = "tcp"  # what works without RDMA hardware; "rdma" on InfiniBand/RoCE machines


def load_engine():
    """mooncake.engine.TransferEngine, or ImportError naming what is missing."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(f"the mooncake transfer backend needs `pip install mooncake-transfer-engine-non-cuda` "
                          f"(CUDA: mooncake-transfer-engine) and Debian's libibverbs1: {e}") from e
    return TransferEngine


class MooncakeTransport(KVTransport):
    name = "mooncake"

    def __init__(self, host: str):
        self._engine = load_engine()()
        if self._engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
            raise RuntimeError(f"Mooncake Transfer Engine failed to start on {host} over {PROTOCOL}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._bases: dict[str, int] = {}
        self._keep: list[torch.Tensor] = []

    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            view = byte_view(t)
            if self._engine.register_memory(view.data_ptr(), view.numel()) != 0:
                raise RuntimeError(f"Mooncake could not register {name!r} ({view.numel()} bytes)")
            self._bases[name] = view.data_ptr()
            self._keep.append(view)

    def endpoint(self) -> dict:
        return {"backend": self.name, "session": self._session, "bases": dict(self._bases)}

    def read(self, peer: dict, spans: list[Span], timeout_s: float) -> None:
        remote = peer["bases"]
        local_ptrs = [self._bases[s.name] + s.local_offset for s in spans]
        remote_ptrs = [remote[s.name] + s.remote_offset for s in spans]
        status = self._engine.batch_transfer_sync_read(peer["session"], local_ptrs, remote_ptrs,
                                                       [s.nbytes for s in spans])
        if status != 0:
            raise TransferError(f"Mooncake read of {len(spans)} ranges from {peer['session']} failed ({status})")

    def close(self) -> None:
        for view in self._keep:
            self._engine.unregister_memory(view.data_ptr())
        self._keep.clear()
