"""Per-step training records: one JSON line each in ``train_log.jsonl``, and a console line.

A step record (:class:`StepRecord`) carries what tells whether asynchronous
RL is healthy: rewards, advantage moments, the PPO statistics
(``PPOStats.as_dict`` plus gradient norms), the staleness histogram (how many
policy versions behind the trained tokens were), what was dropped, the
throughput, and where the step's wall time went (waiting for data,
proximal-logprob recompute, training, weight export + push).

Other events (start-up recovery, stop) are JSON lines with an ``event`` field
other than ``"step"``.

With a ``[tracking]`` section (``proxima.trainer.tracking``) every step record also goes to
the configured experiment trackers, with a table of the sessions the step claimed (handed
over by the loop with :meth:`TrainLog.note_batch`).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from proxima.proxy.store.records import CompletionRecord, SessionRecord
from proxima.trainer.production import ProductionUse
from proxima.trainer.samples import Sample
from proxima.trainer.tracking import Tracker, TrackingConfig
from tqdm import tqdm

logger = logging.getLogger(__name__)

LOG_FILE = "train_log.jsonl"
ADAPTERS_DIR = "adapters"


def policy_home(output_dir: Path, adapter: str | None = None) -> Path:
    """Where a policy's pending step, checkpoints and log live: ``output_dir`` for the base,
    ``<output_dir>/adapters/<adapter>`` for an adapter (here, torch-free: ``proxima train``'s
    rollout process reads the logs)."""
    return output_dir if adapter is None else output_dir / ADAPTERS_DIR / adapter


@dataclass(frozen=True)
class StepTimes:
    """Seconds spent in each phase of a step."""

    wait: float = 0.0  # polling the store until a full batch was claimed
    prox: float = 0.0  # recomputing proximal logprobs
    train: float = 0.0  # PPO minibatch updates
    export: float = 0.0  # writing the HF weights of the new version
    push: float = 0.0  # POST /admin/weights until every backend loaded them
    proxy_update: float = 0.0  # the proxy's own report of the load (part of push)
    total: float = 0.0  # the whole step, wall clock

    @property
    def weight_sync(self) -> float:
        """Export + push: the cost of getting new weights to the inference backends."""
        return self.export + self.push


@dataclass(frozen=True)
class StepRecord:
    """One training step, as logged."""

    step: int
    version: int  # policy version after the step (the one pushed, or unchanged if none)
    pushed: bool  # False when every sample of the batch was dropped
    sessions: int  # sessions claimed
    trained_sessions: int
    dropped_sessions: int  # sessions with no sample left (stale or empty)
    samples: int  # samples trained
    dropped_samples: int  # samples dropped as stale
    tokens: int  # tokens of the trained samples (prompt + generated)
    loss_tokens: int  # generated tokens trained
    reward_mean: float | None  # mean total reward of the claimed sessions
    advantage_mean: float  # over trained tokens
    advantage_std: float
    staleness: dict[int, int]  # version lag (current - token version) -> trained tokens
    production_samples: int = 0  # samples of recorded production sessions trained
    production_staleness_mean: float | None = None  # their mean lag (current - oldest version)
    ppo: dict[str, float] = field(default_factory=dict)  # StepStats.as_dict()
    times: StepTimes = field(default_factory=StepTimes)

    @property
    def tokens_per_s(self) -> float:
        """Training throughput: tokens over proximal recompute + training time."""
        busy = self.times.prox + self.times.train
        return self.tokens / busy if busy > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The JSON record (``event = "step"``)."""
        data = asdict(self)
        data["staleness"] = {str(lag): n for lag, n in sorted(self.staleness.items())}
        data["times"] = {**asdict(self.times), "weight_sync": self.times.weight_sync}
        return {"event": "step", **data, "tokens_per_s": self.tokens_per_s}


# --------------------------------------------------------------------------- metrics


def staleness_histogram(samples: Sequence[Sample], current_version: int) -> dict[int, int]:
    """Trained tokens per version lag ``current_version - token version``."""
    lags: Counter[int] = Counter()
    for sample in samples:
        for version, trained in zip(sample.versions, sample.loss_mask, strict=True):
            if trained:
                lags[current_version - version] += 1
    return dict(sorted(lags.items()))


def advantage_moments(samples: Sequence[Sample]) -> tuple[float, float]:
    """Mean and (population) std of the advantage over trained tokens; (0, 0) if none."""
    values = [
        a
        for sample in samples
        for a, trained in zip(sample.advantages, sample.loss_mask, strict=True)
        if trained
    ]
    if not values:
        return 0.0, 0.0
    mean = math.fsum(values) / len(values)
    var = math.fsum((a - mean) ** 2 for a in values) / len(values)
    return mean, math.sqrt(var)


# --------------------------------------------------------------------------- output


