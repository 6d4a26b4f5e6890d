"""Structured outputs: constrain sampling to a JSON schema, regex, choice, EBNF grammar or tool-call format.

`params` is the plain-data spec carried by SamplingParams; `backend` (xgrammar) validates and compiles
it; `manager` owns compilation in a thread pool, per-request matchers and the step's token bitmask.
"""

from deepinfer.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
