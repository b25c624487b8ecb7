"""``proxima serve --workers``' parent, without processes: what it gives its workers, and
what it refuses (the live workers: tests/production/test_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from proxima.proxy.config import Settings
from proxima.proxy.embedded.launcher import EngineProcess
from proxima.proxy.embedded.startup import StartedEngines
from pydantic import SecretStr, ValidationError

from proxima.cli import main as cli_main
from proxima.workers import shareable, worker_settings


@pytest.fixture(autouse=True)
def _no_proxima_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("PROXIMA_"):
            monkeypatch.delenv(name)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_the_workers_get_the_engines_urls_and_one_signing_key(model_dir: Path) -> None:
    settings = Settings(model=model_dir, workers=3)
    engines = StartedEngines(
        training=[EngineProcess(model_dir, port=30001), EngineProcess(model_dir, port=30002)]
    )
    given = worker_settings(settings, engines)
    assert given.backends == ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    assert given.workers == 3 and given.signing_key is not None
    # With a key or an admin token (from which the key derives), nothing is drawn.
    keyed = Settings(model=model_dir, workers=3, admin_token=SecretStr("t"))
    assert worker_settings(keyed, StartedEngines()).signing_key is None
    external = Settings(model=model_dir, workers=2, backends=["http://a:1"])
    assert worker_settings(external, StartedEngines()).backends == ["http://a:1"]


def test_databases_the_workers_can_share() -> None:
    assert shareable("sqlite:///data/proxima.db")
    assert shareable("postgresql://u@h/db")
    assert not shareable("sqlite://")
    assert not shareable("sqlite:///:memory:")


def test_workers_refuse_a_production_engine(model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="--production-backend"):
        Settings(model=model_dir, workers=2, production_engine=True)


def test_serve_refuses_workers_on_an_in_memory_database(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--model", str(model_dir), "--workers", "2", "--db", "sqlite://"]
    assert cli_main(argv) == 2
    assert "--workers needs a SQLite database file" in capsys.readouterr().err
