"""The embedded engine's errors, and the HTTP status each one answers with.

::

    EngineError
    ├── InvalidRequestError      bad prompt / params / duplicate rid   (HTTP 400)
    └── EngineUnavailableError   the worker is not running             (HTTP 503)
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's errors."""


class InvalidRequestError(EngineError):
    """The request cannot be served as given (HTTP 400)."""


class EngineUnavailableError(EngineError):
    """The worker thread is not running (HTTP 503)."""
