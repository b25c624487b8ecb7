"""Driver of the Ray rollout test (``test_rollout_ray.py``): run inside a loopback-only netns.

Starts ``proxima serve`` (embedded engine, the tiny model, SQLite), a local
multi-node Ray cluster (``ray.cluster_utils.Cluster``: one head and worker
raylets, each its own node), and the rollout controller in ``mode="ray"``
over ``argv[3]`` runs; then reads every session's trajectory back from the
proxy and writes the report and trajectories as JSON to ``argv[2]``.

The agents below are user code: the OpenAI SDK with a placeholder key (bound
by the session hook) or with nothing but the environment; some items make
their worker die (``os._exit``), raise, or hang past the timeout.

    python ray_cluster_driver.py MODEL_DIR OUT_JSON RUNS
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHORT = {"max_tokens": 4, "temperature": 1.0}
WORKER_NODES = 2
CPUS_PER_NODE = 3
# A run's limit, Ray's scheduling and a worker's start included: 20 s let two ordinary runs
# time out when the 2 cores also ran another test process (2026-11-29), and 40 s let six
# time out, and a dying run too, on a host whose cores ran half as fast (2026-11-29); the
# hanging run still fails by it.
RUN_TIMEOUT_S = 90.0
# Fewer slots than failing runs (8): a slot a failed run kept would stall the rollout.
MAX_CONCURRENCY = 6
NODE_LOSS_RUNS = 18


def reward_of(data: dict[str, Any]) -> float:
    return float(data["n"] % 5) / 4


def agent(data: dict[str, Any]) -> float:
    """A sync agent, as users write them; its fate is chosen by ``data["kind"]``."""
    from openai import OpenAI

    # PROXIMA_PUBLIC_BASE_URL, not the address the controller itself uses.
    assert data["base_url"].startswith("http://localhost:"), data["base_url"]
    if data["n"] % 2:
        # Reads OPENAI_BASE_URL / OPENAI_API_KEY, set for this session on the worker.
        client = OpenAI(max_retries=0)
        assert client.base_url == data["base_url"].rstrip("/") + "/"
    else:
        client = OpenAI(base_url=data["base_url"], api_key="placeholder", max_retries=0)
    client.chat.completions.create(
        model=data["model"], messages=[{"role": "user", "content": data["question"]}], **SHORT
    )
    kind = data.get("kind", "ok")
    if kind == "die":
        os._exit(3)  # the worker process dies mid-run, after one recorded turn
    if kind == "raise":
        raise ValueError("agent bug on a Ray worker")
    if kind == "hang":
        time.sleep(600)
    if kind == "slow":
        # Still running when its node is taken away: the marker says it got this far, and
        # it returns only once the driver has removed the node (or after two minutes).
        markers = Path(data["marker_dir"])
        (markers / data["session_id"]).touch()
        deadline = time.monotonic() + 120
        while not (markers / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return reward_of(data)


def items(runs: int, group_size: int) -> list[dict[str, Any]]:
    out = []
    for i in range(runs // group_size):
        kind = {0: "die", 1: "raise", 2: "hang", 3: "die"}.get(i, "ok")
        out.append({"id": f"q-{i}", "question": f"What is {i} + 1?", "n": i, "kind": kind})
    return out


async def rollout(proxy: Any, runs: int, group_size: int) -> dict[str, Any]:
    from proxima.trainer.rollout.controller import RolloutController

    controller = RolloutController(
        proxy.url,
        proxy.admin_token,
        "ray_cluster_driver:agent",
        mode="ray",
        group_size=group_size,
        max_concurrency=MAX_CONCURRENCY,
        timeout_s=RUN_TIMEOUT_S,
        model=proxy.model_name,
        # Ray's default packs tasks onto the driver's node while it has room; SPREAD places
        # them over every node (a user's choice, passed through ray_options).
        ray_options={"scheduling_strategy": "SPREAD"},
    )
    started = time.monotonic()
    report = await controller.run(items(runs, group_size))
    elapsed = time.monotonic() - started
    return {
        "summary": report.summary(),
        "elapsed_s": elapsed,
        "runs": [
            {
                "session_id": r.session_id,
                "data_id": r.data_id,
                "group_id": r.group_id,
                "status": r.status,
                "reward": r.reward,
                "error": r.error,
                "timed_out": r.timed_out,
                "node_id": r.node_id,
            }
            for r in report.runs
        ],
    }


async def node_loss(proxy: Any, cluster: Any, victim: Any, runs: int) -> dict[str, Any]:
    """``runs`` slow runs over every slot of the cluster; one worker node is removed mid-run."""
    from proxima.trainer.rollout.controller import RolloutController

    controller = RolloutController(
        proxy.url,
        proxy.admin_token,
        "ray_cluster_driver:agent",
        mode="ray",
        max_concurrency=CPUS_PER_NODE * (WORKER_NODES + 1),
        timeout_s=60.0,
        model=proxy.model_name,
        group_tag="node-loss",
    )
    markers = Path(tempfile.mkdtemp(prefix="pxmark-"))
    dataset = [
        {"id": f"slow-{i}", "question": "hi", "n": i, "kind": "slow", "marker_dir": str(markers)}
        for i in range(runs)
    ]
    rollout = asyncio.create_task(controller.run(dataset))
    # Every slot (one CPU of every node each) holds a sleeping agent: then the victim's raylet
    # and workers are killed, with the runs it holds.
    deadline = time.monotonic() + 120
    while len(list(markers.iterdir())) < controller.max_concurrency:
        assert time.monotonic() < deadline, "the node-loss runs never all started"
        await asyncio.sleep(0.1)
    await asyncio.to_thread(cluster.remove_node, victim)
    (markers / "release").touch()
    report = await rollout
    shutil.rmtree(markers, ignore_errors=True)
    return {
        "summary": report.summary(),
        "victim": victim.node_id,
        "runs": [
            {
                "session_id": r.session_id,
                "status": r.status,
                "error": r.error,
                "node_id": r.node_id,
            }
            for r in report.runs
        ],
    }


def loopback_only() -> None:
    """Bring ``lo`` up in this fresh network namespace, and check it is the only interface.

    An ioctl rather than ``ip link set lo up``: no iproute2 needed.
    """
    assert socket.if_nameindex() == [(1, "lo")], (
        f"not a loopback-only netns: {socket.if_nameindex()}"
    )
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def main() -> int:
    model_dir, out_path, runs = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    loopback_only()
    import ray
    from proxima.proxy.testing.live import LiveProxy
    from ray.cluster_utils import Cluster

    work = Path(tempfile.mkdtemp(prefix="pxray-"))  # short: Ray's socket paths must fit 107 bytes
    os.environ["RAY_TMPDIR"] = str(work)  # this run's sessions, logs and sockets; not /tmp/ray
    started = time.monotonic()
    proxy = LiveProxy(
        model_dir,
        db_url=f"sqlite:///{work / 'store.db'}",
        log_path=out_path.with_suffix(".serve.log"),
        # The address agents are handed differs from the controller's (127.0.0.1): they must
        # use the session's base_url, as sandboxes behind another name would.
        env={"PROXIMA_PUBLIC_BASE_URL": "http://localhost:{port}/v1"},
    )
    proxy.env["PROXIMA_PUBLIC_BASE_URL"] = proxy.env["PROXIMA_PUBLIC_BASE_URL"].format(
        port=proxy.port
    )
    proxy.start()
    proxy_up = time.monotonic() - started
    node_args = {
        "num_cpus": CPUS_PER_NODE,
        "object_store_memory": 80 * 1024**2,
        # The only interface of this network namespace (Ray would guess from the hostname).
        "node_ip_address": "127.0.0.1",
    }
    cluster = Cluster(
        initialize_head=True, head_node_args={**node_args, "include_dashboard": False}
    )
    try:
        workers = [cluster.add_node(**node_args) for _ in range(WORKER_NODES)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        cluster_up = time.monotonic() - started - proxy_up
        nodes = {
            n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]
        }  # id -> address
        result = asyncio.run(rollout(proxy, runs, group_size=2))
        loss = asyncio.run(node_loss(proxy, cluster, workers[-1], runs=NODE_LOSS_RUNS))
        result["node_loss"] = loss
        result["trajectories"] = {
            r["session_id"]: proxy.trajectory(r["session_id"])
            for r in result["runs"] + loss["runs"]
        }
        result.update(
            nodes=nodes,
            proxy_base_url=proxy.env["PROXIMA_PUBLIC_BASE_URL"],
            proxy_up_s=proxy_up,
            cluster_up_s=cluster_up,
        )
        out_path.write_text(json.dumps(result))
    finally:
        ray.shutdown()
        cluster.shutdown()
        proxy.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
