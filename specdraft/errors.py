"""Errors for user mistakes: the CLI prints their message, never a stack trace.

One leaf module that every layer may import (it imports nothing of specdraft), so that the runtime, the
verifier and the API raise the same family of errors and callers catch one base class.
"""


class SpecdraftError(Exception):
    """Base class for errors caused by input (paths, parameters, requests), not by bugs."""


class ModelLoadError(SpecdraftError):
    """A model reference that cannot be loaded: missing path, unsupported architecture, corrupt file."""


class ContextOverflowError(SpecdraftError):
    """The prompt plus requested tokens do not fit in the model's context / KV cache."""


class InvalidParameterError(SpecdraftError, ValueError):
    """A sampling, generation or configuration parameter that makes no sense."""
