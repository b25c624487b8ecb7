"""Sessions -> training sequences, with discounted returns and group-relative advantages.

A session is one agent run: a set of completions (turns) linked by
``parent_id``, per-turn rewards (optional) and a final session reward.

Returns (DESIGN.md, "Rewards and advantages"). The turns of a session, ordered
by ``created_at`` across the whole session, are ``t = 1..T`` with rewards
``r_t`` (``CompletionRecord.reward``, unset = 0; the session reward is *added*
to the last turn's ``r_T``)::

    G_t = r_t + gamma * G_{t+1},    G_{T+1} = 0

Advantages (GRPO, Shao et al. 2024, eq. 3 for the group mean/std; RLOO,
Ahmadian et al. 2024, eq. 6 for leave-one-out). For session ``i`` of a group
``g`` with episode returns ``R_j = G_1^{(j)}`` of its sessions::

    b_i = mean_{j in g} R_j                      (group_mean)
    b_i = mean_{j in g, j != i} R_j              (leave_one_out)
    b_i = 0                                      (none)
    A_t^{(i)} = (G_t^{(i)} - b_i) / sigma_g      sigma_g = pstd_{j in g} R_j  (normalize_std)
    A_t^{(i)} =  G_t^{(i)} - b_i                 (otherwise)

Each generated token of turn ``t`` carries ``A_t``.

Where this departs from the papers:

1. GRPO's outcome supervision gives every token the single normalised episode
   reward. Here the *baseline and scale are episode-level* (``b_i`` and
   ``sigma_g`` come from ``G_1``), but the *quantity centred is the per-turn
   return* ``G_t``, so per-turn rewards survive normalisation: two turns with
   different returns keep different advantages. With only a final reward and
   ``gamma = 1`` every ``G_t = G_1`` and this is exactly GRPO / RLOO.
2. A group whose episode returns are all equal carries no relative signal and
   gets zero advantage on every turn (with any baseline but ``none``); so
   does a single-session group under ``leave_one_out`` (no other session to
   form a baseline). We never divide by ``sigma + epsilon``: zero std means
   zero advantage, small std means a genuinely small spread. The std is the
   population std (ddof = 0), as GRPO's reference implementations use.
3. Sessions with no completions have no turns and are left out of their
   group's statistics (they have nothing to train).

Sequences (``sample_mode``):

- ``chain``: a child whose ``prompt_ids`` starts token-exactly with
  ``parent.prompt_ids + parent.output_ids`` (and was sampled at the same
  temperature) continues its parent's sequence. Each root-to-leaf path of
  these links is one packed sequence (the leaf's prompt + output). A
  completion shared by several paths (a branch point) is trained in exactly
  one sequence, the one of the earliest-created leaf below it; elsewhere it is
  context with loss mask 0. A child that does not extend its parent starts a
  new sequence.
- ``individual``: one sequence per completion.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from proxima.proxy.store.records import CompletionRecord, SessionRecord

from .config import AdvantageConfig

Baseline = Literal["group_mean", "leave_one_out", "none"]

NOT_GENERATED_VERSION = -1  # `versions` value of prompt / context tokens


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sequence.

    All per-token lists have length ``num_tokens`` and are aligned with
    ``input_ids`` (entry ``i`` belongs to token ``input_ids[i]``); ``trainer.
    batching.pack`` shifts them onto next-token targets.
    """

    session_id: str
    group_id: str
    input_ids: list[int]  # (L,) prompt + generated tokens of the path
    loss_mask: list[int]  # (L,) 1 on generated tokens trained in this sequence, else 0
    behav_logprobs: list[float]  # (L,) behaviour logprob of trained tokens, else 0.0
    versions: list[int]  # (L,) policy version of trained tokens, else -1
    advantages: list[float]  # (L,) the turn's advantage A_t on its trained tokens, else 0.0
    temperature: float  # sampling temperature of every completion in the sequence
    completion_ids: tuple[str, ...] = ()  # completions trained in this sequence
    prox_logprobs: list[float] | None = None  # (L,) proximal logprobs, set by the trainer

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lists = {
            "loss_mask": self.loss_mask,
            "behav_logprobs": self.behav_logprobs,
            "versions": self.versions,
            "advantages": self.advantages,
        }
        if self.prox_logprobs is not None:
            lists["prox_logprobs"] = self.prox_logprobs
        for name, values in lists.items():
            if len(values) != n:
                raise ValueError(
                    f"Sample {self.session_id}: {name} has {len(values)} entries, expected {n}"
                )

    @property
    def num_tokens(self) -> int:
        """Sequence length L."""
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Number of tokens trained in this sequence."""
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        """Oldest policy version among the trained tokens (the staleness of the sample)."""
        trained = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        if not trained:
            raise ValueError(f"Sample of session {self.session_id} has no trained tokens")
        return min(trained)


# --------------------------------------------------------------------------- returns


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
        normalize_std: divide by the group's population std of episode returns ``G_1``.

    Returns:
        session id -> per-turn advantages ``A_1..A_T`` (same length as its returns).
        Zero for every turn of a group whose episode returns are all equal
        (any baseline but ``none``) and of a single-session group under
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
        episode = [float(returns_by_session[sid][0]) for sid in session_ids]  # R_j = G_1^(j)
        n = len(episode)
        # statistics.* use exact rational arithmetic on floats: equal returns give sigma == 0.0
        # exactly, so the zero-variance test below is not at the mercy of rounding.
        sigma = statistics.pstdev(episode) if n > 1 else 0.0  # population std over the group
        no_signal = baseline != "none" and (
            sigma == 0.0 or (baseline == "leave_one_out" and n == 1)
        )
        total = math.fsum(episode)
        group_mean = statistics.mean(episode)  # exact: equal returns give exactly that value
        for sid, own in zip(session_ids, episode, strict=True):
            returns = [float(g) for g in returns_by_session[sid]]
            if no_signal:
                advantages[sid] = [0.0] * len(returns)
                continue
            if baseline == "group_mean":
                b = group_mean  # b_i = mean_j R_j
            elif baseline == "leave_one_out":
                b = (total - own) / (n - 1)  # b_i = mean_{j != i} R_j
            else:
                b = 0.0
            scale = sigma if normalize_std else 1.0
            advantages[sid] = [(g - b) / scale for g in returns]  # A_t = (G_t - b_i) / sigma_g
    return advantages


# --------------------------------------------------------------------------- sequences


def _extends(child: CompletionRecord, parent: CompletionRecord) -> bool:
    """True iff ``child`` continues ``parent`` token-exactly at the same temperature."""
    prefix = parent.prompt_ids + parent.output_ids
    return (
        len(child.prompt_ids) >= len(prefix)
        and child.prompt_ids[: len(prefix)] == prefix
        and child.temperature == parent.temperature
    )


def _check_completion(completion: CompletionRecord) -> None:
    n = len(completion.output_ids)
    if len(completion.output_logprobs) != n or len(completion.output_versions) != n:
        raise ValueError(
            f"completion {completion.id}: {n} output_ids but {len(completion.output_logprobs)} "
            f"logprobs and {len(completion.output_versions)} versions"
        )


def _paths(
    completions: Sequence[CompletionRecord], mode: Literal["chain", "individual"]
) -> list[list[CompletionRecord]]:
    """Split a session's completions (in created_at order) into root-to-leaf paths."""
    if mode == "individual":
        return [[c] for c in completions]
    by_id = {c.id: c for c in completions}
    chain_parent: dict[str, str] = {}  # child id -> parent id, only for token-exact extensions
    for c in completions:
        parent = by_id.get(c.parent_id) if c.parent_id is not None else None
        if parent is not None and _extends(c, parent):
            chain_parent[c.id] = parent.id
    has_child = set(chain_parent.values())
    paths = []
    for leaf in completions:  # created_at order: earlier leaves claim shared ancestors first
        if leaf.id in has_child:
            continue
        path = [leaf]
        while path[-1].id in chain_parent:
            path.append(by_id[chain_parent[path[-1].id]])
        paths.append(path[::-1])  # root -> leaf
    return paths


