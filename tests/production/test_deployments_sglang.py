"""Deployments on SGLang-protocol backends: ``--production-backend`` and ``--canary-backend``.

Three fake SGLang servers (``proxima.proxy.testing.fake_sglang``, which
reports the ``weight_version`` it was last given, as SGLang does) stand for
the training, production and canary fleets. Which server generated each
recorded completion is read back from the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from proxima.proxy.store.store import Store
from proxima.proxy.testing.live import LiveProxy

from tests.production.procs import BackendProcess, create_production_key


@pytest.fixture(scope="module")
def fleets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BackendProcess]]:
    work = tmp_path_factory.mktemp("fleets")
    backends = {
        name: BackendProcess.fake(tokens_per_s=0, log_path=work / f"{name}.log")
        for name in ("training", "production", "canary")
    }
    try:
        for backend in backends.values():
            backend.start()
        yield backends
    finally:
        for backend in backends.values():
            backend.stop()


def _served(db_url: str, session_id: str) -> list[tuple[str | None, list[int]]]:
    async def read() -> list[tuple[str | None, list[int]]]:
        store = await Store.open(db_url)
        try:
            return [
                (c.backend, c.output_versions)
                for c in await store.list_completions(session_id=session_id)
            ]
        finally:
            await store.close()

    return asyncio.run(read())


def test_each_deployment_generates_on_its_own_backends(
    tiny_model_dir: Path, tmp_path: Path, fleets: dict[str, BackendProcess]
) -> None:
    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    key = create_production_key(db_url, "app")
    proxy = LiveProxy(
        tiny_model_dir,
        db_url=db_url,
        log_path=tmp_path / "serve.log",
        extra_args=[
            "--backend",
            fleets["training"].url,
            "--production-backend",
            fleets["production"].url,
            "--canary-backend",
            fleets["canary"].url,
        ],
    )
    proxy.start()
    try:
        admin = proxy.admin_headers()
        for version in (1, 2):
            resp = httpx.post(
                proxy.url + "/admin/weights",
                json={"version": version, "path": f"/weights/v{version}"},
                headers=admin,
                timeout=60,
            )
            assert resp.status_code == 200, resp.text

        def production(name: str) -> tuple[str | None, list[int]]:
            resp = httpx.post(
                proxy.base_url + "/chat/completions",
                headers={"Authorization": f"Bearer {key}", "X-Session-Id": name},
                json={
                    "model": proxy.model_name,
                    "messages": [{"role": "user", "content": name}],
                    "max_tokens": 5,
                },
                timeout=60,
            )
            assert resp.status_code == 200, resp.text
            ((backend, versions),) = _served(db_url, resp.headers["X-Proxima-Session-Id"])
            return backend, versions

        s = proxy.new_session()
        httpx.post(
            s["base_url"] + "/chat/completions",
            headers={"Authorization": f"Bearer {s['api_key']}"},
            json={"model": proxy.model_name, "messages": [{"role": "user", "content": "x"}]},
            timeout=60,
        ).raise_for_status()
        ((backend, versions),) = _served(db_url, s["session_id"])
        assert backend == fleets["training"].url and set(versions) == {2}
        backend, versions = production("first")
        assert backend == fleets["production"].url and set(versions) == {0}

        state = httpx.post(
            proxy.url + "/admin/production",
            json={"version": 1, "canary": {"version": 2, "fraction": 1.0}},
            headers=admin,
            timeout=60,
        ).json()
        assert state["version"] == 1 and state["canary"] == {"version": 2, "fraction": 1.0}
        assert state["deployments"]["canary"]["backends"][0]["url"] == fleets["canary"].url
        backend, versions = production("second")  # fraction 1: every session on the canary
        assert backend == fleets["canary"].url and set(versions) == {2}

        httpx.post(
            proxy.url + "/admin/production",
            json={"version": 1, "canary": {"version": 2, "fraction": 0.0}},
            headers=admin,
            timeout=60,
        ).raise_for_status()
        backend, versions = production("third")
        assert backend == fleets["production"].url and set(versions) == {1}
        # Fraction 0 keeps version 2 served (by the canary) for evaluation by name.
        registry = httpx.get(proxy.url + "/admin/versions", headers=admin).json()
        served = {v["version"]: v["served_by"] for v in registry["versions"]}
        assert served == {0: [], 1: ["production"], 2: ["training", "canary"]}
    finally:
        proxy.stop()
