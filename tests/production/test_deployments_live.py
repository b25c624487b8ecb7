"""Serving the trained policy: a pinned production version beside training, live.

``proxima serve --production-engine`` runs the tiny model on two embedded
engines: ``training`` follows every weight push, ``production`` (production
keys) serves the version last promoted. Promotions, the canary and rollbacks
go through the ``proxima production`` CLI as an operator types them; what
each request was served by is read back from the recorded per-token versions.
The tests run in order on one proxy (each one's state is the next one's start).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.policies.deployments import canary_bucket
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.tiny_model import build_tiny_model

from tests.production.procs import create_production_key

SESSION_HEADER = "X-Proxima-Session-Id"


@dataclass
class Env:
    proxy: LiveProxy
    key: str
    work: Path


@pytest.fixture(scope="module")
def env(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("deployments")
    db_url = f"sqlite:///{work / 'store.db'}"
    key = create_production_key(db_url, "product")
    proxy = LiveProxy(
        tiny_model_dir,
        db_url=db_url,
        log_path=work / "serve.log",
        extra_args=["--production-engine"],
    )
    proxy.start()
    try:
        for version in (1, 2):  # the trainer pushes two versions
            proxy.push_weights(version, build_tiny_model(work / f"v{version}", seed=version))
        yield Env(proxy, key, work)
    finally:
        proxy.stop()


def cli(env: Env, *args: str) -> dict[str, Any]:
    """``proxima production ...`` as an operator runs it; its printed JSON."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxima.cli",
            "production",
            *args,
            "--proxy",
            env.proxy.url,
            "--admin-token",
            env.proxy.admin_token,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def admin(env: Env, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(
        method,
        env.proxy.url + path,
        json=body,
        headers=env.proxy.admin_headers(),
        timeout=300,
    )


def production_turns(env: Env, name: str, turns: int = 1) -> tuple[str, list[int]]:
    """``turns`` turns of one production conversation; its session id and token versions."""
    messages: list[dict[str, str]] = []
    session_id = None
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} of {name}?"})
        resp = httpx.post(
            env.proxy.base_url + "/chat/completions",
            headers={"Authorization": f"Bearer {env.key}", "X-Session-Id": name},
            json={"model": env.proxy.model_name, "messages": messages, "max_tokens": 6},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        session_id = resp.headers[SESSION_HEADER]
        messages.append(resp.json()["choices"][0]["message"])
    assert session_id is not None
    completions = env.proxy.trajectory(session_id)["completions"]
    assert len(completions) == turns
    return session_id, [v for c in completions for v in c["output_versions"]]


def training_versions(env: Env) -> list[int]:
    s = env.proxy.new_session()
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    client.chat.completions.create(
        model=env.proxy.model_name,
        messages=[{"role": "user", "content": "Train on this."}],
        max_tokens=6,
    )
    return env.proxy.trajectory(s["session_id"])["completions"][0]["output_versions"]


def test_production_stays_pinned_until_a_promotion(env: Env) -> None:
    registry = admin(env, "GET", "/admin/versions").json()
    assert [v["version"] for v in registry["versions"]] == [0, 1, 2]
    assert (registry["training"], registry["production"], registry["canary"]) == (2, 0, None)
    served = {v["version"]: v["served_by"] for v in registry["versions"]}
    assert served == {0: ["production"], 1: [], 2: ["training"]}
    assert registry["versions"][0]["path"] == str(env.proxy.model_dir)
    health = httpx.get(env.proxy.url + "/health").json()
    assert health["status"] == "ok" and health["version"] == 2
    assert {name: d["version"] for name, d in health["deployments"].items()} == {
        "training": 2,
        "production": 0,
    }

    _, versions = production_turns(env, "before-promotion")
    assert versions and set(versions) == {0}  # the trainer's pushes did not reach production
    assert set(training_versions(env)) == {2}

    state = cli(env, "promote", "1")
    assert (state["mode"], state["version"], state["canary"]) == ("pinned", 1, None)
    assert state["rollback_to"] == 0

    _, versions = production_turns(env, "after-promotion", turns=2)
    assert set(versions) == {1}  # every token of every turn
    assert set(training_versions(env)) == {2}
    status = cli(env, "status")
    assert [(h["action"], h["version"]) for h in status["history"]] == [("promote", 1)]


def test_canary_serves_half_of_the_sessions_each_on_one_version(env: Env) -> None:
    state = cli(env, "promote", "1", "--canary", "2", "--fraction", "0.5")
    assert state["canary"] == {"version": 2, "fraction": 0.5}
    assert state["deployments"]["canary"]["embedded_engine"]  # started on demand

    with ThreadPoolExecutor(8) as pool:
        sessions = list(pool.map(lambda i: production_turns(env, f"canary-{i}", 2), range(40)))
    by_version: dict[int, int] = {1: 0, 2: 0}
    for session_id, versions in sessions:
        assert len(set(versions)) == 1, versions  # sticky: both turns on one version
        expected = 2 if canary_bucket(session_id) < 0.5 else 1
        assert versions[0] == expected
        by_version[versions[0]] += 1
    assert by_version[1] > 0 and by_version[2] > 0 and sum(by_version.values()) == 40

    metrics = httpx.get(env.proxy.url + "/metrics").text
    for deployment, version in (("canary", 2), ("production", 1)):
        requests = _sample(
            metrics,
            "proxima_deployment_requests_total",
            deployment=deployment,
            outcome="ok",
            version=str(version),
        )
        assert requests >= 2 * by_version[version]
        latency = _sample(
            metrics,
            "proxima_deployment_request_seconds_count",
            deployment=deployment,
            version=str(version),
        )
        assert latency == requests
    assert _sample(metrics, "proxima_canary_fraction") == 0.5
    assert _sample(metrics, "proxima_deployment_version", deployment="canary") == 2.0


def test_rollback_returns_to_the_previous_version(env: Env) -> None:
    state = admin(env, "POST", "/admin/production", {"version": 2}).json()
    assert (state["version"], state["canary"]) == (2, None)
    _, versions = production_turns(env, "on-two")
    assert set(versions) == {2}

    state = cli(env, "rollback")
    assert (state["version"], state["canary"]) == (1, None)
    _, versions = production_turns(env, "rolled-back")
    assert set(versions) == {1}
    assert [(h["action"], h["version"]) for h in state["history"]] == [
        ("promote", 1),
        ("promote", 1),
        ("promote", 2),
        ("rollback", 1),
    ]
    assert set(training_versions(env)) == {2}  # training never moved


def test_a_promotion_during_eight_streams_fails_none(env: Env) -> None:
    n_streams, length = 8, 300
    client = OpenAI(base_url=env.proxy.base_url, api_key=env.key, max_retries=0)
    started = threading.Barrier(n_streams + 1, timeout=300)
    results: list[dict[str, Any]] = [{} for _ in range(n_streams)]

    def stream(i: int) -> None:
        response = client.chat.completions.with_raw_response.create(
            model=env.proxy.model_name,
            messages=[{"role": "user", "content": f"Tell story {i}."}],
            stream=True,
            max_tokens=length,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Session-Id": f"load-{i}"},
        )
        results[i]["session"] = response.headers[SESSION_HEADER]
        text, finish, waited = "", None, False
        for chunk in response.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if not waited and text:
                started.wait()  # every stream is generating before the promotion
                waited = True
        results[i].update(text=text, finish=finish)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n_streams)]
    for t in threads:
        t.start()
    started.wait()
    state = cli(env, "promote", "2")
    for t in threads:
        t.join(timeout=300)
    assert state["version"] == 2

    switched = 0
    for result in results:
        assert result["finish"] == "length"
        (c,) = env.proxy.trajectory(result["session"])["completions"]
        versions = c["output_versions"]
        assert len(c["output_ids"]) == len(versions) == length  # resumed, not restarted
        assert versions == sorted(versions) and set(versions) <= {1, 2}
        assert versions[0] == 1
        switched += versions[-1] == 2
        assert c["response_text"] == result["text"]
    assert switched > 0  # at least one stream was still generating when version 2 landed


