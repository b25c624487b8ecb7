"""Sessions -> training sequences with per-token advantages.

A session is one agent run: a set of completions (turns) linked by
``parent_id``, per-turn rewards (optional) and a final session reward.
Returns and advantages are computed by ``proxima.trainer.advantages`` over the
turns ordered by ``created_at`` across the whole session; every generated
token of a turn carries that turn's advantage.

Temperature: a sample carries the temperature its behaviour logprobs were
*reported* at (:func:`logprob_temperature`), which is not always the one
requested. A greedy request (temperature below ``GREEDY_TEMPERATURE``) is
served by argmax, and both SGLang (``SamplingParams`` rewrites ``T < 1e-6`` to
``T = 1, top_k = 1``) and the embedded engine (``effective_temperature``)
report its logprobs at ``T = 1``; the trainer recomputes them at ``T = 1`` too,
so ``w = exp(prox - behav)`` compares like with like. Greedy tokens are not
samples of the distribution their logprob describes; the importance weight
then measures how far the policy moved, not an unbiased correction.

Transformed distributions: a completion sampled under ``logit_bias`` or penalties
has behaviour logprobs the trainer cannot recompute; it is context (loss mask 0),
never loss tokens (``proxima.trainer.logit_transforms``). A completion sampled under
a grammar alone trains (``constrained=True``) when its record holds the grammar: its
sample carries a :class:`ConstrainedSpan` per such completion, whose masks the trainer
replays before the forward pass (``proxima.trainer.constrained``).

Validation: :func:`session_problem` says why a session's records cannot be
trained (misaligned lists, non-finite logprobs, positive logprobs, negative
token ids); the loop drops such a session with that reason instead of failing
the step, so one bad session never stops training or loops on restart.

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

import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from proxima.proxy.store.records import CompletionRecord, SessionRecord

from .advantages import (
    Baseline,
    advantage_groups,
    discounted_returns,
    group_advantages,
)
from .config import AdvantageConfig
from .constrained import ConstrainedSpan, GrammarMask, replayable
from .logit_transforms import behaviour_logprobs_reproducible

__all__ = [
    "Baseline",
    "Sample",
    "build_samples",
    "discounted_returns",
    "filter_stale",
    "group_advantages",
    "logprob_temperature",
    "session_problem",
    "zero_signal_filter",
]

NOT_GENERATED_VERSION = -1  # `versions` value of prompt / context tokens

GREEDY_TEMPERATURE = 1e-5
"""Requested temperatures below this are greedy, with logprobs reported at ``T = 1``
(the embedded engine's threshold; SGLang's is 1e-6, a gap no client sends)."""


def logprob_temperature(completion: CompletionRecord) -> float:
    """The temperature ``completion``'s logprobs were reported at: 1.0 for greedy requests."""
    requested = completion.temperature
    return 1.0 if requested < GREEDY_TEMPERATURE else requested


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
    constraints: tuple[ConstrainedSpan, ...] = ()  # constrained completions trained here
    grammar_mask: GrammarMask | None = None  # their replayed masks (``constrained.GrammarReplay``)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lists: dict[str, Sequence[object]] = {
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

    def with_grammar_mask(self, loss_mask: list[int], mask: GrammarMask | None) -> Sample:
        """A copy with ``loss_mask``, ``mask`` as its grammar mask and no spans left to replay
        (``proxima.trainer.constrained.GrammarReplay.attach``)."""
        return dataclasses.replace(self, loss_mask=loss_mask, grammar_mask=mask, constraints=())

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


# --------------------------------------------------------------------------- sequences


def _extends(child: CompletionRecord, parent: CompletionRecord) -> bool:
    """True iff ``child`` continues ``parent`` token-exactly at the same temperature."""
    prefix = parent.prompt_ids + parent.output_ids
    return (
        len(child.prompt_ids) >= len(prefix)
        and child.prompt_ids[: len(prefix)] == prefix
        and logprob_temperature(child) == logprob_temperature(parent)
    )


