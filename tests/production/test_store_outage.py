"""A PostgreSQL outage under a live proxy: no 500, a 503 with ``Retry-After``, and sessions
open again once the database is back.

Real processes: a private PostgreSQL cluster of this test's own (stopped and started again on
its port), a fake SGLang backend and ``proxima serve``. During the outage a client on one
keep-alive connection opens sessions, reads one, takes a turn and probes health, for a few
seconds: every answer is a 503 in OpenAI's envelope (with ``Retry-After``) or a health
answer, none is a 500, and the connection is never closed (each answer came back on it).
``/health/live`` stays 200 and ``/health/ready`` is 503 until the database answers again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from proxima.proxy.server_process import ProxyProcess
from proxima.proxy.store import ensure_schema

from tests.pg import POSTGRES_PARAM, PostgresCluster, find_pg_bin
from tests.production.procs import BackendProcess, wait_until

OUTAGE_S = 3.0


@dataclass
class Env:
    cluster: PostgresCluster
    proxy: ProxyProcess


@pytest.fixture(params=[POSTGRES_PARAM])
def env(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Env]:
    bin_dir = find_pg_bin()
    assert bin_dir is not None  # deselected without PostgreSQL (tests.pg)
    cluster = PostgresCluster.start(bin_dir)  # its own: this test stops it
    backend = BackendProcess.fake(tokens_per_s=400, log_path=tmp_path / "fake.log")
    proxy: ProxyProcess | None = None
    try:
        db_url = cluster.url(cluster.create_database())
        asyncio.run(ensure_schema(db_url))
        backend.start()
        proxy = ProxyProcess(
            tiny_model_dir,
            db_url=db_url,
            log_path=tmp_path / "proxy.log",
            extra_args=["--backend", backend.url],
        ).start()
        yield Env(cluster, proxy)
    finally:
        if proxy is not None:
            proxy.stop()
        backend.stop()
        cluster.stop()


def _port(response: httpx.Response) -> int:
    """The client side's port of the connection that carried ``response``."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def _outage_requests(
    client: httpx.Client, session: dict[str, str], model: str
) -> list[httpx.Response]:
    """One round of what clients send: open, read, a turn (the session's key), the probes."""
    key = {"Authorization": f"Bearer {session['api_key']}"}
    turn = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [
        client.post("/rl/sessions", json={}),
        client.get(f"/rl/sessions/{session['session_id']}"),
        client.post("/v1/chat/completions", json=turn, headers=key),
        client.get("/health"),
        client.get("/health/live"),
        client.get("/health/ready"),
    ]


def test_postgres_outage_is_503_with_retry_after_and_sessions_open_after(env: Env) -> None:
    proxy = env.proxy
    with httpx.Client(base_url=proxy.url, headers=proxy.admin_headers(), timeout=30) as client:
        opened = client.post("/rl/sessions", json={})
        assert opened.status_code == 200, opened.text
        session = opened.json()
        port = _port(opened)
        assert client.get("/health/ready").status_code == 200

        env.cluster.pause()
        statuses: Counter[tuple[str, int]] = Counter()
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline:
            for answer in _outage_requests(client, session, proxy.model_name):
                where = f"{answer.request.method} {answer.request.url.path}"
                statuses[(where, answer.status_code)] += 1
                assert answer.status_code != 500, (where, answer.text)
                assert _port(answer) == port, f"{where}: the connection was closed"
                if answer.request.url.path.startswith("/health"):
                    continue
                assert answer.status_code == 503, (where, answer.text)
                assert answer.headers["retry-after"] == "2", where
                error = answer.json()["error"]
                assert (error["type"], error["code"]) == (
                    "service_unavailable",
                    "store_unavailable",
                )
        paths = {where: status for where, status in statuses}
        assert paths["GET /health/live"] == 200 and paths["GET /health"] == 200
        assert {s for (w, s) in statuses if w == "GET /health/ready"} == {503}
        assert client.get("/health").json()["store"] == "unavailable"

        env.cluster.resume()
        wait_until(
            lambda: client.post("/rl/sessions", json={}).status_code == 200,
            20,
            interval=0.2,
            what="a session to open after the outage",
        )
        assert client.get("/health/ready").status_code == 200
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["store"] == "ok"
        read = client.get(f"/rl/sessions/{session['session_id']}")
        assert read.status_code == 200 and _port(read) == port
    assert "Traceback" not in (proxy.log_path.read_text() if proxy.log_path else "")
