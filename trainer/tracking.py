"""Experiment trackers: every training step's metrics, a table of sample rollouts per step and
the evaluations, to TensorBoard, MLflow and Weights & Biases.

Configured by a ``[tracking]`` section (:class:`TrackingConfig`): in the trainer's config
(``proxima trainer``: the trainer process logs its steps and the sessions each step claimed),
or in ``proxima train``'s run config (that command logs its trainer's steps, the sessions each
step trained on, read back from the store, and its evaluations before and after training). All
three work without a network: TensorBoard event files, an MLflow store in a local database
(``sqlite:``) or directory (``file:``), W&B in offline mode (``wandb sync`` uploads it later).

The trackers are an optional extra (``pip install 'proxima[tracking]'``): each is imported
only when configured, and a configured one that is not installed is a
:class:`TrackingUnavailable` error at start, naming the package.

What is logged, at tracker step ``index`` (the step record's position in the step log, from 1:
the log's own ``step`` repeats when a step trained nothing):

- every step record's keys (``trainer.log.StepRecord.as_dict``), nested ones flattened with
  ``/`` (``reward_mean``, ``ppo/loss``, ``times/wait``, ``staleness/0``); booleans as 0 or 1,
  ``None`` and strings left out;
- up to ``rollouts_per_step`` sessions of the step as a table (:data:`ROLLOUT_COLUMNS`): a W&B
  Table ``rollouts``, an MLflow JSON artifact ``rollouts/step_000001.json`` (``{"columns",
  "data"}``, the layout of MLflow's ``log_table``), a TensorBoard text ``rollouts`` (Markdown);
- evaluations as ``eval/<name>`` at the index of the last step before them.

A tracker that fails while logging (a network error of W&B online) is logged as a warning and
skipped; training goes on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # the store is not imported with the trainer's config (the CLI starts light)
    from proxima.proxy.store.records import CompletionRecord, SessionRecord

logger = logging.getLogger(__name__)

Backend = Literal["tensorboard", "mlflow", "wandb"]
PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
ROLLOUT_COLUMNS = [
    "session_id",
    "group_id",
    "data_id",
    "status",
    "reward",
    "turns",
    "output_tokens",
    "conversation",
]


class TrackingConfig(BaseModel):
    """``[tracking]``: where every step's metrics, sample rollouts and evaluations go."""

    model_config = ConfigDict(extra="forbid")

    backends: list[Backend] = Field(
        default_factory=list,
        description="Trackers to log to: any of tensorboard, mlflow, wandb (pip install "
        "'proxima[tracking]'). Empty: none.",
    )
    dir: Path | None = Field(
        None,
        description="Where the trackers write: TensorBoard event files (tensorboard/<run_name>), "
        "the MLflow store (mlflow.db, mlartifacts) and the W&B offline runs (wandb/). Default: "
        "<output_dir>/tracking.",
    )
    project: str = Field(
        "proxima", description="W&B project and MLflow experiment the runs belong to."
    )
    run_name: str | None = Field(
        None,
        description="Name of the tracker run (an adapter's runs add '-<adapter>'). Default: the "
        "output directory's name.",
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: the run is written under dir/wandb, no network (upload later with "
        "`wandb sync`); online: sent to W&B as it runs (needs WANDB_API_KEY).",
    )
    wandb_entity: str | None = Field(None, description="W&B entity (team or user) of the runs.")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI: a server (http://...), a database (sqlite:///...) or "
        "a file store (file:/..., MLflow's older layout). Default: sqlite:///<dir>/mlflow.db.",
    )
    rollouts_per_step: int = Field(
        4, ge=0, description="Sessions of each step logged as a table of rollouts (0: none)."
    )
    max_text_chars: int = Field(
        4000, ge=100, description="Longest conversation text in a rollout row (its end is kept)."
    )


class TrackingUnavailable(RuntimeError):
    """A configured tracker's package is not installed."""


class _Writer(Protocol):
    name: str

    def metrics(self, values: Mapping[str, float], step: int) -> None: ...

    def table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric values of ``record``, nested keys joined with ``/``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, int | float):  # bool included: 0 or 1
            out[name] = float(value)
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def conversation(completion: CompletionRecord) -> str:
    """A completion as text: its request messages, then its reply (``role: content`` lines;
    a text prompt's completion: its reply alone)."""
    lines = []
    for message in completion.request_messages or []:
        content = message.get("content")
        lines.append(f"{message.get('role', '?')}: {'' if content is None else _text(content)}")
        if message.get("tool_calls"):
            lines.append(f"  tool_calls: {_text(message['tool_calls'])}")
    reply = completion.response_message
    if reply is not None and (reply.get("content") or reply.get("tool_calls")):
        lines.append(f"assistant: {_text(reply.get('content') or '')}")
        if reply.get("tool_calls"):
            lines.append(f"  tool_calls: {_text(reply['tool_calls'])}")
    else:
        lines.append(f"assistant: {completion.response_text}")
    return "\n".join(lines)


