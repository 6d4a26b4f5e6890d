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
from deepinfer.layers.metadata import ForwardMeta  # noqa: E402
from deepinfer.worker import cuda_graphs  # noqa: E402
from deepinfer.worker.cuda_graphs import capture_sizes, pick_size, uniform_query_len  # noqa: E402
from deepinfer.worker.model_runner import ModelRunner  # noqa: E402

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
    llm = LLM(str(ckpt), **{**OPTIONS, "enforce_eager": False, **options})
    graphs = llm.engine.runner.graphs
    replays = []
    if graphs is not None:
        run = graphs.run
        graphs.run = lambda meta: replays.append(uniform_query_len(meta.query_start)) or run(meta)
    prompts = _prompts(repeat)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 5, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if graphs is not None:  # captured without autograd: no grad_fn kept alive by the graphs' outputs
        assert not any(t.requires_grad for g in graphs.graphs.values() for t in g.out)
        assert not any(p.requires_grad for p in llm.engine.model.parameters())
    return [o.outputs[0].token_ids for o in outs], replays


@pytest.mark.parametrize("options", [{}, pytest.param({"async_scheduling": True}, marks=pytest.mark.slow)],
                         ids=["sync", "async"])
def test_graph_replayed_decode_matches_eager(ckpt, monkeypatch, options):
    """Prompts prefilled in chunks of 16 tokens, so some steps mix decodes with a prefill chunk: their decodes
    replay as a batch of their own and only the chunk runs eagerly (ModelRunner._graphed_decodes)."""
    _force_kernels(monkeypatch)
    options = {"max_num_batched_tokens": 16, **options}
    want, none = _generate(ckpt, enforce_eager=True, **options)
    assert none == []
    monkeypatch.setattr(core, "use_cuda_graphs", lambda model, args, device, proposer=None: not args.enforce_eager)
    split = []
    real = ModelRunner._graphed_decodes
    monkeypatch.setattr(ModelRunner, "_graphed_decodes",
                        lambda self, meta: (lambda d: split.append(d is not None) or d)(real(self, meta)))
    got, replays = _generate(ckpt, **options)
    assert got == want
    assert len(replays) >= 6  # every decode step after the prompts: batches of 3, 2 and 1 padded to 4, 2, 1
    assert any(split)  # mixed steps whose decodes replayed


@pytest.mark.slow
def test_graph_replayed_verify_steps_match_eager(ckpt, monkeypatch):
    """Speculative verify steps (k + 1 tokens per request) replay their own graphs."""
    _force_kernels(monkeypatch)
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    want, _ = _generate(ckpt, True, enforce_eager=True, **spec)
    monkeypatch.setattr(core, "use_cuda_graphs", lambda model, args, device, proposer=None: not args.enforce_eager)
    got, replays = _generate(ckpt, True, **spec)
    assert got == want and 3 in replays


def test_models_without_a_fixed_shape_forward_run_eagerly():
    assert not cuda_graphs.supports_graphs(torch.nn.Linear(2, 2))


class _StaticModel(torch.nn.Module):
    """What the graph decision and StepGraphs read of a model: a fixed-shape forward and rope tables."""

    def forward_static(self, step, scratch_block, return_mtp_input=False):
        raise AssertionError("not captured in these tests")

    def grow_rope(self, max_position):
        self.rope_rows = max_position


def test_graphs_are_declined_without_the_kernels_or_with_a_hooking_proposer(monkeypatch):
    """DEEPINFER_TRITON=0 (the forward_static needs the kernels), --enforce-eager, and DSpark (its LayerTap
    hooks do not run on replay) all mean eager steps; nothing is allocated on the device to decide."""
    from deepinfer import kernels
    from deepinfer.config import EngineArgs
    from deepinfer.spec.dspark import DSparkProposer

    monkeypatch.setattr(kernels, "HAS_TRITON", True)
    model, cuda = _StaticModel(), torch.device("cuda")
    assert cuda_graphs.use_cuda_graphs(model, EngineArgs(enforce_eager=False), cuda)
    assert not cuda_graphs.use_cuda_graphs(model, EngineArgs(enforce_eager=False), torch.device("cpu"))
    assert not cuda_graphs.use_cuda_graphs(model, EngineArgs(enforce_eager=True), cuda)
    dspark = DSparkProposer.__new__(DSparkProposer)
    assert not cuda_graphs.use_cuda_graphs(model, EngineArgs(enforce_eager=False), cuda, dspark)
    monkeypatch.setenv("DEEPINFER_TRITON", "0")
    assert not cuda_graphs.use_cuda_graphs(model, EngineArgs(enforce_eager=False), cuda)


def _meta(seq_starts, write_from, q=1, width=2):
    n = len(seq_starts)
    return ForwardMeta(torch.zeros(n * q, dtype=torch.long), torch.zeros(n * q, dtype=torch.long),
                       torch.arange(n).repeat_interleave(q), torch.zeros(n, width, dtype=torch.long),
                       torch.zeros(n, dtype=torch.long), torch.arange(n * q), list(range(0, n * q + 1, q)),
                       seq_starts, [s + q for s in seq_starts], 16, paged_write_from=write_from)


def test_steps_that_must_keep_shared_prefix_entries_run_eagerly():
    """The static step writes every new position; a step with paged_write_from past seq_starts (a prefix hit
    recomputing tokens to rebuild bounded state) must not, so it is not replayed."""
    model = _StaticModel()
    graphs = cuda_graphs.StepGraphs(model, [1, 2, 4], 40, 16, 0, 0, torch.device("cpu"))
    assert model.rope_rows == 41 and graphs.max_blocks == 3
    assert graphs.covers(_meta([5, 9], None)) and graphs.covers(_meta([5, 9], [5, 9]))
    assert not graphs.covers(_meta([5, 9], [5, 12]))
    assert graphs.covers(_meta([5, 9], None, q=3)) is False  # no (size, 3) graphs without speculation
    assert not graphs.covers(_meta([5, 9, 1, 2, 3], None))  # more requests than the largest size
    assert not graphs.covers(_meta([5], None, width=4))  # a wider block table than max_model_len needs


def test_reserved_rope_tables_never_move():
    """Graphs read the tables' addresses: reserve() grows once, and a later position past it is an error,
    not a silent reallocation."""
    from deepinfer.config import RopeConfig
    from deepinfer.layers.rotary import RotaryTable

    table = RotaryTable(RopeConfig(theta=10000.0, dim=8), 8)
    table.reserve(32)
    cos = table.cos
    table.lookup(torch.tensor([31]))
    assert table.cos is cos and cos.shape[0] == 32
    with pytest.raises(RuntimeError, match="reserved rope table"):
        table.lookup(torch.tensor([32]))


@pytest.mark.slow
def test_graph_replayed_mla_decode_matches_eager(tmp_path, monkeypatch):
    """DeepSeek-V3 (MLA, fused MoE) decode steps through the graphs."""
    path = save_reference(make_reference("v3", seed=2), tmp_path / "v3")
    _force_kernels(monkeypatch)
    want, _ = _generate(path, enforce_eager=True)
    monkeypatch.setattr(core, "use_cuda_graphs", lambda model, args, device, proposer=None: not args.enforce_eager)
    got, replays = _generate(path)
    assert got == want and len(replays) >= 6
