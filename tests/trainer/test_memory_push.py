"""Pushes from the trainer's memory (``trainer/publish.py``): the export after the push, and
the recovery rule around it, on a real SQLite store with the tiny model.

The sink stands in for the broadcast sink (``MemoryWeightSink``): it reads the tensors the
trainer hands it, as the broadcast does, and records the version in the store exactly as the
proxy does once its backends took it. The live version is
``tests/proxy/test_weight_broadcast_live.py``'s training run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from proxima.proxy.store import SessionStatus, Store
from proxima.trainer.log import read_log
from proxima.trainer.loop import Trainer
from proxima.trainer.weight_push import MemoryWeightSink
from proxima.trainer.weights import PushResult, latest_checkpoint, read_pending, weights_dir
from safetensors.torch import load_file

from tests.trainer.test_loop import _cfg, add_batch, crash, statuses


class MemorySink:
    """Records each version in the store from the tensors handed to it; ``fail``: "after"
    (it lands, the answer is lost), "fallback" (it goes from disk: exported first)."""

    def __init__(self, store: Store, *, fail: str | None = None) -> None:
        self.store = store
        self.fail = fail
        self.pushed: list[tuple[int, str]] = []  # (version, transport)
        self.exported_before: list[bool] = []  # was weights/v{n} on disk when it was pushed?
        self.sent: dict[int, dict[str, torch.Tensor]] = {}

    async def push(self, *, version: int, path: Path, adapter: str | None = None) -> PushResult:
        raise AssertionError("a trainer with in-memory weights pushes from memory")

    async def push_from(
        self,
        *,
        version: int,
        path: Path,
        source: Callable[[], Iterable[tuple[str, Any]]],
        export: Callable[[], Awaitable[Path]],
    ) -> PushResult:
        self.exported_before.append(path.exists())
        transport = "broadcast"
        if self.fail == "fallback":
            assert await export() == path and (path / "config.json").is_file()
            transport = "disk"
        self.sent[version] = {k: t.detach().clone() for k, t in source()}
        await self.store.record_policy_version(version=version, path=str(path))
        if self.fail == "after":
            raise ConnectionError("connection lost while waiting for the answer")
        self.pushed.append((version, transport))
        return PushResult(version, str(path), 0.01, 0.02, transport)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        return None


def _exported(cfg: Any, version: int) -> dict[str, torch.Tensor]:
    return load_file(weights_dir(cfg.output_dir, version) / "model.safetensors")


async def test_the_export_follows_the_push_and_holds_what_was_pushed(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, tiny_model_dir, checkpoint_every=2, keep_versions=1)
    sink = MemorySink(store)
    assert isinstance(sink, MemoryWeightSink)
    batches = [await add_batch(store, 4) for _ in range(3)]
    trainer = await Trainer.start(cfg, store=store, sink=sink, console=False)
    records = [await trainer.step() for _ in range(3)]
    await trainer.close()

    assert sink.pushed == [(1, "broadcast"), (2, "broadcast"), (3, "broadcast")]
    assert sink.exported_before == [False, False, False]  # no export on the push's path
    assert all(r is not None and r.times.export == 0.0 for r in records)
    for version, ids in enumerate(batches, 1):
        assert await statuses(store, ids) == [(SessionStatus.TRAINED, version)] * 4
    # The export written after the push is the pushed version (tied lm_head stored once).
    exported = _exported(cfg, 3)
    assert exported.keys() <= sink.sent[3].keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, sink.sent[3][name]), name
    assert [p.name for p in (cfg.output_dir / "weights").iterdir()] == ["v3"]  # pruned
    assert read_pending(cfg.output_dir) is None
    events = read_log(cfg.output_dir)
    assert [e["version"] for e in events if e["event"] == "exported"] == [1, 2, 3]
    ckpt = latest_checkpoint(cfg.output_dir)  # step 2's (with v2's weights), then close's
    assert ckpt is not None and (ckpt.state.version, ckpt.state.step) == (3, 3)


async def test_a_fallback_to_disk_exports_first_and_settles_at_once(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, tiny_model_dir)
    sink = MemorySink(store, fail="fallback")
    ids = await add_batch(store, 4)
    trainer = await Trainer.start(cfg, store=store, sink=sink, console=False)
    await trainer.step()
    assert await statuses(store, ids) == [(SessionStatus.TRAINED, 1)] * 4  # no export pending
    await trainer.close()
    assert sink.pushed == [(1, "disk")]
    assert not [e for e in read_log(cfg.output_dir) if e["event"] == "exported"]


async def test_a_trainer_that_dies_before_the_export_trains_that_step_again(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Version 2 lands from memory and the trainer dies before exporting it: the restarted
    trainer resumes from v1's export labelled version 2 (its next push is 3), and step 2's
    sessions are released and trained again, never counted as trained into lost weights."""
    cfg = _cfg(tmp_path, tiny_model_dir)
    first, second = await add_batch(store, 4), await add_batch(store, 4)
    trainer = await Trainer.start(cfg, store=store, sink=MemorySink(store), console=False)
    await trainer.step()
    trainer.sink = MemorySink(store, fail="after")  # v2 lands; the trainer dies at once
    with pytest.raises(ConnectionError):
        await trainer.step()
    crash(trainer)
    assert await store.current_policy_version() == 2
    assert not weights_dir(cfg.output_dir, 2).exists()
    pending = read_pending(cfg.output_dir)
    assert pending is not None and (pending.version, pending.exported) == (2, False)

    sink = MemorySink(store)
    restarted = await Trainer.start(cfg, store=store, sink=sink, console=False)
    assert (restarted.state.version, restarted.state.step) == (2, 1)
    assert read_pending(cfg.output_dir) is None
    assert await statuses(store, first) == [(SessionStatus.TRAINED, 1)] * 4
    assert await statuses(store, second) == [(SessionStatus.FINISHED, None)] * 4
    v1 = _exported(cfg, 1)
    model = dict(restarted.backend.state_dict()["model"])
    for name, tensor in v1.items():
        assert torch.equal(model[name], tensor), name
    start = [e for e in read_log(cfg.output_dir) if e["event"] == "start"][-1]
    assert (start["source"], start["version"], start["weights"]) == (
        "pushed",
        2,
        str(weights_dir(cfg.output_dir, 1)),
    )
    await restarted.step()
    await restarted.close()
    assert sink.pushed == [(3, "broadcast")]
    assert await statuses(store, second) == [(SessionStatus.TRAINED, 3)] * 4


