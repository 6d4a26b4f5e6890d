import json

import jinja2
import pytest

from deepinfer.tokenizer import Tokenizer
from deepinfer.training import corpus
from deepinfer.training.tokenizer_train import (
    ASSISTANT,
    BOS,
    END_THINK,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    THINK,
    TOOL_MARKERS,
    USER,
    train_bpe,
    train_tokenizer,
)

MAX_BYTES, VOCAB = 300_000, 1024
CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP = TOOL_MARKERS[:5]
OUT_BEGIN, OUT_END = TOOL_MARKERS[7:]


@pytest.fixture(scope="module")
def files():
    return corpus.list_corpus_files()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB, max_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


# ------------------------------------------------------------------------------------------ corpus


def make_tree(root, names):
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")


def test_walk_filters_a_synthetic_stdlib(tmp_path):
    kept = ["os.py", "json/decoder.py", "idlelib/editor.py", "lib2to3/pgen2/parse.py", "zz.py"]
    dropped = ["site-packages/pkg/mod.py", "dist-packages/m.py", "test/test_os.py", "json/tests/t.py",
               "idlelib/idle_test/htest.py", "lib2to3/tests/data/bom.py", "ctypes/test/x.py",
               "tkinter/test_ttk/y.py", "pkg_test_data/z.py", "json/__pycache__/d.py", "README.txt",
               "idlelib/NEWS.txt", "test_loose.py", "_sysconfigdata__linux.py", "config-3.11/python-config.py"]
    make_tree(tmp_path, kept + dropped)
    names = [corpus.relative_name(f, tmp_path) for f in corpus.list_corpus_files(tmp_path)]
    assert names == sorted(kept)


def test_real_corpus_is_sorted_stdlib_py_without_tests(files):
    names = [corpus.relative_name(f) for f in files]
    assert names == sorted(names) and len(names) > 300
    assert {"os.py", "json/__init__.py"} <= set(names)
    assert all(name.endswith(".py") for name in names)
    for name in names:
        parts = name.split("/")
        assert not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(parts), name
        assert not any(p.startswith("test") or "_test" in p for p in parts), name


def test_split_is_stable_disjoint_and_in_range(files):
    train, heldout = corpus.split_files(files)
    assert not set(train) & set(heldout) and sorted(train + heldout) == sorted(files)
    assert corpus.split_files(files[::-1]) == (train[::-1], heldout[::-1])  # membership ignores order
    assert 0.02 <= len(heldout) / len(files) <= 0.08
    # Pinned: the split is a function of the name only, identical on every machine.
    assert [i for i in range(130) if corpus.is_heldout(f"mod{i}.py")] == [12, 56, 68, 102, 106, 108, 127, 128, 129]


def test_stats_and_describe_agree(files):
    stats = corpus.corpus_stats()
    assert stats["total"]["files"] == len(files) == stats["train"]["files"] + stats["heldout"]["files"]
    assert stats["total"]["bytes"] == sum(f.stat().st_size for f in files)
    text = corpus.describe()
    assert f"{stats['total']['files']} files" in text and f"{stats['heldout']['bytes']:,} bytes" in text


def test_iter_documents_caps_bytes():
    docs = list(corpus.iter_documents("train", max_bytes=MAX_BYTES))
    assert MAX_BYTES - 3 <= sum(len(d.encode("utf-8")) for d in docs) <= MAX_BYTES  # cut at a char boundary
    assert docs[0] == corpus.read_text(corpus.split_paths("train")[0])
    with pytest.raises(ValueError, match="unknown split"):
        list(corpus.iter_documents("dev"))


# --------------------------------------------------------------------------------------- tokenizer


def test_special_tokens_have_fixed_ids_and_flags(tok):
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(16))
    assert tok.vocab_size == VOCAB and tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.special_token_ids == {0, 1, 2, 3, 4}  # BOS, EOS, pad, User, Assistant; think/tool stay visible


