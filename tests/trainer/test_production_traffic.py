"""Training on recorded production traffic: its own staleness bound, its batch share.

Production sessions carry the pinned version production served, here 10
versions behind the trainer. Their behaviour logprobs are the real ones of
that old policy (another tiny model), so the importance weights
``w = exp(prox - behav)`` of the decoupled objective are far from 1; the
logged statistics must equal ``w`` computed independently from both models.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from proxima.proxy.store import SessionStatus, Store
from proxima.proxy.store.records import CompletionRecord, SessionKind
from proxima.proxy.testing.tiny_model import build_tiny_model
from proxima.trainer.log import read_log
from proxima.trainer.loop import Trainer
from transformers import AutoModelForCausalLM

from tests.trainer.test_loop import RecordingSink, _cfg, add_session, statuses

_EPOCH = datetime(2025, 6, 1, tzinfo=UTC)
CURRENT = 10  # the trainer's version; production served version 0


@pytest.fixture(scope="module")
def old_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights production still serves (version 0): a different tiny model."""
    return build_tiny_model(tmp_path_factory.mktemp("v0"), seed=7)


def _logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].double()  # (L, V)
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


async def _production_session(
    store: Store, key_id: str, old: torch.nn.Module, reward: float, seed: int
) -> tuple[str, list[int], list[int]]:
    session = await store.get_or_create_production_session(
        api_key_id=key_id, external_id=f"user-{seed}"
    )
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (6,), generator=gen).tolist()
    output = torch.randint(0, 256, (5,), generator=gen).tolist()
    await store.record_completion(
        completion=CompletionRecord(
            id=f"cmpl-{uuid.uuid4().hex}",
            session_id=session.id,
            parent_id=None,
            prompt_ids=prompt,
            output_ids=output,
            output_logprobs=_logprobs(old, prompt, output),
            output_versions=[0] * len(output),
            finish_reason="stop",
            created_at=_EPOCH + timedelta(seconds=seed),
            sampling={"temperature": 1.0},
        )
    )
    await store.set_session_reward(session_id=session.id, reward=reward)
    await store.finish_session(session_id=session.id)
    return session.id, prompt, output


async def _setup(store: Store, tiny_model_dir: Path, old_policy: Path, count: int = 4):  # noqa: ANN202
    for version in range(1, CURRENT + 1):  # the trainer resumes at v10 (weights: the tiny model)
        await store.record_policy_version(version=version, path=str(tiny_model_dir))
    key = await store.create_api_key(
        name="app", key_hash=hashlib.sha256(uuid.uuid4().bytes).hexdigest(), record=True
    )
    old = AutoModelForCausalLM.from_pretrained(old_policy).eval()
    return [
        await _production_session(store, key.id, old, reward=float(i % 2), seed=i)
        for i in range(count)
    ]


async def test_trains_on_production_sessions_ten_versions_stale(
    store: Store,
    tiny_model_dir: Path,
    old_policy: Path,
    tmp_path: Path,
) -> None:
    production = await _setup(store, tiny_model_dir, old_policy)
    # The importance weights exp(prox - behav) of the two real policies, computed here.
    current = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    old = AutoModelForCausalLM.from_pretrained(old_policy).eval()
    weights = [
        math.exp(p - b)
        for _, prompt, output in production
        for p, b in zip(
            _logprobs(current, prompt, output), _logprobs(old, prompt, output), strict=True
        )
    ]
    assert max(weights) > 1.0
    cap = (1.0 + max(weights)) / 2  # some tokens above it: the cap is exercised too
    cfg = _cfg(tmp_path, tiny_model_dir, max_staleness=2, ppo={"importance_weight_cap": cap})
    assert cfg.production_max_staleness is None  # the default: off-policy allowed
    trainer = await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)
    assert trainer.state.version == CURRENT
    record = await trainer.step()
    await trainer.close()

    assert record is not None and record.pushed and record.version == CURRENT + 1
    assert record.samples == record.production_samples == 4  # ungrouped: a batch baseline
    assert record.production_staleness_mean == pytest.approx(10.0)
    assert record.staleness == {10: 20}
    ids = [sid for sid, _, _ in production]
    assert await statuses(store, ids) == [(SessionStatus.TRAINED, CURRENT + 1)] * 4

    assert record.ppo["importance_weight_mean"] == pytest.approx(
        sum(weights) / len(weights), rel=1e-3
    )
    assert record.ppo["importance_weight_max"] == pytest.approx(max(weights), rel=1e-3)
    assert record.ppo["masked_tokens"] == sum(w > cap for w in weights) > 0
    assert max(weights) - min(weights) > 0.1  # far from on-policy (w = 1 everywhere)

    step = next(e for e in read_log(cfg.output_dir) if e["event"] == "step")
    assert step["production_samples"] == 4 and step["production_staleness_mean"] == 10.0


