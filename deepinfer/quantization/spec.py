"""Which int4 weight format a checkpoint uses, read once from its config.json `quantization_config`.

Two layouts of one family (4-bit integer codes, a float16 scale and an integer zero point per group of
`group_size` consecutive inputs of an output channel):
  * "awq": AutoAWQ's GEMM layout, which LMDeploy and vLLM also read;
  * "gptq": AutoGPTQ's layout (`checkpoint_format` "gptq", zero points stored minus one, or "gptq_v2", stored
    as they are), with `g_idx` for act-order checkpoints.

Torch-free on purpose: config.py imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

INT4_METHODS = ("awq", "gptq")
PACK = 8  # 4-bit codes per int32


class QuantConfigError(ValueError):
    """A `quantization_config` deepinfer cannot serve (the message names the field)."""


@dataclass(frozen=True)
class Int4Spec:
    method: str  # "awq" | "gptq"
    group_size: int = 128
    zero_point: bool = True  # AWQ: asymmetric codes with a zero point per group (the only AWQ layout served)
    zeros_minus_one: bool = True  # GPTQ v1: qzeros hold zero - 1; gptq_v2 holds the zero itself
    modules_to_not_convert: tuple[str, ...] = ()

    def to_config(self) -> dict:
        """The `quantization_config` entry a checkpoint in this format carries (what AutoAWQ / AutoGPTQ write)."""
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": self.zero_point,
                    "version": "gemm", "modules_to_not_convert": list(self.modules_to_not_convert)}
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq" if self.zeros_minus_one else "gptq_v2"}


def int4_spec(quant: dict | None) -> Int4Spec | None:
    """The Int4Spec of a raw `quantization_config` (None for none, or for DeepSeek's own fp8 / fp4 configs)."""
    method = str((quant or {}).get("quant_method", "")).lower()
    if method not in INT4_METHODS:
        return None
    bits, group = quant.get("bits", quant.get("w_bit", 4)), quant.get("group_size", quant.get("q_group_size", 128))
    if bits != 4:
        raise QuantConfigError(f"quantization_config.bits = {bits!r}: deepinfer serves 4-bit {method} checkpoints")
    if not isinstance(group, int) or group <= 0 or group % PACK:
        raise QuantConfigError(f"quantization_config.group_size = {group!r}: need a positive multiple of {PACK} "
                               "(per-channel group_size -1 is not served)")
    if method == "awq":
        return _awq(quant, group)
    return _gptq(quant, group)


def _awq(quant: dict, group: int) -> Int4Spec:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm" or not quant.get("zero_point", True):
        raise QuantConfigError(f"quantization_config: AWQ version {version!r} zero_point "
                               f"{quant.get('zero_point', True)!r}; deepinfer reads the GEMM layout with zero points")
    skip = tuple(str(m) for m in quant.get("modules_to_not_convert") or ())
    return Int4Spec("awq", group, True, modules_to_not_convert=skip)


def _gptq(quant: dict, group: int) -> Int4Spec:
    fmt = str(quant.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantConfigError(f"quantization_config.checkpoint_format = {fmt!r}: expected 'gptq' or 'gptq_v2'")
    return Int4Spec("gptq", group, zeros_minus_one=fmt == "gptq")


def check_requested(requested: str | None, spec: Int4Spec | None) -> None:
    """`quantization=` (None: whatever the checkpoint says) against the checkpoint's layout."""
    if requested is not None and (spec is None or spec.method != requested):
        found = f"a {spec.method} checkpoint" if spec else "not an int4 checkpoint (no awq / gptq quantization_config)"
        raise QuantConfigError(f"quantization={requested!r} was requested, but the model is {found}")
