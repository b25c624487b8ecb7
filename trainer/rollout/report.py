"""What a rollout pass reports: one :class:`RunResult` per agent run (one session), and the
counters of the whole pass (:class:`RolloutReport`, live while it runs), which
``proxima.trainer.rollout.controller`` fills in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass(slots=True)
class RunResult:
    """One agent run (one session)."""

    session_id: str
    group_id: str
    data_id: str
    sample: int
    status: Literal["finished", "failed"]
    reward: float | None
    """Total posted reward (final plus per-completion); ``None`` for a failed run."""
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    node_id: str | None = None
    """The Ray node that ran the agent (``mode="ray"``; ``None`` otherwise or if its task died)."""


@dataclass(slots=True)
class RolloutReport:
    """Counters of one :meth:`RolloutController.run` (live while it runs)."""

    items: int = 0
    sessions_started: int = 0
    sessions_rewarded: int = 0
    sessions_failed: int = 0
    timeouts: int = 0
    waits_429: int = 0
    """Times a session request was answered 429 (staleness capacity) and waited out."""
    wait_seconds_429: float = 0.0
    elapsed_s: float = 0.0
    runs: list[RunResult] = field(default_factory=list)

    @property
    def mean_reward(self) -> float | None:
        """Mean total reward over the rewarded runs (``None`` if there are none)."""
        rewards = [r.reward for r in self.runs if r.status == "finished" and r.reward is not None]
        return sum(rewards) / len(rewards) if rewards else None

    @property
    def runs_by_node(self) -> dict[str, int]:
        """Completed agent runs per Ray node (empty outside ``mode="ray"``)."""
        counts: dict[str, int] = {}
        for run in self.runs:
            if run.node_id is not None:
                counts[run.node_id] = counts.get(run.node_id, 0) + 1
        return counts

    def summary(self) -> dict[str, Any]:
        """The counters as a JSON-ready dict (without the per-run list)."""
        out = {k: v for k, v in asdict(self).items() if k != "runs"}
        out["mean_reward"] = self.mean_reward
        if by_node := self.runs_by_node:
            out["runs_by_node"] = by_node
        return out
