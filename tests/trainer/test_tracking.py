"""The experiment trackers: what ``Tracker`` writes is read back from each tracker's own files.

Step records (real ``StepRecord.as_dict()`` output, as the step log holds them) and a step's
sessions are fed to a ``Tracker`` with all three backends offline; the TensorBoard events are
read with TensorBoard's ``EventAccumulator``, the MLflow store with ``MlflowClient``, the W&B
offline run from its ``.wandb`` transaction log (W&B's record protobufs, framed as LevelDB log
records). Each holds every step's metrics under the step log's keys, the evaluations and the
table of rollouts.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from proxima.proxy.store.records import SessionKind, SessionRecord, SessionStatus
from proxima.trainer.log import StepRecord, StepTimes, TrainLog
from proxima.trainer.pipeline.evaluation import Accuracy, Score
from proxima.trainer.tracking import (
    ROLLOUT_COLUMNS,
    Tracker,
    TrackingConfig,
    TrackingUnavailable,
    flatten,
)

from tests.proxy.store.factories import completion


def step_records() -> list[dict[str, Any]]:
    """Three step records: two pushed, one that trained nothing (its ``step`` repeats)."""
    return [record.as_dict() for record in steps()]


def steps() -> list[StepRecord]:
    records = []
    for i, (step, pushed) in enumerate([(1, True), (2, True), (2, False)]):
        record = StepRecord(
            step=step,
            version=step,
            pushed=pushed,
            sessions=4,
            trained_sessions=4 if pushed else 0,
            dropped_sessions=0 if pushed else 4,
            samples=4 if pushed else 0,
            dropped_samples=0,
            tokens=100 + i,
            loss_tokens=40 + i,
            reward_mean=0.25 * (i + 1),
            advantage_mean=0.0,
            advantage_std=0.5 + i,
            staleness={0: 30, 1: 10 + i},
            ppo={"loss": -0.1 * i, "clip_fraction": 0.01, "approx_kl": 1e-4, "grad_norm": 1.5}
            if pushed
            else {},
            times=StepTimes(wait=1.0, prox=0.5, train=2.0 + i, total=4.0),
        )
        records.append(record)
    return records


def sessions() -> list[tuple[SessionRecord, list[Any]]]:
    out = []
    for i in range(3):
        session = SessionRecord(
            id=f"s{i}",
            kind=SessionKind.TRAIN,
            status=SessionStatus.TRAINED,
            group_id="q1@run",
            data_id="q1",
            metadata={},
            reward=float(i),
            created_at=datetime(2026, 1, 1, tzinfo=UTC),
        )
        messages = [{"role": "user", "content": f"what is {i}+{i}?"}]
        turn = completion(
            session.id,
            request_messages=messages,
            response_message={"role": "assistant", "content": f"{2 * i}"},
            response_text=f"{2 * i}",
        )
        out.append((session, [turn]))
    return out


@pytest.fixture(scope="module")
def written(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    tmp_path = tmp_path_factory.mktemp("tracking")
    cfg = TrackingConfig(
        backends=["tensorboard", "mlflow", "wandb"],
        dir=tmp_path / "tracking",
        run_name="unit",
        mlflow_tracking_uri=f"file:{tmp_path / 'tracking' / 'mlruns'}",
        rollouts_per_step=2,
    )
    tracker = Tracker.open(cfg, output_dir=tmp_path, config={"steps": 3})
    assert tracker is not None
    records = step_records()
    tracker.log_eval(0, {"accuracy": 0.2, "unseen_accuracy": None})
    for index, record in enumerate(records, start=1):
        tracker.log_step(index, record)
        tracker.log_rollouts(index, sessions())
    tracker.log_eval(len(records), {"accuracy": 0.6})
    tracker.close()
    yield tmp_path / "tracking", records


def expected(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """key -> [(tracker step, value)] of every step record's metrics."""
    out: dict[str, list[tuple[int, float]]] = {}
    for index, record in enumerate(records, start=1):
        for key, value in flatten(record).items():
            out.setdefault(key, []).append((index, value))
    return out


def test_flatten_keeps_the_step_logs_keys() -> None:
    record = step_records()[0]
    flat = flatten(record)
    assert flat["reward_mean"] == 0.25 and flat["pushed"] == 1.0 and flat["step"] == 1.0
    assert flat["ppo/loss"] == 0.0 and flat["times/wait"] == 1.0 and flat["staleness/1"] == 10
    assert flat["times/weight_sync"] == 0.0 and flat["tokens_per_s"] == 100 / 2.5
    assert "event" not in flat and "production_staleness_mean" not in flat  # a string, a None
    top = {k for k, v in record.items() if isinstance(v, int | float) and v is not None}
    assert top <= set(flat)


