"""C++ kernels for the CPU path, built on first use with torch's extension builder (a C++ compiler and ninja,
cached under ~/.cache/deepinfer/extensions, or DEEPINFER_EXTENSIONS_DIR) and registered as torch ops, so compiled
steps call them like aten ops.

Dispatch rule: `available()` is True once `load()` built and loaded them; it never raises. Without a compiler,
or with DEEPINFER_CPU_KERNELS=0, every caller keeps its torch path (the kernels' references). The models read
`available()` while tracing, so load() runs before a step is compiled: a model that uses a kernel calls it when
built on a CPU, so every process serving that model (ranks, the one-process reference) computes the same way.

Kernels (sources in kernels/cpu/):
- mla_decode: MLA absorbed paged decode attention (the contract of kernels/mla_decode.py without KV scales or a
  DSA selection), one pass over each request's context rows with an online softmax, no gathered copy. Used up to
  MLA_DECODE_MAX_HEADS query heads per rank; with more, a head group's dots lose to the GEMMs of the torch path.
- rows_linear: x @ w^T for up to ROWS_LINEAR_MAX_ROWS rows of x (a decode step's LM head), one streaming pass
  over w in storage order; BLAS reads a tall row-major w at half that speed for so few rows. Each output
  element is one dot in a fixed order, whatever the number of rows or threads.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("deepinfer")

SOURCES = Path(__file__).parent / "cpu"
DEFAULT_BUILD_DIR = Path("~/.cache/deepinfer/extensions").expanduser()
MLA_DECODE_MAX_HEADS = 8  # query heads per rank up to which mla_decode beats gather + GEMMs (measured)
ROWS_LINEAR_MAX_ROWS = 4  # rows of x up to which rows_linear beats BLAS on an LM head (measured)
_state: dict[str, bool] = {}


def available() -> bool:
    return _state.get("loaded", False)


def load(progress: bool = True) -> bool:
    """Build (first time only) and load the kernels; False, with the reason logged once, when they cannot be."""
    if "loaded" in _state:
        return _state["loaded"]
    if os.environ.get("DEEPINFER_CPU_KERNELS", "1") == "0":
        _state["loaded"] = False
        return False
    try:
        _build(progress)
        _state["loaded"] = True
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths serve
        logger.warning("CPU kernels unavailable (%s: %s); using the torch paths", type(exc).__name__,
                       str(exc).splitlines()[0] if str(exc) else "")
        _state["loaded"] = False
    return _state["loaded"]


def _build(progress: bool) -> None:
    from torch.utils import cpp_extension

    build = Path(os.environ.get("DEEPINFER_EXTENSIONS_DIR", DEFAULT_BUILD_DIR)) / _tag()
    build.mkdir(parents=True, exist_ok=True)
    if progress and not any(build.glob("*.so")):
        logger.info("building the CPU kernels (once per torch version and CPU; under a minute)")
    cpp_extension.load(name="deepinfer_cpu_kernels", sources=[str(p) for p in sorted(SOURCES.glob("*.cpp"))],
                       extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], build_directory=str(build),
                       is_python_module=False, verbose=False)
    torch.library.register_fake("deepinfer_cpu::mla_decode", _mla_decode_fake)  # shapes for tracing
    torch.library.register_fake("deepinfer_cpu::rows_linear", _rows_linear_fake)


def _tag() -> str:
    """One build per torch version, source text and CPU (-march=native): a changed kernel or another CPU
    behind the same cache directory rebuilds."""
    import hashlib

    from deepinfer.config import cpu_flags

    key = b"".join(p.read_bytes() for p in sorted(SOURCES.glob("*.cpp"))) + " ".join(cpu_flags()).encode()
    return f"torch{torch.__version__.replace('+', '_')}-{hashlib.sha256(key).hexdigest()[:12]}"


def mla_decode(q: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int, latent: int, scale: float) -> torch.Tensor:
    """o_c [R, H, latent] (kernels.mla_decode's contract; no scales, no selection). Requires available()."""
    return torch.ops.deepinfer_cpu.mla_decode(q, pool, block_table, seq_lens, block_size, latent, scale)


def _mla_decode_fake(q, pool, block_table, seq_lens, block_size, latent, scale):
    return q.new_empty(q.shape[0], q.shape[1], latent)


def rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (float32 arithmetic). Requires available()."""
    return torch.ops.deepinfer_cpu.rows_linear(x, w)


def _rows_linear_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[0])
