"""`deepinfer serve`: start the engine process, then serve HTTP with uvicorn until told to stop.

Lifecycle invariants:
- the HTTP port is bound before the engine starts (a taken port fails in a second, not after the model
  loaded) but listens only once the engine reported ready, so any answered /health means the server can
  generate;
- SIGTERM / SIGINT: uvicorn stops accepting connections and lets in-flight requests finish for up to
  --drain-timeout seconds; then every engine request still open is aborted, so each unfinished choice
  ends with finish_reason "abort" (a last chunk and [DONE] in streams), and only what has not ended
  ABORT_GRACE_S later is cancelled; the engine is shut down afterwards (the grammar-check workers are
  killed first, so an overrunning compile never delays the exit) and the exit status is 0;
- engine death: /health answers 503 at once, in-flight requests end with an error, and after a short
  grace the server shuts down and the process exits with EXIT_ENGINE_DEAD, so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from deepinfer.config import EngineArgs, ModelConfig
from deepinfer.llm import resolve_model
from deepinfer.multimodal.media import MediaPolicy
from deepinfer.server.app import build_app
from deepinfer.server.engine_client import AsyncEngineClient
from deepinfer.server.metrics import Metrics
from deepinfer.server.router_state import EventLog, RouterStateView
from deepinfer.server.serving import ServerSettings, Serving
from deepinfer.server.tool_formats import attach_format
from deepinfer.tokenizer import TOKENIZER_FILE, Tokenizer

logger = logging.getLogger("deepinfer")

EXIT_ENGINE_DEAD = 1
EXIT_STARTUP_FAILED = 1
BUNDLED_MODEL_NAME = "deepinfer-default"
DEAD_ENGINE_GRACE_S = 1.0  # time for in-flight requests to send their errors (and /health its 503)
DEAD_ENGINE_DRAIN_S = 2.0  # cap on the drain once the engine is gone: nothing can finish normally
ABORT_GRACE_S = 2.0  # after the drain's aborts: time for the responses to send their last chunks
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def model_path(args: argparse.Namespace) -> str | None:
    """MODEL (positional) or --model; giving both with different values is an error."""
    positional, option = getattr(args, "model_path", None), getattr(args, "model", None)
    if positional and option and positional != option:
        raise ValueError(f"two models given: {positional!r} and --model {option!r}")
    return positional or option


def settings_from(args: argparse.Namespace, path: Path, bundled: bool) -> ServerSettings:
    from deepinfer.cli import engine_kwargs  # the cli imports this module lazily, so no cycle

    name = args.served_model_name or (BUNDLED_MODEL_NAME if bundled else path.name)
    api_keys = api_keys_from(args)
    isolation = getattr(args, "prefix_cache_isolation", "none")
    if isolation == "key" and not api_keys:
        raise ValueError("--prefix-cache-isolation key needs at least one --api-key (or $DEEPINFER_API_KEY)")
    share = getattr(args, "max_request_seqs", None)
    for flag in ("max_queue", "max_n", "max_body_bytes", "max_request_seqs"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    vision, image_token = _vision_of(path)
    return ServerSettings(model_name=name, api_keys=api_keys, max_queue=args.max_queue, max_n=args.max_n,
                          max_body_bytes=args.max_body_bytes, max_request_seqs=share,
                          grammar_timeout_s=engine_kwargs(args)["grammar_compile_timeout_s"],
                          prefix_cache_isolation=isolation, vision=vision, image_token_id=image_token,
                          media=media_policy(args))


def _vision_of(path: Path):
    """(vision config, image token id) of a vision checkpoint, else (None, -1)."""
    if not (path / "config.json").is_file():
        return None, -1
    cfg = ModelConfig.from_hf(path).v41
    return (cfg.vision, cfg.image_token_id) if cfg is not None and cfg.vision is not None else (None, -1)


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """The image-input flags; a bad value is a ValueError naming the flag."""
    try:
        limits = json.loads(getattr(args, "limit_mm_per_prompt", None) or '{"image": 8}')
        max_images = int(limits.get("image", 8))
    except (ValueError, TypeError, AttributeError):
        raise ValueError('--limit-mm-per-prompt must be JSON like {"image": 4}') from None
    local = getattr(args, "allowed_local_media_path", None)
    if local is not None and not Path(local).is_dir():
        raise ValueError(f"--allowed-local-media-path {local}: not a directory")
    domains = getattr(args, "allowed_media_domains", None)
    return MediaPolicy(allowed_local_path=local, allow_remote=not getattr(args, "disable_remote_media", False),
                       allowed_domains=tuple(d.lower() for d in domains) if domains else None,
                       max_bytes=getattr(args, "max_image_bytes", 20 * 2**20),
                       fetch_timeout_s=getattr(args, "media_fetch_timeout", 10.0), max_images=max(max_images, 0))


def api_keys_from(args: argparse.Namespace) -> tuple[str, ...]:
    """Every --api-key given (each one a tenant), else $DEEPINFER_API_KEY; empty keys do not count."""
    given = args.api_key if args.api_key is not None else [os.environ.get("DEEPINFER_API_KEY", "")]
    return tuple(key for key in given if key)


def run_server(args: argparse.Namespace) -> int:
    """Serve until stopped; returns the process exit status."""
    from deepinfer.cli import engine_kwargs  # the cli imports this module lazily, so no cycle

    path, bundled = resolve_model(model_path(args))
    if bundled:
        print(f"deepinfer: using the bundled default model ({path.name})", flush=True)
    settings = settings_from(args, path, bundled)
    options = engine_kwargs(args)
    EngineArgs.from_kwargs(**options)  # a bad option (e.g. --speculative-config) fails before anything starts
    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else path)
    fmt = attach_format(tokenizer, getattr(args, "tool_call_parser", None), path)  # ValueError: unknown name
    if fmt is not None:
        logger.info("tool calls: %s format", fmt.name)
    with bind_socket(args.host, args.port) as sock:
        try:
            return asyncio.run(_serve(args, sock, str(path), options, settings, tokenizer))
        except RuntimeError as e:  # the engine could not start: a message, not a traceback
            print(f"error: {e}", file=sys.stderr)
            return EXIT_STARTUP_FAILED


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound, not yet listening, TCP socket (connections are refused until uvicorn listens)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def load_tokenizer(directory: Path) -> Tokenizer | None:
    """The directory's tokenizer, with the tool-call format its checkpoint speaks (server/tool_formats.py)."""
    if not (directory / TOKENIZER_FILE).is_file():
        logger.warning("no %s in the model directory: only token-id prompts can be served", TOKENIZER_FILE)
        return None
    tokenizer = Tokenizer.from_dir(directory)
    attach_format(tokenizer, None, directory)
    return tokenizer


