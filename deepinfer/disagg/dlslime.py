"""DLSlime backend (LMDeploy's transport), over its TCP endpoint (no RDMA needed): the prefill engine's endpoint
exposes every cache tensor as a named memory region; a decode engine opens one endpoint per prefill peer,
registers its own tensors there, and reads with `(local region, remote region, remote offset, local offset,
length)` assignments, each batch bounded by a timeout."""

from __future__ import annotations

import threading

import torch

from deepinfer.disagg.plan import Span
from deepinfer.disagg.transport import KVTransport, TransferError, byte_view


def load_dlslime():
    try:
        import dlslime
    except ImportError as e:
        raise ImportError(f"the dlslime transfer backend needs `pip install dlslime` and Debian's libibverbs1: {e}") \
            from e
    return dlslime


class _Peer:
    """This engine's endpoint connected to one prefill engine: local and remote region handles by name."""

    def __init__(self, dlslime, host: str, tensors: dict[str, torch.Tensor], info: dict):
        self.endpoint = dlslime.TcpEndpoint(host, 0)
        self.local = {name: self.endpoint.register_memory_region(name, v.data_ptr(), 0, v.numel())
                      for name, v in tensors.items()}
        self.endpoint.connect(info)
        self.remote = {name: self.endpoint.register_remote_memory_region(name, mr)
                       for name, mr in info["mr_info"].items()}
        self.lock = threading.Lock()  # one batch at a time on an endpoint


class DLSlimeTransport(KVTransport):
    name = "dlslime"

    def __init__(self, host: str):
        self._dlslime, self._host = load_dlslime(), host
        self._server = self._dlslime.TcpEndpoint(host, 0)
        self._views: dict[str, torch.Tensor] = {}
        self._peers: dict[tuple, _Peer] = {}
        self._lock = threading.Lock()

    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            view = self._views[name] = byte_view(t)
            self._server.register_memory_region(name, view.data_ptr(), 0, view.numel())

    def endpoint(self) -> dict:
        return {"backend": self.name, "info": self._server.endpoint_info()}

    def _peer(self, info: dict) -> _Peer:
        key = (info["host"], info["port"])
        with self._lock:
            if key not in self._peers:
                self._peers[key] = _Peer(self._dlslime, self._host, self._views, info)
            return self._peers[key]

    def read(self, peer: dict, spans: list[Span], timeout_s: float) -> None:
        conn = self._peer(peer["info"])
        batch = [(conn.local[s.name], conn.remote[s.name], s.remote_offset, s.local_offset, s.nbytes) for s in spans]
        with conn.lock:
            status = conn.endpoint.read(batch, timeout_ms=int(timeout_s * 1000)).wait()
        if status != 0:
            raise TransferError(f"DLSlime read of {len(spans)} ranges from {peer['info']['host']}:"
                                f"{peer['info']['port']} failed ({status})")

    def close(self) -> None:
        for conn in self._peers.values():
            conn.endpoint.shutdown()
        self._server.shutdown()
