"""A run's step logs and reward curves: the step records its trainer appends (one per PPO
step, per policy), and the PNG of their mean reward with held-out accuracy before and after."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a line being written
        if record.get("event", "step") == "step":
            records.append(record)
    return records


def read_events(path: Path, name: str) -> list[dict[str, Any]]:
    """The ``{"event": name, ...}`` records of a trainer log, in order."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a line being written
        if record.get("event") == name:
            found.append(record)
    return found


def curve_points(records: list[dict[str, Any]]) -> tuple[list[int], list[float], list[int]]:
    """x (1, 2, ... one per trainer step, in log order), the mean train reward of each step,
    and the x of the steps that pushed no version (their ``step`` repeats the one before)."""
    steps = list(range(1, len(records) + 1))
    rewards = [float(r.get("reward_mean") or 0.0) for r in records]
    idle = [x for x, r in zip(steps, records, strict=True) if not r.get("pushed", True)]
    return steps, rewards, idle


def plot_rewards(
    records: list[dict[str, Any]],
    path: Path,
    *,
    before: float | None = None,
    after: float | None = None,
    unseen_before: float | None = None,
    unseen_after: float | None = None,
) -> None:
    """Reward curve (mean reward per step and its moving average) as a PNG, with held-out accuracy
    (in the train phrasing and, when given, in unseen phrasings) before and after.

    One point per trainer step, in order: a step whose batch had no signal trains
    nothing and pushes no version (its record repeats the version), so the x axis
    counts steps, not versions, and such steps are drawn as hollow markers.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards, idle = curve_points(records)
    window = 3
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    (line,) = ax.plot(steps, rewards, marker="o", alpha=0.5, label="train reward (mean per step)")
    if idle:
        ax.plot(
            idle,
            [rewards[x - 1] for x in idle],
            linestyle="none",
            marker="o",
            markerfacecolor="white",
            color=line.get_color(),
            label="step without signal (no update, no new version)",
        )
    ax.plot(steps, smooth, linewidth=2, label=f"moving average ({window} steps)")
    for value, color, style, label in (
        (before, "gray", "--", "held-out accuracy before"),
        (after, "green", "--", "held-out accuracy after"),
        (unseen_before, "gray", ":", "unseen phrasings before"),
        (unseen_after, "purple", ":", "unseen phrasings after"),
    ):
        if value is not None:
            ax.axhline(value, color=color, linestyle=style, label=f"{label} ({value:.0%})")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
