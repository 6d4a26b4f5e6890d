"""CUDA graphs for fixed-shape steps: decode (one new token per request) and speculative verify (k + 1).

A step of n requests with q new tokens each is padded up to the smallest capture size B >= n and replayed
from the graph captured for (B, q): the step's values are copied into that graph's static buffers
(layers/static_step.py), the graph is launched once, and the first n * q rows of its output are the step's.
Padding rows read and write only the scratch block and state slot the runner allocates past the scheduler's
(so no real request ever sees them). Steps the graphs do not cover (prefill chunks, mixed query lengths, more
requests than the largest size, a wider block table) run eagerly.

The model provides `forward_static(step, scratch_block, return_mtp_input)` with no host sync and no
data-dependent shape, and `grow_rope(max_position)`. Off CUDA the same code runs with eager replay (each
"replay" re-runs the function into the same output buffers), which is how the CPU tests exercise it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from deepinfer.layers.static_step import StaticStep

logger = logging.getLogger("deepinfer")

# vLLM-style capture sizes: every size up to 4, then steps of 8, then of 16 (padding waste <= ~25 %).
DEFAULT_MAX_CAPTURE = 256


def capture_sizes(max_num_seqs: int, limit: int = DEFAULT_MAX_CAPTURE) -> list[int]:
    """Batch sizes to capture for up to max_num_seqs requests (the last one covers max_num_seqs)."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, min(top, 64), 8)) + list(range(64, top, 16))
    return sorted(set(sizes + [top]))


def pick_size(n: int, sizes: Sequence[int]) -> int | None:
    """Smallest capture size >= n, or None when n exceeds them all."""
    return next((s for s in sorted(sizes) if s >= n), None)


def uniform_query_len(query_start: Sequence[int]) -> int:
    """q when every request of the step has q new tokens, else 0."""
    lens = {b - a for a, b in zip(query_start[:-1], query_start[1:])}
    return lens.pop() if len(lens) == 1 else 0


@dataclass
class _Graph:
    step: StaticStep
    out: tuple[torch.Tensor, ...]
    replay: Callable[[], None]


def _capture_cuda(fn: Callable[[], tuple], pool) -> tuple[tuple, Callable[[], None]]:
    """Warm up on a side stream (Triton compiles, the allocator settles), then capture one call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return out, graph.replay


def _capture_eager(fn: Callable[[], tuple]) -> tuple[tuple, Callable[[], None]]:
    """The graph semantics without CUDA: fixed output buffers, refilled by each replay."""
    out = fn()

    def replay() -> None:
        for buf, new in zip(out, fn()):
            buf.copy_(new)
    return out, replay


class StepGraphs:
    """Captured fixed-shape steps of one model, keyed by (capture size, tokens per request)."""

    def __init__(self, model: torch.nn.Module, sizes: Sequence[int], max_model_len: int, block_size: int,
                 scratch_block: int, scratch_slot: int, device: torch.device, query_lens: Sequence[int] = (1,),
                 with_streams: bool = False):
        self.model, self.sizes, self.query_lens = model, sorted(sizes), tuple(query_lens)
        self.block_size, self.device, self.with_streams = block_size, device, with_streams
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        longest = longest_position(model, max_model_len)
        self.max_blocks = -(-longest // block_size)
        model.grow_rope(longest)  # frozen from here: the graphs read the tables' addresses
        self.cuda = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def covers(self, meta) -> bool:
        """Uniform q-token steps within the sizes and block-table width, writing every new position (a step
        that must leave shared prefix entries untouched, paged_write_from > seq_starts, runs eagerly: the
        static step writes from seq_starts)."""
        return fits_static_step(meta, self.query_lens, max(self.sizes), self.max_blocks)

    @torch.inference_mode()  # the static buffers are inference tensors (captured so): refilled in that mode
    def run(self, meta) -> tuple[torch.Tensor, ...]:
        """(hidden,) or (hidden, streams) of a covered step's rows."""
        q = uniform_query_len(meta.query_start)
        graph = self._graph(pick_size(meta.num_reqs, self.sizes), q)
        graph.step.reset_padding(meta.num_reqs, self.scratch_slot, self.scratch_block)
        graph.step.copy_from(StaticStep.from_meta(meta))
        graph.replay()
        return tuple(t[:meta.num_tokens] for t in graph.out)

    @torch.inference_mode()
    def capture_all(self, progress: bool = True) -> None:
        """Capture every (size, q) now (start-up), largest first so smaller ones reuse its memory pool."""
        keys = [(s, q) for q in self.query_lens for s in reversed(self.sizes)]
        before = torch.cuda.memory_reserved(self.device) if self.cuda else 0
        for size, q in tqdm(keys, desc="Capturing CUDA graphs", disable=not progress):
            self._graph(size, q)
        if self.cuda:  # the pool comes out of the headroom gpu_memory_utilization leaves
            logger.info("CUDA graphs: %d captured, %.2f GiB of graph memory", len(keys),
                        (torch.cuda.memory_reserved(self.device) - before) / 2**30)

    @torch.inference_mode()  # no autograd state in the graph: outputs without grad_fn, caches written in place
    def _graph(self, size: int, q: int) -> _Graph:
        if (size, q) not in self.graphs:
            step = StaticStep.empty(size, q, self.max_blocks, self.block_size, self.scratch_slot,
                                    self.scratch_block, self.device)
            fn = self._function(step)
            out, replay = _capture_cuda(fn, self.pool) if self.cuda else _capture_eager(fn)
            self.graphs[(size, q)] = _Graph(step, out, replay)
        return self.graphs[(size, q)]

    def _function(self, step: StaticStep) -> Callable[[], tuple]:
        def fn() -> tuple:
            out = self.model.forward_static(step, self.scratch_block, return_mtp_input=self.with_streams)
            return out if isinstance(out, tuple) else (out,)
        return fn