async def test_production_bound_and_rollout_bound_are_separate(
    store: Store,
    tiny_model_dir: Path,
    old_policy: Path,
    tmp_path: Path,
) -> None:
    production = await _setup(store, tiny_model_dir, old_policy, count=2)
    # Two rollout sessions as stale as production ones: eta = 2 drops them.
    rollout = [
        await add_session(store, group="g", reward=float(r), versions=[0] * 3) for r in (0, 1)
    ]
    cfg = _cfg(tmp_path, tiny_model_dir, max_staleness=2, production_max_staleness=5)
    trainer = await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)
    record = await trainer.step()
    await trainer.close()
    assert record is not None and not record.pushed
    assert (record.dropped_samples, record.production_samples) == (4, 0)
    ids = [sid for sid, _, _ in production] + rollout
    assert await statuses(store, ids) == [(SessionStatus.DROPPED, None)] * 4

    # Without a production bound the production sessions train, the rollout ones do not.
    more = await _setup_more(store, old_policy)
    stale_rollout = [
        await add_session(store, group="h", reward=float(r), versions=[0] * 3) for r in (0, 1)
    ]
    cfg = _cfg(tmp_path / "b", tiny_model_dir, max_staleness=2)
    trainer = await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)
    record = await trainer.step()
    await trainer.close()
    assert record is not None and record.pushed
    assert (record.production_samples, record.dropped_samples) == (2, 2)
    assert await statuses(store, more + stale_rollout) == [
        (SessionStatus.TRAINED, CURRENT + 1),
        (SessionStatus.TRAINED, CURRENT + 1),
        (SessionStatus.DROPPED, None),
        (SessionStatus.DROPPED, None),
    ]


async def _setup_more(store: Store, old_policy: Path) -> list[str]:
    key = await store.create_api_key(
        name="app2", key_hash=hashlib.sha256(uuid.uuid4().bytes).hexdigest(), record=True
    )
    old = AutoModelForCausalLM.from_pretrained(old_policy).eval()
    return [
        (await _production_session(store, key.id, old, reward=float(i % 2), seed=100 + i))[0]
        for i in range(2)
    ]


async def test_production_share_caps_production_sessions_per_batch(
    store: Store,
    tiny_model_dir: Path,
    old_policy: Path,
    tmp_path: Path,
) -> None:
    await _setup(store, tiny_model_dir, old_policy, count=4)  # the oldest sessions
    for i, r in enumerate((0, 1, 0, 1)):  # two groups of two: the trainer claims whole groups
        await add_session(store, group=f"g{i // 2}", reward=float(r), versions=[CURRENT] * 3)
    cfg = _cfg(tmp_path, tiny_model_dir, production_share=0.5)
    trainer = await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)
    record = await trainer.step()
    await trainer.close()
    assert record is not None and record.sessions == 4
    for kind in (SessionKind.PRODUCTION, SessionKind.TRAIN):
        counts = await store.count_sessions_by_status(kind=kind)
        claimed = counts[SessionStatus.TRAINED] + counts[SessionStatus.DROPPED]
        assert claimed == 2, (kind, counts)
