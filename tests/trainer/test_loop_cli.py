"""``proxima trainer`` command line: flags over the config file, exit statuses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from proxima.proxy.api import admin
from proxima.proxy.config import Settings
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.store import ensure_schema
from proxima.proxy.testing.app_state import install_test_state
from proxima.trainer.cli import build_parser, config_from_args, main
from proxima.trainer.config import MegatronConfig, TrainerConfig
from proxima.trainer.weights import TrainerState, save_checkpoint
from pydantic import ValidationError

ADMIN_TOKEN = "cli-admin-token"


def test_flags_override_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "trainer.toml"
    config.write_text(
        'batch_size = 16\noutput_dir = "from-file"\n'
        '[connection]\nproxy_url = "http://file:1"\ndb_url = "sqlite:///file.db"\n'
        'admin_token = "file-token"\n[loop]\ntrainer_id = "file-id"\n'
    )
    args = build_parser().parse_args(
        ["--config", str(config), "--proxy", "http://flag:2", "--model", "m", "--max-steps", "3"]
    )
    cfg = config_from_args(args)
    assert cfg.batch_size == 16 and cfg.output_dir == Path("from-file")
    assert cfg.connection.proxy_url == "http://flag:2"
    assert cfg.connection.db_url == "sqlite:///file.db" and cfg.connection.model_dir == Path("m")
    assert cfg.loop.trainer_id == "file-id" and cfg.loop.max_steps == 3
    assert cfg.connection.admin_token is not None
    assert cfg.connection.admin_token.get_secret_value() == "file-token"
    assert "file-token" not in repr(cfg)  # the token never shows in logs or reprs

    monkeypatch.setenv("PROXIMA_ADMIN_TOKEN", "env-token")
    cfg = config_from_args(build_parser().parse_args(["--config", str(config)]))
    assert cfg.connection.admin_token is not None
    assert cfg.connection.admin_token.get_secret_value() == "env-token"


def test_invalid_or_incomplete_configuration_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--proxy", "http://x:1"]) == 2
    assert "missing --db, --model" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"ppo": {"eps_clp": 0.1}}')
    assert main(["--config", str(bad), "--proxy", "p", "--db", "d", "--model", "m"]) == 2
    assert "eps_clp" in capsys.readouterr().err


def test_a_checkpoint_ahead_of_the_store_is_refused_with_exit_1(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'store.db'}"
    asyncio.run(ensure_schema(db))
    out = tmp_path / "out"
    save_checkpoint(out, TrainerState("proxima-trainer", version=3, step=3), {})
    with _admin_config_route(tiny_model_dir) as proxy_url:  # the trainer reads B and eta first
        argv = ["--proxy", proxy_url, "--db", db, "--model", str(tiny_model_dir)]
        argv += ["--admin-token", ADMIN_TOKEN]
        assert main([*argv, "--output-dir", str(out), "--no-progress"]) == 1
    assert "another database" in capsys.readouterr().err


def test_an_unreachable_proxy_is_refused_before_anything_loads(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'store.db'}"
    argv = ["--proxy", "http://127.0.0.1:9", "--db", db, "--model", str(tiny_model_dir)]
    assert main([*argv, "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 1
    assert "cannot read the proxy's settings at http://127.0.0.1:9/admin/config" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


@contextlib.contextmanager
def _admin_config_route(model_dir: Path) -> Iterator[str]:
    """The proxy's real ``GET /admin/config`` route alone (no engine, no store), served locally."""
    app = FastAPI()
    app.include_router(admin.router)
    settings = Settings(model=model_dir, admin_token=ADMIN_TOKEN)
    install_test_state(app, settings=settings, store=None)  # the admin token never reads it
    with ThreadedServer(app) as server:
        yield server.url


def test_new_config_sections_validate() -> None:
    cfg = TrainerConfig()
    assert cfg.loop.trainer_id == "proxima-trainer" and cfg.loop.max_steps is None
    assert cfg.connection.missing() == ["proxy_url", "db_url", "model_dir"]
    assert cfg.megatron.tensor_parallel == 1
    with pytest.raises(ValidationError, match="set pipeline_parallel = 1"):
        MegatronConfig(pipeline_parallel=2)
    with pytest.raises(ValidationError, match="greater than 0"):
        TrainerConfig(loop={"poll_interval_s": 0})
    for model in (type(cfg.loop), type(cfg.connection), MegatronConfig):
        assert all(f.description for f in model.model_fields.values()), model.__name__
