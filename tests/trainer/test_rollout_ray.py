"""Agents fanned out on a real multi-node Ray cluster, through the real proxy.

``ray_cluster_driver.py`` runs in a network namespace of its own with only
loopback (``unshare -n``; Ray binds and advertises the machine's interface
address otherwise, even when told 127.0.0.1) and a PID namespace (whatever
it started dies with it). In there: ``proxima serve`` with the tiny model, a
Ray cluster of three raylets (head + two worker nodes, ``ray.cluster_utils``),
and the rollout controller in ``mode="ray"`` running 200 agent runs; some
runs' workers die, raise or hang. Then a second rollout loses a whole worker
node mid-run. This test checks what the driver read back from the proxy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from proxima.trainer.pipeline.config import load_run_config
from proxima.trainer.pipeline.train import rollout_controller
from proxima.trainer.rollout.agents import RolloutError
from proxima.trainer.rollout.controller import RolloutController
from proxima.trainer.rollout.controller import main as rollout_main

HERE = Path(__file__).resolve().parent
RUNS = 200
NODE_LOSS_RUNS = 18
# Proxy start, cluster start and both rollouts; on 2 busy cores it has taken 110 s (the
# hanging runs hold their slots for the run timeout, 90 s).
pytestmark = pytest.mark.timeout(900)
FAILING = {"q-0": "died", "q-3": "died", "q-1": "raised", "q-2": "timed out"}


def _in_loopback_namespace(argv: list[str]) -> list[str]:
    """``argv`` in new network + PID namespaces (the driver brings their ``lo`` up itself)."""
    user_ns = [] if os.geteuid() == 0 else ["--map-root-user"]
    return ["unshare", *user_ns, "--net", "--pid", "--fork", "--mount-proc", *argv]


@pytest.fixture(scope="module")
def ray_rollout(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import ray  # noqa: F401 - part of the test environment (Makefile: [ray]); fails clearly here

    out = tmp_path_factory.mktemp("ray-rollout") / "result.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [
        sys.executable,
        str(HERE / "ray_cluster_driver.py"),
        str(tiny_model_dir),
        str(out),
        str(RUNS),
    ]
    proc = subprocess.run(
        _in_loopback_namespace(argv),
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, f"driver failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_runs_fan_out_over_every_node(ray_rollout: dict[str, Any]) -> None:
    summary, nodes = ray_rollout["summary"], ray_rollout["nodes"]
    assert len(nodes) == 3 and set(nodes.values()) == {"127.0.0.1"}
    assert summary["items"] == RUNS // 2
    assert summary["sessions_started"] == RUNS
    assert (summary["sessions_rewarded"], summary["sessions_failed"]) == (RUNS - 8, 8)
    assert summary["timeouts"] == 2 and summary["waits_429"] == 0
    # Every finished run names the node that ran it; all nodes ran some. How many each is
    # Ray's choice and the machine's load (a node whose workers start late gets fewer short
    # runs); the node-loss rollout below fills every node's slots exactly.
    by_node = summary["runs_by_node"]
    assert set(by_node) == set(nodes), by_node
    assert sum(by_node.values()) == RUNS - 8


def test_every_finished_run_is_in_the_store_with_its_reward(ray_rollout: dict[str, Any]) -> None:
    trajectories = ray_rollout["trajectories"]
    finished = [r for r in ray_rollout["runs"] if r["status"] == "finished"]
    assert len(finished) == RUNS - 8
    groups: dict[str, int] = {}
    for run in finished:
        stored = trajectories[run["session_id"]]
        n = int(run["data_id"].removeprefix("q-"))
        assert stored["status"] == "finished"
        assert stored["reward"] == run["reward"] == (n % 5) / 4
        assert stored["group_id"] == run["group_id"] and stored["data_id"] == run["data_id"]
        # The agent's one turn reached this session (env-configured and placeholder-key
        # clients alike), with the tokens the real engine generated.
        (completion,) = stored["completions"]
        assert completion["output_ids"] and len(completion["output_logprobs"]) == len(
            completion["output_ids"]
        )
        groups[stored["group_id"]] = groups.get(stored["group_id"], 0) + 1
    assert set(groups.values()) == {2}  # group_size runs per item, one group id each


def test_dead_raising_and_hanging_tasks_fail_their_sessions(ray_rollout: dict[str, Any]) -> None:
    failed = [r for r in ray_rollout["runs"] if r["status"] == "failed"]
    assert sorted(r["data_id"] for r in failed) == sorted([*FAILING] * 2)
    for run in failed:
        stored = ray_rollout["trajectories"][run["session_id"]]
        assert stored["status"] == "failed" and stored["reward"] is None
        assert run["reward"] is None and run["node_id"] is None
        how = FAILING[run["data_id"]]
        if how == "died":
            assert "agent task died: WorkerCrashedError" in run["error"]
            # The turn recorded before the worker died stays recorded (never trained on).
            assert len(stored["completions"]) == 1
        elif how == "raised":
            assert "ValueError('agent bug on a Ray worker')" in run["error"]
        else:
            assert run["timed_out"] and "timed out" in run["error"]


def test_a_lost_node_fails_only_the_runs_it_held(ray_rollout: dict[str, Any]) -> None:
    loss, nodes = ray_rollout["node_loss"], ray_rollout["nodes"]
    summary = loss["summary"]
    # Before the loss all 9 slots held a run: 3 on each node (one CPU each).
    assert summary["sessions_started"] == NODE_LOSS_RUNS
    assert summary["sessions_rewarded"] + summary["sessions_failed"] == NODE_LOSS_RUNS
    # Every slot (3 CPUs on each of 3 nodes) held a running agent when the node went: its 3
    # runs failed; the rest, and the runs queued behind them, finished on the surviving nodes.
    assert summary["sessions_failed"] == 3
    assert summary["sessions_rewarded"] == NODE_LOSS_RUNS - 3
    assert loss["victim"] in nodes
    assert set(summary["runs_by_node"]) <= set(nodes) - {loss["victim"]}
    for run in loss["runs"]:
        stored = ray_rollout["trajectories"][run["session_id"]]
        assert stored["status"] == run["status"]
        if run["status"] == "failed":
            assert run["error"].startswith("AgentError: agent task died: "), run["error"]
            assert "NodeDiedError" in run["error"] or "WorkerCrashedError" in run["error"]
            assert stored["reward"] is None
        else:
            assert run["node_id"] != loss["victim"] and stored["reward"] is not None


def test_rollout_cli_takes_ray_mode_and_address(tmp_path: Path) -> None:
    dataset = tmp_path / "data.jsonl"
    dataset.write_text('{"id": "x"}\n')
    argv = ["--proxy", "http://127.0.0.1:9", "--admin-token", "t", "--agent", "m:f"]
    argv += ["--dataset", str(dataset), "--mode", "ray", "--ray-address", "no-such-cluster"]
    with pytest.raises(RolloutError, match="cannot join the Ray cluster at no-such-cluster"):
        rollout_main(argv)


async def test_train_run_config_puts_rollouts_on_ray(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        '[rollout]\nagent = "m:f"\nmode = "ray"\nray_address = "no-such-cluster"\n'
        "ray_options = { num_cpus = 0.25, max_retries = 3 }\n"
    )
    ctl = rollout_controller(load_run_config(config), "http://127.0.0.1:9", "t", "tiny")
    assert ctl.mode == "ray" and ctl._ray is not None
    assert ctl._ray.address == "no-such-cluster"
    # The run's task options, except retries: a retried run would add turns to its session.
    assert ctl._ray.options["num_cpus"] == 0.25 and ctl._ray.options["max_retries"] == 0
    with pytest.raises(RolloutError, match="cannot join the Ray cluster"):
        await ctl.run([{"id": "x"}])


async def test_ray_mode_without_a_cluster() -> None:
    with pytest.raises(RolloutError, match="module:function"):
        RolloutController("http://127.0.0.1:9", "t", "no_colon", mode="ray")
    with pytest.raises(ValueError, match="'ray'"):
        RolloutController("http://127.0.0.1:9", "t", "m:f", mode="threads")  # type: ignore[arg-type]
    # A cluster that cannot be joined stops the rollout before any session is opened.
    ctl = RolloutController(
        "http://127.0.0.1:9", "t", "m:f", mode="ray", ray_address="no-such-cluster"
    )
    with pytest.raises(RolloutError, match="cannot join the Ray cluster at no-such-cluster"):
        await ctl.run([{"id": "x"}])
    assert ctl.progress.sessions_started == 0
