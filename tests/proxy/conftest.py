"""Live-server fixtures: a real ``proxima serve`` with the tiny model on 127.0.0.1."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from proxima.proxy.testing.cache import built_once
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.teach import teach
from proxima.proxy.testing.tiny_model import build_tiny_model

from tests.proxy.scripts import TEACH_EXAMPLES

CACHE = Path(__file__).resolve().parents[2] / ".cache"


@pytest.fixture(scope="session")
def taught_model_dir() -> Path:
    """The tiny model, taught the scripted tool-call conversation of ``scripts.py``.

    Cached under ``.cache/`` by a hash of everything that determines it, so
    only the first run of a checkout pays the ~30 s of teaching.
    """
    import proxima.proxy.testing.teach as teach_mod
    import proxima.proxy.testing.tiny_model as tiny_mod

    digest = hashlib.sha256(
        Path(tiny_mod.__file__).read_bytes()
        + Path(teach_mod.__file__).read_bytes()
        + repr(TEACH_EXAMPLES).encode()
    ).hexdigest()[:16]
    return built_once(
        CACHE / f"taught-{digest}" / "tiny-tools",
        lambda staging: teach(build_tiny_model(staging), TEACH_EXAMPLES),
        "model.safetensors",
    )


@pytest.fixture(scope="module")
def live_proxy(
    taught_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("proxy")
    proxy = LiveProxy(
        taught_model_dir, db_url=f"sqlite:///{work / 'store.db'}", log_path=work / "serve.log"
    )
    proxy.start()
    yield proxy
    proxy.stop()
    if proxy.log_path and proxy.log_path.exists() and "Traceback" in proxy.log_path.read_text():
        shutil.copy(proxy.log_path, work / "serve-with-traceback.log")