def test_tensorboard_holds_every_step(written: tuple[Path, list[dict[str, Any]]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory, records = written
    events = EventAccumulator(
        str(directory / "tensorboard" / "unit"), size_guidance={"scalars": 0, "tensors": 0}
    )
    events.Reload()
    want = expected(records)
    assert set(want) <= set(events.Tags()["scalars"])
    for key, points in want.items():
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], key
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [
        (0, pytest.approx(0.2)),
        (3, pytest.approx(0.6)),
    ]
    texts = events.Tensors("rollouts")
    assert [t.step for t in texts] == [1, 2, 3]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert table.startswith("| " + " | ".join(ROLLOUT_COLUMNS))
    assert "user: what is 1+1?<br>assistant: 2" in table and "s2" not in table  # 2 per step


def test_mlflow_holds_every_step(
    written: tuple[Path, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store else
    directory, records = written
    client = MlflowClient(tracking_uri=f"file:{directory / 'mlruns'}")
    experiment = client.get_experiment_by_name("proxima")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "unit" and run.info.status == "FINISHED"
    for key, points in expected(records).items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert got == [(s, pytest.approx(v)) for s, v in points], key
    evals = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert sorted((m.step, m.value) for m in evals) == [(0, 0.2), (3, 0.6)]
    root = Path(run.info.artifact_uri.removeprefix("file://"))
    table = json.loads((root / "rollouts" / "step_000002.json").read_text())
    assert table["columns"] == ROLLOUT_COLUMNS and [r[0] for r in table["data"]] == ["s0", "s1"]
    assert json.loads((root / "config.json").read_text()) == {"steps": 3}


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB log records (a 7-byte
    header each: checksum, length, type) in 32 KiB blocks, each a W&B ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", raw[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    pos, pending = 7, b""
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _checksum, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + data)
            pending = b""
            yield record
        elif kind in (2, 3):  # the first or a middle piece
            pending += data


def test_wandb_offline_run_holds_every_step(
    written: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, records = written
    (run_dir,) = (directory / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")
    rows: dict[int, dict[str, Any]] = {}
    name = None
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name
        elif kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            rows[row["_step"]] = row
    assert name == "unit"
    for key, points in expected(records).items():
        assert [(s, rows[s][key]) for s, _ in points] == [
            (s, pytest.approx(v)) for s, v in points
        ], key
    assert rows[0]["eval/accuracy"] == pytest.approx(0.2)
    assert rows[3]["eval/accuracy"] == pytest.approx(0.6)
    table = json.loads((run_dir / "files" / rows[1]["rollouts/path"]).read_text())
    assert table["columns"] == ROLLOUT_COLUMNS and [r[0] for r in table["data"]] == ["s0", "s1"]


def test_a_tracker_not_installed_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    real = builtins.__import__

    def no_mlflow(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    cfg = TrackingConfig(backends=["mlflow"], dir=tmp_path)
    with pytest.raises(TrackingUnavailable, match=r"pip install 'proxima\[tracking\]'"):
        Tracker.open(cfg, output_dir=tmp_path)
    assert Tracker.open(TrackingConfig(), output_dir=tmp_path) is None


def test_the_trainers_log_sends_its_steps(tmp_path: Path) -> None:
    """``proxima trainer`` with ``[tracking]``: each step record the log writes goes to the
    trackers at its place in the log (a resumed log continues), with the batch the loop
    handed over as its rollouts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first, second, third = steps()
    earlier = TrainLog(tmp_path, console=False)  # a run before this one, without trackers
    earlier.step(first)
    earlier.close()
    log = TrainLog(
        tmp_path, console=False, tracking=TrackingConfig(backends=["tensorboard"], run_name="t")
    )
    log.note_batch(sessions())
    log.step(second)
    log.step(third)  # no batch handed over: no table
    log.close()
    events = EventAccumulator(str(tmp_path / "tracking" / "tensorboard" / "t"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("pushed")] == [(2, 1.0), (3, 0.0)]
    assert [t.step for t in events.Tensors("rollouts")] == [2]


async def test_proxima_trains_trackers_read_a_steps_sessions(tmp_path: Path) -> None:
    """``proxima train``'s trackers: a pushed step's record, with the sessions trained into
    its version read back from the store, and evaluations at the last step's place."""
    from proxima.proxy.store import Store, ensure_schema
    from proxima.trainer.pipeline.config import TrainRunConfig
    from proxima.trainer.pipeline.tracking import RunTrackers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.proxy.store.factories import key_hash

    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    store = await Store.open(url)
    opened = await store.create_session(api_key_hash=key_hash(), group_id="g")
    await store.record_completions(completions=[completion(opened.id, response_text="4")])
    await store.set_session_reward(session_id=opened.id, reward=1.0)
    await store.finish_session(session_id=opened.id)
    await store.claim_groups(min_sessions=1, trainer_id="t")
    await store.mark_sessions(
        session_ids=[opened.id], status=SessionStatus.TRAINED, trained_version=1
    )
    await store.close()
    cfg = TrainRunConfig(
        output_dir=tmp_path, tracking=TrackingConfig(backends=["tensorboard"], run_name="r")
    )
    trackers = await RunTrackers.open(cfg, {None: tmp_path / "train_log.jsonl"}, url)
    assert trackers is not None
    trackers.evaluation(None, Accuracy(Score(0.25), None))
    await trackers.step(None, step_records()[0])  # version 1, pushed
    trackers.evaluation(None, Accuracy(Score(0.5), Score(0.75)))
    await trackers.close()
    events = EventAccumulator(str(tmp_path / "tracking" / "tensorboard" / "r"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.25), (1, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25)]
    (table,) = events.Tensors("rollouts")
    assert opened.id in table.tensor_proto.string_val[0].decode()
    assert "config" in events.Tags()["tensors"]
