"""Discounted returns and group-relative advantages over the turns of sessions.

Returns (docs/design.md, "Rewards and advantages"). The turns of a session in
order ``t = 1..T`` with rewards ``r_t`` (unset = 0; the session reward is added
to the last turn)::

    G_t = r_t + gamma * G_{t+1},    G_{T+1} = 0

Advantages (GRPO, Shao et al. 2024, eq. 3 for the group mean/std; RLOO,
Ahmadian et al. 2024, eq. 6 for leave-one-out), with statistics over every
(session, turn) return of a group ``g`` of ``n`` sessions, each session
weighing 1 in total (``1 / T_i`` per turn)::

    m_i     = (1 / T_i) sum_t G_t^(i)                       session mean return
    mu_g    = (1 / n) sum_i m_i                              group mean
    sigma_g = sqrt((1 / n) sum_i (1 / T_i) sum_t (G_t^(i) - mu_g)^2)
    b_i     = mu_g                                           (group_mean)
    b_i     = (1 / (n - 1)) sum_{j != i} m_j                 (leave_one_out)
    b_i     = 0                                              (none)
    A_t^(i) = (G_t^(i) - b_i) / sigma_g                      (normalize_std)
    A_t^(i) =  G_t^(i) - b_i                                 (otherwise)

Each generated token of turn ``t`` carries ``A_t``.

Sessions without a group (``group_id`` None: every production session) are
pooled into one group per batch (``ungrouped = "batch"``): a batch-level
baseline, as REINFORCE with a mean-reward baseline. We chose it over a running
mean across steps because it needs no state (nothing to checkpoint or to
resume), and its sessions come from the same few policy versions as the
sessions they are compared with, whereas a running mean mixes returns of
policies many pushes old. ``ungrouped = "alone"`` keeps each such session a
group of one (zero advantage under any baseline but ``none`` unless its
turns' returns differ).

Where this departs from the papers:

1. GRPO gives every token the normalised episode reward. Here every turn
   keeps its own return ``G_t``, and the baseline and scale are statistics
   over all (session, turn) returns of the group. With only a final reward and
   ``gamma = 1`` every ``G_t^(i) = R_i``, the weights make ``mu_g``,
   ``sigma_g`` the mean and population std of the ``R_i``, and this is
   exactly GRPO (or RLOO). Per-turn rewards survive: returns ``[0, -1]`` and
   ``[0, 0]`` (rewards ``[1, -1]`` and ``[0, 0]`` at gamma 1) tie on ``G_1``
   yet get different advantages. Because ``sigma_g`` includes the spread of
   the turns' returns, a turn of weight share ``p = 1 / (n T_i)`` has
   ``|A| <= sqrt((1 - p) / p) = sqrt(n T_i - 1)`` under ``group_mean`` (GRPO's
   ``sqrt(n - 1)`` when ``T_i = 1``). An episode-level std with per-turn
   returns has no such bound: two sessions succeeding after 3 turns and two
   after 4, at gamma 0.9, get advantages up to 5.69 that way and 1.65 here.
2. A shared baseline compares returns of different turns: with ``gamma < 1``
   and only a final reward, early turns (smaller ``G_t``) are pushed down
   relative to late turns of the same session. A per-state value would avoid
   that; without a critic there is none.
3. A group whose returns are all equal carries no signal and gets zero
   advantage on every turn (any baseline but ``none``); so does a
   single-session group under ``leave_one_out``. We never divide by
   ``sigma + epsilon``: equal returns are detected exactly, and any other
   spread is genuine. Population std (ddof = 0), as GRPO's implementations.
4. Sessions with no completions have no turns and are left out of the
   statistics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

Baseline = Literal["group_mean", "leave_one_out", "none"]
Ungrouped = Literal["batch", "alone"]

UNGROUPED_GROUP = "\x00ungrouped"  # group id of the batch pool of ungrouped sessions


def discounted_returns(rewards: Sequence[float], discount: float) -> list[float]:
    """Per-turn returns ``G_t = r_t + discount * G_{t+1}`` with ``G_{T+1} = 0``.

    Shape: ``(T,) -> (T,)``. Example: rewards ``[1, 0, 2]``, discount 0.9 ->
    ``[1 + 0.9 * 0 + 0.81 * 2, 0 + 0.9 * 2, 2] = [2.62, 1.8, 2.0]``.
    """
    returns = [0.0] * len(rewards)
    next_return = 0.0  # G_{T+1}
    for t in reversed(range(len(rewards))):
        next_return = float(rewards[t]) + discount * next_return  # G_t = r_t + gamma * G_{t+1}
        returns[t] = next_return
    return returns


def advantage_groups(
    group_ids: Mapping[str, str | None], *, ungrouped: Ungrouped
) -> dict[str, str]:
    """Session id -> the group its advantages are computed in.

    A session with a ``group_id`` is in that group; one without is in the
    batch pool (``ungrouped = "batch"``) or alone (``"alone"``). Pooled ids
    cannot collide with real group ids (they start with a NUL character).
    """
    out = {}
    for sid, gid in group_ids.items():
        if gid is not None:
            out[sid] = gid
        elif ungrouped == "batch":
            out[sid] = UNGROUPED_GROUP
        else:
            out[sid] = "\x00alone:" + sid
    return out


def group_advantages(
    returns_by_session: Mapping[str, Sequence[float]],
    group_of: Mapping[str, str],
    *,
    baseline: Baseline,
    normalize_std: bool,
) -> dict[str, list[float]]:
    """Group-relative per-turn advantages (see the module docstring for the equations).

    Args:
        returns_by_session: session id -> its per-turn returns ``G_1..G_T`` (``(T_i,)``).
            Sessions with no turns are left out of the statistics (and get ``[]``).
        group_of: session id -> group id (sessions sharing a group id are compared).
        baseline: ``group_mean`` (GRPO), ``leave_one_out`` (RLOO) or ``none``.
        normalize_std: divide by the group's session-weighted population std of
            all its (session, turn) returns.

    Returns:
        session id -> per-turn advantages ``A_1..A_T`` (same length as its returns).
        Zero for every turn of a group whose returns are all equal (any
        baseline but ``none``) and of a single-session group under
        ``leave_one_out``.
    """
    if baseline == "none" and normalize_std:
        raise ValueError("normalize_std needs a baseline (group_mean or leave_one_out)")
    members: dict[str, list[str]] = {}
    for session_id, returns in returns_by_session.items():
        if returns:
            members.setdefault(group_of[session_id], []).append(session_id)

    advantages: dict[str, list[float]] = {
        sid: [] for sid, returns in returns_by_session.items() if not returns
    }
    for session_ids in members.values():
        group_returns = {sid: [float(g) for g in returns_by_session[sid]] for sid in session_ids}
        n = len(session_ids)
        session_mean = {sid: math.fsum(g) / len(g) for sid, g in group_returns.items()}  # m_i
        mu = math.fsum(session_mean.values()) / n  # mu_g
        variance = (
            math.fsum(
                math.fsum((g - mu) ** 2 for g in group_returns[sid]) / len(group_returns[sid])
                for sid in session_ids
            )
            / n
        )  # sigma_g^2, each session weighing 1
        all_equal = len({g for gs in group_returns.values() for g in gs}) == 1  # exact, no rounding
        no_signal = baseline != "none" and (all_equal or (baseline == "leave_one_out" and n == 1))
        sigma = math.sqrt(variance) if normalize_std else 1.0
        total = math.fsum(session_mean.values())
        for sid in session_ids:
            if no_signal:
                advantages[sid] = [0.0] * len(group_returns[sid])
                continue
            if baseline == "group_mean":
                b = mu  # b_i = mu_g
            elif baseline == "leave_one_out":
                b = (total - session_mean[sid]) / (n - 1)  # b_i = mean_{j != i} m_j
            else:
                b = 0.0
            advantages[sid] = [
                (g - b) / sigma for g in group_returns[sid]
            ]  # A_t = (G_t - b_i) / sigma
    return advantages
