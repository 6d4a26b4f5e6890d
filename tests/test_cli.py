"""The `deepinfer` command line, run in-process on a tiny random DeepSeek-V4 checkpoint."""

import dataclasses
import io
import json
import shutil
import subprocess
import sys

import pytest
from tiny_models import make_reference, save_reference, write_tokenizer

from deepinfer import cli
from deepinfer.config import EngineArgs

# small KV cache and no progress bar: fast, and stderr stays readable
FAST = ["--temperature", "0", "--ignore-eos", "--no-load-progress", "--kv-cache-memory-bytes", "16777216",
        "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny V4 checkpoint without a tokenizer."""
    return save_reference(make_reference("v4"), tmp_path_factory.mktemp("tiny_v4"))


@pytest.fixture(scope="module")
def ckpt_tok(ckpt, tmp_path_factory):
    """The same checkpoint plus a tiny tokenizer with a DeepSeek-style chat template."""
    path = tmp_path_factory.mktemp("tiny_v4_tok") / "model"
    shutil.copytree(ckpt, path)
    write_tokenizer(path)
    return path


@pytest.fixture
def no_bundled_model(monkeypatch, tmp_path):
    monkeypatch.setattr("deepinfer.llm.default_model_path", lambda: tmp_path / "absent")


def json_lines(text):
    return [json.loads(line) for line in text.splitlines()]


def test_engine_flags_round_trip():
    parser = cli.argparse.ArgumentParser()
    cli.add_engine_args(parser)
    assert cli.engine_kwargs(parser.parse_args([])) == dataclasses.asdict(EngineArgs())
    args = parser.parse_args(["--no-enable-chunked-prefill", "--kv-cache-memory-bytes", "5", "--seed", "3",
                              "--dtype", "float32", "--gpu-memory-utilization", "0.5"])
    kwargs = cli.engine_kwargs(args)
    assert kwargs["enable_chunked_prefill"] is False and kwargs["kv_cache_memory_bytes"] == 5
    assert (kwargs["seed"], kwargs["dtype"], kwargs["gpu_memory_utilization"]) == (3, "float32", 0.5)


def test_generate_and_chat_run_eagerly_unless_asked(monkeypatch):
    """One-shot and interactive commands skip the compile; serve keeps EngineArgs' default (the env's)."""
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "0")
    parser = cli.build_parser()
    for command in (["generate", "x"], ["chat"]):
        assert cli.engine_kwargs(parser.parse_args(command))["enforce_eager"] is True
        assert cli.engine_kwargs(parser.parse_args([*command, "--no-enforce-eager"]))["enforce_eager"] is False
    assert cli.engine_kwargs(parser.parse_args(["serve"]))["enforce_eager"] is False


def test_sampling_flags():
    parser = cli.argparse.ArgumentParser()
    cli.add_sampling_args(parser)
    params = cli.sampling_params(parser.parse_args(["--stop", "a", "--stop", "bc", "--top-k", "5", "--n", "2"]))
    assert (params.max_tokens, params.stop, params.top_k, params.n) == (128, ["a", "bc"], 5, 2)
    assert params.temperature == 1.0 and not params.ignore_eos


def test_generate_token_ids_json(ckpt, capsys):
    rc = cli.main(["generate", "--model", str(ckpt), "--prompt-token-ids", "0,5,6,7", "--max-tokens", "8",
                   "--json", *FAST])
    out, err = capsys.readouterr()
    assert rc == 0
    (result,) = json_lines(out)
    assert len(result["token_ids"]) == 8 and result["finish_reason"] == "length"
    assert "KV cache" in err  # INFO logs reach stderr, stdout holds only the JSON


