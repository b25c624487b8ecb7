"""Shared fixtures: the tiny offline model every live test runs on."""

from __future__ import annotations

from pathlib import Path

import pytest
from proxima.proxy.testing.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 model + byte-level tokenizer, built once per test run."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny-qwen2")
