"""Production traffic in the training batch: its own staleness bound and batch share.

Recorded production sessions carry the version production served, typically
many versions behind the trainer (production serves a pinned, promoted
version). They are trained off-policy on purpose: the decoupled objective's
importance weight ``w = exp(prox - behav)``, with tokens above ``ppo.importance_weight_cap``
masked, corrects for the gap (``proxima.trainer.loss``). So they get a bound
of their own, ``production_max_staleness`` (None: any staleness), while
rollout sessions keep ``max_staleness`` (eta), which the proxy's admission
rule enforces for them.

``production_share`` caps how many of a batch's sessions are production
sessions; the rest of the batch is rollout sessions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from proxima.proxy.store.records import SessionKind
from proxima.trainer.samples import Sample, filter_stale


def production_quota(batch_size: int, share: float | None) -> int | None:
    """Most production sessions per batch; None: no limit."""
    if share is None:
        return None
    return math.floor(share * batch_size)


def filter_stale_by_kind(
    samples: Sequence[Sample],
    kinds: Mapping[str, SessionKind],
    current_version: int,
    *,
    max_staleness: int,
    production_max_staleness: int | None,
    rule: Literal["token", "sample"] = "token",
) -> tuple[list[Sample], int]:
    """``filter_stale`` with each sample's kind's bound; ``(kept in order, dropped count)``.

    Production samples use ``production_max_staleness`` (None keeps every
    one whole), the others ``max_staleness``; ``rule`` is ``filter_stale``'s.
    """
    kept: list[Sample] = []
    dropped = 0
    for sample in samples:
        production = kinds.get(sample.session_id) is SessionKind.PRODUCTION
        bound = production_max_staleness if production else max_staleness
        if bound is None:
            kept.append(sample)
            continue
        out, n = filter_stale([sample], current_version, bound, rule)
        kept += out
        dropped += n
    return kept, dropped


@dataclass(frozen=True, slots=True)
class ProductionUse:
    """How much production traffic one step trained on."""

    samples: int  # production samples trained
    staleness_mean: float | None  # mean of current_version - oldest trained version; None if 0


def production_use(
    samples: Sequence[Sample], kinds: Mapping[str, SessionKind], current_version: int
) -> ProductionUse:
    lags = [
        current_version - s.oldest_version
        for s in samples
        if kinds.get(s.session_id) is SessionKind.PRODUCTION
    ]
    return ProductionUse(len(lags), math.fsum(lags) / len(lags) if lags else None)