def console_line(record: StepRecord) -> str:
    """One human-readable line per step."""
    t = record.times
    reward = "n/a" if record.reward_mean is None else f"{record.reward_mean:.3f}"
    parts = [
        f"step {record.step} v{record.version}",
        f"sessions {record.trained_sessions}/{record.sessions} (dropped {record.dropped_sessions})",
        f"reward {reward}",
    ]
    if record.production_samples:
        parts.append(
            f"production {record.production_samples} "
            f"(staleness {record.production_staleness_mean:.1f})"
        )
    if record.ppo:
        parts.append(
            f"loss {record.ppo['loss']:+.4f} clip {record.ppo['clip_fraction']:.3f} "
            f"kl {record.ppo['approx_kl']:.2e} |g| {record.ppo['grad_norm']:.3f}"
        )
    parts += [
        f"tokens {record.tokens} ({record.tokens_per_s:,.0f}/s)",
        f"wait {t.wait:.1f}s prox {t.prox:.2f}s train {t.train:.2f}s push {t.weight_sync:.2f}s",
    ]
    return " | ".join(parts)


class TrainLog:
    """Appends step records to ``<output_dir>/train_log.jsonl`` and shows them on the console.

    With ``console`` on, a tqdm bar counts steps (out of ``total_steps`` when
    known) and each step's :func:`console_line` is written above it.
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        console: bool = True,
        total_steps: int | None = None,
        stream: TextIO | None = None,
        desc: str = "train",
        tracking: TrackingConfig | None = None,
        adapter: str | None = None,
    ) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / LOG_FILE
        # The trackers' step axis: the step records of the log so far, this one included.
        self._tracker = (
            None
            if tracking is None
            else Tracker.open(tracking, output_dir=output_dir, adapter=adapter)
        )
        self._logged = count_steps(self.path) if self._tracker is not None else 0
        self._batch: Sequence[tuple[SessionRecord, Sequence[CompletionRecord]]] = ()
        torn = _ends_mid_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if torn:
            self._file.write("\n")  # a killed run left half a line: start on a fresh one
        self._stream = stream or sys.stderr
        self._bar: tqdm[Any] | None = None
        if console:
            self._bar = tqdm(
                total=total_steps, unit="step", desc=desc, file=self._stream, dynamic_ncols=True
            )

    def note_batch(self, batch: Sequence[tuple[SessionRecord, Sequence[CompletionRecord]]]) -> None:
        """The sessions the step being run claimed: the trackers' rollout table of its record."""
        self._batch = batch

    def step(self, record: StepRecord) -> None:
        """Write one step's record and console line (and send it to the trackers)."""
        data = record.as_dict()
        self._write(data)
        if self._tracker is not None:
            self._logged += 1
            self._tracker.log_step(self._logged, data)
            self._tracker.log_rollouts(self._logged, self._batch)
        self._batch = ()
        if self._bar is not None:
            self._bar.write(console_line(record), file=self._stream)
            self._bar.update(1)
        logger.info("train step", extra={"step": record.step, "version": record.version})

    def event(self, name: str, **fields: Any) -> None:
        """Write a non-step record (``{"event": name, **fields}``)."""
        self._write({"event": name, **fields})

    def _write(self, data: dict[str, Any]) -> None:
        self._file.write(json.dumps(data, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file and the bar."""
        if self._bar is not None:
            self._bar.close()
        if self._tracker is not None:
            self._tracker.close()
        self._file.close()


def _ends_mid_line(path: Path) -> bool:
    """True when ``path`` is non-empty and its last byte is not a newline."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def count_steps(path: Path) -> int:
    """How many step records ``path`` holds (0 when it does not exist)."""
    if not path.is_file():
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if '"event": "step"' in line)


def read_log(output_dir: Path) -> list[dict[str, Any]]:
    """All records of ``<output_dir>/train_log.jsonl`` (for tests, benchmarks, analysis).

    A line a killed trainer left half-written is skipped.
    """
    path = output_dir / LOG_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("skipping a torn line in %s", path)
    return records


@dataclass(frozen=True)
class BatchMetrics:
    """Batch statistics that do not depend on training."""

    sessions: int
    samples: int
    dropped_samples: int
    tokens: int
    loss_tokens: int
    reward_mean: float | None
    advantage_mean: float
    advantage_std: float
    staleness: dict[int, int]
    production: ProductionUse = ProductionUse(0, None)

    @classmethod
    def of(
        cls,
        batch: Sequence[tuple[SessionRecord, Sequence[CompletionRecord]]],
        samples: Sequence[Sample],
        version: int,
        dropped_samples: int,
    ) -> BatchMetrics:
        rewards = [_total_reward(session, completions) for session, completions in batch]
        adv_mean, adv_std = advantage_moments(samples)
        return cls(
            sessions=len(batch),
            samples=len(samples),
            dropped_samples=dropped_samples,
            tokens=sum(s.num_tokens for s in samples),
            loss_tokens=sum(s.num_loss_tokens for s in samples),
            reward_mean=math.fsum(rewards) / len(rewards) if rewards else None,
            advantage_mean=adv_mean,
            advantage_std=adv_std,
            staleness=staleness_histogram(samples, version),
        )


def _total_reward(session: SessionRecord, completions: Sequence[CompletionRecord]) -> float:
    """Session reward plus per-turn rewards (unset = 0)."""
    turns = math.fsum(c.reward for c in completions if c.reward is not None)
    return (session.reward or 0.0) + turns
