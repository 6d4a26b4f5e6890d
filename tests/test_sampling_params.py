import copy
import dataclasses

import pytest

from deepinfer.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output


def test_unknown_option_names_it_and_lists_valid_ones():
    with pytest.raises(ValueError, match="best_of_n") as info:
        SamplingParams(temperature=0.5, best_of_n=3)
    assert "temperature" in str(info.value) and "max_tokens" in str(info.value)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5},
    {"min_p": -0.1}, {"min_p": 1.1}, {"n": 0}, {"top_k": -2}, {"repetition_penalty": 0.0},
    {"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"min_tokens": 20, "max_tokens": 10},
    {"min_tokens": -1}, {"logprobs": -1}, {"prompt_logprobs": -2}, {"stop": [""]}, {"stop": [3]},
    {"stop_token_ids": [-1]}, {"temperature": "hot"}, {"top_k": 2.5}, {"seed": 1.5},
    {"stop": "x", "detokenize": False}, {"ignore_eos": "yes"}, {"temperature": float("nan")},
])
def test_invalid_values_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_and_stop_token_ids_normalised_to_lists():
    p = SamplingParams(stop="###", stop_token_ids=7)
    assert p.stop == ["###"] and p.stop_token_ids == [7]
    q = SamplingParams(stop=("a", " b "), stop_token_ids=(1, 2))
    assert q.stop == ["a", " b "] and q.stop_token_ids == [1, 2]


def test_numbers_accepted_as_ints_and_none_max_tokens():
    p = SamplingParams(temperature=0, top_p=1, max_tokens=None, min_tokens=5)
    assert p.temperature == 0.0 and isinstance(p.temperature, float) and p.max_tokens is None


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=-1).is_greedy
    assert not SamplingParams().is_greedy


def test_stop_buffer_length():
    assert SamplingParams().stop_buffer_length == 0
    assert SamplingParams(stop=["ab", "wxyz"]).stop_buffer_length == 3
    assert SamplingParams(stop=["wxyz"], include_stop_str_in_output=True).stop_buffer_length == 0


def test_copy_clone_and_replace():
    p = SamplingParams(stop=["x"], seed=3, temperature=0.3)
    deep = copy.deepcopy(p)
    assert deep == p and deep.stop is not p.stop
    clone = p.clone(temperature=0.9)
    assert clone.temperature == 0.9 and clone.seed == 3 and clone.stop == ["x"] and p.temperature == 0.3
    assert dataclasses.replace(p, top_k=5).top_k == 5
    with pytest.raises(ValueError):
        p.clone(top_p=0)
    with pytest.raises(ValueError, match="bogus"):
        p.clone(bogus=1)
