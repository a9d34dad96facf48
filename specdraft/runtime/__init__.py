"""Model runtime: checkpoints, the transformer forward pass and its KV cache. Knows nothing of speculation."""

from specdraft.errors import ContextOverflowError, ModelLoadError, SpecdraftError
from specdraft.runtime.config import ModelConfig
from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.loader import CATALOG, load_model, load_tokenizer, resolve
from specdraft.runtime.model import Transformer
from specdraft.runtime.tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "CATALOG", "ContextOverflowError", "KVCache", "ModelConfig", "ModelLoadError", "SpecdraftError",
    "StreamDecoder", "Tokenizer", "Transformer", "load_model", "load_tokenizer", "resolve",
]
