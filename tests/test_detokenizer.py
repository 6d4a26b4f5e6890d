import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import Tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SENTENCES = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer"] * 20


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """Byte-level BPE with a tiny vocab: 'é' and '😀' are split into several byte tokens."""
    path = tmp_path_factory.mktemp("tok")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return Tokenizer.from_dir(path)


def stream(tok, text, params, prompt="hello", chunk=1):
    """Feeds `text`'s tokens `chunk` at a time; returns (detokenizer, stop, streamed deltas)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), params)
    ids = tok.encode(text, add_special_tokens=False)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = detok.append(ids[i:i + chunk])
        deltas.append(detok.get_delta(finished=False))
        assert "\ufffd" not in detok.output_text
        if stop:
            break
    deltas.append(detok.get_delta(finished=True))
    return detok, stop, deltas


def spans_tokens(tok, text, needle):
    """True when no single token of `text` decodes to something containing `needle`."""
    ids = tok.encode(text, add_special_tokens=False)
    return all(needle not in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", ["the quick brown fox", "café, crème 😀 brûlée é😀é", "😀😀 ok"])
def test_multibyte_text_decoded_incrementally(tok, text):
    assert len(tok.encode("😀", add_special_tokens=False)) > 1  # really split across byte tokens
    detok, stop, deltas = stream(tok, text, SamplingParams())
    assert stop is None and detok.output_text == text and "".join(deltas) == text


def test_stop_string_spanning_tokens_is_excluded(tok):
    text = "the quick brown fox jumps"
    assert spans_tokens(tok, text, "brown fox")
    detok, stop, deltas = stream(tok, text, SamplingParams(stop=["lazy", "brown fox"]))
    assert stop == "brown fox" and detok.stopped
    assert detok.output_text == "the quick " and "".join(deltas) == "the quick "


def test_include_stop_str_in_output(tok):
    params = SamplingParams(stop=["brown fox"], include_stop_str_in_output=True)
    detok, stop, deltas = stream(tok, "the quick brown fox jumps", params)
    assert stop == "brown fox" and detok.output_text == "the quick brown fox"
    assert "".join(deltas) == "the quick brown fox"


def test_streaming_never_emits_partial_stop_string(tok):
    # "brown fog" starts like the stop string: its prefix must be held back, then released.
    params = SamplingParams(stop=["brown fox"])
    detok, stop, deltas = stream(tok, "a brown fog, a brown fox", params)
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert detok.output_text.startswith(emitted)
    assert stop == "brown fox" and emitted == detok.output_text == "a brown fog, a "
    held = stream(tok, "a brown fo", params)[2]
    # len("brown fox") - 1 = 8 chars are held back while streaming and released at finish.
    assert "".join(held[:-1]) == "a " and held[-1] == "brown fo"


def test_stop_string_inside_multibyte_characters(tok):
    text = "hello 😀 world"
    detok, stop, _ = stream(tok, text, SamplingParams(stop=["😀"]))
    assert stop == "😀" and detok.output_text == "hello "


def test_earliest_stop_wins_and_later_tokens_ignored(tok):
    text = "the quick brown fox jumps"
    detok, stop, _ = stream(tok, text, SamplingParams(stop=["fox", "quick"]), chunk=100)
    assert stop == "quick" and detok.output_text == "the "
    assert len(detok.output_token_ids) < len(tok.encode(text, add_special_tokens=False))
    assert detok.append(tok.encode(" more", add_special_tokens=False)) == "quick"
    assert detok.output_text == "the "


def test_min_tokens_defers_stop_strings(tok):
    text = "the quick brown fox"
    ids = tok.encode(text, add_special_tokens=False)
    first = tok.encode("the", add_special_tokens=False)
    params = SamplingParams(stop=["the", "fox"], min_tokens=len(first), max_tokens=50)
    detok, stop, _ = stream(tok, text, params)
    assert len(ids) > len(first) and stop == "fox" and detok.output_text == "the quick brown "


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    skipped = IncrementalDetokenizer(tok, [tok.bos_token_id], SamplingParams())
    skipped.append(ids)
    kept = IncrementalDetokenizer(tok, [tok.bos_token_id], SamplingParams(skip_special_tokens=False))
    kept.append(ids)
    assert skipped.output_text == "hi" and kept.output_text == "hi" + EOS


def test_prompt_context_does_not_leak_into_output(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("the quick brown"), SamplingParams())
    detok.append(tok.encode(" fox", add_special_tokens=False))
    assert detok.output_text == " fox" and detok.get_delta() == " fox" and detok.get_delta() == ""


def test_detokenize_false_only_tracks_ids(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(detokenize=False))
    assert detok.append([5, 6, 7]) is None
    assert detok.output_token_ids == [5, 6, 7] and detok.output_text == ""


class PieceDecoder:
    """Each id is a whole text piece: lets one token complete several stop strings at once."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_earliest_of_several_matches_in_one_token():
    detok = IncrementalDetokenizer(PieceDecoder(["ab", "cxyzw"]), [], SamplingParams(stop=["zw", "xy", "q"]))
    assert detok.append([0]) is None
    assert detok.append([1]) == "xy" and detok.output_text == "abc"
