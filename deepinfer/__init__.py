"""deepinfer: an inference and serving engine for the DeepSeek model family."""

__version__ = "0.1.0"  # first: modules imported below read it

from deepinfer.llm import LLM
from deepinfer.logger import setup_logging
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]
setup_logging()
