"""Backend errors.

BackendError
├── BackendConnectionError   the backend is unreachable or died mid-request (fail over)
├── BackendRejected          the backend refused the request (4xx): the request is wrong
└── BackendOperationFailed   an admin call answered ``success: false`` or 5xx
"""

from __future__ import annotations


class BackendError(Exception):
    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url


class BackendConnectionError(BackendError):
    pass


class BackendRejected(BackendError):
    def __init__(self, message: str, *, url: str | None = None, status_code: int = 400):
        super().__init__(message, url=url)
        self.status_code = status_code


class BackendOperationFailed(BackendError):
    pass
