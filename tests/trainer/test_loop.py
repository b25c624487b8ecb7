"""The training loop on a real SQLite store with the tiny model.

The weight sink here does to the store exactly what the proxy's
``POST /admin/weights`` does after its backends loaded the weights (record
the policy version); the live tests push to a real proxy.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from proxima.proxy.store import SessionStatus, Store
from proxima.proxy.store.records import CompletionRecord, SessionRecord
from proxima.trainer.config import TrainerConfig
from proxima.trainer.log import read_log
from proxima.trainer.loop import Trainer
from proxima.trainer.weights import PushResult, latest_checkpoint, read_pending, weights_dir
from transformers import AutoModelForCausalLM

_EPOCH = datetime(2025, 1, 1, tzinfo=UTC)


class RecordingSink:
    """Records each pushed version in the store, as the proxy does once its backends loaded it."""

    def __init__(self, store: Store, *, fail: str | None = None) -> None:
        self.store = store
        self.fail = fail  # "before": the push never lands; "after": it lands, the answer is lost
        self.pushed: list[int] = []

    async def push(self, *, version: int, path: Path) -> PushResult:
        assert (path / "config.json").is_file()
        if self.fail == "before":
            raise ConnectionError("proxy unreachable")
        await self.store.record_policy_version(version=version, path=str(path))
        if self.fail == "after":
            raise ConnectionError("connection lost while waiting for the answer")
        self.pushed.append(version)
        return PushResult(version=version, path=str(path), proxy_seconds=0.01, http_seconds=0.02)

    async def aclose(self) -> None:
        return None


def _cfg(tmp_path: Path, model_dir: Path, **overrides: Any) -> TrainerConfig:
    settings: dict[str, Any] = {
        "batch_size": 4,
        "optim": {"lr": 1e-3},
        "loop": {"trainer_id": "trainer-a"},
        # The step-level filters are what these tests pin; refill's screening has its own tests.
        "advantage": {"zero_signal": "filter"},
    }
    return merged_config(tmp_path, model_dir, settings, overrides)


def merged_config(tmp_path: Path, model_dir: Path, *layers: dict[str, Any]) -> TrainerConfig:
    """The trainer tests' common config (output under ``tmp_path``, the tiny model, 128-token
    micro-batches, a 50 ms poll) with each of ``layers`` applied in turn: a dict updates that
    section, anything else replaces it."""
    data: dict[str, Any] = {
        "output_dir": tmp_path / "out",
        "batching": {"max_tokens_per_mb": 128},
        "loop": {"poll_interval_s": 0.05},
        "connection": {"db_url": "unused-here", "model_dir": model_dir},
    }
    for layer in layers:
        for key, value in layer.items():
            data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return TrainerConfig.model_validate(data)


_clock = iter(range(10**6))


async def add_session(
    store: Store,
    *,
    group: str | None,
    reward: float,
    versions: list[int],
    logprob: float = -1.0,
    temperature: float = 1.0,
    bad_token: int | None = None,
    opened: SessionRecord | None = None,
) -> str:
    """A finished, rewarded session with one completion whose tokens have ``versions``
    (``opened``: a session of ``group`` already created, still OPEN)."""
    session = opened or await open_session(store, group)
    rng = random.Random(session.id)
    await store.record_completion(
        completion=CompletionRecord(
            id=f"cmpl-{uuid.uuid4().hex}",
            session_id=session.id,
            parent_id=None,
            prompt_ids=[rng.randrange(256) for _ in range(6)],
            output_ids=[rng.randrange(256) for _ in versions[:-1]]
            + [rng.randrange(256) if bad_token is None else bad_token],
            output_logprobs=[logprob] * len(versions),
            output_versions=versions,
            finish_reason="stop",
            created_at=_EPOCH + timedelta(seconds=next(_clock)),
            sampling={"temperature": temperature},
        )
    )
    await store.set_session_reward(session_id=session.id, reward=reward)
    await store.finish_session(session_id=session.id)
    return session.id


async def open_session(store: Store, group: str | None) -> SessionRecord:
    return await store.create_session(
        api_key_hash=hashlib.sha256(uuid.uuid4().bytes).hexdigest(), group_id=group
    )


async def add_batch(store: Store, count: int = 4, version: int = 0) -> list[str]:
    """``count`` sessions in groups of two with rewards 1 and 0 (nonzero advantages)."""
    ids = []
    batch = uuid.uuid4().hex[:6]
    for i in range(count):
        group = f"{batch}-g{i // 2}"
        ids.append(
            await add_session(store, group=group, reward=float(i % 2), versions=[version] * 5)
        )
    return ids


async def statuses(store: Store, ids: list[str]) -> list[tuple[SessionStatus, int | None]]:
    out = []
    for sid in ids:
        session = await store.get_session(session_id=sid)
        assert session is not None
        out.append((session.status, session.trained_version))
    return out


def crash(trainer: Trainer) -> None:
    """Drop a trainer without its clean shutdown (no claim release, no final checkpoint)."""
    trainer.log.close()
    trainer._executor.shutdown(wait=True)


async def test_one_step_claims_trains_pushes_marks_and_logs(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    ids = await add_batch(store, 4)
    extra = await add_session(store, group="late", reward=1.0, versions=[0, 0])
    sink = RecordingSink(store)
    cfg = _cfg(tmp_path, tiny_model_dir)
    trainer = await Trainer.start(cfg, store=store, sink=sink, console=False)
    record = await trainer.step()
    await trainer.close()

    assert record is not None and record.pushed and (record.step, record.version) == (1, 1)
    assert sink.pushed == [1] and await store.current_policy_version() == 1
    assert await statuses(store, ids) == [(SessionStatus.TRAINED, 1)] * 4
    assert await statuses(store, [extra]) == [(SessionStatus.FINISHED, None)]  # oldest first
    assert (record.sessions, record.trained_sessions, record.samples) == (4, 4, 4)
    assert record.reward_mean == 0.5 and record.staleness == {0: 20}
    assert record.loss_tokens == 20 and record.tokens == 44
    assert record.advantage_mean == pytest.approx(0.0) and record.advantage_std == pytest.approx(
        1.0
    )

    exported = AutoModelForCausalLM.from_pretrained(weights_dir(cfg.output_dir, 1))
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(exported.lm_head.weight, initial.lm_head.weight)
    assert read_pending(cfg.output_dir) is None

    events = read_log(cfg.output_dir)
    assert [e["event"] for e in events] == ["start", "step", "stop"]
    step = events[1]
    for key in ("loss", "clip_fraction", "approx_kl", "importance_weight_mean", "grad_norm"):
        assert key in step["ppo"]
    assert set(step["times"]) >= {"wait", "prox", "train", "export", "push", "weight_sync"}
    assert step["staleness"] == {"0": 20} and step["tokens_per_s"] > 0


@pytest.mark.parametrize("decoupled", [True, False])
async def test_prox_is_behav_when_not_decoupled(
    store: Store, tiny_model_dir: Path, tmp_path: Path, decoupled: bool
) -> None:
    await add_batch(store, 4)  # behaviour logprobs -1.0: not the model's own
    cfg = _cfg(tmp_path, tiny_model_dir, ppo={"decoupled": decoupled})
    trainer = await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)
    if not decoupled:

        def no_recompute(samples: object) -> list[list[float]]:
            raise AssertionError("prox = behav must not recompute logprobs")

        trainer.backend.compute_logprobs = no_recompute  # type: ignore[method-assign]
    record = await trainer.step()
    await trainer.close()
    assert record is not None
    weight_mean, weight_max = (
        record.ppo["importance_weight_mean"],
        record.ppo["importance_weight_max"],
    )
    if decoupled:
        assert weight_mean != pytest.approx(1.0)  # exp(prox - behav) with recomputed prox
    else:
        assert weight_mean == weight_max == 1.0  # w = exp(behav - behav)


@pytest.mark.parametrize("rule", ["token", "sample"])
async def test_stale_samples_are_dropped_counted_and_marked(
    store: Store, tiny_model_dir: Path, tmp_path: Path, rule: str
) -> None:
    for version in range(1, 6):  # the proxy serves version 5 (weights: the tiny model)
        await store.record_policy_version(version=version, path=str(tiny_model_dir))
    fresh = await add_session(store, group="a", reward=1.0, versions=[5, 5, 5])
    lagging = await add_session(store, group="a", reward=0.0, versions=[4, 4])
    stale = await add_session(store, group="b", reward=1.0, versions=[1, 1])
    mixed = await add_session(store, group="b", reward=0.0, versions=[2, 3])  # oldest token: 2
    cfg = _cfg(tmp_path, tiny_model_dir, max_staleness=2, stale_rule=rule)
    trainer = await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)
    assert trainer.state.version == 5
    record = await trainer.step()
    await trainer.close()

    assert record is not None and record.version == 6
    # bound: version >= 5 - 2 = 3. token: mixed keeps its version-3 token; sample: dropped whole.
    if rule == "token":
        assert (record.dropped_samples, record.dropped_sessions, record.trained_sessions) == (
            1,
            1,
            3,
        )
        assert record.staleness == {0: 3, 1: 2, 2: 1}
    else:
        assert (record.dropped_samples, record.dropped_sessions, record.trained_sessions) == (
            2,
            2,
            2,
        )
        assert record.staleness == {0: 3, 1: 2}
    mixed_status = (SessionStatus.TRAINED, 6) if rule == "token" else (SessionStatus.DROPPED, None)
    assert await statuses(store, [fresh, lagging, stale, mixed]) == [
        (SessionStatus.TRAINED, 6),
        (SessionStatus.TRAINED, 6),
        (SessionStatus.DROPPED, None),
        mixed_status,
    ]
    assert read_log(cfg.output_dir)[0]["source"] == "pushed"


async def test_refill_drops_groups_that_cannot_train_whole_and_waits_for_fresh_ones(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    for version in range(1, 6):
        await store.record_policy_version(version=version, path=str(tiny_model_dir))
    tied = [await add_session(store, group="tied", reward=1.0, versions=[5, 5]) for _ in range(2)]
    # At max_staleness 0 the one-turn success is all stale, the failure straddles the push:
    # training what is left would train the failure alone (a one-sided gradient).
    straddle = [
        await add_session(store, group="straddle", reward=1.0, versions=[4, 4]),
        await add_session(store, group="straddle", reward=0.0, versions=[4, 5, 5]),
    ]
    first = [await add_session(store, group="g1", reward=float(i), versions=[5, 5]) for i in (1, 0)]
    cfg = _cfg(tmp_path, tiny_model_dir, max_staleness=0, advantage={"zero_signal": "refill"})
    trainer = await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)
    step = asyncio.create_task(trainer.step())
    # The batch (4 sessions) is not full: the tied and straddling groups are dropped as soon
    # as they are claimed, which also hands their places back to the proxy's admission.
    for _ in range(200):
        if (await statuses(store, straddle))[0][0] is SessionStatus.DROPPED:
            break
        await asyncio.sleep(0.05)
    assert not step.done()
    assert await statuses(store, tied + straddle) == [(SessionStatus.DROPPED, None)] * 4
    assert (await store.admission_state()).admitted == 2  # g1 only
    # Both opened first: a trainer polling between the two would claim a group of one (tied).
    opened = [await open_session(store, "g2") for _ in range(2)]
    second = [
        await add_session(store, group="g2", reward=float(i), versions=[5], opened=o)
        for i, o in zip((0, 1), opened, strict=True)
    ]
    record = await asyncio.wait_for(step, 60)
    await trainer.close()

    assert record is not None and record.pushed and record.version == 6
    assert (record.sessions, record.trained_sessions, record.dropped_sessions) == (8, 4, 4)
    assert record.samples == 4 and record.staleness == {0: 6}
    assert record.reward_mean == pytest.approx(5 / 8)  # the curve counts every rollout
    assert await statuses(store, first + second) == [(SessionStatus.TRAINED, 6)] * 4


async def test_a_batch_with_nothing_left_is_marked_but_not_pushed(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    await store.record_policy_version(version=3, path=str(tiny_model_dir))
    ids = [await add_session(store, group="g", reward=float(i), versions=[0, 1]) for i in range(4)]
    sink = RecordingSink(store)
    trainer = await Trainer.start(
        _cfg(tmp_path, tiny_model_dir, max_staleness=1), store=store, sink=sink, console=False
    )
    record = await trainer.step()
    await trainer.close()
    assert record is not None and not record.pushed and record.version == 3
    assert (record.dropped_samples, record.dropped_sessions, record.ppo) == (4, 4, {})
    assert sink.pushed == [] and await statuses(store, ids) == [(SessionStatus.DROPPED, None)] * 4


async def test_greedy_and_untrainable_sessions_never_stop_training(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Greedy completions (temperature 0) train at T = 1, where their logprobs were reported;
    # a session with a token outside the vocabulary is dropped with its reason, once.
    greedy = [
        await add_session(store, group="g", reward=float(r), versions=[0] * 3, temperature=0.0)
        for r in (1, 0)
    ]
    good = await add_session(store, group="h", reward=1.0, versions=[0] * 3)
    bad = await add_session(store, group="h", reward=0.0, versions=[0] * 3, bad_token=10**6)
    sink = RecordingSink(store)
    trainer = await Trainer.start(
        _cfg(tmp_path, tiny_model_dir), store=store, sink=sink, console=False
    )
    record = await trainer.step()
    await trainer.close()
    assert record is not None and record.pushed and sink.pushed == [1]
    assert (record.sessions, record.trained_sessions, record.dropped_sessions) == (4, 2, 2)
    assert await statuses(store, [*greedy, good, bad]) == [
        (SessionStatus.TRAINED, 1),
        (SessionStatus.TRAINED, 1),
        (SessionStatus.DROPPED, None),  # alone in its group after the bad one left: no signal
        (SessionStatus.DROPPED, None),
    ]


async def test_a_batch_without_signal_takes_no_step(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    ids = [await add_session(store, group="tie", reward=1.0, versions=[0] * 3) for _ in range(4)]
    sink = RecordingSink(store)
    cfg = _cfg(tmp_path, tiny_model_dir)
    trainer = await Trainer.start(cfg, store=store, sink=sink, console=False)
    record = await trainer.step()
    assert record is not None and not record.pushed and record.ppo == {}
    assert sink.pushed == [] and await statuses(store, ids) == [(SessionStatus.DROPPED, None)] * 4
    # keep: the old behaviour, a step on a zero gradient that still pushes a version
    ids = [await add_session(store, group="tie2", reward=1.0, versions=[0] * 3) for _ in range(4)]
    await trainer.close()
    cfg = _cfg(tmp_path, tiny_model_dir, advantage={"zero_signal": "keep"})
    trainer = await Trainer.start(cfg, store=store, sink=sink, console=False)
    record = await trainer.step()
    await trainer.close()
    assert record is not None and record.pushed and sink.pushed == [1]
    assert record.ppo["grad_norm"] == 0.0


async def test_restart_resumes_at_the_pushed_version_after_a_crash(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, tiny_model_dir, checkpoint_every=2, keep_versions=1)
    await add_batch(store, 12)
    sink = RecordingSink(store)
    trainer = await Trainer.start(cfg, store=store, sink=sink, console=False)
    for _ in range(3):
        await trainer.step()
    pushed_v3 = {k: v.clone() for k, v in trainer.backend.state_dict()["model"].items()}
    crash(trainer)  # after pushing v3; the newest checkpoint is from step 2 (v2)
    ckpt = latest_checkpoint(cfg.output_dir)
    assert ckpt is not None and ckpt.state.version == 2
    assert [p.name for p in (cfg.output_dir / "weights").iterdir()] == ["v3"]  # keep_versions=1

    restarted = await Trainer.start(cfg, store=store, sink=sink, console=False)
    assert (restarted.state.version, restarted.state.step) == (3, 3)
    for key, value in restarted.backend.state_dict()["model"].items():
        assert torch.equal(value, pushed_v3[key]), key
    later = await add_batch(store, 4)
    record = await restarted.step()
    await restarted.close()  # clean stop: final checkpoint at v4
    assert record is not None and record.version == 4
    assert sink.pushed == [1, 2, 3, 4]  # no version pushed twice
    assert await statuses(store, later) == [(SessionStatus.TRAINED, 4)] * 4
    start = [e for e in read_log(cfg.output_dir) if e["event"] == "start"]
    assert [(e["source"], e["version"], e["checkpoint_version"]) for e in start] == [
        ("initial", 0, None),
        ("pushed", 3, 2),
    ]
    ckpt = latest_checkpoint(cfg.output_dir)
    assert ckpt is not None and (ckpt.state.version, ckpt.state.step) == (4, 4)


@pytest.mark.parametrize("landed", [True, False])
async def test_a_step_that_died_around_its_push_is_settled_at_restart(
    store: Store, tiny_model_dir: Path, tmp_path: Path, landed: bool
) -> None:
    cfg = _cfg(tmp_path, tiny_model_dir)
    ids = await add_batch(store, 4)
    trainer = await Trainer.start(
        cfg,
        store=store,
        sink=RecordingSink(store, fail="after" if landed else "before"),
        console=False,
    )
    with pytest.raises(ConnectionError):
        await trainer.step()
    crash(trainer)
    assert await statuses(store, ids) == [(SessionStatus.CLAIMED, None)] * 4
    assert read_pending(cfg.output_dir) is not None

    sink = RecordingSink(store)
    restarted = await Trainer.start(cfg, store=store, sink=sink, console=False)
    assert read_pending(cfg.output_dir) is None
    if landed:  # v1 is served: its sessions are consumed by it, and training goes on at v1
        assert restarted.state.version == 1
        assert await statuses(store, ids) == [(SessionStatus.TRAINED, 1)] * 4
    else:  # nothing was pushed: the sessions are released and trained again into v1
        assert restarted.state.version == 0 and not weights_dir(cfg.output_dir, 1).exists()
        assert await statuses(store, ids) == [(SessionStatus.FINISHED, None)] * 4
        await restarted.step()
        assert sink.pushed == [1]
        assert await statuses(store, ids) == [(SessionStatus.TRAINED, 1)] * 4
    await restarted.close()


async def test_a_failed_push_that_landed_is_settled_on_close(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, tiny_model_dir, checkpoint_every=5)
    ids = await add_batch(store, 4)
    trainer = await Trainer.start(
        cfg, store=store, sink=RecordingSink(store, fail="after"), console=False
    )
    with pytest.raises(ConnectionError):
        await trainer.run(asyncio.Event())  # the step raises; run() still closes the trainer
    # The store says v1 is served: its sessions are TRAINED, not released for a second training,
    # and the final checkpoint holds the v1 weights.
    assert await statuses(store, ids) == [(SessionStatus.TRAINED, 1)] * 4
    assert read_pending(cfg.output_dir) is None
    ckpt = latest_checkpoint(cfg.output_dir)
    assert ckpt is not None and (ckpt.state.version, ckpt.state.step) == (1, 1)


async def test_stop_while_waiting_releases_the_claims(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    ids = await add_batch(store, 2)  # half a batch: the trainer holds them and waits
    cfg = _cfg(tmp_path, tiny_model_dir, checkpoint_every=1)
    trainer = await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)
    stop = asyncio.Event()
    run = asyncio.create_task(trainer.run(stop))
    for _ in range(100):
        if await statuses(store, ids) == [(SessionStatus.CLAIMED, None)] * 2:
            break
        await asyncio.sleep(0.05)
    assert await statuses(store, ids) == [(SessionStatus.CLAIMED, None)] * 2
    stop.set()
    assert await asyncio.wait_for(run, timeout=10) == 0
    assert await statuses(store, ids) == [(SessionStatus.FINISHED, None)] * 2
    assert read_log(cfg.output_dir)[-1] == {
        "event": "stop",
        "version": 0,
        "step": 0,
        "released_claims": 2,
    }
