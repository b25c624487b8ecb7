"""``proxima train`` outlives an engine SIGKILL and a PostgreSQL restart, losing no session.

Before, a 503 from ``POST /rl/sessions`` while the database restarted was a ``RolloutError``
that ended the run, and a killed engine left every request waiting 30 s for a 503 until the
proxy was restarted. Here a run on a private PostgreSQL cluster (its own: stopped and started
on its port) has its engine killed after the first step and its database stopped for 3 s
after the second; it still trains its 3 steps, and every session its rollouts opened was
rewarded and finished (none failed, none left open).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from proxima.proxy.store import SessionKind, SessionStatus, Store

from tests.pg import POSTGRES_PARAM, PostgresCluster, find_pg_bin

OUTAGE_S = 3.0


@pytest.fixture(params=[POSTGRES_PARAM])
def cluster() -> Iterator[PostgresCluster]:
    bin_dir = find_pg_bin()
    assert bin_dir is not None  # deselected without PostgreSQL (tests.pg)
    own = PostgresCluster.start(bin_dir)  # its own: this test stops it
    try:
        yield own
    finally:
        own.stop()


def _config(tiny_model_dir: Path, tmp_path: Path, db_url: str) -> tuple[Path, Path]:
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f"""
steps = 3
output_dir = "{out}"

[model]
path = "{tiny_model_dir}"

[proxy]
db = "{db_url}"

[data]
difficulty = "tiny"
train_items = 30
test_items = 1

[eval]
items = 1

[rollout]
group_size = 2
max_concurrency = 2
timeout_s = 120
retry_window_s = 90
item_fields = {{ max_turns = 1, max_tokens = 4 }}

[trainer]
batch_size = 2
max_staleness = 1

[trainer.loop]
retry_window_s = 90

[trainer.advantage]
zero_signal = "keep"
""")
    return config, out


def _steps(out: Path) -> int:
    log = out / "trainer" / "train_log.jsonl"
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if '"event": "step"' in line)


def _wait_for_step(proc: subprocess.Popen[str], out: Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _steps(out) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no step {step} within {timeout:.0f}s"
        time.sleep(0.2)


def _engine(proc: subprocess.Popen[str]) -> psutil.Process:
    (engine,) = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "proxima.proxy.embedded" in " ".join(p.cmdline())
    ]
    return engine


async def _sessions(db_url: str) -> dict[SessionStatus, int]:
    store = await Store.open(db_url)
    try:
        return await store.count_sessions_by_status(kind=SessionKind.TRAIN)
    finally:
        await store.close()


def test_a_run_survives_an_engine_kill_and_a_postgres_restart_losing_no_session(
    cluster: PostgresCluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    db_url = cluster.url(cluster.create_database())
    config, out = _config(tiny_model_dir, tmp_path, db_url)
    argv = [sys.executable, "-m", "proxima.cli", "--log-format", "text"]
    argv += ["--log-level", "warning", "train", "--config", str(config), "--no-progress"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(proc, out, 1, timeout=240)
        engine = _engine(proc)
        os.kill(engine.pid, signal.SIGKILL)  # agents are generating the next sessions

        _wait_for_step(proc, out, 2, timeout=120)
        cluster.pause()
        time.sleep(OUTAGE_S)
        cluster.resume()

        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    steps = [
        json.loads(line) for line in (out / "trainer" / "train_log.jsonl").read_text().splitlines()
    ]
    assert [s["version"] for s in steps if s["event"] == "step"] == [1, 2, 3]
    rollouts = summary["rollouts"]
    assert rollouts["sessions_failed"] == 0 and rollouts["timeouts"] == 0, rollouts
    statuses = asyncio.run(_sessions(db_url))
    assert statuses[SessionStatus.OPEN] == statuses[SessionStatus.FAILED] == 0, statuses
    assert sum(statuses.values()) == rollouts["sessions_started"], (statuses, rollouts)
    assert statuses[SessionStatus.TRAINED] >= 6

    # Both outages were felt: the engine was restarted, the store was out of reach.
    proxy_log = (out / "proxy.log").read_text()
    assert "exited with status -9: restarting it" in proxy_log
    assert "trajectory store unavailable" in proxy_log
    # ... and waited out: the rollout (this command's log) or the trainer retried a call.
    retried = stderr + (out / "trainer.log").read_text()
    assert "failed, retrying in" in retried, stderr[-3000:]
    assert not psutil.pid_exists(engine.pid), "the killed engine was reaped"
