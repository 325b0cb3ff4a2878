"""Typed errors of the serving workers (prefill, decode, colocated).

The gRPC layer maps them to status codes without parsing messages: a bad request is INVALID_ARGUMENT, a
cache problem under ``--on-cache-error fail`` is FAILED_PRECONDITION. Store trouble under the default
``recompute`` policy never surfaces as an error: it is counted and recomputed.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base of every error the workers raise on purpose."""


class BadRequestError(ServingError, ValueError):
    """The request itself is invalid (empty prompt, token out of range, bad sampling knob, bad handoff)."""


class CacheFetchError(ServingError):
    """A cache object was missing, corrupt or late and the worker runs with ``--on-cache-error fail``."""


# What a worker does when the cache fails it: recompute (default, never an error) or fail the request.
ON_CACHE_ERROR = ("recompute", "fail")