async def _serve(args, sock: socket.socket, model: str, engine_kwargs: dict, settings: ServerSettings,
                 tokenizer) -> int:
    client = await _start_engines(args, model, engine_kwargs)
    serving = None
    try:
        serving = Serving(client, tokenizer, settings, Metrics(client.engine_stats, client.collectors()))
        app = build_app(serving, _router_view(client, engine_kwargs, settings))
        server = _DrainingServer(_uvicorn_config(args, app), client, args.drain_timeout)
        watcher = asyncio.create_task(_stop_when_engine_dies(client, server))
        with _signals_absorbed():
            await server.serve(sockets=[sock])
        watcher.cancel()
    finally:
        if serving is not None:
            serving.close()
        await client.shutdown()
    return EXIT_ENGINE_DEAD if client.dead else 0


async def _start_engines(args, model: str, engine_kwargs: dict):
    """One engine process, or --data-parallel-replicas of them behind a router (deepinfer/router)."""
    replicas = getattr(args, "data_parallel_replicas", 1)
    if replicas < 1:
        raise RuntimeError(f"--data-parallel-replicas must be >= 1, got {replicas}")
    if replicas == 1:
        return await AsyncEngineClient.start(model, engine_kwargs)
    from deepinfer.router.policy import RouterConfig
    from deepinfer.router.replicas import ReplicatedEngineClient

    return await ReplicatedEngineClient.start(model, engine_kwargs, replicas, RouterConfig(args.router_policy))


def _router_view(client, engine_kwargs: dict, settings: ServerSettings) -> RouterStateView:
    """/router/state for a `deepinfer router` in front; one engine's prefix-cache events with --kv-events (a
    server that routes replicas itself keeps their events to itself and reports its load only)."""
    log = None
    if engine_kwargs.get("kv_events") and isinstance(client, AsyncEngineClient):
        log = EventLog()
        client.on_kv_events = log.append
    return RouterStateView(client, client.ready.block_size, settings.prefix_cache_isolation, log)


def _uvicorn_config(args, app) -> uvicorn.Config:
    return uvicorn.Config(app, host=args.host, port=args.port, lifespan="off", access_log=args.access_log,
                          timeout_graceful_shutdown=args.drain_timeout + ABORT_GRACE_S, log_level=args.log_level)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server whose drain ends by aborting the engine requests still open, so their responses
    end normally with finish_reason "abort" before uvicorn's own timeout would cancel them mid-write."""

    def __init__(self, config: uvicorn.Config, client: AsyncEngineClient, drain_s: float):
        super().__init__(config)
        self.client, self.drain_s = client, drain_s

    async def shutdown(self, sockets=None) -> None:
        aborter = asyncio.create_task(self._abort_after(self.drain_s))
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()

    async def _abort_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        logger.warning("drain timeout: aborting the requests still running")
        self.client.abort_all()


async def _stop_when_engine_dies(client: AsyncEngineClient, server: uvicorn.Server) -> None:
    await client.dead_event.wait()
    logger.error("the engine process is gone; the server shuts down with exit status %d", EXIT_ENGINE_DEAD)
    await asyncio.sleep(DEAD_ENGINE_GRACE_S)
    drain = server.config.timeout_graceful_shutdown
    server.config.timeout_graceful_shutdown = min(drain, DEAD_ENGINE_DRAIN_S) if drain else DEAD_ENGINE_DRAIN_S
    server.should_exit = True


def _absorb(signum: int, frame) -> None:
    """Stands in for the default handlers while uvicorn runs (see _signals_absorbed)."""


@contextlib.contextmanager
def _signals_absorbed():
    """uvicorn re-raises the stop signal after its drain, meant for the previous handler; with the
    default one the process would die there, before the engine is shut down. This absorbs it."""
    previous = {sig: signal.signal(sig, _absorb) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
