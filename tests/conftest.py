"""Test-session setup that must happen before any test module imports triton, and the GPU routing of the
kernel tests.

Without a GPU the Triton kernels run under the interpreter on CPU tensors. With one, the same tests run the
compiled kernels: each kernel launcher is wrapped to take its tensor arguments to the GPU and bring its
results back to where the arguments came from, so every test (written with CPU tensors and CPU references)
checks the compiled kernel against the same reference.
"""

import dataclasses
import importlib
import os

import pytest
import torch

# Engines in tests run eagerly unless a test asks otherwise (enforce_eager=False): compiling a decode step
# costs a minute per model on CPU, and tests/test_compiled_step.py checks the compiled path against eager.
# Set before any engine is built, so server and worker processes the tests start inherit it.
os.environ.setdefault("DEEPINFER_ENFORCE_EAGER", "1")
# dtype="auto" means float32 in tests on every CPU (the suite's tolerances are float32's; where the CPU has
# native bf16, auto would otherwise pick bfloat16 for bf16 checkpoints). tests/test_config.py checks the rule.
os.environ.setdefault("DEEPINFER_CPU_BF16", "0")

if not torch.cuda.is_available():  # Triton kernels run under the interpreter on CPU machines
    os.environ.setdefault("TRITON_INTERPRET", "1")

_LAUNCHERS = {"deepinfer.kernels.sparse_attention": ("sparse_attention",),
              "deepinfer.kernels.sparse_attention_v41": ("sparse_attention_v41",),
              "deepinfer.kernels.mla_decode": ("mla_decode",),
              "deepinfer.kernels.indexer": ("indexer_scores", "select_topk", "indexer_topk"),
              "deepinfer.kernels.fused_moe": ("fused_moe",),
              "deepinfer.kernels.fp8_gemm": ("fp8_block_linear",)}


def moved(value, device):
    """value with every tensor in it (dataclass fields, tuples, lists, dicts) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: moved(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, (tuple, list)):
        return type(value)(moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    return value


def _first_device(values) -> torch.device | None:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            found = _first_device(getattr(v, f.name) for f in dataclasses.fields(v))
            if found is not None:
                return found
    return None


def on_device(fn, device: str):
    def run(*args, **kwargs):
        home = _first_device([*args, *kwargs.values()])
        out = fn(*moved(args, device), **moved(kwargs, device))
        return out if home is None else moved(out, home)
    run.__wrapped__ = fn
    return run


@pytest.fixture(autouse=True)
def kernels_on_gpu(request, monkeypatch):
    if not torch.cuda.is_available() or not request.module.__name__.startswith(("test_kernels", "test_static")):
        return
    for module_name, names in _LAUNCHERS.items():
        module = importlib.import_module(module_name)
        for name in names:
            original = getattr(module, name)
            wrapped = on_device(original, "cuda")
            monkeypatch.setattr(module, name, wrapped)
            if getattr(request.module, name, None) is original:
                monkeypatch.setattr(request.module, name, wrapped)