def _completion_problem(c: CompletionRecord, vocab_size: int | None) -> str | None:
    n = len(c.output_ids)
    if len(c.output_logprobs) != n or len(c.output_versions) != n:
        return (
            f"completion {c.id}: {n} output_ids but {len(c.output_logprobs)} "
            f"logprobs and {len(c.output_versions)} versions"
        )
    ids = c.prompt_ids + c.output_ids
    if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
        return f"completion {c.id}: token id outside the vocabulary [0, {vocab_size})"
    bad = [x for x in c.output_logprobs if not math.isfinite(x) or x > 1e-4]
    if bad:
        return f"completion {c.id}: logprob {bad[0]} is not a finite value <= 0"
    if not math.isfinite(c.temperature) or c.temperature < 0:
        return f"completion {c.id}: temperature {c.temperature} is not a finite value >= 0"
    return None


def session_problem(
    completions: Sequence[CompletionRecord], *, vocab_size: int | None = None
) -> str | None:
    """Why these records of one session cannot be trained, or None when they can.

    Checked per completion: aligned output lists, token ids in ``[0, vocab_size)``,
    logprobs finite and ``<= 0`` (1e-4 of rounding allowed), temperature finite and ``>= 0``.
    """
    for c in completions:
        problem = _completion_problem(c, vocab_size)
        if problem is not None:
            return problem
    return None


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
    constrained: bool,
) -> list[Sample]:
    group_id = session.group_id if session.group_id is not None else session.id  # for logging
    assigned: set[str] = set()
    samples = []
    for path in _paths(completions, mode):
        leaf = path[-1]
        input_ids = leaf.prompt_ids + leaf.output_ids
        n = len(input_ids)
        loss_mask, behav, versions, adv = [0] * n, [0.0] * n, [NOT_GENERATED_VERSION] * n, [0.0] * n
        trained = []
        spans: list[ConstrainedSpan] = []
        for c in path:
            masked = constrained and c.grammar is not None and replayable(c)
            if c.id in assigned or not c.output_ids:
                continue  # trained in an earlier path (branch point), or nothing generated
            if not (masked or behaviour_logprobs_reproducible(c)):
                continue  # a transformed distribution (context only: wrong ratio otherwise)
            assigned.add(c.id)
            trained.append(c.id)
            start, end = len(c.prompt_ids), len(c.prompt_ids) + len(c.output_ids)
            if masked:
                assert c.grammar is not None
                spans.append(ConstrainedSpan(start, end, c.grammar))
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
                    temperature=logprob_temperature(leaf),
                    completion_ids=tuple(trained),
                    constraints=tuple(spans),
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
    *,
    constrained: bool = False,
) -> list[Sample]:
    """Turn finished sessions into training sequences with per-token advantages.

    Per session: order turns by ``created_at``, compute rewards and returns, then
    advantages relative to the session's group (``group_id``; sessions without
    one are pooled per ``cfg.ungrouped``), and lay the completions out as
    sequences (``cfg.sample_mode``); with ``constrained``, completions decoded under a
    recorded grammar are trained too (their spans in ``Sample.constraints``). Raises ``ValueError`` naming the session
    when one has records :func:`session_problem` rejects.
    Samples come out session by session, paths in created_at order of their leaves.
    """
    ordered: dict[str, tuple[SessionRecord, list[CompletionRecord]]] = {}
    for session, completions in sessions:
        if session.id in ordered:
            raise ValueError(f"session {session.id} appears twice in the batch")
        problem = session_problem(completions)
        if problem is not None:
            raise ValueError(f"session {session.id}: {problem}")
        ordered[session.id] = (session, sorted(completions, key=lambda c: c.created_at))

    returns = {
        sid: discounted_returns(session_rewards(session, turns), cfg.discount)
        for sid, (session, turns) in ordered.items()
    }
    group_of = advantage_groups(
        {sid: session.group_id for sid, (session, _) in ordered.items()},
        ungrouped=cfg.ungrouped,
    )
    advantages = group_advantages(
        returns, group_of, baseline=cfg.baseline, normalize_std=cfg.normalize_std
    )

    samples: list[Sample] = []
    for sid, (session, turns) in ordered.items():
        advantage_of_turn = {c.id: a for c, a in zip(turns, advantages[sid], strict=True)}
        samples.extend(
            _session_samples(session, turns, advantage_of_turn, cfg.sample_mode, constrained)
        )
    return samples


