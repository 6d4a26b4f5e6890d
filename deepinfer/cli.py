"""The `deepinfer` command line: `generate` for one prompt, `chat` for an interactive conversation,
`serve` for the OpenAI-compatible HTTP server.

Invariants: stdout carries only generated output (text, or one JSON object per line with --json);
logs, progress bars and error messages go to stderr. Every ValueError (bad model path, bad option,
prompt too long, ...) ends the command with `error: <message>` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import sys
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path

import jinja2

from deepinfer import __version__
from deepinfer.config import EngineArgs
from deepinfer.llm import LLM
from deepinfer.logger import setup_logging
from deepinfer.outputs import CompletionOutput
from deepinfer.sampling_params import SamplingParams

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
ENGINE_DEST_PREFIX = "engine_"  # engine options live under their own dests so flag names may be renamed
# name -> (type, help); every flag defaults to None, so unset options keep SamplingParams' own defaults
_SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "temperature": (float, "0 means greedy"),
    "top_p": (float, "nucleus sampling mass in (0, 1]"),
    "top_k": (int, "keep the k most likely tokens (0 or -1: off)"),
    "min_p": (float, "drop tokens below min_p x the top probability"),
    "seed": (int, "per-request sampling seed"),
    "presence_penalty": (float, "in [-2, 2]"),
    "frequency_penalty": (float, "in [-2, 2]"),
    "repetition_penalty": (float, "> 0; 1 means off"),
    "min_tokens": (int, "tokens to generate before EOS / stop may end the output"),
    "n": (int, "number of samples"),
    "logprobs": (int, "top-N log-probabilities per generated token"),
}
_CHAT_EXIT = ("/exit", "/quit")
_CHAT_RESET = "/reset"


# --- engine options ----------------------------------------------------------------------------
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(f: dataclasses.Field, hints: Mapping[str, typing.Any]) -> type:
    """The default's type (a factory's value's); for a None default (Optional[X]) the first non-None member X."""
    if f.default is dataclasses.MISSING:
        return type(f.default_factory())
    if f.default is not None:
        return type(f.default)
    return next(a for a in typing.get_args(hints[f.name]) if a is not type(None))


