"""The backend layer's errors: the backend subtree of ``proxima.proxy.errors``' one tree.

The backend client and pool raise these and know no HTTP of their own; the
edge answers any that reaches it with a 503 (``proxima.proxy.errors.KINDS``)::

    BackendError
    ├── BackendUnavailable       no healthy backend (the pool), interrupted too often
    ├── BackendConnectionError   the backend is unreachable or died mid-request (fail over)
    ├── BackendRejected          the backend refused the request (4xx): the request is wrong
    └── BackendOperationFailed   an admin call answered ``success: false`` or 5xx
"""

from __future__ import annotations

from proxima.proxy.errors import (
    BackendConnectionError,
    BackendError,
    BackendOperationFailed,
    BackendRejected,
    BackendUnavailable,
)

__all__ = [
    "BackendConnectionError",
    "BackendError",
    "BackendOperationFailed",
    "BackendRejected",
    "BackendUnavailable",
]