def rollout_rows(
    sessions: Sequence[tuple[SessionRecord, Sequence[CompletionRecord]]],
    *,
    limit: int,
    max_chars: int,
) -> list[list[Any]]:
    """Rows of :data:`ROLLOUT_COLUMNS` for the first ``limit`` sessions: each session's last
    turn as its conversation (the end kept when longer than ``max_chars``)."""
    rows = []
    for session, completions in list(sessions)[:limit]:
        last = max(completions, key=lambda c: c.created_at, default=None)
        text = "" if last is None else conversation(last)
        if len(text) > max_chars:
            text = "..." + text[-(max_chars - 3) :]
        rows.append(
            [
                session.id,
                session.group_id,
                session.data_id,
                session.status.value,
                session.reward,
                len(completions),
                sum(len(c.output_ids) for c in completions),
                text,
            ]
        )
    return rows


class Tracker:
    """The configured trackers of one run; open with :meth:`open`, :meth:`close` at the end."""

    def __init__(self, writers: list[_Writer], cfg: TrackingConfig) -> None:
        self.writers = writers
        self.cfg = cfg

    @classmethod
    def open(
        cls,
        cfg: TrackingConfig,
        *,
        output_dir: Path,
        adapter: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> Tracker | None:
        """The trackers ``cfg`` names (None when it names none), writing under ``cfg.dir``
        (default ``<output_dir>/tracking``); ``config``: the run's settings, recorded with it.

        Raises :class:`TrackingUnavailable` when a configured tracker is not installed.
        """
        if not cfg.backends:
            return None
        directory = (cfg.dir or output_dir / "tracking").resolve()
        directory.mkdir(parents=True, exist_ok=True)
        name = cfg.run_name or output_dir.resolve().name
        if adapter is not None:
            name = f"{name}-{adapter}"
        settings = dict(config or {})
        makers: dict[str, Callable[[TrackingConfig, Path, str, dict[str, Any]], _Writer]] = {
            "tensorboard": _TensorBoard,
            "mlflow": _MLflow,
            "wandb": _WandB,
        }
        writers: list[_Writer] = []
        try:
            for backend in dict.fromkeys(cfg.backends):
                writers.append(makers[backend](cfg, directory, name, settings))
        except BaseException:
            for writer in writers:
                writer.close()
            raise
        return cls(writers, cfg)

    def log_step(self, index: int, record: Mapping[str, Any]) -> None:
        """One step record's metrics at tracker step ``index``."""
        self._each("metrics", flatten(record), index)

    def log_rollouts(
        self, index: int, sessions: Sequence[tuple[SessionRecord, Sequence[CompletionRecord]]]
    ) -> None:
        """A table of the step's sample rollouts at tracker step ``index``."""
        if self.cfg.rollouts_per_step == 0 or not sessions:
            return
        rows = rollout_rows(
            sessions, limit=self.cfg.rollouts_per_step, max_chars=self.cfg.max_text_chars
        )
        self._each("table", "rollouts", index, list(ROLLOUT_COLUMNS), rows)

    def log_eval(self, index: int, metrics: Mapping[str, float | None]) -> None:
        """Evaluation results as ``eval/<name>`` at tracker step ``index``."""
        values = {f"eval/{k}": float(v) for k, v in metrics.items() if v is not None}
        if values:
            self._each("metrics", values, index)

    def close(self) -> None:
        for writer in self.writers:
            try:
                writer.close()
            except Exception:
                logger.warning("closing the %s tracker failed", writer.name, exc_info=True)

    def _each(self, method: str, *args: Any) -> None:
        for writer in self.writers:
            try:
                getattr(writer, method)(*args)
            except Exception:
                logger.warning("the %s tracker failed to log; skipped", writer.name, exc_info=True)


def check_installed(backends: Sequence[str]) -> None:
    """Raise :class:`TrackingUnavailable` for the first of ``backends`` not installed (without
    importing it: a check that costs nothing, made before a run starts)."""
    import importlib.util

    for backend in backends:
        if importlib.util.find_spec(PACKAGES[backend]) is None:
            raise _missing(backend, ImportError(f"No module named {PACKAGES[backend]!r}"))


def _missing(backend: str, exc: ImportError) -> TrackingUnavailable:
    return TrackingUnavailable(
        f"[tracking] backends includes {backend!r}, but {PACKAGES[backend]} is not installed "
        f"({exc}): pip install 'proxima[tracking]' (or {PACKAGES[backend]})"
    )


def _markdown(columns: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        text = "" if value is None else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class _TensorBoard:
    """TensorBoard event files, written with TensorBoard's own writer and protobufs (no torch,
    no TensorFlow): scalars, and text (Markdown) for the tables."""

    name = "tensorboard"

    def __init__(
        self, cfg: TrackingConfig, directory: Path, run_name: str, config: dict[str, Any]
    ) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
            from tensorboard.plugins.text.metadata import create_summary_metadata
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:
            raise _missing("tensorboard", exc) from exc
        self.protos = event_pb2, summary_pb2, tensor_pb2, types_pb2
        self.text_metadata = create_summary_metadata
        self.writer = EventFileWriter(str(directory / "tensorboard" / run_name))
        if config:
            self.table_text("config", 0, "```\n" + json.dumps(config, indent=2) + "\n```")

    def _write(self, step: int, values: list[Any]) -> None:
        event_pb2, summary_pb2, _, _ = self.protos
        summary = summary_pb2.Summary(value=values)
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()

    def metrics(self, values: Mapping[str, float], step: int) -> None:
        summary_pb2 = self.protos[1]
        self._write(
            step, [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        )

    def table_text(self, name: str, step: int, text: str) -> None:
        _, summary_pb2, tensor_pb2, types_pb2 = self.protos
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()])
        metadata = self.text_metadata(display_name=name, description="")
        self._write(step, [summary_pb2.Summary.Value(tag=name, metadata=metadata, tensor=tensor)])

    def table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.table_text(name, step, _markdown(columns, rows))

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    name = "mlflow"

    def __init__(
        self, cfg: TrackingConfig, directory: Path, run_name: str, config: dict[str, Any]
    ) -> None:
        uri = cfg.mlflow_tracking_uri or f"sqlite:///{directory / 'mlflow.db'}"
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless asked.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow import MlflowClient
        except ImportError as exc:
            raise _missing("mlflow", exc) from exc
        self.client = MlflowClient(tracking_uri=uri)
        local = uri.startswith(("sqlite:", "file:"))
        experiment = self.client.get_experiment_by_name(cfg.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (directory / "mlartifacts").as_uri() if local else None
            experiment_id = self.client.create_experiment(cfg.project, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        if config:
            self.client.log_dict(self.run_id, config, "config.json")

    def metrics(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        table = {"columns": columns, "data": rows}
        self.client.log_dict(self.run_id, table, f"{name}/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _WandB:
    name = "wandb"

    def __init__(
        self, cfg: TrackingConfig, directory: Path, run_name: str, config: dict[str, Any]
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", exc) from exc
        self.wandb = wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.wandb_entity,
            name=run_name,
            dir=str(directory),
            mode=cfg.wandb_mode,
            config=config,
            reinit="create_new",  # one run per adapter in one process
            settings=wandb.Settings(console="off", silent=True),
        )

    def metrics(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        table = self.wandb.Table(columns=list[str | int](columns), data=rows)
        self.run.log({name: table}, step=step)

    def close(self) -> None:
        self.run.finish()
