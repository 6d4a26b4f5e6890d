import pytest
import torch

from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.sampler import (
    Sampler,
    SamplingBatch,
    compute_prompt_logprobs,
    make_generator,
    plain_greedy,
)

EOS = 2


def build(params, vocab_size, prompt_ids=None, output_ids=None, generators=None, eos=(EOS,)):
    n = len(params)
    return SamplingBatch.build(
        params, prompt_ids or [[] for _ in range(n)], output_ids or [[] for _ in range(n)],
        generators or [None] * n, eos, vocab_size, "cpu")


def sample(logits, params, **kwargs):
    return Sampler()(logits, build(params, logits.shape[-1], **kwargs))


def test_greedy_is_argmax_and_input_untouched():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0)] * 6)
    assert torch.equal(out.sampled, logits.argmax(-1)) and out.logprobs is None
    assert torch.equal(logits, before)


@pytest.mark.parametrize("params, outputs, plain", [
    (SamplingParams(temperature=0), 0, True),
    (SamplingParams(temperature=0, min_tokens=3), 3, True),  # min_tokens met: nothing is suppressed
    (SamplingParams(temperature=0, min_tokens=3), 2, False),
    (SamplingParams(temperature=0, logprobs=0), 0, False),
    (SamplingParams(temperature=0, repetition_penalty=1.1), 0, False),
    (SamplingParams(temperature=0, frequency_penalty=0.5), 0, False),
    (SamplingParams(temperature=0, presence_penalty=0.5), 0, False),
    (SamplingParams(temperature=0.7), 0, False),
])
def test_plain_greedy_rows_are_those_the_sampler_only_argmaxes(params, outputs, plain):
    """The runner skips the SamplingBatch for plain_greedy rows and takes the argmax: what the sampler picks."""
    assert plain_greedy(params, outputs) is plain
    logits = torch.zeros(1, 8)
    logits[0, EOS], logits[0, 5] = 3.0, 2.9
    out = sample(logits, [params], prompt_ids=[[EOS]], output_ids=[[EOS] * outputs],
                 generators=[make_generator(0)])
    if plain:
        assert out.sampled.tolist() == [EOS]


def test_top_k_one_is_greedy_even_with_temperature():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=1)] * 4)
    assert torch.equal(out.sampled, logits.argmax(-1))


def test_frequency_and_presence_penalties_change_argmax():
    logits = torch.tensor([[3.0, 2.5, 0.0, 1.0]] * 3)
    params = [SamplingParams(temperature=0, frequency_penalty=0.3),  # 3 - 3*0.3 = 2.1 < 2.5
              SamplingParams(temperature=0, presence_penalty=0.6),  # 3 - 0.6 = 2.4 < 2.5
              SamplingParams(temperature=0, frequency_penalty=0.1)]  # 3 - 0.3 = 2.7 > 2.5
    out = sample(logits, params, output_ids=[[0, 0, 0], [0], [0, 0, 0]])
    assert out.sampled.tolist() == [1, 1, 0]


def test_repetition_penalty_uses_prompt_and_output_and_sign():
    logits = torch.tensor([[3.0, 2.0, -1.0, -1.5]] * 3)
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)] * 3
    # row 0: token 0 in prompt -> 1.5 < 2.0; row 1: token 0 in output -> same; row 2: nothing seen.
    out = sample(logits, params, prompt_ids=[[0], [], []], output_ids=[[], [0], []])
    assert out.sampled.tolist() == [1, 1, 0]
    # Negative logits are multiplied: with 0, 1 masked, the seen token 2 (-1 -> -2) loses to 3 (-1.5).
    logits = torch.tensor([[-float("inf"), -float("inf"), -1.0, -1.5]])
    out = sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)], prompt_ids=[[2]])
    assert out.sampled.tolist() == [3]


def test_min_tokens_suppresses_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 2.0]] * 4)  # EOS (2) best, then stop token 3
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3], ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=2)]
    out = sample(logits, params, output_ids=[[1], [1, 1], [1], [4]])
    # row 0: still short -> neither EOS nor 3; row 1: reached -> EOS; row 2: ignore_eos keeps EOS
    # selectable (it is no stop) while 3 stays banned; row 3: EOS banned, 3 is ordinary.
    assert out.sampled.tolist() == [4, 2, 2, 3]


