"""A post-grad pass of compiled CPU steps: the few-row GEMMs of a decode step go to the rows kernel.

A batch-1 decode step multiplies one row by each dense projection, x [M, K] @ W^T with W [N, K] a stored weight:
inductor emits `mm(x, permute(W, [1, 0]))` (`addmm(c, ...)` with a residual or bias c), which BLAS computes at well
under streaming speed for so few rows, and the weights come from memory between steps. kernels/cpu's rows_linear
reads W as stored (docs/performance.md, "Small GEMMs of a compiled step"). The pass rewrites such a node when:
- M is a static int (a dynamic batch's graph keeps BLAS: one graph serves every batch size there) and W is
  contiguous (the kernel reads its rows in place);
- the LM head's rule holds (layers/lm_head.rows_kernel_serves: at most cpu_kernels.ROWS_LINEAR_MAX_ROWS rows of
  2-D float32 x and W on CPU, kernels loaded, not batch-invariant mode);
- an addmm has alpha = beta = 1 (then it becomes rows_linear + c, which inductor fuses into the next kernel).
Each output element is one float32 dot in a fixed order, as in the LM head: a row's values do not depend on the
batch or the thread count. They differ from BLAS's in rounding only.
`uuid` (this file's text) keys inductor's graph cache, so a changed pass compiles again.
"""

from __future__ import annotations

import os

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

from deepinfer.kernels import cpu_kernels
from deepinfer.layers.lm_head import rows_kernel_serves

aten = torch.ops.aten
ENV = "DEEPINFER_ROWS_GEMMS"  # "0": compiled steps keep BLAS for few-row GEMMs (an A/B switch)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and cpu_kernels.available()


class RowsGemmPass(CustomGraphPass):
    def __call__(self, graph: Graph) -> None:
        for node in list(graph.nodes):
            if (parts := _match(node)) is not None:
                _rewrite(graph, node, *parts)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def _match(node: Node) -> tuple[Node, Node, Node | None] | None:
    """(x, W, addend or None) of a rewritable mm / addmm node, else None."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
        return None
    if node.target is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 3:
            return None
        addend, x, wt = node.args
    else:
        addend, (x, wt) = None, node.args
    w = _transposed(wt)
    return (x, w, addend) if w is not None and _fits(x, w) else None


def _transposed(node) -> Node | None:
    """W when node is W.t() / W.permute(1, 0), else None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        return node.args[0]
    return None


def _fits(x, w) -> bool:
    """The LM head's dispatch rule (layers/lm_head.rows_kernel_serves) on the nodes' fake values, for a static row
    count (a symbolic one is never compared: that would guard the graph on it) and a contiguous W."""
    xv, wv = _val(x), _val(w)
    if xv is None or wv is None or xv.dim() != 2 or wv.dim() != 2 or type(xv.shape[0]) is not int:
        return False
    return wv.device.type == "cpu" and wv.is_contiguous() and rows_kernel_serves(xv, wv)


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _rewrite(graph: Graph, node: Node, x: Node, w: Node, addend: Node | None) -> None:
    with graph.inserting_before(node):
        out = graph.call_function(torch.ops.deepinfer_cpu.rows_linear.default, (x, w))
        out.meta["val"] = node.meta["val"]
        if addend is not None:
            out = graph.call_function(aten.add.Tensor, (out, addend))
            out.meta["val"] = node.meta["val"]
    transposed = node.args[-1]
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    if not transposed.users:
        graph.erase_node(transposed)
