import json

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from deepinfer.tokenizer import Tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SENTENCES = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer",
             "stop strings can span several tokens", "café au lait et crème brûlée"] * 20
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% if thinking %}<think>{% else %}</think>{% endif %}"
    "{% endif %}"
)


def write_tokenizer_dir(path, config=None):
    """A byte-level BPE tokenizer (small vocab: multi-byte chars span several tokens) saved HF-style."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    tok.save(str(path / "tokenizer.json"))
    default = {"bos_token": {"content": BOS}, "eos_token": EOS, "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(default if config is None else config))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_special_tokens_and_vocab(tok):
    assert tok.bos_token == BOS and tok.eos_token == EOS
    assert tok.bos_token_id == tok.token_to_id(BOS) == 0 and tok.eos_token_id == 1
    assert tok.vocab_size == 320 and tok.add_bos_token
    assert {tok.bos_token_id, tok.eos_token_id} <= tok.special_token_ids


def test_encode_adds_bos_once(tok):
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode("hello world", add_special_tokens=False) == ids[1:]


def test_decode_round_trip_and_special_tokens(tok):
    text = "héllo 😀 world"
    ids = tok.encode(text) + [tok.eos_token_id]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS + text + EOS


def test_chat_template_with_kwargs(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    text = tok.apply_chat_template(messages, thinking=True)
    assert text == f"{BOS}{USER}hi{ASSISTANT}yo{EOS}{USER}again{ASSISTANT}<think>"
    assert tok.apply_chat_template(messages, thinking=False).endswith("</think>")
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith(f"{USER}again")
    ids = tok.apply_chat_template(messages, tokenize=True, thinking=True)
    assert ids.count(tok.bos_token_id) == 1 and tok.decode(ids, skip_special_tokens=False) == text


def test_template_raise_exception(tok):
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_helpers_and_list_form(tmp_path):
    template = ("{{ messages | tojson }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=True) }}|"
                "{{ strftime_now('%Y') | length }}")
    config = {"chat_template": [{"name": "tool_use", "template": "nope"},
                                {"name": "default", "template": template}], "add_bos_token": False}
    tok = Tokenizer.from_dir(write_tokenizer_dir(tmp_path, config))
    out = tok.apply_chat_template([{"role": "user", "content": "é<b>"}])
    assert out == '[{"role": "user", "content": "é<b>"}]|{"a": 2, "b": 1}|4'
    assert tok.bos_token_id is None and tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


def test_chat_template_jinja_file(tmp_path):
    write_tokenizer_dir(tmp_path, {"eos_token": EOS})
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_missing_chat_template(tmp_path):
    tok = Tokenizer.from_dir(write_tokenizer_dir(tmp_path, {}))
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_or_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_config(tmp_path):
    write_tokenizer_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)
