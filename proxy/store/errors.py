"""Domain errors of the trajectory store.

The store raises these plain exceptions; the API layer maps them to HTTP
statuses (``NotFound`` -> 404, ``RewardAlreadySet`` and ``Conflict`` -> 409)::

    StoreError                 base of everything the store raises on purpose
     +-- NotFound              a session / completion / key / version does not exist
     +-- Conflict              the request contradicts the stored state
          +-- RewardAlreadySet  a reward was already posted for this target
          +-- SessionClosed     the session is no longer open (finished, failed, taken)
          +-- NotAdmitted       admission refused a new training session (capacity)
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of the store's domain errors."""


class NotFound(StoreError):
    """The addressed row does not exist (or is not visible to the caller)."""


class Conflict(StoreError):
    """The operation is not allowed in the row's current state."""


class RewardAlreadySet(Conflict):
    """A reward was already posted; rewards are write-once."""


class SessionClosed(Conflict):
    """The session is not OPEN: it takes no more completions."""


class NotAdmitted(Conflict):
    """Admission refused a new training session; ``reason`` says which limit."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
