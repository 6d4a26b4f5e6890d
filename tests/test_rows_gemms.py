"""The compiled CPU step's post-grad pass (worker/rows_gemms.py): which GEMMs of an aten graph go to the rows kernel,
and that the rewritten graph computes what the original did. Engine-level parity of compiled steps (which run the
pass) with eager ones is in test_compiled_step.py."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from deepinfer.kernels import cpu_kernels
from deepinfer.worker import rows_gemms
from deepinfer.worker.compiled_step import inductor_options

if not cpu_kernels.load(progress=False):
    pytest.skip("the CPU kernels could not be built here (no C++ compiler or ninja)", allow_module_level=True)

ROWS = torch.ops.deepinfer_cpu.rows_linear.default


def _projections(x, w1, w2, b, res):
    """A residual projection (mm + add, or addmm once decomposed), a biased one (addmm) and a plain one (mm)."""
    return res + x @ w1.t(), torch.addmm(b, x, w2.t()), torch.mm(x, w2.t())


def _rewritten(fn, args, mode="fake"):
    gm = make_fx(fn, tracing_mode=mode)(*args)
    rows_gemms.RowsGemmPass()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, sum(n.target is ROWS for n in gm.graph.nodes)


def _args(m, dtype=torch.float32, k=48, n=80):
    gen = torch.Generator().manual_seed(m)
    return [torch.randn(*s, generator=gen).to(dtype) for s in ((m, k), (n, k), (n, k), (n,), (m, n))]


@pytest.mark.parametrize("m", [1, 2, cpu_kernels.ROWS_LINEAR_MAX_ROWS])
def test_static_few_row_gemms_go_to_the_rows_kernel(m):
    args = _args(m)
    gm, rewritten = _rewritten(_projections, args)
    assert rewritten == 3
    assert not any(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for n in gm.graph.nodes)
    for got, want in zip(gm(*args), _projections(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_the_kernel_does_not_serve_keeps_blas():
    assert _rewritten(_projections, _args(cpu_kernels.ROWS_LINEAR_MAX_ROWS + 1))[1] == 0  # too many rows
    assert _rewritten(_projections, _args(2, torch.bfloat16))[1] == 0  # float32 only
    assert _rewritten(_projections, _args(3), mode="symbolic")[1] == 0  # a dynamic batch: one graph for every size
    x, w1, _, b, _ = _args(2)
    strided = torch.randn(w1.shape[1], w1.shape[0]).t()  # a weight that is itself a transposed view
    assert _rewritten(lambda x, w: x @ w.t(), [x, strided])[1] == 0
    assert _rewritten(lambda x, w, b: torch.addmm(b, x, w.t(), beta=2), [x, w1, b])[1] == 0


def test_inductor_options_carry_the_pass_on_cpu_only(monkeypatch):
    assert isinstance(inductor_options(torch.device("cpu"))["post_grad_custom_post_pass"], rows_gemms.RowsGemmPass)
    assert "post_grad_custom_post_pass" not in inductor_options(torch.device("cuda"))
    monkeypatch.setenv(rows_gemms.ENV, "0")
    assert "post_grad_custom_post_pass" not in inductor_options(torch.device("cpu"))


def test_compiled_function_with_the_pass_matches_eager(monkeypatch):
    """Through torch.compile (caches off, so the pass runs): the batch-1 graph's two GEMMs are rewritten, the dynamic
    batch's are not, and both match eager."""
    rewrite, rewrites = rows_gemms._rewrite, []
    monkeypatch.setattr(rows_gemms, "_rewrite", lambda g, node, *a: rewrites.append(node) or rewrite(g, node, *a))
    lin, out = torch.nn.Linear(64, 96, bias=True), torch.nn.Linear(96, 64, bias=False)
    options = inductor_options(torch.device("cpu"))
    fn = torch.compile(lambda x: x + out(torch.relu(lin(x))), dynamic=True, options=options)
    with torch.inference_mode(), torch._inductor.config.patch(force_disable_caches=True):
        for m, want in ((1, 2), (3, 2), (7, 2)):
            x = torch.randn(m, 64)
            if m > 1:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(fn(x), x + out(torch.relu(lin(x))), rtol=1e-5, atol=1e-5)
            assert len(rewrites) == want  # the dynamic graph (compiled at m = 3) added none
