"""Fixtures for the engine tests: the engine app in-process, a live server, helper models."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from proxima.proxy.embedded.app import create_engine_app
from proxima.proxy.embedded.engine import Engine
from proxima.proxy.embedded.live import EngineServer
from proxima.proxy.testing.tiny_model import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture
async def engine_app(tiny_model_dir: Path) -> AsyncIterator[FastAPI]:
    """The engine app with its lifespan running (model loaded, worker started)."""
    app = create_engine_app(tiny_model_dir, num_threads=1)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
def engine(engine_app: FastAPI) -> Engine:
    """The running engine behind ``engine_app``."""
    running: Engine = engine_app.state.engine
    return running


@pytest.fixture
async def client(engine_app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client that calls ``engine_app`` in-process."""
    transport = httpx.ASGITransport(app=engine_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=30) as c:
        yield c


@pytest.fixture
def live_url(tiny_model_dir: Path) -> Iterator[str]:
    """Base URL of the engine served by uvicorn on a free loopback port."""
    with EngineServer(tiny_model_dir, num_threads=1) as server:
        yield server.url


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as the tiny model, different random weights."""
    return build_tiny_model(tmp_path_factory.mktemp("other") / "tiny-seed1", seed=1)


@pytest.fixture(scope="session")
def narrow_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with hidden size 32: its weights do not fit the 64-wide model."""
    return build_tiny_model(tmp_path_factory.mktemp("narrow") / "tiny-h32", hidden_size=32)


@pytest.fixture(scope="session")
def short_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 32-token context."""
    path = tmp_path_factory.mktemp("short") / "tiny-ctx32"
    return build_tiny_model(path, max_position_embeddings=32)


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model edited so that greedy decoding emits an eos token at once.

    Logits are ``norm(h) . E[v]`` (tied embeddings). Keeping only hidden dim 0
    in the final norm and giving the two eos tokens embeddings +10 / -10 in
    that dim (all others 0) makes one of them the argmax whatever the sign of
    ``norm(h)[0]``.
    """
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    eos_ids = model.generation_config.eos_token_id
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        embeddings = model.model.embed_tokens.weight
        embeddings[:, 0] = 0.0
        embeddings[eos_ids[0], 0] = 10.0
        embeddings[eos_ids[1], 0] = -10.0
    path = tmp_path_factory.mktemp("eos") / "tiny-eos"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path