def test_saved_config(tok_dir):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (BOS, EOS, PAD)
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    assert config["model_max_length"] > 0 and "<｜User｜>" in config["chat_template"]


def snippets(files):
    """A few 3000-char stdlib excerpts (train and held-out), plus every non-ASCII line of the corpus."""
    train, heldout = corpus.split_files(files)
    texts = [corpus.read_text(f)[:3000] for f in train[:3] + heldout[:2]]
    lines = [ln for f in files for ln in corpus.read_text(f).splitlines(True) if not ln.isascii()]
    assert lines, "expected some non-ASCII text in the stdlib"
    return [*texts, "".join(lines), "tab\tcrlf\r\nnul\x00 é ∑ 中文 😀\n"]


def test_round_trip_is_exact(tok, files):
    for text in snippets(files):
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert tok.decode(ids) == text


def test_special_tokens_survive_round_trip(tok):
    visible = f"{THINK}why{END_THINK}ok{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{}}{CALL_END}{CALLS_END}"
    text = f"{BOS}{USER}hi{ASSISTANT}{visible}{EOS}"
    ids = tok.encode(text, add_special_tokens=False)
    assert [i for i in ids if i < 16] == [0, 3, 4, 5, 6, 7, 9, 11, 10, 8, 1]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == f"hi{visible}"


def test_training_is_deterministic():
    docs = list(corpus.iter_documents("train", max_bytes=50_000))
    assert train_bpe(docs, 512).to_str() == train_bpe(docs, 512).to_str()


# ----------------------------------------------------------------------------------- chat template


def chat(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, **kwargs)


def test_single_turn_thinking_switch(tok):
    messages = [{"role": "user", "content": "hi"}]
    assert chat(tok, messages, thinking=True) == f"{BOS}{USER}hi{ASSISTANT}{THINK}"
    assert chat(tok, messages, thinking=False) == f"{BOS}{USER}hi{ASSISTANT}{END_THINK}"
    assert chat(tok, messages) == f"{BOS}{USER}hi{ASSISTANT}{END_THINK}"  # non-thinking by default
    assert chat(tok, messages, add_generation_prompt=False) == f"{BOS}{USER}hi"


def test_multi_turn_drops_previous_reasoning(tok):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"},
                {"role": "user", "content": "and 3+3?"}]
    history = f"{BOS}{USER}2+2?{ASSISTANT}{END_THINK}4{EOS}{USER}and 3+3?{ASSISTANT}"
    assert chat(tok, messages, thinking=True) == history + THINK
    assert chat(tok, messages, thinking=False) == history + END_THINK


def test_final_reply_keeps_its_reasoning(tok):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "add</think>4"}]
    assert chat(tok, messages, add_generation_prompt=False) == f"{BOS}{USER}2+2?{ASSISTANT}{THINK}add{END_THINK}4{EOS}"


def test_system_prompts_lead(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use Python."},
                {"role": "user", "content": "hi"}]
    assert chat(tok, messages) == f"{BOS}Be brief.\n\nUse Python.{USER}hi{ASSISTANT}{END_THINK}"


def test_tool_call_and_output(tok):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]
    expected = (f"{BOS}{USER}Weather?{ASSISTANT}{END_THINK}{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}"
                f'{{"city": "Paris"}}{CALL_END}{CALLS_END}{EOS}{OUT_BEGIN}sunny{OUT_END}Sunny.{EOS}')
    assert chat(tok, messages) == expected  # no generation prompt after the assistant's turn


def test_rendered_chat_tokenizes_to_single_marker_tokens(tok):
    ids = chat(tok, [{"role": "user", "content": "hi"}], thinking=True, tokenize=True)
    assert ids[:2] == [0, 3] and ids[-2:] == [4, 5] and ids.count(0) == 1


def test_unknown_role_is_rejected(tok):
    with pytest.raises(jinja2.exceptions.TemplateError, match="unsupported role: robot"):
        chat(tok, [{"role": "robot", "content": "beep"}])
