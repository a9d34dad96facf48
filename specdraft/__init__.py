"""specdraft: lossless speculative decoding for Hugging Face checkpoints."""

from specdraft.api import LLM, CompletionOutput, Logprob, RequestOutput
from specdraft.errors import ContextOverflowError, ModelLoadError, SpecdraftError
from specdraft.verify.sampling import InvalidParameterError, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "CompletionOutput", "ContextOverflowError", "InvalidParameterError", "Logprob", "ModelLoadError",
    "RequestOutput", "SamplingParams", "SpecdraftError", "__version__",
]
