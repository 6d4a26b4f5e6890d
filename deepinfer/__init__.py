"""deepinfer: an inference and serving engine for the DeepSeek model family."""

from deepinfer.llm import LLM
from deepinfer.logger import setup_logging
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]
setup_logging()