def test_generate_text_and_chat(ckpt_tok, capsys):
    base = ["generate", "--model", str(ckpt_tok), "--max-tokens", "4", *FAST]
    assert cli.main([*base, "hello world"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    assert cli.main([*base, "--chat", "--json", "--n", "2", "--temperature", "1", "--seed", "0",
                     "hello"]) == 0
    samples = json_lines(capsys.readouterr().out)
    assert [s["index"] for s in samples] == [0, 1] and all(len(s["token_ids"]) == 4 for s in samples)


def test_chat_piped_two_turns(ckpt_tok, capsys, monkeypatch):
    replies, turn = [], cli.ChatSession.turn
    monkeypatch.setattr(cli.ChatSession, "turn", lambda self, text: replies.append(turn(self, text)))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/reset\n\nhow are you\n"))
    rc = cli.main(["chat", "--model", str(ckpt_tok), "--max-tokens", "5", "--system", "be brief", *FAST])
    out, err = capsys.readouterr()
    assert rc == 0 and len(replies) == 2 and "history cleared" in err
    assert out == "".join(reply + "\n" for reply in replies)  # each reply streamed, then a newline


def test_chat_exit_command(ckpt_tok, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/exit\nnever answered\n"))
    monkeypatch.setattr(cli.ChatSession, "turn", lambda self, text: print(text))
    assert cli.main(["chat", "--model", str(ckpt_tok), *FAST]) == 0
    assert capsys.readouterr().out == "hello\n"


def test_chat_session_keeps_history(ckpt_tok, capsys):
    llm = cli.LLM(str(ckpt_tok), load_progress=False, kv_cache_memory_bytes=1 << 24)
    session = cli.ChatSession(llm, cli.SamplingParams(max_tokens=3, temperature=0), None, thinking=True)
    first = session.turn("hi")
    session.turn("again")
    assert [m["role"] for m in session.history] == ["user", "assistant"] * 2
    assert session.history[1]["content"] == first and capsys.readouterr().out.startswith(first)


def test_missing_model_without_bundle(no_bundled_model, capsys):
    assert cli.main(["generate", "--prompt-token-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no model given") and "--model" in err and "Traceback" not in err


def test_bundled_model_notice(ckpt, monkeypatch, capsys):
    monkeypatch.setattr("deepinfer.llm.default_model_path", lambda: ckpt)
    assert cli.main(["generate", "--prompt-token-ids", "0,5", "--max-tokens", "2", *FAST]) == 0
    assert "bundled default model" in capsys.readouterr().out.splitlines()[0]
    assert cli.main(["generate", "--prompt-token-ids", "0,5", "--max-tokens", "2", "--json", *FAST]) == 0
    out, err = capsys.readouterr()
    assert len(json_lines(out)) == 1 and "bundled default model" in err


@pytest.mark.parametrize("argv, message", [
    (["--model", "no/such/dir", "--prompt-token-ids", "1"], "does not exist"),
    (["--max-tokens", "0", "--prompt-token-ids", "1"], "max_tokens must be >= 1, got 0"),
    (["hello", "--prompt-token-ids", "1"], "exactly one"),
])
def test_errors_exit_2(argv, message, capsys):
    assert cli.main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_text_prompt_without_tokenizer(ckpt, capsys):
    assert cli.main(["generate", "--model", str(ckpt), "hello", *FAST]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_bad_engine_option_exits_2(ckpt, capsys):
    assert cli.main(["generate", "--model", str(ckpt), "--prompt-token-ids", "1", "--dtype", "int3",
                     *FAST]) == 2
    assert "dtype must be" in capsys.readouterr().err


def test_python_m_entry_point(ckpt):
    cmd = [sys.executable, "-m", "deepinfer", "generate", "--model", str(ckpt), "--prompt-token-ids", "0,5,6",
           "--max-tokens", "3", "--json", *FAST]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(json_lines(proc.stdout)[0]["token_ids"]) == 3
    bad_cmd = [*cmd[:5], "no/such/dir", "--prompt-token-ids", "1"]
    bad = subprocess.run(bad_cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and not bad.stdout


# --- what a fresh install (the README's first command, no extras) must be able to run ---------------
_EXTRAS_ONLY = ("matplotlib", "transformers", "openai", "hypothesis", "accelerate", "schemathesis")


def test_generate_and_parsers_need_no_extra(ckpt):
    """`deepinfer generate` and every subcommand's parser run with the test/bench extras unimportable,
    and generate never loads the benchmark client (httpx)."""
    script = (f"import sys\nsys.modules.update(dict.fromkeys({_EXTRAS_ONLY!r}))\n"
              "from deepinfer import cli\n"
              f"code = cli.main(['generate', '--model', {str(ckpt)!r}, '--prompt-token-ids', '0,5', '--max-tokens',"
              f" '2', '--json', *{FAST!r}])\n"
              "assert code == 0 and 'httpx' not in sys.modules, (code, sorted(sys.modules))\n"
              "for argv in (['serve'], ['bench', 'serve', '--help']):\n"
              "    try:\n        cli.build_parser(argv).parse_args(argv)\n"
              "    except SystemExit as e:\n        assert e.code == 0, argv\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(json_lines(proc.stdout.split("usage:")[0])[0]["token_ids"]) == 2


def _module_level_imports(path) -> set[str]:
    """Top-level package names imported at module level (imports inside functions are lazy on purpose)."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_module_level_imports_are_declared_dependencies():
    """Every third-party package imported at module level by deepinfer/ is a runtime dependency in
    pyproject.toml (or one of theirs), so the README's plain install can import every module."""
    import importlib.metadata as md
    import re
    from pathlib import Path

    def name(requirement: str) -> str:
        return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()

    root = Path(cli.__file__).parent
    declared = {name(r) for r in md.requires("deepinfer") if "extra" not in r}  # as installed from pyproject
    allowed = declared | {name(r) for d in declared for r in (md.requires(d) or []) if "extra" not in r}
    dists = md.packages_distributions()
    undeclared = {}
    for path in root.rglob("*.py"):
        for name in _module_level_imports(path) - set(sys.stdlib_module_names) - {"deepinfer"}:
            found = [d.lower() for d in dists.get(name, [name])]
            if not any(d.replace("_", "-") in {a.replace("_", "-") for a in allowed} for d in found):
                undeclared[str(path.relative_to(root))] = name
    assert not undeclared, undeclared
