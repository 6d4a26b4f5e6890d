"""CUDA graphs' mechanism (worker/cuda_graphs.py): capture sizes, which steps replay, padding, and whole
engine runs whose decode steps replay fixed-shape graphs giving the same tokens as eager steps. Off CUDA the
graphs replay eagerly into fixed buffers and the Triton kernels run under the interpreter; on a GPU
(benchmarks/gpu_check.sh) the same tests capture real graphs."""

import pytest
import torch

pytest.importorskip("triton")

from test_kernels_models import _force_kernels  # noqa: E402
from tiny_models import make_reference, save_reference  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.engine import core  # noqa: E402
from deepinfer.worker import cuda_graphs  # noqa: E402
from deepinfer.worker.cuda_graphs import capture_sizes, pick_size, uniform_query_len  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPTIONS = dict(block_size=16, load_progress=False, max_num_seqs=4, max_cuda_graph_batch_size=4, device=DEVICE,
               dtype="float32")


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(300)
    assert all(pick_size(n, sizes) >= n for n in range(1, 257)) and pick_size(257, sizes) is None


def test_only_uniform_steps_replay():
    assert uniform_query_len([0, 1, 2, 3]) == 1
    assert uniform_query_len([0, 4, 8]) == 4
    assert uniform_query_len([0, 1, 5]) == 0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_reference(make_reference("v4", seed=11), tmp_path_factory.mktemp("v4") / "model")


def _prompts(repeat: bool) -> list[list[int]]:
    """Random prompts; repeated ones give the n-gram proposer full-length drafts (uniform verify steps)."""
    rand = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 21, 5)]
    return [(p[:4] * 6)[:len(p) + 8] for p in rand] if repeat else rand


def _generate(ckpt, repeat: bool = False, **options) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs of a few prompts, and the tokens per request of each step that replayed a graph."""
    llm = LLM(str(ckpt), **{**OPTIONS, **options})
    graphs = llm.engine.runner.graphs
    replays = []
    if graphs is not None:
        run = graphs.run
        graphs.run = lambda meta: replays.append(uniform_query_len(meta.query_start)) or run(meta)
    prompts = _prompts(repeat)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 5, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], replays


@pytest.mark.parametrize("options", [{}, pytest.param({"async_scheduling": True}, marks=pytest.mark.slow)],
                         ids=["sync", "async"])
def test_graph_replayed_decode_matches_eager(ckpt, monkeypatch, options):
    _force_kernels(monkeypatch)
    want, none = _generate(ckpt, enforce_eager=True, **options)
    assert none == []
    monkeypatch.setattr(core, "use_cuda_graphs", lambda model, args, device: not args.enforce_eager)
    got, replays = _generate(ckpt, **options)
    assert got == want
    assert len(replays) >= 6  # every decode step after the prompts: batches of 3, 2 and 1 padded to 4, 2, 1


@pytest.mark.slow
def test_graph_replayed_verify_steps_match_eager(ckpt, monkeypatch):
    """Speculative verify steps (k + 1 tokens per request) replay their own graphs."""
    _force_kernels(monkeypatch)
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    want, _ = _generate(ckpt, True, enforce_eager=True, **spec)
    monkeypatch.setattr(core, "use_cuda_graphs", lambda model, args, device: not args.enforce_eager)
    got, replays = _generate(ckpt, True, **spec)
    assert got == want and 3 in replays


def test_models_without_a_fixed_shape_forward_run_eagerly():
    assert not cuda_graphs.supports_graphs(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_graph_replayed_mla_decode_matches_eager(tmp_path, monkeypatch):
    """DeepSeek-V3 (MLA, fused MoE) decode steps through the graphs."""
    path = save_reference(make_reference("v3", seed=2), tmp_path / "v3")
    _force_kernels(monkeypatch)
    want, _ = _generate(path, enforce_eager=True)
    monkeypatch.setattr(core, "use_cuda_graphs", lambda model, args, device: not args.enforce_eager)
    got, replays = _generate(path)
    assert got == want and len(replays) >= 6
