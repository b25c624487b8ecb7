"""What a ``proxima train`` run trains: the model, its items, and its policies.

The model is an HF directory (or ``smollm2``, the demo model, converted once). The
items are the train, held-out and unseen-phrasing splits (:class:`Items`). A policy
(:class:`Policy`) is the base model, or with ``[[rollout.tenants]]`` one tenant's LoRA
adapter, with the agent, items and item fields of its rollouts; each gets its own
rollout controller (:func:`rollout_controller`) fed the train items forever
(:func:`train_items`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxima.trainer.log import LOG_FILE, policy_home
from proxima.trainer.pipeline.config import DataSection, ModelSection, TrainRunConfig
from proxima.trainer.rollout.controller import RolloutController


def resolve_model_dir(section: ModelSection) -> Path:
    if section.path == "smollm2":
        from proxima.trainer.pipeline.demo_model import prepare_smollm2

        return prepare_smollm2(section.cache_dir)
    path = Path(section.path)
    if not (path / "config.json").exists():
        raise ValueError(f"model.path {path}: no config.json there; give an HF model directory")
    return path


@dataclass(frozen=True, slots=True)
class Items:
    """A run's items: train, held-out, and held-out in unseen phrasings (may be empty)."""

    train: list[dict[str, Any]]
    test: list[dict[str, Any]]
    unseen: list[dict[str, Any]]


def load_items(data: DataSection) -> Items:
    if data.source == "arithmetic":
        from proxima.agents_examples.datasets import arithmetic_splits

        splits = arithmetic_splits(
            difficulty=data.difficulty,
            n_train=data.train_items,
            n_test=data.test_items,
            seed=data.seed,
            n_unseen=data.unseen_items,
            train_phrasings=data.train_phrasings,
        )
        return Items(splits["train"], splits["test"], splits.get("unseen", []))
    from proxima.agents_examples.datasets import read_jsonl

    train = list(read_jsonl(Path(data.source)))
    test = list(read_jsonl(data.test_file)) if data.test_file else []
    unseen = list(read_jsonl(data.unseen_file)) if data.unseen_file else []
    return Items(train, test, unseen)


@dataclass(frozen=True)
class Policy:
    """What one run trains: the base model, or one tenant's LoRA adapter
    (``[[rollout.tenants]]``), with the agent, items and item fields of its rollouts."""

    adapter: str | None
    agent: str
    items: Items
    fields: dict[str, Any]

    @property
    def prefix(self) -> str:
        """What starts each of its printed lines: nothing for the base, ``"<adapter>: "``."""
        return "" if self.adapter is None else f"{self.adapter}: "

    def log_path(self, cfg: TrainRunConfig) -> Path:
        """Its trainer's step log."""
        return policy_home(cfg.output_dir / "trainer", self.adapter) / LOG_FILE

    def curve_path(self, cfg: TrainRunConfig) -> Path:
        name = "reward_curve.png" if self.adapter is None else f"reward_curve_{self.adapter}.png"
        return cfg.output_dir / name


def run_policies(cfg: TrainRunConfig) -> list[Policy]:
    """The base (no tenants), or one policy per tenant with its own agent and items."""
    r = cfg.rollout
    if not r.tenants:
        return [Policy(None, r.agent, load_items(cfg.data), dict(r.item_fields))]
    return [
        Policy(
            t.adapter,
            t.agent or r.agent,
            load_items(t.data or cfg.data),
            dict(r.item_fields if t.item_fields is None else t.item_fields),
        )
        for t in r.tenants
    ]


def rollout_controller(
    cfg: TrainRunConfig,
    url: str,
    token: str,
    model_name: str,
    policy: Policy | None = None,
) -> RolloutController:
    """The controller of the run's training rollouts (of ``policy``: a tenant's), as its
    ``rollout`` section says."""
    r = cfg.rollout
    return RolloutController(
        url,
        token,
        r.agent if policy is None else policy.agent,
        group_size=r.group_size,
        max_concurrency=r.max_concurrency,
        timeout_s=r.timeout_s,
        model=model_name,
        mode=r.mode,
        ray_address=r.ray_address,
        ray_options=r.ray_options,
        adapter=None if policy is None else policy.adapter,
        retry_window_s=r.retry_window_s,
    )


async def train_items(
    items: list[dict[str, Any]], fields: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """Train items forever (epochs), each epoch's items tagged so group ids stay unique."""
    epoch = 0
    while True:
        for item in items:
            yield {**item, **fields, "id": f"{item.get('id')}@{epoch}"}
        epoch += 1


def rollout_fields(cfg: TrainRunConfig, policy: Policy) -> dict[str, Any]:
    """The fields every rollout item of ``policy`` gets: its item fields, the rollout
    temperature and (when set) the rollout seed."""
    fields = {**policy.fields, "temperature": cfg.rollout.temperature}
    if cfg.rollout.seed is not None:
        fields["seed"] = cfg.rollout.seed
    return fields
