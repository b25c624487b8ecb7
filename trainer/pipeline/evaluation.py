"""Held-out accuracy: the mean reward of an agent on held-out items through the proxy (served
unrecorded: no session), and the lines that report it before and after training.

Every evaluation item carries ``report = True`` and the ``eval`` section's ``item_fields``
over the rollout's (``make demo`` trains on one turn and evaluates two). An agent returns a
float (its reward), or a mapping with ``final`` (the reward: success within its turns) and,
where it can tell, ``first_try`` (1.0 when its first answer alone was right) and
``truncated`` (1.0 when its first answer was cut at ``max_tokens``); any other number every
item reports is averaged into ``Score.metrics`` (the tool demo's ``well_formed`` and
``turns``, reported by :func:`tool_line`). The headline is
first-try accuracy when every item reports it, else the mean reward; a :class:`Score` keeps
all three. With ``report``, ``proxima.agents_examples.math_agent`` returns the mapping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from proxima.trainer.pipeline.config import EvalSection, TrainRunConfig
from proxima.trainer.pipeline.policies import Policy
from proxima.trainer.rollout.agents import resolve_agent

_TRIES = {2: "two", 3: "three", 4: "four", 5: "five"}


@dataclass(frozen=True, slots=True)
class Score:
    """One evaluation of one item set: the mean reward (success within the agent's turns),
    first-try accuracy and the share of first answers cut at ``max_tokens`` (None: some item
    did not report it)."""

    accuracy: float
    first_try: float | None = None
    truncated: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def headline(self) -> float:
        """First-try accuracy where reported, else the mean reward."""
        return self.accuracy if self.first_try is None else self.first_try

    def as_dict(self) -> dict[str, float | None]:
        fixed = {
            "accuracy": self.accuracy,
            "first_try": self.first_try,
            "truncated": self.truncated,
        }
        return {**self.metrics, **fixed}


class Accuracy(NamedTuple):
    """The held-out set's score and the unseen-phrasings set's (None without such items)."""

    test: Score
    unseen: Score | None


def _mean(values: list[float | None]) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None) / len(values)


_FIXED = frozenset({"final", "first_try", "truncated"})


def _metrics(results: list[Any]) -> dict[str, float]:
    """The mean of every other number all ``results`` report (none when one is a float)."""
    if not results or not all(isinstance(r, Mapping) for r in results):
        return {}
    keys = set.intersection(*(set(r) for r in results)) - _FIXED
    numeric = [
        k
        for k in sorted(keys)
        if all(isinstance(r[k], int | float) and not isinstance(r[k], bool) for r in results)
    ]
    return {k: sum(float(r[k]) for r in results) / len(results) for k in numeric}


def _reported(result: Any, key: str) -> float | None:
    if isinstance(result, Mapping) and result.get(key) is not None:
        return float(result[key])
    return None


async def evaluate(
    agent: str,
    items: list[dict[str, Any]],
    *,
    base_url: str,
    api_key: str,
    model: str,
    section: EvalSection,
    fields: dict[str, Any],
) -> Score:
    """``agent`` on ``items``, served unrecorded (admin key: no session)."""
    fn = resolve_agent(agent)
    chosen = items[: section.items] if section.items else items
    slots = asyncio.Semaphore(section.max_concurrency)

    async def one(item: dict[str, Any]) -> Any:
        data = {
            **item,
            **fields,
            **section.item_fields,
            "report": True,
            "base_url": base_url,
            "api_key": api_key,
            "model": model,
            "temperature": section.temperature,
        }
        async with slots:
            result = fn(data)
            if asyncio.iscoroutine(result):
                result = await result
        return result

    results = await asyncio.gather(*(one(i) for i in chosen))
    finals = [float(r.get("final", 0.0)) if isinstance(r, Mapping) else float(r) for r in results]
    return Score(
        accuracy=sum(finals) / max(1, len(finals)),
        first_try=_mean([_reported(r, "first_try") for r in results]),
        truncated=_mean([_reported(r, "truncated") for r in results]),
        metrics=_metrics(results),
    )


def scored_items(section: EvalSection, items: list[dict[str, Any]]) -> int:
    """How many of ``items`` the ``eval`` section scores."""
    return min(section.items, len(items)) if section.items else len(items)


def _tries(cfg: TrainRunConfig, policy: Policy) -> str | None:
    """``within two tries`` (the evaluation's ``max_turns``); None with one turn (the first
    try is the only one)."""
    turns = {**policy.fields, **cfg.eval.item_fields}.get("max_turns")
    if turns == 1:
        return None
    if isinstance(turns, int) and turns > 1:
        return f"within {_TRIES.get(turns, str(turns))} tries"
    return "within its turns"


def _pair(before: float | None, after: float | None) -> str:
    return f"{before:.1%} -> {after:.1%}" if before is not None and after is not None else "n/a"


def accuracy_line(
    cfg: TrainRunConfig, policy: Policy, before: Accuracy, after: Accuracy | None = None
) -> str:
    """Before training: ``first-try accuracy before training: 20.0% (50 items); within two
    tries: 30.0%; unseen phrasings (first try): 18.0% (50 items)``; after:
    ``first-try accuracy: 20.0% -> 44.0%; within two tries: 30.0% -> 52.0%; unseen phrasings
    (first try): 18.0% -> 34.0%``. An agent that reports no first try gets ``held-out
    accuracy`` and ``unseen phrasings`` (its mean reward) instead."""
    first = before.test.first_try is not None
    name = "first-try accuracy" if first else "held-out accuracy"
    unseen_name = "unseen phrasings (first try)" if first else "unseen phrasings"
    items = policy.items
    if after is None:
        line = (
            f"{policy.prefix}{name} before training: {before.test.headline:.1%} "
            f"({scored_items(cfg.eval, items.test)} items)"
        )
        tries = _tries(cfg, policy) if first else None
        if tries is not None:
            line += f"; {tries}: {before.test.accuracy:.1%}"
        if before.unseen is not None:
            line += (
                f"; {unseen_name}: {before.unseen.headline:.1%} "
                f"({scored_items(cfg.eval, items.unseen)} items)"
            )
        return line
    line = f"{policy.prefix}{name}: {before.test.headline:.1%} -> {after.test.headline:.1%}"
    tries = _tries(cfg, policy) if first else None
    if tries is not None:
        line += f"; {tries}: {before.test.accuracy:.1%} -> {after.test.accuracy:.1%}"
    if before.unseen is not None and after.unseen is not None:
        line += f"; {unseen_name}: {before.unseen.headline:.1%} -> {after.unseen.headline:.1%}"
    return line


def truncation_line(
    cfg: TrainRunConfig, policy: Policy, before: Accuracy, after: Accuracy | None = None
) -> str | None:
    """``first answers cut at max_tokens (32): 20.0% -> 0.0% held-out, 18.0% -> 2.0% unseen
    phrasings`` (None when the agent reports no truncation)."""
    if before.test.truncated is None:
        return None
    limit = {**policy.fields, **cfg.eval.item_fields}.get("max_tokens", "the agent's default")
    sets = [("held-out", before.test, after.test if after else None)]
    if before.unseen is not None:
        sets.append(("unseen phrasings", before.unseen, after.unseen if after else None))
    if after is None:
        parts = [f"{b.truncated:.1%} {label}" for label, b, _ in sets if b.truncated is not None]
        return f"{policy.prefix}first answers cut at max_tokens ({limit}): {', '.join(parts)}"
    parts = [f"{_pair(b.truncated, a.truncated if a else None)} {label}" for label, b, a in sets]
    return f"{policy.prefix}first answers cut at max_tokens ({limit}): {', '.join(parts)}"


def tool_line(policy: Policy, before: Accuracy, after: Accuracy) -> str | None:
    """Two lines on held-out items when the agent reports ``well_formed`` (the tool demo's
    agent), else None: ``tool agent: mean turns 1.90 -> 2.00`` and, last (``make demo-tools``
    ends with it), ``tool agent: first-try accuracy 3.0% -> 41.0%; well-formed tool calls
    50.0% -> 96.0%``."""
    b, a = before.test, after.test
    if "well_formed" not in b.metrics or "well_formed" not in a.metrics:
        return None
    head = f"{policy.prefix}tool agent: "
    lines = []
    if "turns" in b.metrics and "turns" in a.metrics:
        lines.append(f"{head}mean turns {b.metrics['turns']:.2f} -> {a.metrics['turns']:.2f}")
    lines.append(
        f"{head}first-try accuracy {_pair(b.first_try, a.first_try)}; "
        f"well-formed tool calls {_pair(b.metrics['well_formed'], a.metrics['well_formed'])}"
    )
    return "\n".join(lines)
