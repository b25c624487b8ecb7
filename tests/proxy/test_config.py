"""``proxima serve``'s settings: one declaration, read from flags, environment and a file.

Every ``Settings`` field has a flag generated from it; the flags the docs and
deployments use keep their names; a flag wins over the environment, which
wins over the ``--config`` file, which wins over the field's default.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from proxima.proxy.config import Settings, flags_of, read_settings_file

from proxima.cli import build_parser
from proxima.cli import main as cli_main


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _settings(*argv: str) -> Settings:
    args = _serve_args(*argv)
    return Settings.load(flags_of(args), args.config)


@pytest.fixture(autouse=True)
def _no_proxima_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("PROXIMA_"):
            monkeypatch.delenv(name)


def test_every_setting_has_a_flag_with_its_description() -> None:
    serve = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices["serve"]
    helps = {opt: action.help or "" for action in serve._actions for opt in action.option_strings}
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if flag not in helps:
            flag = flag.removesuffix("s")  # a list: its singular, repeated
        assert flag in helps, f"no flag for the setting {name}"
        assert (field.description or "").split(":")[0] in helps[flag], name
        assert f"PROXIMA_{name.upper()}" in helps[flag], name


def test_the_documented_flags_keep_their_names(model_dir: Path) -> None:
    settings = _settings(
        "--model", str(model_dir), "--host", "0.0.0.0", "--port", "9000",
        "--db", "sqlite:///x.db", "--backend", "http://a:1", "--backend", "http://b:2",
        "--production-backend", "http://p:3", "--canary-backend", "http://c:4",
        "--admin-token", "t", "--served-model-name", "m", "--tool-parser", "hermes",
        "--reasoning-parser", "qwen3", "--max-staleness", "2", "--train-batch-size", "4",
        "--context-length", "64", "--tool-fallback", "hermes", "--clamp-max-tokens",
    )  # fmt: skip
    assert (settings.host, settings.port, settings.db) == ("0.0.0.0", 9000, "sqlite:///x.db")
    assert settings.backends == ["http://a:1", "http://b:2"]
    assert settings.production_backends == ["http://p:3"]
    assert settings.canary_backends == ["http://c:4"]
    assert settings.admin_token is not None and settings.admin_token.get_secret_value() == "t"
    assert (settings.served_model_name, settings.tool_parser) == ("m", "hermes")
    assert (settings.reasoning_parser, settings.max_staleness) == ("qwen3", 2)
    assert (settings.train_batch_size, settings.context_length) == (4, 64)
    assert settings.tool_fallback == "hermes" and settings.clamp_max_tokens
    assert _settings("--model", str(model_dir), "--production-engine").production_engine
    assert not _settings("--model", str(model_dir), "--no-record-production").record_production


def test_flag_beats_environment_beats_file_beats_default(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'model = "{model_dir}"\nmax_staleness = 1\ntrain_batch_size = 2\n'
        'max_n = 3\nbackends = ["http://file:1"]\n'
    )
    monkeypatch.setenv("PROXIMA_TRAIN_BATCH_SIZE", "20")
    monkeypatch.setenv("PROXIMA_MAX_N", "30")
    monkeypatch.setenv("PROXIMA_CORS_ORIGINS", '["http://env"]')
    settings = _settings("--config", str(config), "--max-n", "300")
    assert settings.model == model_dir  # only the file gives it
    assert settings.max_staleness == 1  # file
    assert settings.train_batch_size == 20  # environment over file
    assert settings.max_n == 300  # flag over environment
    assert settings.backends == ["http://file:1"]
    assert settings.cors_origins == ["http://env"]
    assert settings.max_open_sessions == Settings.model_fields["max_open_sessions"].default


def test_a_file_naming_no_setting_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text("max_stalenes = 1\n")
    with pytest.raises(ValueError, match="no such setting: max_stalenes"):
        read_settings_file(config)


def test_serve_reports_a_missing_model_and_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["serve"]) == 2
    assert "--model is required (or PROXIMA_MODEL" in capsys.readouterr().err
    config = tmp_path / "proxy.toml"
    config.write_text("not toml [")
    assert cli_main(["serve", "--config", str(config)]) == 2
    assert f"--config {config}" in capsys.readouterr().err


def test_the_lora_flags_reach_every_embedded_engine(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--enable-lora --max-loras-per-batch --max-lora-rank`` start the embedded engines
    (training, production, canary) with SGLang's flags of the same names."""
    from proxima.proxy.embedded.launcher import EngineProcess
    from proxima.proxy.embedded.startup import start_engine

    monkeypatch.setattr(EngineProcess, "start", lambda self: None)
    settings = _settings(
        "--model", str(model_dir), "--enable-lora", "--max-loras-per-batch", "3",
        "--max-lora-rank", "16",
    )  # fmt: skip
    assert (settings.enable_lora, settings.max_loras_per_batch, settings.max_lora_rank) == (
        True,
        3,
        16,
    )
    engine = start_engine(settings)
    assert engine.lora_args == [
        "--enable-lora",
        "--max-loras-per-batch",
        "3",
        "--max-lora-rank",
        "16",
    ]
    plain = start_engine(_settings("--model", str(model_dir)))
    assert "--enable-lora" not in plain.lora_args and "--max-lora-rank" not in plain.lora_args
    with pytest.raises(ValueError, match="max_loras_per_batch"):
        _settings("--model", str(model_dir), "--max-loras-per-batch", "0")
