"""Compiled decode and verify steps off CUDA: the model's fixed-shape forward (`forward_static`, the same
function CUDA graphs capture) compiled once by torch.compile (inductor's C++ backend on CPU) and called for
every step it covers, in place of the eager forward's hundreds of small ops and their Python overhead.

CUDA graphs (cuda_graphs.py) replay fixed buffers, so each step is padded to a captured batch size and the
full block-table width. A compiled function takes the step's own tensors instead, with the batch dimension
and the block-table width dynamic, so nothing is padded except a one-column table to two (the compiler
specialises sizes 0 and 1; a width of 1 would be one more graph). Per query length two graphs are compiled
at start-up (`capture_all`): one request, the latency case the compiler specialises, and any larger batch, each
once per intra-op thread count the runner's thread policy uses (torch.compile guards on the thread count).
Inductor caches what it compiles on disk (DEFAULT_CACHE_DIR unless TORCHINDUCTOR_CACHE_DIR is set), so a
restart with the same model and versions compiles nothing (dynamo still traces the model: seconds, not
minutes). A build interrupted mid-write (a killed process) can leave an empty or partial library in that cache,
which inductor would load as done on every later start. When compiling fails with such libraries in the cache,
they and inductor's cached graphs are removed and the step compiled again (a few times at most). A model the
compiler cannot take (an error while compiling at start-up) is logged and run eagerly.
On CPU a post-grad pass sends the few-row GEMMs of a batch-1 step to the rows kernel (rows_gemms.py).
Dynamo's per-call guard check runs once per input key (verified_calls.py), not on every step.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from deepinfer.layers.static_step import StaticStep
from deepinfer.worker import rows_gemms
from deepinfer.worker.cuda_graphs import fits_static_step, longest_position, supports_graphs
from deepinfer.worker.threads import StepThreads
from deepinfer.worker.verified_calls import VerifiedCalls

logger = logging.getLogger("deepinfer")

DEFAULT_CACHE_DIR = Path("~/.cache/deepinfer/inductor").expanduser()
# Set at import, before anything reaches inductor's cache_dir(): its first call fixes the directory for the process
# (it writes the variable itself), and building a model may get there first (the CPU kernels' build does).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(DEFAULT_CACHE_DIR))
# The per-call Python around a small step's graph (benchmarks/step_overhead.py): inductor's wrapper does not re-check
# each buffer's size, strides and alignment on every call (the guards verified the inputs' shapes and strides,
# verified_calls.py). Its C++ wrapper (cpp_wrapper) is left off: the bundled model's cold compile with it was still
# generating code after 7 minutes of CPU (1-3 minutes without), for a gain within this machine's noise on tiny-v3...
INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}
# ...and float attributes (norm eps, scaling factors) traced as constants: with dynamic=True dynamo would make each a
# graph input and turn it into a tensor on every call.
DYNAMO_CONFIG = {"specialize_float": True}
MAX_REPAIRS = 3  # broken cached libraries removed (and compiles retried) at start-up before giving up
GRAPH_CACHES = ("fxgraph", "aotautograd")  # inductor's cached graphs, under its cache directory


def inductor_options(device: torch.device) -> dict:
    """INDUCTOR_OPTIONS, plus the rows-kernel pass for few-row GEMMs on CPU (rows_gemms.py) when it is on."""
    options = dict(INDUCTOR_OPTIONS)
    if device.type == "cpu" and rows_gemms.enabled():
        options["post_grad_custom_post_pass"] = rows_gemms.RowsGemmPass()
    return options


class CompiledSteps:
    """The compiled forward_static of one model and the steps it runs (runner.graphs' interface: covers,
    run, capture_all)."""

    def __init__(self, model: torch.nn.Module, max_model_len: int, block_size: int, scratch_block: int,
                 scratch_slot: int, device: torch.device, max_batch: int, query_lens: Sequence[int] = (1,),
                 with_streams: bool = False, threads: StepThreads | None = None):
        """threads: the runner's per-step thread policy, applied while compiling (see capture_all)."""
        self.model, self.block_size, self.device, self.threads = model, block_size, device, threads
        self.scratch_block, self.scratch_slot, self.max_batch = scratch_block, scratch_slot, max_batch
        self.query_lens, self.with_streams = tuple(query_lens), with_streams
        self.max_blocks = -(-longest_position(model, max_model_len) // block_size)
        model.grow_rope(longest_position(model, max_model_len))  # the rope tables are indexed, never grown
        own = _own_code(self._forward)
        compiled = torch.compile(own, dynamic=True, fullgraph=True, options=inductor_options(device))
        self.fn = VerifiedCalls(own, torch._dynamo.config.patch(**DYNAMO_CONFIG)(compiled))  # guards: once per key
        self.failed = False  # set when compiling failed at start-up: every step then runs eagerly

    def _forward(self, input_ids, positions, block_table, state_slots, seq_starts, q: int) -> tuple:
        step = StaticStep(input_ids, positions, block_table, state_slots, seq_starts, q, self.block_size)
        out = self.model.forward_static(step, self.scratch_block, return_mtp_input=self.with_streams)
        return out if isinstance(out, tuple) else (out,)

    def covers(self, meta) -> bool:
        """Uniform q-token steps of at most max_batch requests writing every new position (as
        StepGraphs.covers: a step keeping shared prefix entries, paged_write_from > seq_starts, runs eagerly)."""
        return not self.failed and fits_static_step(meta, self.query_lens, self.max_batch, self.max_blocks)

    def run(self, meta) -> tuple[torch.Tensor, ...]:
        """(hidden,) or (hidden, streams) of a covered step."""
        return self._call(StaticStep.from_meta(meta))

    @torch.inference_mode()  # as ModelRunner.execute: the grad mode is a guard, one mode means one graph
    def _call(self, step: StaticStep) -> tuple[torch.Tensor, ...]:
        table = step.block_table
        if table.shape[1] < 2:  # pad to two columns (the scratch block): widths 0 / 1 would be graphs of their own
            table = torch.cat([table, table.new_full((table.shape[0], 2 - table.shape[1]), self.scratch_block)], 1)
        elif table.stride(0) != table.shape[1]:  # a slice (a mixed step's decodes): the graph guards on strides
            table = table.clone(memory_format=torch.contiguous_format)
        tensors = (step.input_ids, step.positions, table, step.state_slots, step.seq_starts)
        if step.state_slots.numel() > 1:  # any batch of two or more requests: one graph
            for t in tensors:
                torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(table, 1)
        return self.fn(*tensors, step.tokens_per_req)

    def warm_keys(self) -> list[tuple[int, int, int | None]]:
        """(batch, q, threads) of one warm-up step per graph steps will run: one request and any larger batch per
        query length, under every intra-op thread count the thread policy gives such steps (torch.compile guards
        on the count: a decode alone may run on one thread, decodes beside a prompt chunk on all; the batch graph's
        2-row steps stand for its larger ones, which run on all). A step at a count not compiled for would
        recompile, for seconds, while serving."""
        counts = self.threads.counts if self.threads is not None else (lambda tokens: [None])
        return [(b, q, t) for q in self.query_lens for b in (1, 2) if b <= self.max_batch for t in counts(b * q)]

    @torch.inference_mode()  # the warm-up's tensors are inference tensors, as a step's are (a guard too)
    def capture_all(self, progress: bool = True) -> None:
        """Compile every graph now (start-up), on padding rows: `warm_keys`, each under its thread count. A failure
        with broken libraries in the cache removes them and compiles again (up to MAX_REPAIRS times)."""
        for attempt in range(MAX_REPAIRS + 1):
            try:
                return self._compile_all(progress)
            except Exception as exc:  # the compiler's errors have no common base class
                cache_dir = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
                broken = broken_libraries(exc, cache_dir) if attempt < MAX_REPAIRS else []
                if not broken:
                    self.failed = True
                    logger.warning("torch.compile could not compile the decode step (%s: %s); steps run eagerly",
                                   type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                    return
                logger.warning("compile cache: %d libraries do not load (an interrupted build?), %s first; removed "
                               "with the cached graphs, compiling again", len(broken), broken[0])
                for lib in broken:
                    remove_artifact(lib)
                forget_graphs(cache_dir)

    def _compile_all(self, progress: bool) -> None:
        for batch, q, threads in tqdm(self.warm_keys(), desc="Compiling decode steps", disable=not progress):
            if threads is not None:
                self.threads.set(threads)
            self._call(StaticStep.empty(batch, q, 2, self.block_size, self.scratch_slot, self.scratch_block,
                                        self.device))


def broken_artifact(exc: BaseException, cache_dir: Path) -> Path | None:
    """The compiled library under cache_dir that `exc` (a compile error, or one it was raised from) failed to
    load, if that is what it is."""
    text = []
    while exc is not None and len(text) < 8:  # the backend wraps the loader's ImportError
        text.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    for match in re.finditer(r"(/[^\s:'\"]+\.so)\b", "\n".join(text)):
        path = Path(match.group(1))
        if path.is_file() and path.resolve().is_relative_to(cache_dir.resolve()):
            return path
    return None


def broken_libraries(exc: BaseException, cache_dir: Path) -> list[Path]:
    """What a failed compile may have tripped on: the library its error names, and every library in the cache
    without an ELF header (the failure can surface as a compile error of a kernel that links nothing broken)."""
    named = broken_artifact(exc, cache_dir)
    return list(dict.fromkeys(([named] if named else []) + unloadable_libraries(cache_dir)))


def unloadable_libraries(cache_dir: Path) -> list[Path]:
    """Libraries under cache_dir without an ELF header (empty or cut short before it)."""
    def elf(path: Path) -> bool:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    return [lib for lib in cache_dir.rglob("*.so") if lib.is_file() and not elf(lib)]


def forget_graphs(cache_dir: Path) -> None:
    """Inductor's cached graphs (they name their libraries, and a graph found there rebuilds a missing library
    another way, which fails on some kernels): the next compile lowers each graph afresh."""
    for sub in GRAPH_CACHES:
        shutil.rmtree(cache_dir / sub, ignore_errors=True)


def remove_artifact(path: Path) -> None:
    """The library and inductor's build folder beside it (<name>_CxxBuild), so the next compile rebuilds it."""
    path.unlink(missing_ok=True)
    shutil.rmtree(path.with_name(path.stem + "_CxxBuild"), ignore_errors=True)


def _own_code(method: Callable) -> Callable:
    """`method` bound to a copy of its function with a code object of its own. Dynamo keeps compiled graphs per
    code object, at most `recompile_limit` (8) of them: the engines of one process shared `_forward`'s code and
    its list, so in a benchmark process building one engine per configuration the later engines found it full
    and ran eagerly. Its own code object gives each engine its own list, freed with it."""
    f = method.__func__
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(own, method.__self__)


def use_compiled_steps(model: torch.nn.Module, args, device: torch.device, proposer=None) -> bool:
    """EngineArgs' decision: off CUDA, not --enforce-eager, not deterministic mode (its own kernels), not
    two-batch overlap, one process with a fixed-shape forward, and no proposer that hooks the forward. Quantised
    KV pools are not covered by the compiled-step tests yet, so they run eagerly."""
    return (device.type != "cuda" and not args.enforce_eager and not args.deterministic
            and not args.two_batch_overlap and args.kv_cache_dtype == "auto"
            and supports_graphs(model) and getattr(proposer, "graph_safe", True))


def build_compiled(runner, args, max_model_len: int) -> CompiledSteps:
    """The runner's compiled steps: decode, plus verify steps of k + 1 tokens with speculation."""
    spec = args.speculative
    query_lens = (1,) if spec is None else (1, spec.num_speculative_tokens + 1)
    kind = runner.proposer.hidden_kind if runner.proposer is not None else ""
    layout = runner.layout
    return CompiledSteps(runner.model, max_model_len, layout.block_size, layout.num_blocks, layout.state_rows,
                         runner.device, args.max_num_seqs, query_lens, with_streams=kind == "mtp",
                         threads=runner.threads)