def test_eval_gate_and_versions_by_name(env: Env, tiny_model_dir: Path) -> None:
    # Production serves 2. proxima eval scores version 2 through the proxy and records it.
    config = env.work / "eval.toml"
    config.write_text(
        f'[model]\npath = "{tiny_model_dir}"\n'
        f'[proxy]\nurl = "{env.proxy.url}"\nadmin_token = "{env.proxy.admin_token}"\n'
        "[data]\ntest_items = 2\n"
        "[rollout.item_fields]\nmax_turns = 1\nmax_tokens = 4\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "proxima.cli", "eval", "--config", str(config), "--version", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=env.work,
    )
    assert out.returncode == 0, out.stderr
    assert "first-try accuracy of version 2" in out.stdout
    registry = admin(env, "GET", "/admin/versions").json()
    (v2,) = [v for v in registry["versions"] if v["version"] == 2]
    assert v2["eval"]["items"] == 2 and v2["eval"]["name"] == "proxima eval"
    production_score = v2["eval"]["score"]

    # Version 1 is not served anywhere now: it cannot be evaluated until it is.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = admin(
        env, "POST", "/v1/chat/completions", {"model": f"{env.proxy.model_name}@v1", **chat}
    )
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "version_not_served"
    resp = httpx.post(
        env.proxy.base_url + "/chat/completions",
        headers={"Authorization": f"Bearer {env.key}"},
        json={"model": f"{env.proxy.model_name}@v2", **chat},
        timeout=60,
    )
    assert resp.status_code == 404  # only the admin token picks versions by name

    # The gate: a version scored below production's is refused, one at or above it passes.
    for version, score in ((0, production_score - 0.5), (1, production_score + 0.25)):
        resp = admin(env, "POST", f"/admin/versions/{version}/evals", {"score": score})
        assert resp.status_code == 200, resp.text
    resp = admin(env, "POST", "/admin/production", {"version": 0, "require_eval": True})
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "eval_below_production"
    state = cli(env, "promote", "1", "--require-eval")
    assert state["version"] == 1


