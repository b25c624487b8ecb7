"""Production keys: served by the current policy, optionally recorded for training.

A key made with ``proxima keys create --no-record`` is served and leaves no
trace in the store. A recording key's requests go into production sessions
grouped by ``X-Session-Id`` (the proxy names the session in the
``X-Proxima-Session-Id`` response header); the key may read, reward and
finish its own sessions later, and the trainer claims them like training
sessions. Recorded tokens carry the policy version that produced them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.store.records import SessionKind, SessionStatus
from proxima.proxy.store.store import Store
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.tiny_model import build_tiny_model

from tests.production.procs import create_production_key

SESSION_HEADER = "X-Proxima-Session-Id"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("production-keys")


@pytest.fixture(scope="module")
def db_url(work: Path) -> str:
    return f"sqlite:///{work / 'store.db'}"


@pytest.fixture(scope="module")
def keys(db_url: str) -> dict[str, str]:
    return {
        "quiet": create_production_key(db_url, "quiet-app", record=False),
        "recorded": create_production_key(db_url, "recorded-app"),
        "other": create_production_key(db_url, "other-app"),
    }


@pytest.fixture(scope="module")
def proxy(
    tiny_model_dir: Path, work: Path, db_url: str, keys: dict[str, str]
) -> Iterator[LiveProxy]:
    live = LiveProxy(tiny_model_dir, db_url=db_url, log_path=work / "serve.log")
    live.start()
    yield live
    live.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(
    proxy: LiveProxy, key: str, messages: list[dict], session: str | None = None
) -> httpx.Response:
    headers = _auth(key) | ({"X-Session-Id": session} if session else {})
    resp = httpx.post(
        proxy.base_url + "/chat/completions",
        headers=headers,
        timeout=120,
        # Seeded: an unseeded reply of the random model holds a chat marker (<|im_start|>, or a
        # stop on <|endoftext|>) one time in ten; its text does not give back its tokens, so a
        # turn after it cannot extend it and the test would not see the chain it checks.
        json={"model": proxy.model_name, "messages": messages, "max_tokens": 12, "seed": 3},
    )
    assert resp.status_code == 200, resp.text
    return resp


async def _production_sessions(db_url: str) -> int:
    store = await Store.open(db_url)
    try:
        return await store.count_sessions(kind=SessionKind.PRODUCTION)
    finally:
        await store.close()


async def test_unrecorded_key_is_served_and_leaves_no_trace(
    proxy: LiveProxy, keys: dict[str, str], db_url: str
) -> None:
    before = await _production_sessions(db_url)
    client = OpenAI(base_url=proxy.base_url, api_key=keys["quiet"], max_retries=0)
    reply = client.chat.completions.create(
        model=proxy.model_name, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    resp = _chat(proxy, keys["quiet"], [{"role": "user", "content": "Hello"}], session="conv-q")
    assert SESSION_HEADER not in resp.headers
    assert await _production_sessions(db_url) == before
    # It is not an admin key either.
    denied = httpx.post(proxy.url + "/rl/sessions", json={}, headers=_auth(keys["quiet"]))
    assert denied.status_code == 403


async def test_recorded_production_session_reward_and_claim(
    proxy: LiveProxy, keys: dict[str, str], db_url: str, tmp_path: Path
) -> None:
    key = keys["recorded"]
    first_turn = [{"role": "user", "content": "What is 2+2?"}]
    first = _chat(proxy, key, first_turn, session="conv-1")
    session_id = first.headers[SESSION_HEADER]

    # A new policy version between the turns: each turn's tokens carry their own version.
    proxy.push_weights(1, build_tiny_model(tmp_path / "v1", seed=1))

    reply = first.json()["choices"][0]["message"]
    second = _chat(
        proxy, key, [*first_turn, reply, {"role": "user", "content": "And 3+3?"}], session="conv-1"
    )
    assert second.headers[SESSION_HEADER] == session_id  # X-Session-Id groups them
    # Without X-Session-Id every request is a session of its own.
    lone = _chat(proxy, key, [{"role": "user", "content": "Hi"}])
    assert lone.headers[SESSION_HEADER] != session_id

    own = httpx.get(f"{proxy.url}/rl/sessions/{session_id}", headers=_auth(key))
    assert own.status_code == 200, own.text
    traj = own.json()
    assert traj["kind"] == "production" and traj["status"] == "open"
    c1, c2 = traj["completions"]
    assert (c1["id"], c2["id"]) == (first.json()["id"], second.json()["id"])
    assert c2["parent_id"] == c1["id"]
    assert (
        c2["prompt_ids"][: len(c1["prompt_ids"]) + len(c1["output_ids"])]
        == c1["prompt_ids"] + c1["output_ids"]
    )
    for c, version in ((c1, 0), (c2, 1)):
        assert len(c["output_ids"]) == len(c["output_logprobs"]) == len(c["output_versions"]) >= 1
        assert set(c["output_versions"]) == {version}

    # Another production key sees none of it.
    assert (
        httpx.get(f"{proxy.url}/rl/sessions/{session_id}", headers=_auth(keys["other"])).status_code
        == 403
    )
    assert (
        httpx.post(
            f"{proxy.url}/rl/sessions/{session_id}/reward",
            json={"reward": 5.0},
            headers=_auth(keys["other"]),
        ).status_code
        == 403
    )

    # The reward comes later (user feedback), with the same key; then the session is closed.
    rewarded = httpx.post(
        f"{proxy.url}/rl/sessions/{session_id}/reward", json={"reward": 0.75}, headers=_auth(key)
    )
    assert rewarded.status_code == 200, rewarded.text
    again = httpx.post(
        f"{proxy.url}/rl/sessions/{session_id}/reward", json={"reward": 1.0}, headers=_auth(key)
    )
    assert again.status_code == 409
    finished = httpx.post(f"{proxy.url}/rl/sessions/{session_id}/finish", headers=_auth(key))
    assert finished.status_code == 200 and finished.json()["status"] == "finished"

    # The trainer claims it exactly once, as it claims training sessions.
    store = await Store.open(db_url)
    try:
        claimed = await store.claim_sessions(limit=10, trainer_id="trainer-a")
        assert [(s.id, s.kind, s.reward) for s in claimed] == [
            (session_id, SessionKind.PRODUCTION, 0.75)
        ]
        assert await store.claim_sessions(limit=10, trainer_id="trainer-b") == []
        stored = await store.list_completions(session_id=session_id)
        assert [c.output_versions for c in stored] == [c1["output_versions"], c2["output_versions"]]
        assert (await store.get_session(session_id=session_id)).status is SessionStatus.CLAIMED
    finally:
        await store.close()
    # Claimed: a late reward is refused rather than silently lost.
    late = httpx.post(
        f"{proxy.url}/rl/sessions/{session_id}/reward",
        json={"reward": 1.0, "completion_id": c2["id"]},
        headers=_auth(key),
    )
    assert late.status_code == 409


def test_without_a_production_deployment_production_follows_the_trainer(
    proxy: LiveProxy, keys: dict[str, str]
) -> None:
    # Started without --production-backend/--production-engine: one deployment, as before.
    status = httpx.get(proxy.url + "/admin/production", headers=proxy.admin_headers()).json()
    assert (status["mode"], status["canary"], status["history"]) == ("follows_training", None, [])
    assert status["version"] == httpx.get(proxy.url + "/health").json()["version"]
    refused = httpx.post(
        proxy.url + "/admin/production", json={"version": 0}, headers=proxy.admin_headers()
    )
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "no_production_deployment"
    assert "--production-engine" in refused.json()["error"]["message"]
    registry = httpx.get(proxy.url + "/admin/versions", headers=proxy.admin_headers()).json()
    current = [v for v in registry["versions"] if v["version"] == status["version"]]
    assert current and current[0]["served_by"] == ["training", "production"]
