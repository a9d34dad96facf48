"""specdraft: lossless speculative decoding for Hugging Face checkpoints."""

from specdraft.api import LLM, CompletionOutput, RequestOutput
from specdraft.errors import ContextOverflowError, ModelLoadError, SpecdraftError
from specdraft.verify.sampling import InvalidParameterError, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "CompletionOutput", "ContextOverflowError", "InvalidParameterError", "ModelLoadError",
    "RequestOutput", "SamplingParams", "SpecdraftError", "__version__",
]