def add_engine_args(parser: argparse.ArgumentParser, rename: Mapping[str, str] | None = None) -> None:
    """`--model`, `--tokenizer` and one flag per EngineArgs field (`rename` maps field -> flag name)."""
    parser.add_argument("--model", metavar="PATH", help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory (default: the model's)")
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        _add_engine_flag(group, f, _value_type(f, hints), (rename or {}).get(f.name, f.name))


def _add_engine_flag(group, f: dataclasses.Field, kind: type, name: str) -> None:
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # factories read the env
    common = dict(dest=ENGINE_DEST_PREFIX + f.name, default=default, help=f"EngineArgs.{f.name}")
    if kind is bool:
        group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **common)
    else:
        common["help"] += " (default: %(default)s)"
        group.add_argument(_flag(name), type=kind, metavar=f.name.upper(), **common)


def engine_kwargs(namespace: argparse.Namespace) -> dict[str, typing.Any]:
    """EngineArgs keyword arguments from a namespace filled by a parser given `add_engine_args`."""
    return {f.name: getattr(namespace, ENGINE_DEST_PREFIX + f.name) for f in dataclasses.fields(EngineArgs)}


# --- sampling options --------------------------------------------------------------------------
def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    for name, (kind, help_text) in _SAMPLING_FLAGS.items():
        group.add_argument(_flag(name), type=kind, help=help_text)
    group.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    group = parser.add_argument_group("structured outputs (at most one)")
    group.add_argument("--json-schema", metavar="SCHEMA", help="JSON schema (its JSON text, or a file holding it)")
    group.add_argument("--regex", metavar="REGEX", help="the output fully matches this regular expression")
    group.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    group.add_argument("--grammar", metavar="EBNF", help="EBNF grammar (its text, or a file holding it)")


def _structured(namespace: argparse.Namespace) -> dict | None:
    """The structured-output spec the flags give (files are read), or None."""
    given = {k: getattr(namespace, k, None) for k in ("json_schema", "regex", "choice", "grammar")}
    given = {("json" if k == "json_schema" else k): v for k, v in given.items() if v is not None}
    for key in ("json", "grammar"):
        if key in given:
            given[key] = _text_or_file(given[key])
    return given or None


def _text_or_file(value: str) -> str:
    try:
        return Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
    except OSError:  # e.g. inline text too long to be a file name
        return value


def sampling_params(namespace: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags given; raises ValueError (with its message) for bad values."""
    chosen = {name: getattr(namespace, name) for name in _SAMPLING_FLAGS}
    kwargs = {name: value for name, value in chosen.items() if value is not None}
    return SamplingParams(max_tokens=namespace.max_tokens, stop=namespace.stop or [],
                          ignore_eos=namespace.ignore_eos, structured_outputs=_structured(namespace), **kwargs)


def load_llm(namespace: argparse.Namespace, stdout_is_data: bool = False) -> LLM:
    """LLM for the namespace; with `stdout_is_data` its bundled-model notice goes to stderr instead."""
    target = sys.stderr if stdout_is_data else sys.stdout
    with contextlib.redirect_stdout(target):
        return LLM(namespace.model, namespace.tokenizer, **engine_kwargs(namespace))


# --- generate ----------------------------------------------------------------------------------
def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _prompt(args: argparse.Namespace) -> str | list[int]:
    """Exactly one of the text prompt and --prompt-token-ids; --chat needs text."""
    if (args.prompt is None) == (args.prompt_token_ids is None):
        raise ValueError("give either a text prompt or --prompt-token-ids (exactly one)")
    if args.chat and args.prompt is None:
        raise ValueError("--chat needs a text prompt, not --prompt-token-ids")
    return args.prompt if args.prompt is not None else args.prompt_token_ids


def run_generate(args: argparse.Namespace) -> int:
    prompt, params = _prompt(args), sampling_params(args)
    llm = load_llm(args, stdout_is_data=args.json)
    if args.chat:
        result = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    else:
        result = llm.generate(prompt, params, use_tqdm=False)[0]
    for out in result.outputs:
        _print_output(out, len(result.outputs), args.json, llm.get_tokenizer() is not None)
    return 0


def _print_output(out: CompletionOutput, n: int, as_json: bool, has_text: bool) -> None:
    if as_json:
        print(json.dumps(_output_dict(out), ensure_ascii=False), flush=True)
        return
    if n > 1:
        print(f"=== sample {out.index + 1}/{n} ===")
    # without a tokenizer there is no text to show, so the token ids stand in for it
    print(out.text if has_text else ",".join(map(str, out.token_ids)), flush=True)


def _output_dict(out: CompletionOutput) -> dict[str, typing.Any]:
    data = {"index": out.index, "text": out.text, "token_ids": list(out.token_ids),
            "finish_reason": out.finish_reason}
    if out.logprobs is not None:
        data["cumulative_logprob"] = out.cumulative_logprob
        data["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in out.logprobs]
    return data


# --- chat --------------------------------------------------------------------------------------
def _read_lines(interactive: bool) -> Iterator[str]:
    """Stripped input lines until EOF; prompts (on stderr) only when a person is typing."""
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line.strip()


class ChatSession:
    """A conversation: history (system message first, if any) plus one streamed reply per user turn."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None, thinking: bool):
        if llm.get_tokenizer() is None:
            raise ValueError("chat needs a tokenizer; the model has no tokenizer.json (use --tokenizer)")
        if params.n != 1:
            raise ValueError(f"chat streams one reply per turn; --n must be 1, got {params.n}")
        self.llm, self.params, self.thinking = llm, params, thinking
        self.base = [{"role": "system", "content": system}] if system else []
        self.history = list(self.base)

    def reset(self) -> None:
        self.history = list(self.base)

    def turn(self, text: str) -> str:
        """Stream the reply to stdout; the turn enters the history only once the reply is complete."""
        messages = [*self.history, {"role": "user", "content": text}]
        tok = self.llm.get_tokenizer()
        ids = tok.apply_chat_template(messages, tokenize=True, thinking=self.thinking)
        reply = "".join(_echo(self.llm.stream({"prompt_token_ids": ids}, self.params)))
        print(flush=True)
        self.history = [*messages, {"role": "assistant", "content": reply}]
        return reply


def _echo(deltas: Iterator[str]) -> Iterator[str]:
    for delta in deltas:
        sys.stdout.write(delta)
        sys.stdout.flush()
        yield delta


def run_chat(args: argparse.Namespace) -> int:
    session = ChatSession(load_llm(args), sampling_params(args), args.system, args.thinking)
    interactive = sys.stdin.isatty()
    for line in _read_lines(interactive):
        if line in _CHAT_EXIT:
            break
        if line == _CHAT_RESET:
            session.reset()
            print("(history cleared)", file=sys.stderr)
        elif line:
            _chat_turn(session, line, interactive)
    return 0


def _chat_turn(session: ChatSession, line: str, interactive: bool) -> None:
    """A person at the terminal keeps the session after a bad turn; piped input fails fast (exit 2)."""
    try:
        session.turn(line)
    except (ValueError, jinja2.TemplateError) as e:
        if not interactive:
            raise
        print(f"error: {e} (try /reset)", file=sys.stderr)


# --- parser and entry point --------------------------------------------------------------------
def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser. The benchmark subcommands (and their imports) load only when `argv` names
    `bench`, so `generate`, `chat` and `serve` never import what only the benchmarks need."""
    parser = argparse.ArgumentParser(prog="deepinfer", description="Run DeepSeek models locally.")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate_parser(commands)
    _add_chat_parser(commands)
    _add_serve_parser(commands)
    _add_router_parser(commands)
    from deepinfer.eplb.cli import add_parser as add_eplb_parser  # torch only: cheap next to the rest

    add_eplb_parser(commands)
    from deepinfer.quantization.cli import add_parser as add_quantize_parser

    add_quantize_parser(commands)
    wants_bench = argv is not None and "bench" in argv
    (_add_bench_parser if wants_bench else _add_bench_placeholder)(commands)
    return parser


def _add_common(sub: argparse.ArgumentParser) -> None:
    add_sampling_args(sub)
    # --seed is the per-request sampling seed here, so the engine's global seed is --engine-seed
    add_engine_args(sub, rename={"seed": "engine_seed"})
    # one prompt or one person typing never repays compiling the decode step (a minute on CPU at start-up):
    # generate and chat run eagerly unless --no-enforce-eager; serve and LLM compile by default
    sub.set_defaults(**{ENGINE_DEST_PREFIX + "enforce_eager": True})


def _add_generate_parser(commands) -> None:
    sub = commands.add_parser("generate", help="complete one prompt and print the result")
    sub.add_argument("prompt", nargs="?", help="text prompt (needs a tokenizer)")
    sub.add_argument("--prompt-token-ids", type=_token_ids, metavar="IDS", help="prompt as ids, e.g. 1,2,3")
    sub.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    sub.add_argument("--json", action="store_true", help="print one JSON object per output")
    _add_common(sub)
    sub.set_defaults(handler=run_generate)


def _add_chat_parser(commands) -> None:
    sub = commands.add_parser("chat", help="interactive chat; reads lines from stdin (/reset, /exit)")
    sub.add_argument("--system", metavar="TEXT", help="system message")
    sub.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                     help="thinking mode (chat_template_kwargs thinking)")
    _add_common(sub)
    sub.set_defaults(handler=run_chat)


# --- serve -------------------------------------------------------------------------------------
def run_serve(args: argparse.Namespace) -> int:
    from deepinfer.server.launch import run_server  # the server's dependencies load only for `serve`

    return run_server(args)


def _add_serve_parser(commands) -> None:
    sub = commands.add_parser("serve", help="OpenAI-compatible HTTP server (see docs/serving.md)")
    sub.add_argument("model_path", nargs="?", metavar="MODEL", help="checkpoint directory (default: the bundled model)")
    _add_http_args(sub)
    sub.add_argument("--api-key", action="append", metavar="KEY",
                     help="require `Authorization: Bearer KEY` on /v1/*; repeat for several keys, any of which "
                          "is accepted (default: $DEEPINFER_API_KEY)")
    sub.add_argument("--prefix-cache-isolation", choices=("none", "key"), default="none",
                     help="key: requests share cached prompt prefixes only with requests of the same API key "
                          "(default: %(default)s)")
    sub.add_argument("--served-model-name", metavar="NAME",
                     help="model name in the API (default: the model directory's name, deepinfer-default for "
                          "the bundled model)")
    sub.add_argument("--max-queue", type=int, default=512,
                     help="in-flight requests before new ones get 429 (default: %(default)s)")
    sub.add_argument("--max-request-seqs", type=int, default=None, metavar="N",
                     help="largest prompts x n of one request, at most --max-queue (default: a quarter of "
                          "--max-queue, at least 1)")
    sub.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may run after SIGTERM (default: %(default)s)")
    sub.add_argument("--max-n", type=int, default=16, help="largest n per request (default: %(default)s)")
    sub.add_argument("--data-parallel-replicas", type=int, default=1, metavar="N",
                     help="N engine processes (each with the engine options below) behind this server, routed "
                          "by --router-policy (default: %(default)s)")
    sub.add_argument("--router-policy", choices=("cache_aware", "least_loaded", "round_robin"),
                     default="cache_aware", help="how --data-parallel-replicas routes (default: %(default)s)")
    sub.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                     help="the tool-call format the model speaks: auto (from the checkpoint's chat template, else "
                          "its model_type), deepseek_v3, deepseek_v31, deepseek_v32, deepseek_v4 or deepseek_v41 "
                          "(default: %(default)s)")
    _add_media_args(sub)
    add_engine_args(sub)
    sub.set_defaults(handler=run_serve)


def _add_media_args(sub: argparse.ArgumentParser) -> None:
    """Image inputs of vision models (docs/images.md), named as vLLM names them."""
    sub.add_argument("--allowed-local-media-path", metavar="DIR",
                     help="allow file:// image URLs of files inside DIR (default: file:// URLs are refused)")
    sub.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                     help="fetch http(s) image URLs only from these hosts (default: any host)")
    sub.add_argument("--disable-remote-media", action="store_true", help="refuse http(s) image URLs")
    sub.add_argument("--limit-mm-per-prompt", default='{"image": 8}', metavar="JSON",
                     help="most images per request, as JSON (default: %(default)s)")
    sub.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="S",
                     help="seconds an http(s) image may take to download (default: %(default)s)")
    sub.add_argument("--max-image-bytes", type=int, default=20 * 2**20, metavar="N",
                     help="largest encoded image, in bytes (default: %(default)s)")


def _add_http_args(sub: argparse.ArgumentParser) -> None:
    """What `serve` and `router` share: where to listen, the body limit, logging."""
    sub.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    sub.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    sub.add_argument("--max-body-bytes", type=int, default=16 * 2**20,
                     help="largest request body, larger ones get 413 (default: %(default)s)")
    sub.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                     help="log one line per HTTP request")
    sub.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                     help="uvicorn's log level (default: %(default)s)")


# --- router --------------------------------------------------------------------------------------
def run_router(args: argparse.Namespace) -> int:
    from deepinfer.router.http import run_router as run  # the router's dependencies load only for `router`

    return run(args)


def _add_router_parser(commands) -> None:
    sub = commands.add_parser("router", help="one OpenAI-compatible endpoint in front of several `deepinfer serve` "
                              "instances, cache- and load-aware (see docs/serving.md)")
    roles = sub.add_mutually_exclusive_group(required=True)
    roles.add_argument("--workers", nargs="+", metavar="URL",
                       help="the servers' base URLs, e.g. http://10.0.0.5:8000 (serve them with --kv-events)")
    roles.add_argument("--prefill", nargs="+", metavar="URL", help="disaggregation: the prefill servers (serve "
                       "them with --disaggregation-mode prefill; give --decode too; docs/disaggregation.md)")
    sub.add_argument("--decode", nargs="+", metavar="URL", help="disaggregation: the decode servers "
                     "(--disaggregation-mode decode)")
    _add_http_args(sub)
    sub.add_argument("--policy", choices=("cache_aware", "least_loaded", "round_robin"), default="cache_aware",
                     help="routing policy (default: %(default)s)")
    sub.add_argument("--balance-abs-tokens", type=int, default=4096, metavar="N",
                     help="cache_aware: a load gap above N tokens (and --balance-rel) routes by load (default: "
                          "%(default)s)")
    sub.add_argument("--balance-rel", type=float, default=2.0, metavar="X",
                     help="cache_aware: ... and the busiest worker above X times the idlest (default: %(default)s)")
    sub.add_argument("--tokenizer", metavar="DIR", help="the served model's directory, for its tokenizer and chat "
                     "template (default: the bundled model)")
    sub.add_argument("--api-key", action="append", metavar="KEY",
                     help="require `Authorization: Bearer KEY` on /v1/*; the header is forwarded to the workers "
                          "(default: $DEEPINFER_API_KEY)")
    sub.add_argument("--worker-api-key", metavar="KEY", help="the key the router polls /router/state with (default: "
                     "the first --api-key)")
    sub.add_argument("--poll-interval-ms", type=float, default=50.0,
                     help="how often each worker's load and prefix-cache events are read (default: %(default)s)")
    sub.add_argument("--health-timeout", type=float, default=1.0, metavar="S",
                     help="a worker that answers no poll this long leaves rotation (default: %(default)s)")
    sub.add_argument("--hang-timeout", type=float, default=1.5, metavar="S",
                     help="a worker whose engine sent nothing this long (a step longer than this counts as hung) "
                          "leaves rotation (default: %(default)s)")
    sub.add_argument("--startup-timeout", type=float, default=60.0, metavar="S",
                     help="how long to wait for a first worker before serving anyway (default: %(default)s)")
    sub.set_defaults(handler=run_router)


# --- bench ---------------------------------------------------------------------------------------
# module, entry point, argument adder, help; modules load only for `bench` (httpx, matplotlib, ...)
_BENCH_COMMANDS = {
    "serve": ("serve", "main_serve", "add_serve_args", "load-test a running OpenAI-compatible server"),
    "sweep": ("sweep", "main_sweep", "add_sweep_args", "`bench serve` over concurrencies or rates, with plots"),
    "plot": ("sweep", "main_plot", "add_plot_args", "draw several sweep results (engines) on one plot"),
    "throughput": ("offline", "main_throughput", "add_throughput_args", "offline batch throughput (LLM API)"),
    "latency": ("offline", "main_latency", "add_latency_args", "prefill and per-token decode latency"),
}


def _bench_entry(module: str, entry: str):
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"deepinfer.bench.{module}"), entry)(args)

    return run


_BENCH_HELP = "benchmarks (see `deepinfer bench --help`)"


def _add_bench_placeholder(commands) -> None:
    """`bench` listed in the help without loading its modules; reached only if `bench` was not seen in
    argv (never, in practice), it parses again with the real subcommands."""
    sub = commands.add_parser("bench", help=_BENCH_HELP, add_help=False)
    sub.add_argument("bench_args", nargs=argparse.REMAINDER)
    sub.set_defaults(handler=lambda args: main(["bench", *args.bench_args]))


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help=_BENCH_HELP)
    sub_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name, (module, entry, adder, help_text) in _BENCH_COMMANDS.items():
        sub = sub_commands.add_parser(name, help=help_text)
        getattr(importlib.import_module(f"deepinfer.bench.{module}"), adder)(sub)
        if module == "offline":
            add_engine_args(sub)
        sub.set_defaults(handler=_bench_entry(module, entry))


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse usage errors exit 2 themselves)."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    setup_logging()
    try:
        return args.handler(args)
    except (ValueError, jinja2.TemplateError) as e:  # user errors: a message, never a traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
