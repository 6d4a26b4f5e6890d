"""deepinfer's log records go to stderr through one handler, configured once per process.

The level comes from DEEPINFER_LOG_LEVEL (default INFO), so offline users see start-up facts such
as the KV-cache layout, as they would with vLLM. Idempotent: calling it again only updates level
and format.
"""

from __future__ import annotations

import logging
import os
import sys


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (redirections and test capture swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(level: int | str | None = None, fmt: str = "%(name)s: %(message)s") -> logging.Logger:
    logger = logging.getLogger("deepinfer")
    logger.setLevel(level if level is not None else os.environ.get("DEEPINFER_LOG_LEVEL", "INFO").upper())
    handler = next((h for h in logger.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:
        handler = _StderrHandler()
        logger.addHandler(handler)
    handler.setFormatter(logging.Formatter(fmt))
    logger.propagate = False  # one copy of each record even when the application configures the root logger
    return logger
