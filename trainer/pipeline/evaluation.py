"""Held-out accuracy: the mean reward of an agent on held-out items through the proxy (served
unrecorded: no session), and the lines that report it before and after training."""

from __future__ import annotations

import asyncio
from typing import Any

from proxima.trainer.pipeline.config import EvalSection, TrainRunConfig
from proxima.trainer.pipeline.policies import Policy
from proxima.trainer.rollout.agents import resolve_agent

Accuracy = tuple[float, float | None]  # held-out, and in unseen phrasings (None: no such items)


async def evaluate(
    agent: str,
    items: list[dict[str, Any]],
    *,
    base_url: str,
    api_key: str,
    model: str,
    section: EvalSection,
    fields: dict[str, Any],
) -> float:
    """Mean reward of ``agent`` on ``items``, served unrecorded (admin key: no session)."""
    fn = resolve_agent(agent)
    chosen = items[: section.items] if section.items else items
    slots = asyncio.Semaphore(section.max_concurrency)

    async def one(item: dict[str, Any]) -> float:
        data = {
            **item,
            **fields,
            "base_url": base_url,
            "api_key": api_key,
            "model": model,
            "temperature": section.temperature,
        }
        async with slots:
            result = fn(data)
            if asyncio.iscoroutine(result):
                result = await result
        return float(result if not isinstance(result, dict) else result.get("final", 0.0))

    rewards = await asyncio.gather(*(one(i) for i in chosen))
    return sum(rewards) / max(1, len(rewards))


def scored_items(section: EvalSection, items: list[dict[str, Any]]) -> int:
    """How many of ``items`` the ``eval`` section scores."""
    return min(section.items, len(items)) if section.items else len(items)


def accuracy_line(
    cfg: TrainRunConfig, policy: Policy, before: Accuracy, after: Accuracy | None = None
) -> str:
    """``held-out accuracy before training: 23.0% (50 items); unseen phrasings: ...`` (before),
    ``held-out accuracy: 23.0% -> 41.0%; unseen phrasings: 18.0% -> 30.0%`` (after)."""
    items = policy.items
    if after is None:
        line = (
            f"{policy.prefix}held-out accuracy before training: {before[0]:.1%} "
            f"({scored_items(cfg.eval, items.test)} items)"
        )
        if before[1] is not None:
            line += f"; unseen phrasings: {before[1]:.1%} ({scored_items(cfg.eval, items.unseen)} items)"
        return line
    line = f"{policy.prefix}held-out accuracy: {before[0]:.1%} -> {after[0]:.1%}"
    if before[1] is not None and after[1] is not None:
        line += f"; unseen phrasings: {before[1]:.1%} -> {after[1]:.1%}"
    return line
