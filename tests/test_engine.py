"""Engine behaviour on a tiny random V4 checkpoint: bad input, isolation, seeds, n > 1, stop strings,
logprobs, aborts. Parity with transformers lives in test_parity.py."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from tiny_models import make_reference, reference_logits, save_reference, write_tokenizer

from deepinfer import LLM, SamplingParams
from deepinfer.request import RequestStatus


@pytest.fixture(scope="module")
def ref():
    return make_reference("v4", seed=3)


@pytest.fixture(scope="module")
def ckpt(ref, tmp_path_factory):
    path = save_reference(ref, tmp_path_factory.mktemp("v4") / "model")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, block_size=16, max_num_batched_tokens=32, load_progress=False,
               kv_cache_memory_bytes=32 * 2**20)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drain(engine) -> dict[str, list[int]]:
    finished = {}
    while engine.has_unfinished:
        for req in engine.step():
            if req.is_finished:
                finished[req.request_id] = list(req.output_token_ids)
    return finished


# --- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("make_bad, message", [
    (lambda e: (_prompt(e.max_model_len, 1), SamplingParams()), "context"),
    (lambda e: ([3, 4, 512], SamplingParams()), "outside the vocabulary"),
    (lambda e: ([3, -1], SamplingParams()), "outside the vocabulary"),
    (lambda e: ([], SamplingParams()), "empty"),
])
def test_bad_request_fails_alone_and_others_finish(llm, make_bad, message):
    engine = llm.engine
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("good-a", _prompt(9, 2), good)
    prompt, params = make_bad(engine)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    engine.add_request("good-b", _prompt(20, 3), good)
    done = _drain(engine)
    assert sorted(done) == ["good-a", "good-b"] and all(len(t) == 6 for t in done.values())
    assert engine.kv.num_free_blocks == engine.layout.num_blocks


@pytest.mark.parametrize("options, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temprature": 0.5}, "unknown"),
])
def test_bad_sampling_options_raise_value_error(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_generate_validates_every_prompt_before_running_any(llm):
    before = llm.engine.kv.num_free_blocks
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([_prompt(5, 1), [9999]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.engine.has_unfinished and llm.engine.kv.num_free_blocks == before


def test_unknown_engine_option_is_a_clear_error(ckpt):
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(ckpt, max_num_seq=3)


# --- aborts ------------------------------------------------------------------------------------------
def test_abort_frees_blocks_and_others_continue(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("keep", _prompt(40, 5), params)
    engine.add_request("drop", _prompt(40, 6), params)
    for _ in range(3):
        engine.step()
    engine.abort("drop")
    done = _drain(engine)
    assert list(done) == ["keep"] and len(done["keep"]) == 30
    assert engine.kv.num_free_blocks == engine.layout.num_blocks
    assert engine.kv.num_free_slots == engine.layout.num_state_slots


# --- seeds and sampling ------------------------------------------------------------------------------
def test_seeded_sampling_is_independent_of_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([_prompt(12, 7)], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=99, max_tokens=10, ignore_eos=True)]
    outs = llm.generate([_prompt(30, 8), _prompt(12, 7), _prompt(3, 9), _prompt(50, 10)],
                        [others[0], seeded, others[1], others[2]], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone


def test_n_samples_share_the_prompt_cache_and_match_separate_runs(llm):
    prompt = _prompt(37, 11)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert llm.engine.scheduler.requests == {}
    # sample i of a seeded n-request equals a single request seeded seed + i (forked cache is exact)
    for i, sample in enumerate(out.outputs):
        single = SamplingParams(temperature=1.0, seed=5 + i, max_tokens=12, ignore_eos=True)
        assert llm.generate([prompt], single, use_tqdm=False)[0].outputs[0].token_ids == sample.token_ids


# --- stop strings, stop ids, logprobs ----------------------------------------------------------------
def test_stop_string_is_excluded_and_ends_the_request(llm):
    prompt = _prompt(10, 12)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert llm.engine.kv.num_free_blocks == llm.engine.layout.num_blocks


def test_stop_token_id_and_length_finish_reasons(llm):
    prompt = _prompt(10, 13)
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 10
    target = greedy.token_ids[4]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    first = greedy.token_ids.index(target)
    assert out.token_ids == greedy.token_ids[: first + 1] and out.stop_reason == target


def test_logprobs_and_prompt_logprobs_match_the_reference(llm, ref):
    prompt = _prompt(21, 14)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    sample = out.outputs[0]
    ref_lp = torch.log_softmax(reference_logits(ref, prompt + sample.token_ids), dim=-1)
    for i, (tok, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
        pos = len(prompt) - 1 + i
        assert entry[tok].rank == 1 and abs(entry[tok].logprob - ref_lp[pos, tok].item()) < 1e-4
        assert len(entry) == 3  # greedy token is the top-1, so it coincides with one of the top 3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos][prompt[pos]]
        assert abs(entry.logprob - ref_lp[pos - 1, prompt[pos]].item()) < 1e-4
        assert entry.rank == 1 + int((ref_lp[pos - 1] > ref_lp[pos - 1, prompt[pos]]).sum())
    assert math.isclose(sample.cumulative_logprob, sum(e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs)),
                        rel_tol=1e-6)


def test_min_tokens_suppresses_eos(llm):
    eos = llm.engine.model_config.eos_token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    out = llm.generate([_prompt(6, 15)], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and eos not in out.token_ids


def test_text_prompts_and_chat(llm):
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt == "hello world" and out.prompt_token_ids[0] == llm.get_tokenizer().bos_token_id
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, ignore_eos=True),
                    use_tqdm=False)[0]
    assert chat.prompt.endswith("</think>") and len(chat.outputs[0].token_ids) == 3


def test_finish_status_values_are_openai_finish_reasons():
    assert RequestStatus.FINISHED_STOPPED.value == "stop" and RequestStatus.FINISHED_LENGTH.value == "length"


def test_copied_checkpoint_without_tokenizer_takes_token_ids(ckpt, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    llm = LLM(bare, load_progress=False, kv_cache_memory_bytes=8 * 2**20)
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text", use_tqdm=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 2
