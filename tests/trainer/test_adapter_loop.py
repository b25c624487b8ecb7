"""Several LoRA adapters in one trainer, on a real SQLite store with the tiny model.

Each adapter claims only its own sessions, pushes its own version sequence
(peft files under ``adapters/<name>/v<n>``), and the adapters with a batch
ready take turns. The sink records each push in the store as the proxy's
``POST /admin/weights`` does once its backends loaded it.
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
from proxima.proxy.store.records import CompletionRecord
from proxima.trainer.adapter_loop import AdapterTrainers, next_turn
from proxima.trainer.config import TrainerConfig
from proxima.trainer.log import policy_home, read_log
from proxima.trainer.weights import PushResult
from transformers import AutoModelForCausalLM

from tests.trainer.test_loop import merged_config, statuses

_EPOCH = datetime(2025, 1, 1, tzinfo=UTC)
_clock = iter(range(10**6))
ADAPTERS = ["tenant-a", "tenant-b"]


class AdapterSink:
    """Records each pushed (adapter, version) in the store, as the proxy does."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.pushed: list[tuple[str | None, int]] = []

    async def push(self, *, version: int, path: Path, adapter: str | None = None) -> PushResult:
        files = sorted(p.name for p in path.iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"], files
        await self.store.record_policy_version(version=version, path=str(path), adapter=adapter)
        self.pushed.append((adapter, version))
        return PushResult(version=version, path=str(path), proxy_seconds=0.01, http_seconds=0.02)

    async def aclose(self) -> None:
        return None


def _cfg(tmp_path: Path, model_dir: Path, **overrides: Any) -> TrainerConfig:
    settings: dict[str, Any] = {
        "batch_size": 2,
        "optim": {"lr": 1e-2},
        "lora": {"adapters": ADAPTERS, "rank": 4, "alpha": 8.0},
        "loop": {"trainer_id": "trainer-x"},
    }
    return merged_config(tmp_path, model_dir, settings, overrides)


async def add_group(store: Store, adapter: str | None, version: int = 0) -> list[str]:
    """Two finished sessions of ``adapter`` in one group, rewards 1 and 0."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    ids = []
    for reward in (1.0, 0.0):
        session = await store.create_session(
            api_key_hash=hashlib.sha256(uuid.uuid4().bytes).hexdigest(),
            group_id=group,
            adapter=adapter,
        )
        rng = random.Random(session.id)
        await store.record_completion(
            completion=CompletionRecord(
                id=f"cmpl-{uuid.uuid4().hex}",
                session_id=session.id,
                parent_id=None,
                prompt_ids=[rng.randrange(256) for _ in range(6)],
                output_ids=[rng.randrange(256) for _ in range(5)],
                output_logprobs=[-1.0] * 5,
                output_versions=[version] * 5,
                finish_reason="stop",
                created_at=_EPOCH + timedelta(seconds=next(_clock)),
                sampling={"temperature": 1.0},
                adapter=adapter,
            )
        )
        await store.set_session_reward(session_id=session.id, reward=reward)
        await store.finish_session(session_id=session.id)
        ids.append(session.id)
    return ids


@pytest.mark.parametrize(
    ("ready", "last", "expected"),
    [
        ([True, True, True], None, 0),  # nobody stepped yet: the first ready
        ([True, True, True], 0, 1),  # after 0 comes 1
        ([True, True, True], 2, 0),  # wraps around
        ([True, False, True], 0, 2),  # 1 has no batch: skipped
        ([True, False, False], 0, 0),  # only the one that just stepped is ready: it again
        ([False, False, False], 1, None),  # nothing ready
    ],
)
def test_next_turn_is_round_robin_among_ready(
    ready: list[bool], last: int | None, expected: int | None
) -> None:
    assert next_turn(ready, last) == expected


async def test_each_adapter_trains_its_own_sessions_and_pushes_its_own_version(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    a_ids = await add_group(store, "tenant-a")
    b_ids = await add_group(store, "tenant-b")
    base_ids = await add_group(store, None)
    sink = AdapterSink(store)
    cfg = _cfg(tmp_path, tiny_model_dir)
    trainers = await AdapterTrainers.start(cfg, store=store, sink=sink, console=False)
    base_before = {n: p.detach().clone() for n, p in trainers.backend.base_parameters()}
    first, second = await trainers.step(), await trainers.step()
    await trainers.close()

    assert first is not None and second is not None and first.pushed and second.pushed
    assert sink.pushed == [("tenant-a", 1), ("tenant-b", 1)]
    assert await statuses(store, a_ids) == [(SessionStatus.TRAINED, 1)] * 2
    assert await statuses(store, b_ids) == [(SessionStatus.TRAINED, 1)] * 2
    assert await statuses(store, base_ids) == [(SessionStatus.FINISHED, None)] * 2  # not ours
    assert await store.current_policy_version(adapter="tenant-a") == 1
    assert await store.current_policy_version() == 0  # the base's sequence did not move
    for name, param in trainers.backend.base_parameters():
        assert torch.equal(param, base_before[name]), name
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert torch.equal(
        dict(trainers.backend.base_parameters())["base_model.model.model.embed_tokens.weight"],
        initial.model.embed_tokens.weight,
    )
    for adapter in ADAPTERS:
        home = policy_home(cfg.output_dir, adapter)
        assert (home / "v1" / "adapter_model.safetensors").is_file()
        events = read_log(home)
        assert [e["event"] for e in events] == ["start", "step", "stop"]
        assert events[0]["adapter"] == adapter and events[0]["trainer_id"] == f"trainer-x/{adapter}"


async def test_a_busy_adapter_does_not_starve_another(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    for _ in range(3):
        await add_group(store, "tenant-a")
    await add_group(store, "tenant-b")
    sink = AdapterSink(store)
    trainers = await AdapterTrainers.start(
        _cfg(tmp_path, tiny_model_dir), store=store, sink=sink, console=False
    )
    try:
        for _ in range(3):
            await trainers.step()
        await add_group(store, "tenant-b")  # B's next batch arrives while A still has one
        await trainers.step()
        await trainers.step()
    finally:
        await trainers.close()
    assert sink.pushed == [
        ("tenant-a", 1),
        ("tenant-b", 1),
        ("tenant-a", 2),  # B had nothing: A again
        ("tenant-b", 2),  # B's turn comes before A's third
        ("tenant-a", 3),
    ]


async def test_run_stops_after_max_steps_per_adapter_and_resumes_from_checkpoints(
    store: Store, tiny_model_dir: Path, tmp_path: Path
) -> None:
    for _ in range(2):
        await add_group(store, "tenant-a")
        await add_group(store, "tenant-b")
    sink = AdapterSink(store)
    cfg = _cfg(tmp_path, tiny_model_dir, checkpoint_every=1, loop={"max_steps": 1})
    trainers = await AdapterTrainers.start(cfg, store=store, sink=sink, console=False)
    assert await trainers.run(asyncio.Event()) == 2  # one step each, then it stops
    trained = {
        a: [p.detach().clone() for p in trainers.backend.adapter_parameters(a)] for a in ADAPTERS
    }
    moments = {
        a: [s["exp_avg"].clone() for s in trainers.backend.optimizers[a].state.values()]
        for a in ADAPTERS
    }

    again = await AdapterTrainers.start(cfg, store=store, sink=sink, console=False)
    try:
        for trainer in again.trainers:
            assert (trainer.state.version, trainer.state.step) == (1, 1)
        for adapter in ADAPTERS:
            log = read_log(policy_home(cfg.output_dir, adapter))
            starts = [e["source"] for e in log if e.get("event") == "start"]
            assert starts == ["initial", "checkpoint"]
            restored = again.backend.adapter_parameters(adapter)
            assert all(torch.equal(x, y) for x, y in zip(restored, trained[adapter], strict=True))
            state = list(again.backend.optimizers[adapter].state.values())
            assert len(state) == len(moments[adapter]) > 0
            assert all(
                torch.equal(s["exp_avg"], m) for s, m in zip(state, moments[adapter], strict=True)
            )
        await again.step()
        await again.step()
    finally:
        await again.close()
    assert sink.pushed[2:] == [("tenant-a", 2), ("tenant-b", 2)]


@pytest.mark.parametrize(
    ("lora", "tenants", "message"),
    [
        (["tenant-a"], [], r"add a \[\[rollout.tenants\]\] table per adapter"),
        ([], ["tenant-a"], r'set \[trainer.lora\] adapters = \["tenant-a"\]'),
        (["tenant-a", "tenant-b"], ["tenant-a"], r"rollout.tenants trains \['tenant-a'\]"),
        (["tenant-a"], ["tenant-a", "tenant-a"], r"names the adapters \['tenant-a'\] more than"),
        (["tenant-a"], ["Tenant-A"], "not an adapter name"),
    ],
)
def test_proxima_train_needs_a_tenant_per_adapter_and_an_adapter_per_tenant(
    lora: list[str], tenants: list[str], message: str
) -> None:
    """Otherwise the trainer would wait forever for sessions no rollout opens."""
    from proxima.trainer.pipeline.config import TrainRunConfig
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        TrainRunConfig.model_validate(
            {
                "trainer": {"lora": {"adapters": lora}},
                "rollout": {"tenants": [{"adapter": name} for name in tenants]},
            }
        )


def test_a_tenant_has_its_own_agent_data_and_fields_or_the_runs() -> None:
    from proxima.trainer.pipeline.config import TrainRunConfig
    from proxima.trainer.pipeline.train import run_policies

    cfg = TrainRunConfig.model_validate(
        {
            "trainer": {"lora": {"adapters": ["tenant-b", "tenant-a"]}},
            "data": {"train_items": 3, "test_items": 2},
            "rollout": {
                "agent": "pkg.a:run",
                "item_fields": {"max_turns": 1},
                "tenants": [
                    {"adapter": "tenant-a"},
                    {
                        "adapter": "tenant-b",
                        "agent": "pkg.b:run",
                        "data": {"train_items": 5, "test_items": 1, "seed": 3},
                        "item_fields": {"max_tokens": 4},
                    },
                ],
            },
        }
    )
    a, b = run_policies(cfg)
    assert (a.adapter, a.agent, a.fields, len(a.items.train)) == (
        "tenant-a",
        "pkg.a:run",
        {"max_turns": 1},
        3,
    )
    assert (b.adapter, b.agent, b.fields, len(b.items.train)) == (
        "tenant-b",
        "pkg.b:run",
        {"max_tokens": 4},
        5,
    )
    assert len(b.items.test) == 1 and a.prefix == "tenant-a: "
    plain = TrainRunConfig.model_validate({"data": {"train_items": 3}})
    (base,) = run_policies(plain)  # no tenants: the base model, as the sections say
    assert (base.adapter, base.prefix, base.agent) == (None, "", plain.rollout.agent)
