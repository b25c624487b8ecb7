"""Fleet: 1 and 3 proxy replicas on one PostgreSQL, two fake backends, HAProxy in front.

For each replica count, on a fresh database: N concurrent multi-turn agents
(each opens a session through the load balancer, then holds a chat of
``--turns`` turns; half send every turn through the load balancer, whose
affinity keeps a session on one replica, the other half rotate their turns
over the replicas by hand, the worst case for a replica's history cache).
Then 90 concurrent session creates spread over the replicas against a known
remaining capacity, and a weight push through the first replica.

Prints, side by side for 1 and 3 replicas:

- completions/s of the agents' turns (wall clock);
- proxy CPU per completion (user + system time of every replica process,
  from /proc, over the agents' run): what scales with replicas. On a 2-core
  machine the replicas, HAProxy, PostgreSQL, the backends and this driver share
  two cores, so completions/s cannot grow with replicas here;
- turns reused token-exactly: the share of turns after the first whose
  stored prompt begins with the previous turn's prompt and output and whose
  parent is that turn (100% is the requirement, rotating turns included);
- admission exactness: sessions admitted by 90 concurrent creates over the
  replicas against the remaining capacity (must be equal);
- push reach: seconds from the push's answer until every replica reports
  the version (its backends included).

    .venv/bin/python bench/fleet.py                 # 48 agents x 4 turns
    .venv/bin/python bench/fleet.py --agents 96 --turns 6
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proxima.proxy.server_process import ProxyProcess  # noqa: E402
from proxima.proxy.store import Store, ensure_schema  # noqa: E402
from proxima.proxy.testing.haproxy import HAProxyProcess  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_model  # noqa: E402

from tests.pg import PostgresCluster, find_pg_bin  # noqa: E402
from tests.production.procs import BackendProcess  # noqa: E402

ADMIN_TOKEN = "bench-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ADMISSION_CREATES = 90
ADMISSION_ROOM = 40  # capacity left for the admission race after the agents' sessions


@dataclass
class Result:
    replicas: int
    completions: int
    seconds: float
    cpu_seconds: float
    reused: int
    reusable: int
    errors: int
    admitted: int
    room: int
    push_reach_s: float

    @property
    def rate(self) -> float:
        return self.completions / self.seconds

    @property
    def cpu_ms_per_completion(self) -> float:
        return 1e3 * self.cpu_seconds / max(self.completions, 1)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _agent(
    client: httpx.AsyncClient, lb: str, turn_urls: list[str], turns: int, args: argparse.Namespace
) -> str:
    resp = await client.post(lb + "/rl/sessions", json={}, headers=ADMIN)
    resp.raise_for_status()
    session = resp.json()
    key = {"Authorization": f"Bearer {session['api_key']}"}
    messages: list[dict[str, Any]] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"step {i}: what next?"})
        url = turn_urls[i % len(turn_urls)]
        body = {"model": args.model_name, "messages": messages, "max_tokens": args.max_tokens}
        resp = await client.post(url + "/v1/chat/completions", json=body, headers=key)
        resp.raise_for_status()
        messages.append(resp.json()["choices"][0]["message"])
    resp = await client.post(f"{lb}/rl/sessions/{session['session_id']}/finish", headers=ADMIN)
    resp.raise_for_status()
    return str(session["session_id"])


async def _agents(lb: str, replicas: list[str], args: argparse.Namespace) -> tuple[list[str], int]:
    limits = httpx.Limits(max_connections=args.agents * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        jobs = [
            _agent(client, lb, [lb] if i % 2 == 0 else replicas, args.turns, args)
            for i in range(args.agents)
        ]
        done = await asyncio.gather(*jobs, return_exceptions=True)
    sessions = [s for s in done if isinstance(s, str)]
    for error in (e for e in done if isinstance(e, BaseException)):
        print(f"  agent failed: {error!r}", file=sys.stderr)
    return sessions, len(done) - len(sessions)


async def _reuse(db_url: str, sessions: list[str]) -> tuple[int, int]:
    store = await Store.open(db_url)
    reused = reusable = 0
    try:
        for sid in sessions:
            completions = await store.list_completions(session_id=sid)
            for prev, nxt in zip(completions, completions[1:], strict=False):
                reusable += 1
                exact = prev.prompt_ids + prev.output_ids
                reused += nxt.parent_id == prev.id and nxt.prompt_ids[: len(exact)] == exact
    finally:
        await store.close()
    return reused, reusable


def _admission(replicas: list[str]) -> int:
    def create(i: int) -> int:
        url = replicas[i % len(replicas)]
        return httpx.post(url + "/rl/sessions", json={}, headers=ADMIN, timeout=120).status_code

    with ThreadPoolExecutor(30) as pool:
        codes = list(pool.map(create, range(ADMISSION_CREATES)))
    unexpected = [c for c in codes if c not in (200, 429)]
    if unexpected:
        print(f"  admission: unexpected statuses {unexpected}", file=sys.stderr)
    return codes.count(200)


def _push_reach(replicas: list[str], version: int) -> float:
    resp = httpx.post(
        replicas[0] + "/admin/weights",
        json={"version": version, "path": f"/weights/v{version}"},
        headers=ADMIN,
        timeout=120,
    )
    resp.raise_for_status()
    pushed = time.monotonic()
    waiting = set(replicas)
    while waiting and time.monotonic() - pushed < 30:
        for url in list(waiting):
            health = httpx.get(url + "/health", timeout=10).json()
            if health["version"] == version and all(
                b["healthy"] and b["version"] == version for b in health["backends"]
            ):
                waiting.discard(url)
        time.sleep(0.01)
    return time.monotonic() - pushed if not waiting else float("inf")


def run_fleet(
    n: int, cluster: PostgresCluster, backends: list[BackendProcess], args: argparse.Namespace
) -> Result:
    db_url = cluster.url(cluster.create_database())
    asyncio.run(ensure_schema(db_url))
    replicas = [
        ProxyProcess(
            args.model_dir,
            db_url=db_url,
            admin_token=ADMIN_TOKEN,
            log_path=args.work / f"replicas{n}-{i}.log",
            extra_args=[
                *(arg for b in backends for arg in ("--backend", b.url)),
                "--max-staleness",
                "0",
                "--train-batch-size",
                str(args.agents + ADMISSION_ROOM),
            ],
        )  # fmt: skip
        for i in range(n)
    ]
    lb = HAProxyProcess([f"127.0.0.1:{r.port}" for r in replicas])
    try:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda r: r.start(), replicas))
        lb.start()
        urls = [r.url for r in replicas]
        pids = [r.proc.pid for r in replicas if r.proc is not None]
        cpu_before = sum(_cpu_seconds(p) for p in pids)
        started = time.perf_counter()
        sessions, errors = asyncio.run(_agents(lb.url, urls, args))
        seconds = time.perf_counter() - started
        cpu = sum(_cpu_seconds(p) for p in pids) - cpu_before
        reused, reusable = asyncio.run(_reuse(db_url, sessions))
        admitted = _admission(urls)
        reach = _push_reach(urls, 1)
        return Result(
            replicas=n,
            completions=len(sessions) * args.turns,
            seconds=seconds,
            cpu_seconds=cpu,
            reused=reused,
            reusable=reusable,
            errors=errors,
            admitted=admitted,
            room=ADMISSION_ROOM + args.agents - len(sessions),
            push_reach_s=reach,
        )
    finally:
        lb.stop()
        for replica in replicas:
            replica.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--agents", type=int, default=48)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tokens-per-s", type=float, default=200.0, help="per request, fake backends")
    p.add_argument("--replicas", default="1,3", help="replica counts to run, comma-separated")
    args = p.parse_args()
    pg_bin = find_pg_bin()
    if pg_bin is None:
        sys.exit("PostgreSQL server binaries not found: make postgres")
    args.work = Path(tempfile.mkdtemp(prefix="proxima-fleet-bench-"))
    args.model_dir = build_tiny_model(args.work / "tiny-qwen2")
    args.model_name = args.model_dir.name
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    cluster = PostgresCluster.start(pg_bin)
    backends = [
        BackendProcess.fake(
            tokens_per_s=args.tokens_per_s, chunk_tokens=4, log_path=args.work / f"backend{i}.log"
        )
        for i in range(2)
    ]
    results = []
    try:
        for backend in backends:
            backend.start()
        for n in (int(x) for x in args.replicas.split(",")):
            results.append(run_fleet(n, cluster, backends, args))
            for backend in backends:  # the next fleet starts from the base weights again
                backend.stop()
                backend.start()
    finally:
        for backend in backends:
            backend.stop()
        cluster.stop()

    print(
        f"\nfleet: {args.agents} agents x {args.turns} turns, 2 fake backends "
        f"({args.tokens_per_s:g} tok/s per request, {args.max_tokens} tokens a turn), "
        f"HAProxy, PostgreSQL 15; commit {commit}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'replicas':>8} {'compl/s':>8} {'CPU ms/compl':>13} {'reused exactly':>15} "
        f"{'errors':>6} {'admitted/room':>14} {'push reach s':>12}"
    )
    for r in results:
        print(
            f"{r.replicas:>8} {r.rate:>8.1f} {r.cpu_ms_per_completion:>13.2f} "
            f"{f'{r.reused}/{r.reusable}':>15} {r.errors:>6} "
            f"{f'{r.admitted}/{r.room}':>14} {r.push_reach_s:>12.3f}"
        )
    if len(results) >= 2:
        first, last = results[0], results[-1]
        print(
            f"ratios {last.replicas} vs {first.replicas} replicas: completions/s "
            f"{last.rate / first.rate:.2f}x, CPU per completion "
            f"{last.cpu_ms_per_completion / first.cpu_ms_per_completion:.2f}x"
        )


if __name__ == "__main__":
    main()
