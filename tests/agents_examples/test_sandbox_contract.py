"""The HTTP contract for agents that are not Python or not on Ray (agents_examples/sandbox/).

A Node script (``agent.mjs``) and a POSIX shell script with curl (``agent.sh``)
drive real sessions through a live proxy whose ``PROXIMA_PUBLIC_BASE_URL``
names another address than the one it was reached at: the sandboxes must use
the ``base_url`` the session hands them. Results are read back from the store.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from proxima.proxy.testing.live import LiveProxy

SANDBOX = Path(__file__).resolve().parents[2] / "agents_examples" / "sandbox"


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("sandbox-proxy")
    live = LiveProxy(
        tiny_model_dir, db_url=f"sqlite:///{work / 'store.db'}", log_path=work / "serve.log"
    )
    live.env["PROXIMA_PUBLIC_BASE_URL"] = f"http://localhost:{live.port}/v1"
    live.start()
    yield live
    live.stop()


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert shutil.which(argv[0]), f"{argv[0]} is needed for this test"
    return subprocess.run(
        argv, env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=120
    )


def test_node_agent_runs_the_whole_contract(proxy: LiveProxy) -> None:
    env = {
        "PROXIMA_URL": proxy.url,
        "PROXIMA_ADMIN_TOKEN": proxy.admin_token,
        "PROXIMA_MODEL": proxy.model_name,
        "PROXIMA_GROUP_ID": "g-node",
        "PROXIMA_DATA_ID": "d-node",
    }
    done = _run(["node", str(SANDBOX / "agent.mjs"), "What is 3 + 4?"], env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["status"] == "finished" and out["reward"] in (1, 0.5)
    stored = proxy.trajectory(out["session_id"])
    assert stored["status"] == "finished" and stored["reward"] == out["reward"]
    assert (stored["group_id"], stored["data_id"]) == ("g-node", "d-node")
    assert stored["metadata"] == {"agent": "agent.mjs"}
    (completion,) = stored["completions"]
    assert completion["request_messages"][0]["content"] == "What is 3 + 4?"
    assert completion["output_ids"] and completion["output_versions"]


def test_node_agent_that_fails_finishes_its_session_failed(proxy: LiveProxy) -> None:
    env = {
        "PROXIMA_URL": proxy.url,
        "PROXIMA_ADMIN_TOKEN": proxy.admin_token,
        "PROXIMA_MODEL": proxy.model_name,
        "PROXIMA_MAX_TOKENS": "-3",  # the proxy's 400 is the agent's failure
    }
    done = _run(["node", str(SANDBOX / "agent.mjs")], env)
    assert done.returncode == 1 and "answered 400" in done.stderr, done.stderr
    out = json.loads(done.stdout)
    assert out["status"] == "failed" and out["reward"] is None
    stored = proxy.trajectory(out["session_id"])
    assert stored["status"] == "failed" and stored["reward"] is None
    assert stored["completions"] == []


def test_shell_sandbox_with_a_session_handed_over(proxy: LiveProxy) -> None:
    # The orchestrator (admin token) opens the session; the sandbox gets only its key and URL.
    opened = proxy.new_session(group_id="g-sh", data_id="d-sh")
    assert opened["base_url"] == f"http://localhost:{proxy.port}/v1"
    env = {
        "PROXIMA_BASE_URL": opened["base_url"],
        "PROXIMA_API_KEY": opened["api_key"],
        "PROXIMA_SESSION_ID": opened["session_id"],
        "PROXIMA_MODEL": proxy.model_name,
    }
    done = _run(["sh", str(SANDBOX / "agent.sh")], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == opened["session_id"]
    stored = proxy.trajectory(opened["session_id"])
    assert stored["status"] == "finished" and stored["reward"] == 0.25
    assert len(stored["completions"]) == 1

    key = {"Authorization": f"Bearer {opened['api_key']}"}
    with httpx.Client(base_url=proxy.url, headers=key, timeout=30) as sandbox:
        # The session key opens no sessions and reaches no other session.
        created = sandbox.post("/rl/sessions", json={})
        assert created.status_code == 403 and "admin token" in created.text, created.text
        other = proxy.new_session()
        assert sandbox.post(f"/rl/sessions/{other['session_id']}/finish").status_code == 403
        # A finished session takes no more turns.
        turn = sandbox.post(
            "/v1/chat/completions",
            json={"model": proxy.model_name, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert turn.status_code == 409 and turn.json()["error"]["code"] == "session_closed"
