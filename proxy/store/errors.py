"""The store's errors: the store subtree of ``proxima.proxy.errors``' one tree.

The store raises these; the edge answers them from the one table
(``proxima.proxy.errors.KINDS``)::

    NotFound                   a session / completion / key / version does not exist (404)
    Conflict                   the request contradicts the stored state (409)
     +-- RewardAlreadySet      a reward was already posted for this target
     +-- SessionClosed         the session is no longer open (finished, failed, taken)
     +-- NotAdmitted           admission refused a new training session (capacity)
    StoreError                 the store cannot work (schema not current, a broken chain): 500
"""

from __future__ import annotations

from proxima.proxy.errors import (
    Conflict,
    NotAdmitted,
    NotFound,
    RewardAlreadySet,
    SessionClosed,
    StoreError,
)

__all__ = ["Conflict", "NotAdmitted", "NotFound", "RewardAlreadySet", "SessionClosed", "StoreError"]
