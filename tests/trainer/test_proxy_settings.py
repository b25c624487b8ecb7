"""The staleness rule's settings are declared once, by the proxy; the trainer adopts or refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from proxima.proxy.testing.live import LiveProxy
from proxima.trainer.cli import build_parser, config_from_args
from proxima.trainer.config import TrainerConfig
from proxima.trainer.proxy_settings import (
    ProxySettings,
    ProxySettingsError,
    adopt_proxy_settings,
    fetch_proxy_settings,
)

URL = "http://proxy:8000"


def test_unset_settings_are_the_proxys() -> None:
    cfg = TrainerConfig.model_validate({"optim": {"lr": 1e-4}})
    adopted = adopt_proxy_settings(cfg, ProxySettings(3, 7), proxy_url=URL)
    assert (adopted.batch_size, adopted.max_staleness) == (3, 7)
    assert adopted.optim.lr == 1e-4  # the rest of the config is kept


def test_equal_settings_are_accepted() -> None:
    cfg = TrainerConfig.model_validate({"batch_size": 3, "max_staleness": 7})
    adopted = adopt_proxy_settings(cfg, ProxySettings(3, 7), proxy_url=URL)
    assert (adopted.batch_size, adopted.max_staleness) == (3, 7)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"batch_size": 16},
            r"batch_size = 16 in the trainer config, but the proxy at http://proxy:8000 runs with "
            r"train_batch_size = 8 \(proxima serve --train-batch-size 8\); remove batch_size",
        ),
        (
            {"max_staleness": 2},
            r"max_staleness = 2 .* max_staleness = 4 \(proxima serve --max-staleness 4\)",
        ),
    ],
)
def test_a_different_value_is_refused(config: dict[str, int], message: str) -> None:
    cfg = TrainerConfig.model_validate(config)
    with pytest.raises(ProxySettingsError, match=message):
        adopt_proxy_settings(cfg, ProxySettings(8, 4), proxy_url=URL)


def test_the_command_line_leaves_unset_settings_unset(tmp_path: Path) -> None:
    config = tmp_path / "trainer.toml"
    config.write_text('max_staleness = 3\n[loop]\ntrainer_id = "t"\n')
    args = build_parser().parse_args(["--config", str(config), "--proxy", URL, "--max-steps", "2"])
    cfg = config_from_args(args)
    assert (cfg.loop.trainer_id, cfg.loop.max_steps, cfg.connection.proxy_url) == ("t", 2, URL)
    assert "max_staleness" in cfg.model_fields_set and "batch_size" not in cfg.model_fields_set
    adopted = adopt_proxy_settings(cfg, ProxySettings(5, None), proxy_url=URL)
    assert (adopted.batch_size, adopted.max_staleness) == (5, 3)


def test_without_a_proxy_gate_eta_is_the_trainers() -> None:
    default = adopt_proxy_settings(TrainerConfig(), ProxySettings(2, None), proxy_url=URL)
    assert (default.batch_size, default.max_staleness) == (2, TrainerConfig().max_staleness)
    own = TrainerConfig.model_validate({"max_staleness": 9})
    assert adopt_proxy_settings(own, ProxySettings(2, None), proxy_url=URL).max_staleness == 9


def test_adopted_config_is_validated() -> None:
    cfg = TrainerConfig.model_validate({"ppo": {"ppo_minibatches": 4}})  # valid with B = 8
    with pytest.raises(ValueError, match="ppo.ppo_minibatches"):
        adopt_proxy_settings(cfg, ProxySettings(2, None), proxy_url=URL)


async def test_the_proxy_serves_them_to_its_admin(proxy: LiveProxy, tmp_path: Path) -> None:
    # The fixture's proxy runs with --train-batch-size 2 and no --max-staleness.
    settings = await fetch_proxy_settings(proxy.url, admin_token=proxy.admin_token)
    assert settings == ProxySettings(train_batch_size=2, max_staleness=None)
    assert httpx.get(proxy.url + "/admin/config").status_code == 401
    with pytest.raises(ProxySettingsError, match="give the trainer the proxy's admin token"):
        await fetch_proxy_settings(proxy.url, admin_token="wrong")

    # `proxima trainer` with a config that contradicts the proxy exits before loading anything.
    config = tmp_path / "trainer.json"
    config.write_text(json.dumps({"batch_size": 5, "output_dir": str(tmp_path / "out")}))
    cmd = [sys.executable, "-m", "proxima.cli", "trainer", "--config", str(config),
           "--proxy", proxy.url, "--db", proxy.db_url, "--model", str(proxy.model_dir),
           "--admin-token", proxy.admin_token, "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "batch_size = 5 in the trainer config" in done.stderr
    assert "--train-batch-size 2" in done.stderr
    assert not (tmp_path / "out").exists()