def _session_samples(
    session: SessionRecord,
    completions: Sequence[CompletionRecord],
    advantage_of_turn: Mapping[str, float],
    mode: Literal["chain", "individual"],
) -> list[Sample]:
    group_id = session.group_id if session.group_id is not None else session.id
    assigned: set[str] = set()
    samples = []
    for path in _paths(completions, mode):
        leaf = path[-1]
        input_ids = leaf.prompt_ids + leaf.output_ids
        n = len(input_ids)
        loss_mask, behav, versions, adv = [0] * n, [0.0] * n, [NOT_GENERATED_VERSION] * n, [0.0] * n
        trained = []
        for c in path:
            if c.id in assigned or not c.output_ids:
                continue  # trained in an earlier path (branch point), or nothing generated
            assigned.add(c.id)
            trained.append(c.id)
            start, end = len(c.prompt_ids), len(c.prompt_ids) + len(c.output_ids)
            loss_mask[start:end] = [1] * (end - start)
            behav[start:end] = c.output_logprobs
            versions[start:end] = c.output_versions
            adv[start:end] = [advantage_of_turn[c.id]] * (end - start)
        if trained:
            samples.append(
                Sample(
                    session_id=session.id,
                    group_id=group_id,
                    input_ids=input_ids,
                    loss_mask=loss_mask,
                    behav_logprobs=behav,
                    versions=versions,
                    advantages=adv,
                    temperature=leaf.temperature,
                    completion_ids=tuple(trained),
                )
            )
    return samples


