"""A torch.compile'd method called without dynamo's per-call guard check once its guards passed for the same key.

Every call of a torch.compile'd function first evaluates the guards of its cached graphs: each parameter's dtype,
shape and strides, the module tree, global state such as the thread count. On a decode step of a small model
that check is a measurable part of the step (benchmarks/compiled_step.py, docs/performance.md). Within one
engine almost nothing it checks can change: the weights, the module tree and the compile options are fixed once
the model is loaded. What does change from step to step is the inputs (their shapes, strides and dtypes) and the
intra-op thread count.

`VerifiedCalls` keys each call on exactly those (`call_key`). The first call of a key goes through torch.compile,
which checks the guards and compiles if none pass. The cache entry whose guards then pass for the same arguments
is remembered, and later calls of that key run its transformed code directly. That is the code dynamo itself
would run after the same check.

Invariant: the model's parameters and attributes are not rebound after the first call (nothing in the CPU engine
does). A key never verified always takes the guarded path. If the private hooks used here are missing (another
torch), every call takes the guarded path.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

try:  # private: the cache entries dynamo keeps per code object (torch 2.13)
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as _cache_entries
except ImportError:  # pragma: no cover - another torch: every call is guarded
    _cache_entries = None

# Keys remembered per compiled function, oldest dropped first: a batch graph meets one key per (batch size, block
# table width), and a dropped key only costs one guarded call again.
MAX_KEYS = 4096


def call_key(args: tuple) -> tuple:
    """What may differ between two calls of one engine's compiled step: each tensor's dtype, shape, strides and
    inference flag, every other argument's value, the intra-op thread count and the default dtype."""
    parts = tuple((a.dtype, a.shape, a.stride(), a.is_inference()) if isinstance(a, torch.Tensor) else a
                  for a in args)
    return parts, torch.get_num_threads(), torch.get_default_dtype()


class VerifiedCalls:
    """`compiled(*args)`, where `compiled` is torch.compile of the bound method `method`, skipping the guard check
    for keys already verified. `guarded` / `direct` count the calls of each kind."""

    def __init__(self, method: types.MethodType, compiled: Callable):
        self.method, self.compiled = method, compiled
        self.code = method.__func__.__code__
        self.names = self.code.co_varnames[:self.code.co_argcount]  # (self, *args) as dynamo binds the frame
        self.verified: dict[tuple, Callable] = {}
        self.guarded = self.direct = 0

    def __call__(self, *args):
        key = call_key(args)
        body = self.verified.get(key)
        if body is not None:
            self.direct += 1
            return body(self.method.__self__, *args)
        self.guarded += 1
        out = self.compiled(*args)
        body = self._passing_body(args)
        if body is not None:
            if len(self.verified) >= MAX_KEYS:
                del self.verified[next(iter(self.verified))]
            self.verified[key] = body
        return out

    def _passing_body(self, args: tuple) -> Callable | None:
        """The transformed code of the cache entry whose guards pass for these arguments, as a function."""
        if _cache_entries is None:
            return None
        frame = dict(zip(self.names, (self.method.__self__, *args)))
        for entry in _cache_entries(self.code):
            if entry.guard_manager.check(frame):
                return types.FunctionType(entry.code, self.method.__func__.__globals__, self.code.co_name)
        return None
