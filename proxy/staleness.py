"""Admission of new training sessions (DESIGN.md, "Staleness control").

With policy version ``i``, trainer batch size ``B`` and max staleness ``eta``,
a new training session is admitted only while ``N < (i + eta + 1) * B``, where
``N`` counts the training sessions admitted so far. Every admitted session is
then trained by a policy at most ``eta`` versions newer than the one that
started generating it. ``eta = 0`` is synchronous RL. Open sessions are also
capped, independently of the version.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    reason: str = ""


def staleness_capacity(*, version: int, max_staleness: int, batch_size: int) -> int:
    """Most training sessions that may exist at policy ``version``: ``(i + eta + 1) * B``."""
    return (version + max_staleness + 1) * batch_size


def admit(
    *,
    admitted_so_far: int,
    open_sessions: int,
    version: int,
    max_staleness: int | None,
    batch_size: int,
    max_open_sessions: int,
) -> Admission:
    if open_sessions >= max_open_sessions:
        return Admission(False, f"{open_sessions} sessions are open (cap {max_open_sessions})")
    if max_staleness is None:
        return Admission(True)
    capacity = staleness_capacity(
        version=version, max_staleness=max_staleness, batch_size=batch_size
    )
    if admitted_so_far >= capacity:
        return Admission(
            False,
            f"staleness capacity reached: {admitted_so_far} sessions admitted, "
            f"(version {version} + max_staleness {max_staleness} + 1) * batch {batch_size} "
            f"= {capacity}; wait for the next policy version",
        )
    return Admission(True)
