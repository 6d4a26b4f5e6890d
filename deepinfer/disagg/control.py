"""The control plane: a prefill engine's bootstrap service (ZeroMQ ROUTER, msgpack dicts) that decode engines
ask for its layout, a transfer's record, and to release a transfer. `call` is the client: one request, one
answer within a timeout, so a dead or hung prefill engine costs a bounded wait."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec
import zmq

logger = logging.getLogger("deepinfer")


class ControlError(RuntimeError):
    """The peer did not answer in time, or answered an error."""


class BootstrapServer:
    """Serves `handler(message) -> answer` on a thread; the handler must be thread-safe."""

    def __init__(self, host: str, port: int, handler: Callable[[dict], dict]):
        self._handler = handler
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="deepinfer-pd-bootstrap")
        self._thread.start()

    def _serve(self) -> None:
        serve_requests(self._sock, self._stop, lambda payload: [msgspec.msgpack.encode(self._answer(payload))])

    def _answer(self, payload: bytes) -> dict:
        try:
            return self._handler(msgspec.msgpack.decode(payload))
        except Exception as e:  # a bad message answers an error; the service keeps running
            logger.exception("bootstrap request failed")
            return {"error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self._sock.close()


def serve_requests(sock: zmq.Socket, stop: threading.Event, answer: Callable[[bytes], list[bytes]]) -> None:
    """A ROUTER socket's loop until `stop`: each [identity, payload] request gets [identity, *answer(payload)];
    any other message is not ours and is dropped, so a stray peer cannot stop the service."""
    while not stop.is_set():
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart()
        if len(frames) == 2:
            sock.send_multipart([frames[0], *answer(frames[1])])


def call(address: str, message: dict, timeout_s: float) -> dict:
    """The peer's answer to `message`; ControlError if it does not come within timeout_s or is an error."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send(msgspec.msgpack.encode(message))
        if not sock.poll(int(timeout_s * 1000)):
            raise ControlError(f"the prefill engine at {address} did not answer {message['op']!r} within {timeout_s} s")
        answer = msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close()
    if "error" in answer:
        raise ControlError(f"the prefill engine at {address} refused {message['op']!r}: {answer['error']}")
    return answer
