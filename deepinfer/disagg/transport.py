"""KVTransport: one-sided reads of registered cache tensors from a peer engine.

Each engine registers its cache tensors by component name and publishes `endpoint()` in the handshake; the
decode side reads the ranges a plan names (plan.Span) straight into its own tensors. Backends:
- `mooncake`: Mooncake Transfer Engine, P2P handshake (no metadata server), TCP here, RDMA/NVLink where present;
- `dlslime`: DLSlime's TCP endpoint (LMDeploy's transport);
- `local`: a ZeroMQ socket served by the prefill engine (no dependencies; fault injection for tests).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import msgspec
import torch
import zmq

from deepinfer.disagg.plan import Span


class TransferError(RuntimeError):
    """A read failed or timed out; the request it served fails, the engine keeps running."""


class KVTransport(ABC):
    name: str

    @abstractmethod
    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        """Make these (contiguous) tensors readable by peers and writable by reads, keyed by name."""

    @abstractmethod
    def endpoint(self) -> dict:
        """What a peer needs to read from this engine (msgpack-ready)."""

    @abstractmethod
    def read(self, peer: dict, spans: list[Span], timeout_s: float) -> None:
        """Copy every span from the peer's tensors into this engine's; TransferError on failure."""

    @abstractmethod
    def close(self) -> None:
        """Unregister and stop serving."""


def byte_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("KV transport needs contiguous cache tensors")
    return t.reshape(-1).view(torch.uint8)


def make_transport(name: str, host: str) -> KVTransport:
    if name == "local":
        return LocalTransport(host)
    if name == "mooncake":
        from deepinfer.disagg.mooncake import MooncakeTransport

        return MooncakeTransport(host)
    if name == "dlslime":
        from deepinfer.disagg.dlslime import DLSlimeTransport

        return DLSlimeTransport(host)
    raise ValueError(f"unknown disaggregation transfer backend {name!r} (mooncake, dlslime or local)")


class LocalTransport(KVTransport):
    """Reads served over ZeroMQ by a thread of the engine that owns the memory (the rows it serves are pinned,
    so no forward writes them meanwhile). `faults` (class-wide) injects a delay or a failure on the serving
    side, for tests."""

    name = "local"
    faults: dict = {"delay_s": 0.0, "fail": False}

    def __init__(self, host: str):
        self._bytes: dict[str, torch.Tensor] = {}
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="deepinfer-kv-local")
        self._thread.start()

    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        self._bytes.update({name: byte_view(t) for name, t in tensors.items()})

    def endpoint(self) -> dict:
        return {"backend": self.name, "address": self._address}

    def _serve(self) -> None:
        from deepinfer.disagg.control import serve_requests

        serve_requests(self._sock, self._stop, self._answer)

    def _answer(self, payload: bytes) -> list[bytes]:
        if self.faults["delay_s"]:
            self._stop.wait(self.faults["delay_s"])
        if self.faults["fail"]:
            return [b"injected transfer failure"]
        try:
            ranges = msgspec.msgpack.decode(payload)
            return [b""] + [self._bytes[name][off:off + n].cpu().numpy().tobytes() for name, off, n in ranges]
        except Exception as e:  # a bad request answers an error, never kills the server
            return [f"{type(e).__name__}: {e}".encode()]

    def read(self, peer: dict, spans: list[Span], timeout_s: float) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(peer["address"])
            sock.send(msgspec.msgpack.encode([(s.name, s.remote_offset, s.nbytes) for s in spans]))
            if not sock.poll(int(timeout_s * 1000)):
                raise TransferError(f"the prefill engine's local transport did not answer within {timeout_s} s")
            status, *frames = sock.recv_multipart()
        finally:
            sock.close()
        if status:
            raise TransferError(f"the prefill engine refused the read: {status.decode()}")
        for s, data in zip(spans, frames, strict=True):
            target = self._bytes[s.name][s.local_offset:s.local_offset + s.nbytes]
            target.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(target.device))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self._sock.close()
