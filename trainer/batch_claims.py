"""Filling one trainer's next batch: whole groups claimed from the store, screened, made samples.

:class:`BatchClaims` holds the sessions one trainer (one policy: the base model or one
LoRA adapter) has claimed toward its next step. Each poll (:meth:`BatchClaims.top_up`)
claims whole groups until ``batch_size`` sessions are held, oldest finished first,
production sessions up to ``production_share`` of the batch. With
``zero_signal = "refill"`` every claimed group is screened at once
(:meth:`BatchClaims.screen`): one that cannot train whole is marked DROPPED and counted
toward the next step's metrics (:class:`Screened`), so other groups are claimed in
its place, up to ``advantage.refill_limit`` dropped sessions a step (then the step
trains what it holds). A claim that fails with the store out of reach is retried for ``[loop]
retry_window_s``; as its answer may have been lost after it took sessions, the claims are
then read back from the store (:meth:`BatchClaims._adopted`).

:func:`trainable_samples` is step 2-3 of ``proxima.trainer.loop``'s step: the samples
of claimed sessions that train at a version (valid, fresh, short enough, with
signal), used by the screen and by the step alike.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from proxima.proxy.store import CompletionRecord, SessionKind, SessionRecord, SessionStatus, Store
from proxima.trainer.config import TrainerConfig
from proxima.trainer.production import filter_stale_by_kind, production_quota
from proxima.trainer.retry import Backoff, retryable_error
from proxima.trainer.samples import (
    Sample,
    build_samples,
    drop_too_long,
    without_invalid,
    zero_signal_filter,
)

logger = logging.getLogger(__name__)

Batch = list[tuple[SessionRecord, list[CompletionRecord]]]
"""Claimed sessions, each with its completions."""


@dataclasses.dataclass
class Screened:
    """Sessions ``zero_signal = "refill"`` dropped toward the next batch, and their samples."""

    sessions: Batch = dataclasses.field(default_factory=list)
    samples: int = 0


def trainable_samples(
    batch: Batch, version: int, cfg: TrainerConfig, vocab_size: int | None
) -> tuple[list[Sample], int, set[str]]:
    """Samples of ``batch`` that train at ``version``, how many were removed, and fresh sessions.

    Removed: sessions whose records cannot be trained (logged with why),
    samples too stale (``max_staleness``), longer than a micro-batch, or
    without signal (``advantage.zero_signal``). Fresh: the sessions with a
    sample left before the signal filter (valid, fresh and short enough).
    """
    # Constrained completions train where the backend applies their grammar masks (torch).
    constrained = cfg.backend == "torch"
    samples = build_samples(
        without_invalid(batch, vocab_size), cfg.advantage, constrained=constrained
    )
    kinds = {s.id: s.kind for s, _ in batch}
    samples, stale = filter_stale_by_kind(
        samples,
        kinds,
        version,
        max_staleness=cfg.max_staleness,
        production_max_staleness=cfg.production_max_staleness,
        rule=cfg.stale_rule,
    )
    samples, too_long = drop_too_long(samples, cfg.batching.max_tokens_per_mb)
    fresh = {s.session_id for s in samples}
    samples, no_signal = zero_signal_filter(samples, cfg.advantage.zero_signal)
    return samples, stale + too_long + no_signal, fresh


class BatchClaims:
    """The claims one trainer holds toward its next batch (kept until a step takes them)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        store: Store,
        *,
        trainer_id: str,
        adapter: str | None,
        vocab_size: int | None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.trainer_id = trainer_id  # the claims are held under it
        self.adapter = adapter  # only this policy's sessions are claimed
        self.vocab_size = vocab_size
        self.held: list[SessionRecord] = []  # claims held toward the next batch
        self.screened = Screened()  # what ``refill`` dropped while the batch filled

    @property
    def ready(self) -> bool:
        """Whether the claims held make the next batch: ``batch_size`` sessions, or what is
        held once ``refill`` dropped ``advantage.refill_limit`` sessions toward it."""
        limit = self.cfg.advantage.refill_limit
        if limit is not None and len(self.screened.sessions) >= limit:
            return True
        return len(self.held) >= self.cfg.batch_size

    def take(self) -> list[SessionRecord]:
        """The claims held, now the step's own (none are held after)."""
        taken, self.held = self.held, []
        return taken

    def take_screened(self) -> Screened:
        """What ``refill`` dropped since the last step, for this step's metrics."""
        screened, self.screened = self.screened, Screened()
        return screened

    async def top_up(self, version: int) -> None:
        """One claim poll toward a full batch, screened at ``version`` (the trainer's)."""
        size = self.cfg.batch_size
        kinds = [SessionKind(k) for k in self.cfg.loop.session_kinds]
        quota = production_quota(size, self.cfg.production_share)
        claimed = self.held
        if len(claimed) >= size:
            return
        if quota is None or SessionKind.PRODUCTION not in kinds:
            claimed += await self._claim(size - len(claimed), kinds, version)
        else:
            # Production sessions up to their share, then rollout sessions fill the batch.
            held = sum(s.kind is SessionKind.PRODUCTION for s in claimed)
            room = min(quota - held, size - len(claimed))
            claimed += await self._claim(room, [SessionKind.PRODUCTION], version)
            others = [k for k in kinds if k is not SessionKind.PRODUCTION]
            claimed += await self._claim(size - len(claimed), others, version)

    async def _claim(
        self, limit: int, kinds: Sequence[SessionKind], version: int
    ) -> list[SessionRecord]:
        if limit <= 0 or not kinds:
            return []
        backoff = Backoff(self.cfg.loop.retry_window_s)
        lost = False  # a claim failed with the store out of reach: it may have taken sessions
        while True:
            try:
                claimed = await self.store.claim_groups(
                    min_sessions=limit,
                    trainer_id=self.trainer_id,
                    kinds=kinds,
                    adapter=self.adapter,
                )
                break
            except Exception as exc:
                if not retryable_error(exc) or not await backoff.wait("claiming", repr(exc)):
                    raise
                lost = True
        if lost:
            claimed = await self._adopted(claimed)
        if self.cfg.advantage.zero_signal == "refill" and claimed:
            claimed = await self.screen(claimed, version)
        return claimed

    async def _adopted(self, claimed: list[SessionRecord]) -> list[SessionRecord]:
        """After a claim whose answer was lost: what this trainer holds in the store and not
        here (the lost claim's sessions, if it landed, and ``claimed``), so that none stays
        CLAIMED unseen until the trainer stops."""
        held = {s.id for s in self.held}
        mine = await self.store.claimed_sessions(trainer_id=self.trainer_id)
        adopted = [s for s in mine if s.id not in held]
        if len(adopted) > len(claimed):
            logger.info(
                "adopted %d sessions a claim took before its answer was lost",
                len(adopted) - len(claimed),
            )
        return adopted

    async def screen(self, claimed: list[SessionRecord], version: int) -> list[SessionRecord]:
        """``zero_signal = "refill"``: the claimed groups that have something to train.

        A group that cannot train whole at this version (its returns tie, or a
        session of it has no sample left that is fresh enough, short enough and
        valid) is marked DROPPED now, whole: training the rest of a group
        would bias its advantages (at ``max_staleness = 0`` the sessions that
        straddle a push are the long, multi-turn ones, mostly failures, so
        keeping the rest would train on failures alone). Dropping also
        returns its sessions' places under the proxy's staleness admission,
        so the rollout fills the batch with fresh groups in their place and
        every step trains ``batch_size`` sessions that carry signal (DAPO's
        dynamic sampling). Sessions without a group are kept: their
        advantages depend on the whole batch (``advantage.ungrouped``).
        """
        kept: list[SessionRecord] = []
        dropped: Batch = []
        groups: dict[str, list[SessionRecord]] = {}
        for session in claimed:
            if session.group_id is None:
                kept.append(session)
            else:
                groups.setdefault(session.group_id, []).append(session)
        for members in groups.values():
            batch = [(s, await self.store.list_completions(session_id=s.id)) for s in members]
            samples, removed, fresh = trainable_samples(batch, version, self.cfg, self.vocab_size)
            if samples and fresh >= {s.id for s in members}:
                kept += members
            else:
                dropped += batch
                self.screened.samples += len(samples) + removed
        if dropped:
            await self.store.mark_sessions(
                session_ids=[s.id for s, _ in dropped], status=SessionStatus.DROPPED
            )
            self.screened.sessions += dropped
            logger.info(
                "refill: dropped %d claimed sessions with nothing to train (tied or stale groups)",
                len(dropped),
            )
        return kept