def test_logprobs_are_raw_with_ranks():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=gen)
    params = [SamplingParams(temperature=0.7, logprobs=3, frequency_penalty=1.0),
              SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=1.3),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0, logprobs=0)]
    out = sample(logits, params, output_ids=[[1, 2, 3]] * 5)
    ref = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == (5, 4) and lp.logprobs.shape == (5, 4)
    assert torch.equal(lp.token_ids[:, 0], out.sampled)
    torch.testing.assert_close(lp.logprobs, ref.gather(1, lp.token_ids))
    top_values, top_ids = ref.topk(3, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(lp.logprobs[:, 1:], top_values)
    expected_ranks = (ref > ref.gather(1, out.sampled[:, None])).sum(-1) + 1
    assert torch.equal(lp.ranks, expected_ranks)


def test_prompt_logprobs():
    logits = torch.randn(7, 20, generator=torch.Generator().manual_seed(4))
    targets = torch.tensor([3, 0, 19, 5, 5, 1, 2])
    lp = compute_prompt_logprobs(logits, targets, 2)
    ref = torch.log_softmax(logits, dim=-1)
    assert lp.token_ids[:, 0].tolist() == targets.tolist()
    torch.testing.assert_close(lp.logprobs[:, 0], ref[torch.arange(7), targets])
    assert torch.equal(lp.token_ids[:, 1:], ref.topk(2, dim=-1).indices)
    assert torch.equal(lp.ranks, (ref > ref[torch.arange(7), targets][:, None]).sum(-1) + 1)
    assert compute_prompt_logprobs(logits, targets, 0).token_ids.shape == (7, 1)


# ------------------------------------------------------------------------------ seeded reproducibility


def _run_seeded(step_logits, layout, seeds):
    """Samples every step with a fresh batch of `layout` rows; returns the tokens of row 'target'."""
    generators = {name: make_generator(seed) for name, seed in seeds.items()}
    params = {"target": SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
              "seeded": SamplingParams(temperature=1.2, seed=7),
              "random": SamplingParams(temperature=1.0, top_k=10),
              "greedy": SamplingParams(temperature=0)}
    tokens = []
    for logits in step_logits:
        rows = torch.stack([logits[name] for name in layout])
        batch = build([params[name] for name in layout], rows.shape[-1],
                      generators=[generators.get(name) for name in layout])
        out = Sampler()(rows, batch)
        tokens.append(int(out.sampled[layout.index("target")]))
    return tokens


def test_seeded_request_independent_of_batch_composition():
    gen = torch.Generator().manual_seed(5)
    names = ("target", "seeded", "random", "greedy")
    step_logits = [{n: torch.randn(64, generator=gen) for n in names} for _ in range(40)]
    seeds = {"target": 1234, "seeded": 7}
    alone = _run_seeded(step_logits, ["target"], seeds)
    torch.manual_seed(99)  # the unseeded rows' draws must not matter
    mixed = _run_seeded(step_logits, ["random", "greedy", "target", "seeded"], seeds)
    reordered = _run_seeded(step_logits, ["seeded", "target", "random"], seeds)
    assert alone == mixed == reordered
    assert len(set(alone)) > 5  # it really sampled, not a degenerate argmax


# ------------------------------------------------------------------------------ statistical checks

PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.04, 0.01])
NUM_SAMPLES = 20000


def _expected(keep):
    p = PROBS * torch.tensor(keep, dtype=torch.float32)
    return p / p.sum()


def _assert_matches(tokens, expected):
    """Each token's count is Binomial(n, p). Allowing 5 standard deviations per token, the chance of a
    false failure is < 6e-7 per token (normal tail), so < 1e-4 over every check in this file; a wrong
    filter shifts a frequency by >= 0.01, i.e. > 7 standard deviations at n = 20000. Tokens with
    expected probability 0 must never appear at all."""
    n = tokens.numel()
    freq = torch.bincount(tokens, minlength=expected.numel()).double() / n
    expected = expected.double()
    assert torch.all(freq[expected == 0] == 0), freq
    bound = 5 * torch.sqrt(expected * (1 - expected) / n) + 1e-12
    assert torch.all((freq - expected).abs() <= bound), (freq, expected)


CASES = {  # name: (params, renormalised distribution that must be sampled)
    "plain": (SamplingParams(temperature=1.0), _expected([1] * 8)),
    "top_k": (SamplingParams(temperature=1.0, top_k=3), _expected([1, 1, 1, 0, 0, 0, 0, 0])),
    # mass before token 3 is 0.68 < 0.7 (kept); before token 4 it is 0.80 >= 0.7 (dropped)
    "top_p": (SamplingParams(temperature=1.0, top_p=0.7), _expected([1, 1, 1, 1, 0, 0, 0, 0])),
    # threshold 0.25 * 0.30 = 0.075: tokens with p >= 0.075 survive
    "min_p": (SamplingParams(temperature=1.0, min_p=0.25), _expected([1, 1, 1, 1, 1, 0, 0, 0])),
    # top-p acts after top-k renormalises: top-4 mass is 0.80, so tokens 0, 1 carry 0.375 + 0.275 =
    # 0.65 >= 0.6 and token 2 is dropped (on the unrenormalised distribution it would be kept).
    "top_k_top_p": (SamplingParams(temperature=1.0, top_k=4, top_p=0.6), _expected([1, 1, 0, 0, 0, 0, 0, 0])),
    # temperature 0.5 squares the probabilities
    "temperature": (SamplingParams(temperature=0.5), PROBS**2 / (PROBS**2).sum()),
    "tiny_top_p": (SamplingParams(temperature=1.0, top_p=1e-6), _expected([1, 0, 0, 0, 0, 0, 0, 0])),
}


def test_filters_sample_the_renormalised_distribution_per_row():
    torch.manual_seed(0)
    names = list(CASES)
    # Interleave all settings in one batch so per-row handling of mixed settings is exercised.
    row_names = [names[i % len(names)] for i in range(NUM_SAMPLES * len(names))]
    logits = PROBS.log().expand(len(row_names), -1).contiguous()
    out = sample(logits, [CASES[name][0] for name in row_names])
    for index, name in enumerate(names):
        _assert_matches(out.sampled[index::len(names)], CASES[name][1])


def test_seeded_rows_sample_the_right_distribution():
    # One seeded generator drawn repeatedly must still follow the filtered distribution.
    params, expected = CASES["top_k_top_p"]
    batch = build([params], PROBS.numel(), generators=[make_generator(11)])
    tokens = torch.cat([Sampler()(PROBS.log()[None], batch).sampled for _ in range(4000)])
    freq = torch.bincount(tokens, minlength=8).double() / tokens.numel()
    assert torch.all(freq[expected == 0] == 0)
    assert torch.all((freq - expected).abs() <= 5 * torch.sqrt(expected * (1 - expected) / 4000) + 1e-12)


@pytest.mark.parametrize("vocab", [1, 3])
def test_top_p_and_top_k_keep_at_least_one_token(vocab):
    logits = torch.zeros(2, vocab)
    out = sample(logits, [SamplingParams(top_p=1e-9), SamplingParams(top_k=50, min_p=1.0)])
    assert out.sampled.min() >= 0 and out.sampled.max() < vocab
