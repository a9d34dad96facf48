"""Errors for user mistakes: the CLI prints their message, never a stack trace."""


class SpecdraftError(Exception):
    """Base class for errors caused by input (paths, parameters, requests), not by bugs."""


class ModelLoadError(SpecdraftError):
    """A model reference that cannot be loaded: missing path, unsupported architecture, corrupt file."""


class ContextOverflowError(SpecdraftError):
    """The prompt plus requested tokens do not fit in the model's context / KV cache."""
