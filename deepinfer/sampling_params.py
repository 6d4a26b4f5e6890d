"""SamplingParams: per-request decoding options, keyword-compatible with vLLM's.

Construction validates every value and normalises `stop` / `stop_token_ids` to lists, so the
rest of the engine can rely on: stop is list[str] of non-empty strings, stop_token_ids is
list[int], top_k in {-1, 0} means "disabled", max_tokens is None or >= 1, structured_outputs is None
or a StructuredOutputsParams with exactly one constraint.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from deepinfer.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (dividing logits by them is numerically meaningless).
GREEDY_EPS = 1e-5
_PENALTY_RANGE = (-2.0, 2.0)


@dataclass(init=False)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a dict of its fields is accepted too

    def __init__(self, **kwargs: Any):
        _reject_unknown(kwargs)
        for f in dataclasses.fields(self):
            setattr(self, f.name, kwargs[f.name] if f.name in kwargs else _default(f))
        self._normalise()
        self._validate()

    # ------------------------------------------------------------------ derived views
    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def stop_buffer_length(self) -> int:
        """Chars a streaming detokenizer must hold back so a partial stop string is never emitted."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied (like dataclasses.replace)."""
        values = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        values.update(changes)
        return SamplingParams(**values)

    # ------------------------------------------------------------------ construction helpers
    def _normalise(self) -> None:
        self.stop = _as_list(self.stop, "stop")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids")
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            setattr(self, name, _as_float(name, getattr(self, name)))

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        self._validate_penalties()
        self._validate_lengths()
        self._validate_outputs()

    def _validate_penalties(self) -> None:
        lo, hi = _PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(lo <= value <= hi, f"{name} must be in [{lo}, {hi}], got {value}")
        _check(self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens,
                   f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")

    def _validate_outputs(self) -> None:
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty str")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        _check(self.detokenize or not self.stop, "stop strings require detokenize=True")
        # A finished grammar allows only EOS, which min_tokens would forbid: nothing could be sampled.
        _check(self.structured_outputs is None or self.min_tokens == 0,
               "min_tokens cannot be combined with structured_outputs (the grammar decides where the output ends)")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool")


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _reject_unknown(kwargs: dict[str, Any]) -> None:
    valid = [f.name for f in dataclasses.fields(SamplingParams)]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"unknown SamplingParams option(s) {unknown}; valid options: {', '.join(valid)}")


def _as_list(value: Any, name: str) -> list:
    if value is None:
        return []
    if isinstance(value, (str, int)):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} must be a single value or a list, got {type(value).__name__}")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int | None) -> None:
    _check(_is_int(value), f"{name} must be an int, got {value!r}")
    if minimum is not None:
        _check(value >= minimum, f"{name} must be >= {minimum}, got {value}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
