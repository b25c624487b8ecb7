"""``proxima serve --workers 2``: two processes on one port act as one proxy, on SQLite and
on PostgreSQL.

Real processes: two fake SGLang backends and one ``proxima serve --workers 2`` on them.
The port is one socket that both workers accept on, so a test picks a worker by opening
connections until ``/health`` on one names it (``worker.index``), then sends its request on
that connection. Turns of one conversation alternate between the workers; a session is
finished through one and used through the other; creates race over both; a weight push
goes through one. With no ``--backend``, the workers share the one embedded engine the
parent started.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from proxima.proxy.server_process import ProxyProcess
from proxima.proxy.store import Store

from tests.pg import POSTGRES_PARAM, create_test_database
from tests.production.procs import BackendProcess, wait_until

WORKERS = 2
BATCH = 20  # --train-batch-size; with --max-staleness 0 the capacity is (version + 1) * BATCH
ADMIN = {"Authorization": "Bearer test-admin-token"}


@dataclass
class Served:
    db_url: str
    backends: list[BackendProcess]
    proxy: ProxyProcess

    def store_call(self, fn: Any) -> Any:
        async def run() -> Any:
            store = await Store.open(self.db_url)
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(run())

    def worker(self, index: int, timeout: float = 30.0) -> httpx.Client:
        """A client whose one connection is served by worker ``index`` (which may still be
        starting: connections go to the others meanwhile)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            client = httpx.Client(
                base_url=self.proxy.url, limits=httpx.Limits(max_connections=1), timeout=60
            )
            health = client.get("/health", headers=ADMIN).json()
            if health["worker"]["index"] == index:
                return client
            client.close()
        raise AssertionError(f"no connection reached worker {index} within {timeout} s")


@pytest.fixture(scope="module", params=["sqlite", POSTGRES_PARAM])
def served(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    logs = tmp_path_factory.mktemp("workers")
    if request.param == "sqlite":
        db_url = f"sqlite:///{logs / 'store.db'}"
    else:
        db_url = create_test_database(request)
    backends = [
        BackendProcess.fake(tokens_per_s=400, chunk_tokens=2, log_path=logs / f"backend{i}.log")
        for i in range(2)
    ]
    proxy = ProxyProcess(
        tiny_model_dir,
        db_url=db_url,
        log_path=logs / "serve.log",
        extra_args=[
            *(arg for b in backends for arg in ("--backend", b.url)),
            "--workers", str(WORKERS), "--max-staleness", "0", "--train-batch-size", str(BATCH),
        ],
    )  # fmt: skip
    try:
        for backend in backends:
            backend.start()
        proxy.start()
        yield Served(db_url, backends, proxy)
    finally:
        proxy.stop()
        for backend in backends:
            backend.stop()


def _turn(client: httpx.Client, key: str, model: str, messages: list[dict[str, Any]]) -> Any:
    return client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 8},
        headers={"Authorization": f"Bearer {key}"},
    )


def test_turns_alternating_between_workers_are_one_token_exact_chain(served: Served) -> None:
    clients = [served.worker(i) for i in range(WORKERS)]
    model = served.proxy.model_name
    session = clients[0].post("/rl/sessions", json={}, headers=ADMIN).json()
    messages: list[dict[str, Any]] = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn}: go on"})
        resp = _turn(clients[turn % WORKERS], session["api_key"], model, messages)
        assert resp.status_code == 200, resp.text
        messages.append(resp.json()["choices"][0]["message"])
    completions = (
        clients[1].get(f"/rl/sessions/{session['session_id']}", headers=ADMIN).json()["completions"]
    )
    assert len(completions) == 4
    for prev, nxt in zip(completions, completions[1:], strict=False):
        exact = prev["prompt_ids"] + prev["output_ids"]
        assert nxt["prompt_ids"][: len(exact)] == exact, "a turn was re-tokenized"
        assert nxt["parent_id"] == prev["id"], "the session split into several roots"
    assert len({c["backend"] for c in completions}) == 1  # one backend's prefix cache

    # Finished through worker 1, the session is closed on worker 0 at once (its key cached).
    finish = clients[1].post(
        f"/rl/sessions/{session['session_id']}/finish", json={"status": "failed"}, headers=ADMIN
    )
    assert finish.status_code == 200
    resp = _turn(clients[0], session["api_key"], model, messages)
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "session_closed"
    for client in clients:
        client.close()


