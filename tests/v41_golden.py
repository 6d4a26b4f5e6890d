"""Shared by the V4.1 parity tests: where the goldens live, which set this CPU reproduces, and the thread count
they were generated with.

The reference's float32 and bf16 GEMMs round differently on different CPU kernels (MKL's and oneDNN's paths differ
between vendors and instruction sets), and through FP8 / FP4 quantisation a last-bit difference grows into other
tokens. So a golden set holds only for the kernels that computed it: each config directory keeps one set per CPU
kind (`cpu/<kind>/golden.{json,safetensors}`, `<kind>` = vendor + a digest of GEMM results, see cpu_kind), and
the top-level `golden.*` of configs a and b were computed on an AMD EPYC before kinds were recorded. A test takes
the set of this machine's kind, else a top-level set without a recorded kind, else it skips, naming the command
that generates the set (tests/golden/v41/README.md).
"""

from __future__ import annotations

import hashlib
import json
import platform
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

GOLDEN = Path(__file__).parent / "golden" / "v41"
GOLDEN_THREADS = 2  # the reference's float32 GEMMs split work by intra-op threads (tests/golden/v41/README.md)


@pytest.fixture(autouse=True)
def golden_threads():
    """Every test of a module that imports this runs at the goldens' thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(GOLDEN_THREADS)
    yield
    torch.set_num_threads(previous)


def _vendor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


@cache
def cpu_kind() -> str:
    """The CPU vendor and a digest of float32 / bf16 GEMM, softmax and attention results at the goldens' thread
    count: machines with equal kinds compute the reference's numbers alike."""
    previous = torch.get_num_threads()
    torch.set_num_threads(GOLDEN_THREADS)
    try:
        g = torch.Generator().manual_seed(0)
        x, w = (torch.randn(n, 256, generator=g, dtype=torch.float32) for n in (101, 96))
        outs = [F.linear(x[:rows], w) for rows in (1, 7, 41, 101)]
        outs += [F.linear(x[:rows].bfloat16(), w.bfloat16()) for rows in (1, 7, 41, 101)]
        q = torch.randn(4, 41, 64, generator=g, dtype=torch.float32).bfloat16()
        outs += [x.softmax(-1), F.scaled_dot_product_attention(q, q, q)]
        digest = hashlib.blake2b(b"".join(o.contiguous().view(torch.uint8).numpy().tobytes() for o in outs),
                                 digest_size=6).hexdigest()
    finally:
        torch.set_num_threads(previous)
    return f"{_vendor()}-{digest}"


def golden_dir(name: str) -> Path:
    """The directory of config `name`'s golden set for this machine (skips the test when there is none)."""
    root = GOLDEN / name
    own = root / "cpu" / cpu_kind()
    if (own / "golden.json").is_file():
        return own
    top = root / "golden.json"
    if top.is_file() and "cpu_kind" not in json.loads(top.read_text()):
        return root
    pytest.skip(f"no V4.1 golden set of config {name} for this CPU kind ({cpu_kind()}): generate one with "
                "tests/golden/make_v41_golden.py (tests/golden/v41/README.md)")


def load_golden(name: str) -> tuple[dict, dict]:
    """(golden.json, golden.safetensors tensors) of config `name` for this machine."""
    d = golden_dir(name)
    return json.loads((d / "golden.json").read_text()), load_file(str(d / "golden.safetensors"))


def run_to_end(llm) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Step the engine of `llm` until its queued requests finish: (output tokens, the log-probs [vocab] of each
    sampled row) by request id, in step order."""
    captured, rows = [], {}
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    tokens: dict[str, list[int]] = {}
    try:
        while llm.engine.has_unfinished:
            for req in llm.engine.step():
                tokens[req.request_id] = list(req.output_token_ids)
            sampled = [s for s in llm.engine.last_scheduled.scheduled if s.samples]
            for row, s in enumerate(sampled):
                rows.setdefault(s.request.request_id, []).append(captured[-1][row].log_softmax(-1))
    finally:
        llm.engine.model.compute_logits = compute
    return tokens, rows
