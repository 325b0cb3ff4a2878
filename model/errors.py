"""Typed errors of the model package.

Callers (prefill/decode workers, the CLI) must be able to tell "the request is bad" (`ModelInputError`) from
"this checkpoint is not something we can run" (`ConfigError`/`UnsupportedConfigError`) and "the weights do not
match the config" (`WeightsError`), without parsing messages. All subclass `ValueError` so generic callers
that only know the builtin still catch them.
"""

from __future__ import annotations


class ModelError(Exception):
    """Base of every error raised on purpose by ``kvpool.model``."""


class ModelInputError(ModelError, ValueError):
    """A request's tokens, start state or boundaries are invalid; nothing was computed."""


class EmptyPromptError(ModelInputError):
    """A prefill was asked for zero tokens."""


class TokenOutOfRangeError(ModelInputError):
    """A token id is negative or not below the vocabulary size."""


class BadStartStateError(ModelInputError):
    """A ``PrefixState``/``DecodeState`` does not fit this model or is not on the 64-token grid."""


class BadBoundaryError(ModelInputError):
    """A requested checkpoint boundary is not a segment end inside ``(start, L]``."""


class ConfigError(ModelError, ValueError):
    """A ``config.json`` is malformed or inconsistent."""


class UnsupportedConfigError(ConfigError):
    """A config asks for a feature this implementation does not provide (we refuse instead of guessing)."""


class WeightsError(ModelError, ValueError):
    """Checkpoint tensors do not match the config: missing, unexpected or wrongly shaped.

    ``tensor`` names the first offending tensor."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