def test_a_restarted_proxy_serves_the_last_promoted_state(env: Env) -> None:
    before = admin(env, "GET", "/admin/production").json()
    assert before["version"] == 1
    env.proxy.stop()
    env.proxy.start()
    after = admin(env, "GET", "/admin/production").json()
    assert (after["version"], after["canary"]) == (1, None)
    assert after["history"] == before["history"]
    _, versions = production_turns(env, "after-restart")
    assert set(versions) == {1}
    assert set(training_versions(env)) == {2}  # training resumes at the newest push


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"version": 9}, 404, "version"),
        ({"version": 1, "canary": {"version": 2, "fraction": 1.5}}, 400, "canary.fraction"),
        ({"version": 1, "canary": {"version": 1, "fraction": 0.5}}, 400, "canary"),
        ({"version": -1}, 400, "version"),
        ({"version": 1, "surprise": True}, 400, "surprise"),
    ],
)
def test_bad_promotions_get_clear_errors(
    env: Env, body: dict[str, Any], status: int, param: str
) -> None:
    resp = admin(env, "POST", "/admin/production", body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


def test_deployment_routes_need_the_admin_token(env: Env) -> None:
    for method, path in (
        ("GET", "/admin/versions"),
        ("GET", "/admin/production"),
        ("POST", "/admin/production/rollback"),
    ):
        resp = httpx.request(method, env.proxy.url + path, timeout=30)
        assert resp.status_code == 401
        resp = httpx.request(
            method, env.proxy.url + path, headers={"Authorization": f"Bearer {env.key}"}
        )
        assert resp.status_code == 403
    resp = admin(env, "POST", "/admin/versions/9/evals", {"score": 1.0})
    assert resp.status_code == 404


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample whose labels include ``labels``."""
    for line in metrics.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"no sample {name} {labels} in /metrics")


def test_a_promotion_whose_canary_cannot_load_changes_nothing(env: Env) -> None:
    """Issue 19, 2.7: production switched to the new version anyway, nothing was recorded,
    and a rollback then answered 409. Now the failed promotion changes nothing."""
    path = build_tiny_model(env.work / "v3", seed=3)
    resp = admin(env, "POST", "/admin/weights", {"version": 3, "path": str(path)})
    assert resp.status_code == 200, resp.text
    shutil.rmtree(path)  # registered, but its weights are gone: the canary cannot load it
    before = cli(env, "promote", "1")
    assert (before["version"], before["canary"]) == (1, None)

    resp = admin(
        env, "POST", "/admin/production", {"version": 2, "canary": {"version": 3, "fraction": 0.5}}
    )
    assert resp.status_code == 400, resp.text
    assert (
        resp.json()["error"]["param"] == "version"
        and "version 3" in resp.json()["error"]["message"]
    )

    after = admin(env, "GET", "/admin/production").json()
    assert (after["version"], after["canary"], after["rollback_to"]) == (
        1,
        None,
        before["rollback_to"],
    )
    assert after["history"] == before["history"]
    _, versions = production_turns(env, "after-a-failed-promotion")
    assert set(versions) == {1}
    state = cli(env, "rollback")  # rolls back the last promotion that happened
    assert state["version"] == before["rollback_to"]
