"""Admission of new training sessions (docs/design.md, "Staleness control").

With policy version ``i``, trainer batch size ``B`` and max staleness ``eta``,
a new training session is admitted only while ``N < (i + eta + 1) * B``, where
``N`` counts the training sessions admitted so far. Every admitted session is
then trained by a policy at most ``eta`` versions newer than the one that
started generating it. ``eta = 0`` is synchronous RL. Open sessions are also
capped, independently of the version.

Groups are admitted as a unit: the capacity rule decides on a group's first
session, and a session joining a group that already has an admitted session
is admitted whatever the capacity (only the open-session cap applies), so a
group is never split across policy versions by admission. A group admitted
just below the capacity can carry ``N`` past it by at most its size minus
one; the trainer's own rule (drop tokens older than ``i - eta``) still bounds
what is trained.
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
    joins_admitted_group: bool = False,
) -> Admission:
    """Admit a new training session? (module docstring: ``N < (i + eta + 1) * B``).

    ``joins_admitted_group``: the session's group already has an admitted
    session, so the group was admitted as a unit and this one follows it.
    """
    if open_sessions >= max_open_sessions:
        return Admission(False, f"{open_sessions} sessions are open (cap {max_open_sessions})")
    if max_staleness is None or joins_admitted_group:
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