def zero_signal_filter(
    samples: Sequence[Sample], mode: Literal["refill", "filter", "skip", "keep"]
) -> tuple[list[Sample], int]:
    """Leave out samples that carry no policy gradient (``advantage.zero_signal``).

    A sample whose trained tokens all have ``A = 0`` adds nothing to the
    gradient but its tokens to the token-mean denominator, diluting every
    other token's weight. ``refill`` and ``filter`` remove such samples
    (``refill`` also refills the batch with other groups before the step:
    ``proxima.trainer.loop``, DAPO's dynamic sampling, Yu et al. 2025;
    ``filter`` does not); ``skip`` removes
    all samples only when none has signal (so no optimizer step is taken and
    no version pushed); ``keep`` removes nothing.

    Returns ``(kept, removed_count)``; ``kept`` preserves the input order.
    """
    has_signal = [
        any(a != 0.0 for a, m in zip(s.advantages, s.loss_mask, strict=True) if m) for s in samples
    ]
    if mode in ("refill", "filter"):
        kept = [s for s, signal in zip(samples, has_signal, strict=True) if signal]
    elif mode == "skip":
        kept = list(samples) if any(has_signal) else []
    else:
        kept = list(samples)
    return kept, len(samples) - len(kept)


def filter_stale(
    samples: Sequence[Sample],
    current_version: int,
    max_staleness: int,
    rule: Literal["token", "sample"] = "token",
) -> tuple[list[Sample], int]:
    """Bound staleness: nothing older than ``current_version - max_staleness`` is trained.

    ``token``: tokens older than the bound leave the loss (mask 0; they stay
    as context), the rest of their sample trains; a sample with no trained
    token left is dropped. ``sample``: a sample whose oldest trained token is
    older than the bound is dropped whole. Both give the same guarantee on
    every trained token; ``sample`` also discards the fresh tokens of any
    completion whose decode spanned more than ``max_staleness`` pushes, and so
    drops the longest answers preferentially.

    Returns ``(kept, dropped_count)``; ``kept`` preserves the input order.
    """
    oldest_allowed = current_version - max_staleness
    if rule == "sample":
        kept = [s for s in samples if s.oldest_version >= oldest_allowed]
        return kept, len(samples) - len(kept)
    kept = []
    for s in samples:
        mask = [
            m if v >= oldest_allowed else 0 for m, v in zip(s.loss_mask, s.versions, strict=True)
        ]
        if not any(mask):
            continue
        kept.append(s if mask == s.loss_mask else dataclasses.replace(s, loss_mask=mask))
    return kept, len(samples) - len(kept)


# --------------------------------------------------------------------------- batch checks

logger = logging.getLogger(__name__)


def vocab_size_of(model_dir: Path | None) -> int | None:
    """The policy's vocabulary size from its HF ``config.json`` (None when unknown)."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def without_invalid(
    batch: list[tuple[SessionRecord, list[CompletionRecord]]], vocab_size: int | None
) -> list[tuple[SessionRecord, list[CompletionRecord]]]:
    """The batch without sessions whose records cannot be trained (each logged with why).

    They are left CLAIMED here and marked DROPPED with the other dropped sessions.
    """
    kept = []
    for session, completions in batch:
        problem = session_problem(completions, vocab_size=vocab_size)
        if problem is None:
            kept.append((session, completions))
        else:
            logger.error("session %s cannot be trained, dropped: %s", session.id, problem)
    return kept


def drop_too_long(samples: list[Sample], max_tokens: int) -> tuple[list[Sample], int]:
    """Samples of at most ``max_tokens`` tokens (one micro-batch), and how many were dropped."""
    kept = [s for s in samples if s.num_tokens <= max_tokens]
    if len(kept) < len(samples):
        longest = max(s.num_tokens for s in samples)
        logger.warning(
            "dropped %d samples longer than batching.max_tokens_per_mb=%d (longest %d tokens); "
            "raise max_tokens_per_mb or cap the agent's context",
            len(samples) - len(kept),
            max_tokens,
            longest,
        )
    return kept, len(samples) - len(kept)