def session_rewards(session: SessionRecord, turns: Sequence[CompletionRecord]) -> list[float]:
    """Per-turn rewards ``r_t`` of turns in order: completion reward (unset = 0), plus the
    session reward (unset = 0) on the last turn."""
    rewards = [float(c.reward) if c.reward is not None else 0.0 for c in turns]
    if rewards and session.reward is not None:
        rewards[-1] += float(session.reward)
    return rewards


def build_samples(
    sessions: Sequence[tuple[SessionRecord, Sequence[CompletionRecord]]],
    cfg: AdvantageConfig,
) -> list[Sample]:
    """Turn finished sessions into training sequences with per-token advantages.

    Per session: order turns by ``created_at``, compute rewards and returns, then
    advantages relative to the session's group (``group_id``, or the session alone
    when it has none), and lay the completions out as sequences (``cfg.sample_mode``).
    Samples come out session by session, paths in created_at order of their leaves.
    """
    ordered: dict[str, tuple[SessionRecord, list[CompletionRecord]]] = {}
    for session, completions in sessions:
        if session.id in ordered:
            raise ValueError(f"session {session.id} appears twice in the batch")
        for c in completions:
            _check_completion(c)
        ordered[session.id] = (session, sorted(completions, key=lambda c: c.created_at))

    returns = {
        sid: discounted_returns(session_rewards(session, turns), cfg.discount)
        for sid, (session, turns) in ordered.items()
    }
    group_of = {
        sid: session.group_id if session.group_id is not None else sid
        for sid, (session, _) in ordered.items()
    }
    advantages = group_advantages(
        returns, group_of, baseline=cfg.baseline, normalize_std=cfg.normalize_std
    )

    samples: list[Sample] = []
    for sid, (session, turns) in ordered.items():
        advantage_of_turn = {c.id: a for c, a in zip(turns, advantages[sid], strict=True)}
        samples.extend(_session_samples(session, turns, advantage_of_turn, cfg.sample_mode))
    return samples


def filter_stale(
    samples: Sequence[Sample], current_version: int, max_staleness: int
) -> tuple[list[Sample], int]:
    """Drop samples whose oldest trained token is older than ``current_version - max_staleness``.

    Returns ``(kept, dropped_count)``; ``kept`` preserves the input order.
    """
    oldest_allowed = current_version - max_staleness
    kept = [s for s in samples if s.oldest_version >= oldest_allowed]
    return kept, len(samples) - len(kept)
