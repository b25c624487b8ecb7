"""``proxima train``'s experiment trackers: its ``[tracking]`` section, one tracker run per policy.

The command logs to the trackers itself, in one process, from what it already follows: each
step record its trainer appends to the step log (at the record's position in the log, so a
resumed run continues the curve), the sessions that step trained on (read back from the store:
the sessions whose ``trained_version`` is the version the step pushed), and the held-out
accuracies before and after training (at the tracker step of the last step before them). The
trainer process it starts gets no ``[tracking]`` of its own (the run config refuses
``[trainer.tracking]``), so nothing is logged twice.

The trackers are opened on a thread (:func:`start_trackers`, importing them takes seconds)
while the proxy starts; a tracker that is not installed is refused before anything starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from proxima.proxy.store.pages import trained_into
from proxima.proxy.store.store import Store
from proxima.trainer.log import count_steps
from proxima.trainer.pipeline.config import TrainRunConfig
from proxima.trainer.pipeline.evaluation import Accuracy
from proxima.trainer.tracking import Tracker, check_installed

logger = logging.getLogger(__name__)

Opening = asyncio.Future[dict[str | None, Tracker]]


def start_trackers(cfg: TrainRunConfig, adapters: Sequence[str | None]) -> Opening | None:
    """Start opening a tracker per policy of ``adapters`` (None: the base) on a thread; None
    without ``[tracking]`` backends. Raises ``TrackingUnavailable`` at once for one that is
    not installed."""
    if not cfg.tracking.backends:
        return None
    check_installed(cfg.tracking.backends)
    settings = cfg.model_dump(
        mode="json", exclude={"proxy": {"admin_token"}, "trainer": {"connection"}}
    )

    def open_all() -> dict[str | None, Tracker]:
        trackers: dict[str | None, Tracker] = {}
        try:
            for adapter in adapters:
                tracker = Tracker.open(
                    cfg.tracking, output_dir=cfg.output_dir, adapter=adapter, config=settings
                )
                assert tracker is not None  # backends are configured
                trackers[adapter] = tracker
        except BaseException:
            for tracker in trackers.values():
                tracker.close()
            raise
        return trackers

    return asyncio.get_running_loop().run_in_executor(None, open_all)


async def discard(opening: Opening) -> None:
    """Close the trackers ``opening`` opens (a run that ended before it used them)."""
    try:
        trackers = await opening
    except Exception:
        return
    for tracker in trackers.values():
        tracker.close()


class RunTrackers:
    """A :class:`Tracker` per policy (None: the base model; else an adapter's name)."""

    def __init__(
        self, trackers: dict[str | None, Tracker], counts: dict[str | None, int], db: str
    ) -> None:
        self.trackers = trackers
        self.counts = counts  # step records logged per policy: the tracker step of the last
        self.db = db
        self.store: Store | None = None  # opened when a rollout table first reads it

    @classmethod
    async def open(
        cls, cfg: TrainRunConfig, logs: Mapping[str | None, Path], db: str
    ) -> RunTrackers | None:
        """:func:`start_trackers` and :meth:`ready` in one (None without backends): for a
        caller with nothing to overlap the opening with."""
        opening = start_trackers(cfg, list(logs))
        return None if opening is None else await cls.ready(opening, logs, db)

    @classmethod
    async def ready(cls, opening: Opening, logs: Mapping[str | None, Path], db: str) -> RunTrackers:
        """The trackers ``opening`` opened, for the policies whose step logs are ``logs``;
        ``db``: the run's store (the rollout tables read it)."""
        trackers = await opening
        return cls(trackers, {adapter: count_steps(path) for adapter, path in logs.items()}, db)

    async def step(self, adapter: str | None, record: dict[str, Any]) -> None:
        """One step record of ``adapter``'s log, and the sessions it trained on."""
        tracker = self.trackers[adapter]
        self.counts[adapter] += 1
        index = self.counts[adapter]
        tracker.log_step(index, record)
        limit = tracker.cfg.rollouts_per_step
        if limit and record.get("pushed") and isinstance(record.get("version"), int):
            try:
                if self.store is None:
                    self.store = await Store.open(self.db)
                sessions = await trained_into(
                    self.store, version=record["version"], adapter=adapter, limit=limit
                )
            except Exception:
                logger.warning("could not read step %d's sessions", index, exc_info=True)
                return
            tracker.log_rollouts(index, sessions)

    def evaluation(self, adapter: str | None, accuracy: Accuracy) -> None:
        """Held-out accuracy (the headline: first try where the agent reports it; success
        within its turns; in unseen phrasings) at the tracker step of the last step."""
        test, unseen = accuracy
        self.trackers[adapter].log_eval(
            self.counts[adapter],
            {
                "accuracy": test.headline,
                "within_turns_accuracy": test.accuracy,
                "truncated": test.truncated,
                "unseen_accuracy": None if unseen is None else unseen.headline,
            },
        )

    async def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()
        if self.store is not None:
            await self.store.close()