def test_creates_racing_over_workers_admit_exactly_the_capacity(served: Served) -> None:
    before = served.store_call(lambda s: s.admission_state())
    expected = (before.version + 1) * BATCH - before.admitted
    assert 0 < expected < 40
    with httpx.Client(base_url=served.proxy.url, timeout=60) as http:
        with ThreadPoolExecutor(16) as pool:  # 16 connections: both workers take creates
            answers = list(
                pool.map(lambda _: http.post("/rl/sessions", json={}, headers=ADMIN), range(40))
            )
        admitted = [r.json()["session_id"] for r in answers if r.status_code == 200]
        assert len(admitted) == expected
        assert all(r.json()["error"]["code"] == "staleness_capacity" for r in answers
                   if r.status_code != 200)  # fmt: skip
        for sid in admitted:  # failed sessions free their capacity again
            finished = http.post(
                f"/rl/sessions/{sid}/finish", json={"status": "failed"}, headers=ADMIN
            )
            assert finished.status_code == 200


def test_a_push_through_one_worker_reaches_the_other(served: Served) -> None:
    clients = [served.worker(i) for i in range(WORKERS)]
    version = served.store_call(lambda s: s.current_policy_version()) + 1
    resp = clients[0].post(
        "/admin/weights", json={"version": version, "path": f"/weights/v{version}"}, headers=ADMIN
    )
    assert resp.status_code == 200, resp.text
    pushed = time.monotonic()

    def follows() -> bool:
        health = clients[1].get("/health", headers=ADMIN).json()
        return health["version"] == version and all(
            b["healthy"] and b["version"] == version for b in health["backends"]
        )

    wait_until(follows, timeout=10, interval=0.02, what="worker 1 at the pushed version")
    assert time.monotonic() - pushed < 2.0
    for backend in served.backends:  # loaded once each, not once per worker
        assert backend.log_path is not None
        loads = backend.log_path.read_text().count(f"weights loaded: version={version} ")
        assert loads == 1, (backend.url, loads)
    for client in clients:
        client.close()


def test_the_workers_share_one_embedded_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    proxy = ProxyProcess(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        log_path=tmp_path / "serve.log",
        extra_args=["--workers", str(WORKERS)],
    )
    proxy.start()
    try:
        assert proxy.proc is not None
        children = psutil.Process(proxy.proc.pid).children()
        workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        engines = [c for c in children if "proxima.proxy.embedded" in " ".join(c.cmdline())]
        assert len(workers) == WORKERS and len(engines) == 1
        served = Served(proxy.db_url, [], proxy)
        urls = set()
        for i in range(WORKERS):
            client = served.worker(i)
            health = client.get("/health", headers=ADMIN).json()
            urls.add(tuple(b["url"] for b in health["backends"]))
            session = client.post("/rl/sessions", json={}, headers=ADMIN).json()
            messages = [{"role": "user", "content": "hi"}]
            resp = _turn(client, session["api_key"], proxy.model_name, messages)
            client.close()
            assert resp.status_code == 200, resp.text
        assert len(urls) == 1  # the same engine behind both

        # A worker that dies is started again, and serves.
        workers[1].kill()
        workers[1].wait(10)

        def replaced() -> bool:
            now = [c for c in psutil.Process(proxy.proc.pid).children() if "spawn_main" in
                   " ".join(c.cmdline())]  # fmt: skip
            return len(now) == WORKERS and workers[1].pid not in {c.pid for c in now}

        wait_until(replaced, timeout=10, what="a new worker process")
        for i in range(WORKERS):
            client = served.worker(i)
            assert client.get("/health/ready").status_code == 200
            client.close()
    finally:
        proxy.stop()
    assert proxy.proc is not None and proxy.proc.returncode == 0
    for child in [*workers, *engines]:  # stopped with the parent
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
