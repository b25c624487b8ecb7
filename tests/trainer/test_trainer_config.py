"""Trainer config: defaults, derived values, rejected combinations, file loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from proxima.trainer.config import (
    AdvantageConfig,
    BatchingConfig,
    OptimConfig,
    PPOConfig,
    TrainerConfig,
    load_config,
)
from pydantic import ValidationError


def test_defaults_and_eps_clip_high_follows_eps_clip() -> None:
    cfg = TrainerConfig()
    assert cfg.ppo.eps_clip == cfg.ppo.eps_clip_high == 0.2
    assert cfg.ppo.decoupled and cfg.ppo.ppo_minibatches == 1
    assert cfg.batching.max_tokens_per_mb == 8192 and cfg.batching.min_mbs == 1
    assert PPOConfig(eps_clip=0.1).eps_clip_high == 0.1
    assert PPOConfig(eps_clip=0.1, eps_clip_high=0.3).eps_clip_high == 0.3


def test_every_field_has_a_description() -> None:
    for model in (PPOConfig, AdvantageConfig, BatchingConfig, OptimConfig, TrainerConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: PPOConfig(eps_clip=-0.1), "greater than 0"),
        (lambda: PPOConfig(eps_clip=1.5), "set eps_clip in"),
        (lambda: PPOConfig(importance_weight_cap=0.5), "set it >= 1"),
        (lambda: PPOConfig(ppo_minibatches=0), "greater than or equal to 1"),
        (lambda: BatchingConfig(min_mbs=0), "greater than or equal to 1"),
        (lambda: AdvantageConfig(baseline="none", normalize_std=True), "set advantage.baseline"),
        (lambda: AdvantageConfig(discount=1.5), "less than or equal to 1"),
        (lambda: OptimConfig(betas=(0.9, 1.0)), "both betas"),
        (lambda: OptimConfig(grad_clip=0.0), "positive max norm"),
        (lambda: TrainerConfig(batch_size=2, ppo={"ppo_minibatches": 4}), "raise batch_size"),
        (lambda: TrainerConfig(device="tpu"), "pattern"),
        (lambda: TrainerConfig(ppo={"eps_clp": 0.1}), "Extra inputs"),
    ],
)
def test_invalid_configs_are_rejected_with_a_hint(build, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        build()


def test_load_config_json_toml_yaml(tmp_path: Path) -> None:
    data = {"batch_size": 16, "ppo": {"eps_clip": 0.1}, "advantage": {"baseline": "leave_one_out"}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.toml").write_text(
        'batch_size = 16\n[ppo]\neps_clip = 0.1\n[advantage]\nbaseline = "leave_one_out"\n'
    )
    (tmp_path / "c.yaml").write_text(
        "batch_size: 16\nppo:\n  eps_clip: 0.1\nadvantage:\n  baseline: leave_one_out\n"
    )
    loaded = [load_config(tmp_path / f"c.{ext}") for ext in ("json", "toml", "yaml")]
    assert loaded[0] == loaded[1] == loaded[2]
    assert loaded[0].batch_size == 16 and loaded[0].ppo.eps_clip_high == 0.1
    assert loaded[0].advantage.baseline == "leave_one_out"


def test_load_config_rejects_unknown_format(tmp_path: Path) -> None:
    path = tmp_path / "c.ini"
    path.write_text("x")
    with pytest.raises(ValueError, match="unknown config format"):
        load_config(path)