async def test_a_failed_push_from_memory_that_landed_is_exported_on_close(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, tiny_model_dir)
    ids = await add_batch(store, 4)
    sink = MemorySink(store, fail="after")
    trainer = await Trainer.start(cfg, store=store, sink=sink, console=False)
    with pytest.raises(ConnectionError):
        await trainer.step()
    await trainer.close()  # settles it: v1 is served, its weights are this trainer's
    assert await statuses(store, ids) == [(SessionStatus.TRAINED, 1)] * 4
    for name, tensor in _exported(cfg, 1).items():
        assert torch.equal(tensor, sink.sent[1][name]), name
    restarted = await Trainer.start(cfg, store=store, sink=MemorySink(store), console=False)
    assert restarted.state.version == 1
    await restarted.close()


async def test_an_export_that_fails_after_the_push_leaves_the_step_to_recovery(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The export after a push from memory fails (a full disk): close raises it after
    releasing the claims, writes no checkpoint, and leaves the pending step, so the restart
    applies the recovery rule: version 1 is labelled, its weights are the initial model's,
    and the step's sessions are trained again into version 2."""
    cfg = _cfg(tmp_path, tiny_model_dir, checkpoint_every=1)
    ids = await add_batch(store, 4)
    trainer = await Trainer.start(cfg, store=store, sink=MemorySink(store), console=False)

    def full_disk(version: int) -> Path:
        raise OSError(28, "No space left on device")

    trainer._export = full_disk  # type: ignore[method-assign]
    record = await trainer.step()
    assert record is not None and record.pushed and record.version == 1
    with pytest.raises(OSError, match="No space left"):
        await trainer.close()
    assert await statuses(store, ids) == [(SessionStatus.FINISHED, None)] * 4
    assert latest_checkpoint(cfg.output_dir) is None
    pending = read_pending(cfg.output_dir)
    assert pending is not None and (pending.version, pending.exported) == (1, False)

    sink = MemorySink(store)
    restarted = await Trainer.start(cfg, store=store, sink=sink, console=False)
    assert restarted.state.version == 1 and read_pending(cfg.output_dir) is None
    start = [e for e in read_log(cfg.output_dir) if e["event"] == "start"][-1]
    assert (start["source"], start["version"]) == ("initial", 1)
    await restarted.step()
    await restarted.close()
    assert sink.pushed == [(2, "broadcast")]
    assert await statuses(store, ids) == [(SessionStatus.TRAINED, 2)] * 4