def longest_position(model: torch.nn.Module, max_model_len: int) -> int:
    """One past the largest position a captured step may see (max_model_len plus the drafts' lookahead)."""
    return max_model_len + getattr(model, "num_lookahead_tokens", 0) + 1


def fits_static_step(meta, query_lens, max_batch: int, max_blocks: int) -> bool:
    """Whether a step can run as a fixed-shape step (graphs, compiled steps): uniform q-token rows with q in
    query_lens, at most max_batch requests and max_blocks table columns, writing every new position."""
    writes_all = meta.paged_write_from is None or list(meta.paged_write_from) == list(meta.seq_starts)
    return (uniform_query_len(meta.query_start) in query_lens and meta.num_reqs <= max_batch
            and meta.block_table.shape[1] <= max_blocks and writes_all)


def supports_graphs(model: torch.nn.Module) -> bool:
    """Models with a fixed-shape forward, in one process (collectives are not captured yet)."""
    parallel = getattr(model, "parallel", None)
    return hasattr(model, "forward_static") and (parallel is None or parallel.is_single)


def use_cuda_graphs(model: torch.nn.Module, args, device: torch.device, proposer=None) -> bool:
    """EngineArgs' decision: CUDA, not --enforce-eager, not deterministic mode (its own kernels), not two-batch
    overlap, a model with a fixed-shape forward, the Triton kernels that forward runs on (installed and not
    turned off by DEEPINFER_TRITON=0), and no proposer that hooks the forward (hooks do not run on replay)."""
    from deepinfer import kernels

    return (device.type == "cuda" and not args.enforce_eager and not args.deterministic
            and not args.two_batch_overlap and kernels.triton_on(device)
            and supports_graphs(model) and getattr(proposer, "graph_safe", True))


def build_graphs(runner, args, max_model_len: int) -> StepGraphs:
    """The runner's graphs: decode steps, plus verify steps of k + 1 tokens with speculation (steps with other
    query lengths run eagerly); padding goes to the runner's scratch block and state row."""
    spec = args.speculative
    query_lens = (1,) if spec is None else (1, spec.num_speculative_tokens + 1)
    kind = runner.proposer.hidden_kind if runner.proposer is not None else ""
    layout = runner.layout
    return StepGraphs(runner.model, capture_sizes(min(args.max_num_seqs, args.max_cuda_graph_batch_size)),
                      max_model_len, layout.block_size, layout.num_blocks, layout.state_rows, runner.device,
                      query_lens, with_streams=kind == "mtp")
