"""Weight versions, checkpoints, the pending-step manifest and the recovery rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from proxima.trainer.weights import (
    PendingStep,
    RecoveryError,
    TrainerState,
    atomic_dir,
    clear_pending,
    export_weights,
    exported_versions,
    latest_checkpoint,
    plan_resume,
    prune_weights,
    read_pending,
    remove_partial_writes,
    save_checkpoint,
    weights_dir,
    write_pending,
)


def _fake_export(directory: Path) -> None:
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")


def test_atomic_dir_leaves_nothing_behind_on_failure(tmp_path: Path) -> None:
    final = tmp_path / "weights" / "v1"
    with pytest.raises(RuntimeError, match="boom"), atomic_dir(final) as tmp:
        (tmp / "half-written").write_text("x")
        raise RuntimeError("boom")
    assert not final.exists()
    assert list((tmp_path / "weights").iterdir()) == []


def test_export_writes_version_dirs_atomically_and_checks_them(tmp_path: Path) -> None:
    path = export_weights(tmp_path, 3, _fake_export)
    assert path == weights_dir(tmp_path, 3).resolve()
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(RuntimeError, match="no config.json"):
        export_weights(tmp_path, 4, lambda d: (d / "model.safetensors").write_bytes(b""))
    assert exported_versions(tmp_path) == [3]
    # A leftover temp dir of a crash is not a version and is cleaned at start-up.
    (tmp_path / "weights" / ".tmp-v9-deadbeef").mkdir()
    assert exported_versions(tmp_path) == [3]
    assert remove_partial_writes(tmp_path) == 1


def test_prune_keeps_the_newest_and_the_served_version(tmp_path: Path) -> None:
    for version in range(1, 6):
        export_weights(tmp_path, version, _fake_export)
    assert prune_weights(tmp_path, keep=2, served_version=5) == [1, 2, 3]
    assert exported_versions(tmp_path) == [4, 5]
    for version in (6, 7):
        export_weights(tmp_path, version, _fake_export)
    # The proxy still serves 5 (say 6 and 7 were exported but not pushed yet): keep it.
    assert prune_weights(tmp_path, keep=1, served_version=5) == [4, 6]
    assert exported_versions(tmp_path) == [5, 7]


def test_checkpoints_are_atomic_and_only_the_newest_is_kept(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, TrainerState("t", version=2, step=2), {"w": torch.ones(2)})
    save_checkpoint(tmp_path, TrainerState("t", version=4, step=4), {"w": torch.zeros(2)})
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.state == TrainerState("t", version=4, step=4)
    assert torch.equal(ckpt.load_tensors()["w"], torch.zeros(2))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000004"]


def test_pending_step_round_trip(tmp_path: Path) -> None:
    assert read_pending(tmp_path) is None
    write_pending(tmp_path, PendingStep("t", 3, ["a", "b"]))
    assert read_pending(tmp_path) == PendingStep("t", 3, ["a", "b"])
    clear_pending(tmp_path)
    assert read_pending(tmp_path) is None


def _checkpoint(tmp_path: Path, version: int, step: int) -> None:
    save_checkpoint(tmp_path, TrainerState("t", version=version, step=step), {})


def test_recovery_rule(tmp_path: Path) -> None:
    # Nothing pushed, nothing saved: the initial model.
    plan = plan_resume(output_dir=tmp_path, checkpoint=None, pushed_version=0)
    assert (plan.source, plan.version, plan.step) == ("initial", 0, 0)

    # The checkpoint is at the pushed version: model and optimizer from it.
    _checkpoint(tmp_path, version=2, step=2)
    ckpt = latest_checkpoint(tmp_path)
    plan = plan_resume(output_dir=tmp_path, checkpoint=ckpt, pushed_version=2)
    assert (plan.source, plan.version, plan.step, plan.weights_path) == ("checkpoint", 2, 2, None)

    # Pushed past the checkpoint: the pushed weights, the checkpoint's optimizer.
    export_weights(tmp_path, 3, _fake_export)
    plan = plan_resume(output_dir=tmp_path, checkpoint=ckpt, pushed_version=3)
    assert (plan.source, plan.version, plan.step) == ("pushed", 3, 3)
    assert plan.checkpoint == ckpt and plan.weights_path == weights_dir(tmp_path, 3)

    # No checkpoint and no local copy: the path the store recorded.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plan = plan_resume(
        output_dir=tmp_path / "fresh",
        checkpoint=None,
        pushed_version=3,
        pushed_paths=[(3, str(elsewhere))],
    )
    assert (plan.source, plan.version, plan.weights_path, plan.checkpoint) == (
        "pushed",
        3,
        elsewhere,
        None,
    )

    # Missing weights for the served version, or a checkpoint ahead of the proxy: refused.
    with pytest.raises(RecoveryError, match="restore that directory"):
        plan_resume(output_dir=tmp_path, checkpoint=ckpt, pushed_version=7)
    with pytest.raises(RecoveryError, match="another database"):
        plan_resume(output_dir=tmp_path, checkpoint=ckpt, pushed_version=1)
