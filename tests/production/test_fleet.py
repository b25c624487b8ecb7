"""Three ``proxima serve`` replicas on one PostgreSQL behave as one proxy (issue: a fleet).

Real processes: a private PostgreSQL cluster, two fake SGLang backends (shared
by every replica), three replicas and HAProxy in front of them. Turns of one
conversation go through the load balancer and, rotated by hand, through every
replica in turn; sessions are finished through one replica and used through
the others; creates race over all three; a weight push goes through one.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxima.proxy.backends.pool import rendezvous_score
from proxima.proxy.server_process import ProxyProcess
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.testing.haproxy import HAProxyProcess

from tests.pg import POSTGRES_PARAM, create_test_database
from tests.production.procs import BackendProcess, wait_until

BATCH = 40  # --train-batch-size; with --max-staleness 0 the capacity is (version + 1) * BATCH
MAX_TOKENS = 12
ADMIN = {"Authorization": "Bearer test-admin-token"}


@dataclass
class Fleet:
    db_url: str
    backends: list[BackendProcess]
    production: BackendProcess
    replicas: list[ProxyProcess]
    lb: HAProxyProcess
    model_name: str

    def store_call(self, fn: Any) -> Any:
        async def run() -> Any:
            store = await Store.open(self.db_url)
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(run())


@pytest.fixture(scope="module", params=[POSTGRES_PARAM])
def fleet(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("fleet")
    db_url = create_test_database(request)
    asyncio.run(ensure_schema(db_url))
    backends = [
        BackendProcess.fake(tokens_per_s=400, chunk_tokens=2, log_path=logs / f"backend{i}.log")
        for i in range(2)
    ]
    # Production's own backend (a pinned, promoted version), shared by the replicas too.
    production = BackendProcess.fake(tokens_per_s=400, log_path=logs / "production.log")
    replicas = [
        ProxyProcess(
            tiny_model_dir,
            db_url=db_url,
            log_path=logs / f"replica{i}.log",
            extra_args=[
                *(arg for b in backends for arg in ("--backend", b.url)),
                "--production-backend",
                production.url,
                "--max-staleness",
                "0",
                "--train-batch-size",
                str(BATCH),
            ],
        )  # fmt: skip
        for i in range(3)
    ]
    lb = HAProxyProcess([f"127.0.0.1:{r.port}" for r in replicas])
    try:
        for backend in [*backends, production]:
            backend.start()
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda r: r.start(), replicas))
        lb.start()
        yield Fleet(db_url, backends, production, replicas, lb, replicas[0].model_name)
    finally:
        lb.stop()
        for replica in replicas:
            replica.stop()
        for backend in [*backends, production]:
            backend.stop()


def _create(url: str) -> httpx.Response:
    return httpx.post(url + "/rl/sessions", json={}, headers=ADMIN, timeout=60)


def _turn(url: str, key: str, model: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": MAX_TOKENS, **kw},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def _finish(url: str, session_id: str, status: str = "finished") -> httpx.Response:
    return httpx.post(
        f"{url}/rl/sessions/{session_id}/finish", json={"status": status}, headers=ADMIN, timeout=30
    )


def _trajectory(url: str, session_id: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{url}/rl/sessions/{session_id}", headers=ADMIN, timeout=30)
    resp.raise_for_status()
    return resp.json()["completions"]


def _conversation(fleet: Fleet, urls: list[str], turns: int) -> str:
    """One multi-turn agent whose turn ``i`` goes to ``urls[i % len(urls)]``."""
    session = _create(urls[0]).json()
    messages: list[dict[str, Any]] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"turn {i}: go on"})
        resp = _turn(urls[i % len(urls)], session["api_key"], fleet.model_name, messages)
        assert resp.status_code == 200, resp.text
        messages.append(resp.json()["choices"][0]["message"])
    return session["session_id"]


def _check_chain(completions: list[dict[str, Any]], turns: int) -> None:
    assert len(completions) == turns
    for prev, nxt in zip(completions, completions[1:], strict=False):
        exact = prev["prompt_ids"] + prev["output_ids"]
        assert nxt["prompt_ids"][: len(exact)] == exact, "a turn was re-tokenized"
        assert nxt["parent_id"] == prev["id"], "the session split into several roots"
    # Every replica hashes the session to the same backend: its prefix cache is reused.
    assert len({c["backend"] for c in completions}) == 1


def test_turns_over_rotating_replicas_are_one_token_exact_chain(fleet: Fleet) -> None:
    urls = [r.url for r in fleet.replicas]
    rotations = [urls, urls[::-1], [fleet.lb.url]]
    jobs = [rotations[i % 3] for i in range(9)]
    with ThreadPoolExecutor(9) as pool:
        sessions = list(pool.map(lambda u: _conversation(fleet, u, 5), jobs))
    backend_urls = [b.url for b in fleet.backends]
    for sid in sessions:
        completions = _trajectory(urls[0], sid)
        _check_chain(completions, 5)
        # Every replica, by whichever route, sent the session where rendezvous hashing of its
        # id puts it (the session ids are random, so which backend that is varies run to run).
        expected = max(backend_urls, key=lambda url, sid=sid: rendezvous_score(sid, url))
        assert completions[0]["backend"] == expected
        assert _finish(fleet.lb.url, sid, "failed").status_code == 200


def test_finish_through_one_replica_is_409_on_the_others_at_once(fleet: Fleet) -> None:
    a, b, c = (r.url for r in fleet.replicas)
    session = _create(a).json()
    key, sid = session["api_key"], session["session_id"]
    messages = [{"role": "user", "content": "hello"}]
    for url in (a, b):  # both replicas have seen the session (and cached its key)
        assert _turn(url, key, fleet.model_name, messages).status_code == 200
    assert _finish(c, sid).status_code == 200
    for url in (a, b, fleet.lb.url):
        resp = _turn(url, key, fleet.model_name, messages)
        assert resp.status_code == 409, resp.text
        assert resp.json()["error"]["code"] == "session_closed"
    assert len(_trajectory(c, sid)) == 2

    # A turn in flight when the finish commits through another replica is not recorded.
    session = _create(a).json()
    key, sid = session["api_key"], session["session_id"]
    slow: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: slow.update(r=_turn(a, key, fleet.model_name, messages, max_tokens=400))
    )
    thread.start()  # 400 tokens at 400 tokens/s: a second of generation
    time.sleep(0.4)
    assert _finish(b, sid).status_code == 200
    thread.join(60)
    assert slow["r"].status_code == 409, slow["r"].text
    assert slow["r"].json()["error"]["code"] == "session_closed"
    assert _trajectory(a, sid) == []


def test_concurrent_admission_over_replicas_admits_exactly_the_capacity(fleet: Fleet) -> None:
    before = fleet.store_call(lambda s: s.admission_state())
    capacity = (before.version + 1) * BATCH
    expected = capacity - before.admitted
    assert 0 < expected < 90
    urls = [r.url for r in fleet.replicas]
    barrier = threading.Barrier(30)

    def create(i: int) -> httpx.Response:
        if i < 30:
            barrier.wait()
        return _create(urls[i % 3])

    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(create, range(90)))
    admitted = [r.json()["session_id"] for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert len(admitted) == expected
    assert all(
        r.status_code == 429 and r.json()["error"]["code"] == "staleness_capacity" for r in refused
    )
    after = fleet.store_call(lambda s: s.admission_state())
    assert after.admitted == capacity
    for sid in admitted:  # failed sessions free their capacity for the other tests
        assert _finish(urls[0], sid, "failed").status_code == 200


def test_a_push_through_one_replica_is_seen_by_all_within_a_second(fleet: Fleet) -> None:
    a = fleet.replicas[0]
    current = fleet.store_call(lambda s: s.current_policy_version())
    version = current + 1
    resp = httpx.post(
        a.url + "/admin/weights",
        json={"version": version, "path": f"/weights/v{version}"},
        headers=ADMIN,
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    pushed = time.monotonic()
    seen: dict[str, float] = {}

    def all_follow() -> bool:
        for replica in fleet.replicas:
            if replica.url in seen:
                continue
            health = httpx.get(replica.url + "/health", timeout=10).json()
            if health["version"] == version and all(
                b["healthy"] and b["version"] == version for b in health["backends"]
            ):
                seen[replica.url] = time.monotonic() - pushed
        return len(seen) == len(fleet.replicas)

    wait_until(all_follow, timeout=10, interval=0.02, what="every replica at the new version")
    assert max(seen.values()) < 1.0, seen
    # The shared backends loaded the push once each, not once per replica.
    for backend in fleet.backends:
        assert backend.log_path is not None
        loads = backend.log_path.read_text().count(f"weights loaded: version={version} ")
        assert loads == 1, (backend.url, loads)
    # Admission on every replica counts with the new version's capacity at once.
    state = fleet.store_call(lambda s: s.admission_state())
    assert state.version == version


def test_a_backend_restarted_after_a_push_serves_the_current_version_on_every_replica(
    fleet: Fleet,
) -> None:
    """A backend SIGKILLed and restarted comes back with its start-up weights (version 0);
    no replica routes to it until it reports the current version again."""
    a = fleet.replicas[0]
    version = fleet.store_call(lambda s: s.current_policy_version()) + 1
    resp = httpx.post(
        a.url + "/admin/weights",
        json={"version": version, "path": f"/weights/v{version}"},
        headers=ADMIN,
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    victim = fleet.backends[0]
    victim.kill()
    victim.start()
    urls = [r.url for r in fleet.replicas]
    served: list[set[int]] = []
    for i in range(12):  # sessions hash over both backends; turns go to every replica
        session = _create(urls[i % 3]).json()
        messages = [{"role": "user", "content": f"after the restart {i}"}]
        resp = _turn(urls[(i + 1) % 3], session["api_key"], fleet.model_name, messages)
        assert resp.status_code == 200, resp.text
        (completion,) = _trajectory(urls[i % 3], session["session_id"])
        served.append(set(completion["output_versions"]))
        _finish(urls[i % 3], session["session_id"], "failed")
    assert served == [{version}] * 12

    def back_everywhere() -> bool:
        for replica in fleet.replicas:
            health = httpx.get(replica.url + "/health", timeout=10).json()
            (b,) = (b for b in health["backends"] if b["url"] == victim.url)
            if not (b["healthy"] and b["version"] == version):
                return False
        return True

    wait_until(back_everywhere, timeout=30, what="the restarted backend back on every replica")
    reported = httpx.get(victim.url + "/model_info", timeout=10).json()["weight_version"]
    assert reported == str(version)


_SEED = (
    "INSERT INTO sessions (id, kind, status, metadata, created_at, finished_at, group_id) "
    "SELECT md5(random()::text || g::text), "
    "CASE WHEN g % 4 = 0 THEN 'production' ELSE 'train' END, "
    "CASE WHEN g % 2 = 0 THEN 'failed' ELSE 'dropped' END, '{}'::json, now(), now(), "
    "'seed-' || (g / 8)::text FROM generate_series(1, :n) AS g"
)


def _seed_sessions(fleet: Fleet, total: int | None) -> int:
    """Bring the store to ``total`` sessions with bulk SQL (history that is not admitted);
    ``None`` removes the seeded ones. Returns how many sessions the store then holds."""

    async def seed(store: Store) -> int:
        from sqlalchemy import text

        async with store.engine.begin() as conn:
            have = (await conn.execute(text("SELECT count(*) FROM sessions"))).scalar_one()
            if total is None:
                await conn.execute(text("DELETE FROM sessions WHERE group_id LIKE 'seed-%'"))
            else:
                await conn.execute(text(_SEED), {"n": max(0, total - have)})
        async with store.engine.connect() as conn:
            auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await auto.execute(text("VACUUM ANALYZE sessions"))
            return int((await auto.execute(text("SELECT count(*) FROM sessions"))).scalar_one())

    return int(fleet.store_call(seed))


def _creation_seconds(url: str, rounds: int = 4, n: int = 30) -> float:
    """Seconds of one session create: the best of ``rounds`` lower quartiles of ``n`` creates
    (each then failed, untimed, to free capacity). Other engineers' load on a shared machine
    only ever adds time, so the best round is the one that measures the proxy."""
    best = float("inf")
    with httpx.Client(headers=ADMIN, timeout=60) as client:
        for _ in range(rounds):
            times = []
            for _ in range(n):
                started = time.perf_counter()
                resp = client.post(url + "/rl/sessions", json={})
                times.append(time.perf_counter() - started)
                assert resp.status_code == 200, resp.text
                sid = resp.json()["session_id"]
                client.post(f"{url}/rl/sessions/{sid}/finish", json={"status": "failed"})
            best = min(best, statistics.quantiles(times, n=4)[0])
    return best


def test_session_creation_at_100k_stored_sessions_within_1_5x_of_1k(fleet: Fleet) -> None:
    url = fleet.replicas[1].url
    at_1k: list[float] = []
    at_100k: list[float] = []
    # Admission reads a counter row and the open sessions, not every session ever created:
    # the rate at 100k stored sessions is at least 1/1.5 of the rate at 1k. A second pair of
    # measurements (back to 1k, then 100k again) only when the first is over the bar: a
    # burst of the other test process's load fell on one side once (12 ms vs 24 ms, on a
    # host at half speed); an admission that scans every session is over it in both pairs.
    for _ in range(2):
        _seed_sessions(fleet, None)
        assert _seed_sessions(fleet, 1_000) >= 1_000
        _creation_seconds(url, 1, 10)  # warm
        at_1k.append(_creation_seconds(url))
        assert _seed_sessions(fleet, 100_000) >= 100_000
        _creation_seconds(url, 1, 10)
        at_100k.append(_creation_seconds(url))
        if min(at_100k) <= 1.5 * min(at_1k):
            break
    assert min(at_100k) <= 1.5 * min(at_1k), (at_1k, at_100k)


def test_the_trainer_pushes_through_any_replica_of_a_fleet(fleet: Fleet, tmp_path: Path) -> None:
    from proxima.proxy.serving import free_port
    from proxima.trainer.config import ConnectionConfig
    from proxima.trainer.proxy_settings import fetch_proxy_settings
    from proxima.trainer.weights import ProxyWeightSink

    dead = f"http://127.0.0.1:{free_port()}"  # a replica that is down
    listed = ", ".join([dead, *(r.url for r in fleet.replicas)])
    conn = ConnectionConfig(proxy_url=listed)
    assert conn.proxy_urls == [dead, *(r.url for r in fleet.replicas)]
    with pytest.raises(ValueError, match="separate their URLs with commas"):
        ConnectionConfig(proxy_url="http://a:1http://b:2")
    assert conn.proxy_url is not None

    async def push() -> tuple[int, list[int]]:
        settings = await fetch_proxy_settings(conn.proxy_url or "", admin_token="test-admin-token")
        assert settings.train_batch_size == BATCH
        sink = ProxyWeightSink(conn.proxy_url or "", admin_token="test-admin-token")
        try:
            version = await sink.served_version(fleet.replicas[0].url) + 1
            await sink.push(version=version, path=tmp_path / f"v{version}")
            served = [await sink.served_version(r.url) for r in fleet.replicas]
        finally:
            await sink.aclose()
        return version, served

    version, served = asyncio.run(push())
    assert served == [version] * 3  # pushed through the first live replica, served by all
    assert fleet.store_call(lambda s: s.current_policy_version()) == version


def _production_version(url: str) -> tuple[int, list[int | None]]:
    state = httpx.get(url + "/admin/production", headers=ADMIN, timeout=10).json()
    backends = state["deployments"]["production"]["backends"]
    return state["version"], [b["version"] if b["healthy"] else None for b in backends]


def test_a_promotion_and_a_rollback_through_one_replica_are_followed_by_all(fleet: Fleet) -> None:
    a, b, c = (r.url for r in fleet.replicas)
    version = fleet.store_call(lambda s: s.current_policy_version())
    if version == 0:  # a version to promote (the push test makes one when it runs first)
        version = 1
        resp = httpx.post(
            a + "/admin/weights", json={"version": 1, "path": "/weights/v1"}, headers=ADMIN
        )
        assert resp.status_code == 200, resp.text
    for through, target, others in ((a, version, (b, c)), (b, 0, (a, c))):
        if target == version:
            resp = httpx.post(
                through + "/admin/production", json={"version": target}, headers=ADMIN, timeout=60
            )
        else:  # back to the version promoted before: the start-up model
            resp = httpx.post(through + "/admin/production/rollback", headers=ADMIN, timeout=60)
        assert resp.status_code == 200, resp.text
        done = time.monotonic()
        seen: dict[str, float] = {}

        def follow(
            others: tuple[str, ...] = others,
            target: int = target,
            seen: dict[str, float] = seen,
            done: float = done,
        ) -> bool:
            for url in others:
                if url not in seen and _production_version(url) == (target, [target]):
                    seen[url] = time.monotonic() - done
            return len(seen) == len(others)

        wait_until(follow, timeout=10, interval=0.02, what=f"production at v{target} everywhere")
        assert max(seen.values()) < 1.0, seen
    # The shared production backend loaded each change once (through the replica that made it).
    assert fleet.production.log_path is not None
    log = fleet.production.log_path.read_text()
    assert log.count(f"weights loaded: version={version} ") == 1
    assert log.count("weights loaded: version=0 ") == 1
