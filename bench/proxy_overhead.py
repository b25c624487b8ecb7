"""Proxy overhead, side by side in one run: direct, a bare relay, Proxima, and LiteLLM's proxy.

Every arm streams the same fake tokens from one backend process (``--backends N``: N of
them, taken in turn by direct and the relay, routed over by Proxima)
(``bench/_bench_backend.py``: the fake SGLang server in incremental streaming mode,
plus an OpenAI chat route for gateways that speak only OpenAI):

- ``direct``: the client reads SGLang's ``/generate`` stream itself;
- ``relay``: through ``bench/_relay.py``, a TCP pass-through in a few lines of asyncio,
  the floor of any Python proxy on this machine;
- ``proxima``: ``/v1/chat/completions`` through ``proxima serve --backend``: auth,
  chat template, routing, re-encoding as OpenAI chunks, and every completion
  recorded durably in SQLite before its response ends; with ``--workers N`` also
  ``proxima xN``, the same proxy as N worker processes on one port (``proxima serve
  --workers N``), the run ending with its req/s beside the one process's;
- ``direct-openai`` and ``litellm``: the backend's OpenAI route straight, and through
  LiteLLM's proxy (``litellm[proxy]`` in its own venv under ``.cache/bench``, made on
  first use; master key, no database, nothing recorded).

For each arm and stream length (``--tokens``, repeatable: 16 and 256 by default):
sequential latency p50/p95 and what it adds to its direct baseline, throughput at
``--concurrency`` streams and its ratio to direct, and the CPU time client, backend and
middle process (with its children: ``--workers``) spend per request; across the lengths,
the CPU each spends per streamed token (the slope between the shortest and the longest).
The arms and lengths run in interleaved rounds, so a slow spell of the machine falls on
all of them. Client, backend and each proxy are separate processes; the host's CPU and
load are printed so the reader sees what limited it. Ends with
``proxy overhead: sequential added p50 X ms; throughput ratio R16; 256 tokens R256;
per-token CPU proxima U us vs relay V us`` (Proxima vs direct; U and V the proxy's and
the relay's CPU per streamed token).

``--tokens-per-s R`` paces the backend (each stream R tokens a second): at a rate the proxy
keeps up with, each token is an event of its own, as on a GPU, and the CPU per token is
the cost of one event. ``--ab REF`` adds the arm ``proxima@REF``: the same proxy at git commit REF (its sources
extracted under the run's folder, ``bench/_code_at.py``), for an A/B of a change in one
run. Every round's figures go to a JSON-lines file (``--jsonl``; by default
one ``proxy_overhead-TIME.jsonl`` file a run in ``bench/results/``), with the summary
as its last line.

    .venv/bin/python bench/proxy_overhead.py            # 3 rounds of 100 sequential + 1000 at 200
    .venv/bin/python bench/proxy_overhead.py --no-litellm --ab HEAD   # the working tree vs HEAD
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _code_at import code_at, code_env  # noqa: E402
from _overhead_report import ArmResult, report  # noqa: E402
from proxima.proxy.backends.wire import WirePool  # noqa: E402
from proxima.proxy.serving import free_port  # noqa: E402
from proxima.proxy.testing.live import LiveProxy  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_model  # noqa: E402

PROMPT_IDS = list(range(20))
LITELLM_VENV = ROOT / ".cache" / "bench" / "litellm-venv"
LITELLM_KEY = "sk-bench-master"

Request = Callable[[int], Awaitable[float]]


class Client:
    """The load generator: one keep-alive HTTP/1.1 connection per stream in flight.

    ``wire`` (the default) is the proxy's own lean client (``WirePool``): on 2 cores
    the load generator shares the CPU with what it measures, and httpx spends
    more per streamed request than the proxy does, so with it the client is what
    saturates first and every arm's throughput is the client's. ``httpx`` reads
    as the OpenAI SDK does (line by line), for comparison.
    """

    def __init__(self, kind: str, concurrency: int):
        self.kind = kind
        self.concurrency = concurrency
        self.pools: dict[str, WirePool] = {}
        self.clients: dict[str, httpx.AsyncClient] = {}  # one per server: its own connections
        self.http = self._httpx()  # set-up calls
        self.events = 0  # server-sent data events read, every stream together

    def _httpx(self) -> httpx.AsyncClient:
        n = self.concurrency + 10
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        return httpx.AsyncClient(timeout=300, limits=limits)

    async def stream(self, url: str, body: dict, headers: dict) -> float:
        """One streamed request read to its end (past ``[DONE]``); its latency in seconds."""
        parts = urlsplit(url)
        base, path = f"{parts.scheme}://{parts.netloc}", parts.path
        if self.kind == "httpx":
            # A client per server, as for the wire pools: one shared pool's limit would make
            # each round close the other arms' connections and open its own again.
            http = self.clients.get(base)
            if http is None:
                http = self.clients[base] = self._httpx()
            latency, events = await _read_stream(http, url, body, headers)
            self.events += events
            return latency
        pool = self.pools.get(base)
        if pool is None:
            pool = self.pools[base] = WirePool(base, max_connections=self.concurrency + 10)
        payload = orjson.dumps(body)
        t0 = time.perf_counter()
        async with await pool.post(path, payload, headers) as resp:
            data = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {data[:200]!r}")
        if data.find(b"data: [DONE]") < 0:
            raise RuntimeError(f"{url}: the stream ended without [DONE]")
        self.events += data.count(b"data:") - 1
        return time.perf_counter() - t0

    async def aclose(self) -> None:
        for http in [self.http, *self.clients.values()]:
            await http.aclose()
        for pool in self.pools.values():
            pool.close()


async def _read_stream(
    http: httpx.AsyncClient, url: str, body: dict, headers: dict
) -> tuple[float, int]:
    """One stream through httpx: its latency, and its data events before ``[DONE]``."""
    t0 = time.perf_counter()
    events = 0
    async with http.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url} answered {resp.status_code}: {await resp.aread()!r}")
        # Read to the end of the body, as the OpenAI SDK does after [DONE]: leaving it
        # unread makes httpx close the connection, and every request would pay a new one.
        done = False
        async for line in resp.aiter_lines():
            done = done or line == "data: [DONE]"
            events += line.startswith("data:") and not done
        if not done:
            raise RuntimeError(f"{url}: the stream ended without [DONE]")
    return time.perf_counter() - t0, events


def generate_arm(client: Client, urls: list[str], tokens: int) -> Request:
    """SGLang's ``/generate`` straight, the requests taking ``urls`` in turn."""
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    return lambda i: client.stream(urls[i % len(urls)] + "/generate", body, {})


def chat_arm(client: Client, base: str, keys: list[str], model: str, tokens: int) -> Request:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    return lambda i: client.stream(
        base + "/chat/completions", body, {"Authorization": f"Bearer {keys[i % len(keys)]}"}
    )


async def session_keys(client: Client, proxy: LiveProxy, n: int) -> list[str]:
    """The API keys of ``n`` new sessions on ``proxy`` (its admin creates them)."""
    keys = []
    for _ in range(n):
        r = await client.http.post(
            proxy.url + "/rl/sessions", json={}, headers=proxy.admin_headers()
        )
        keys.append(r.json()["api_key"])
    return keys


async def run_load(fn: Request, jobs: int, concurrency: int) -> tuple[list[float], float]:
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            latencies.append(await fn(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(jobs)))
    return latencies, time.perf_counter() - t0


def _cpu_seconds(procs: list[psutil.Process], *, children: bool = True) -> float:
    """User+system CPU seconds of ``procs`` (a role's processes: every backend) and, with
    ``children``, their children (a proxy's workers; not the bench's own process, whose
    children are every server it measures)."""
    total = 0.0
    for proc in procs:
        total += sum(proc.cpu_times()[:2])
        for child in proc.children(recursive=True) if children else []:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += sum(child.cpu_times()[:2])
    return total


async def measure(
    result: ArmResult,
    fn: Request,
    args: argparse.Namespace,
    procs: dict[str, list[psutil.Process]],
    round_no: int,
    client: Client,
) -> dict[str, Any]:
    """One round of an arm: sequential requests, then ``--requests`` at ``--concurrency``;
    returns the round's record for the raw results."""
    seq, _ = await run_load(fn, args.sequential, 1)
    before = {role: _cpu_seconds(p, children=role != "client") for role, p in procs.items()}
    host0 = psutil.cpu_times()
    events0 = client.events
    _, wall = await run_load(fn, args.requests, args.concurrency)
    host1 = psutil.cpu_times()
    result.events += client.events - events0
    cpu = {
        role: _cpu_seconds(p, children=role != "client") - before[role] for role, p in procs.items()
    }
    for role, seconds in cpu.items():
        result.cpu_seconds[role] = result.cpu_seconds.get(role, 0.0) + seconds
    idle = (host1.idle + host1.iowait) - (host0.idle + host0.iowait)
    result.sequential += seq
    result.throughputs.append(args.requests / wall)
    result.requests += args.requests
    result.host_busy.append(1 - idle / (sum(host1) - sum(host0)))
    print(
        f"  {result.name} ({result.tokens} tokens): {args.requests / wall:.0f} req/s",
        file=sys.stderr,
        flush=True,
    )
    return result.round_record(round_no, seq, cpu)


def ensure_litellm() -> Path | None:
    exe = LITELLM_VENV / "bin" / "litellm"
    if exe.exists():
        return exe
    print(
        "installing litellm[proxy] into .cache/bench/litellm-venv (first run only)", file=sys.stderr
    )
    try:
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run(
            [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True
        )
    except subprocess.CalledProcessError as exc:
        print(f"litellm unavailable ({exc}); its arm is skipped", file=sys.stderr)
        return None
    return exe


def start_litellm(exe: Path, work: Path, backend_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = work / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: fake\n"
        "    litellm_params:\n"
        "      model: openai/fake\n"
        f"      api_base: {backend_url}/v1\n"
        "      api_key: sk-fake\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_KEY}\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    proc = subprocess.Popen(
        [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
        stdout=open(work / "litellm.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env=env,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_http(
    url: str, proc: subprocess.Popen, timeout: float, headers: dict | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def host_line() -> str:
    model = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"host: {model}, {os.cpu_count()} cores, load average {load} (1/5/15 min) at start"


@dataclass
class ProxyArm:
    """A ``proxima serve`` under test: the working tree's (``proxima``) or a commit's."""

    name: str
    proxy: LiveProxy
    db: Path
    keys: list[str] = field(default_factory=list)

    def rows(self) -> int:
        with sqlite3.connect(self.db) as conn:
            count: int = conn.execute("select count(*) from completions").fetchone()[0]
        return count


def start_proxies(
    args: argparse.Namespace, work: Path, model: Path, backend_urls: list[str]
) -> list[ProxyArm]:
    """The Proxima arms: the working tree's in one process, with ``--workers N`` the same
    tree as N worker processes on one port, and with ``--ab`` the code at that commit."""
    specs: list[tuple[str, dict[str, str], list[str]]] = [("proxima", {}, [])]
    if args.workers:
        specs.append((f"proxima x{args.workers}", {}, ["--workers", str(args.workers)]))
    if args.ab:
        path, commit = code_at(args.ab, work / "code")
        specs.append((f"proxima@{commit}", code_env(path), []))
    arms = []
    for i, (name, env, extra) in enumerate(specs):
        serve_args = [*(a for url in backend_urls for a in ("--backend", url)), *extra]
        db = work / f"store{i}.db"
        proxy = LiveProxy(
            model, db_url=f"sqlite:///{db}", extra_args=serve_args, env=env,
            log_path=work / f"serve{i}.log",
        )  # fmt: skip
        arms.append(ProxyArm(name, proxy, db))
        proxy.start()
    return arms


def git_commit() -> str:
    """The commit measured: git's, or ``BENCH_COMMIT`` where the tree was copied without its
    git folder (a machine the bench was sent to)."""
    with contextlib.suppress(OSError):
        out = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return os.environ.get("BENCH_COMMIT", "?")


async def main_async(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="proxima-bench-"))
    print(host_line())
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path = (
        Path(args.jsonl)
        if args.jsonl
        else ROOT / "bench" / "results" / (f"proxy_overhead-{stamp}.jsonl")
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = [
        {"kind": "run", "host": host_line(), "commit": git_commit(), "time": stamp,
         "args": vars(args)}
    ]  # fmt: skip
    model = build_tiny_model(work / "tiny")
    ports, relay_port = [free_port() for _ in range(args.backends)], free_port()
    procs: list[subprocess.Popen] = []
    backends = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench" / "_bench_backend.py"),
                "--port",
                str(port),
                "--tokens-per-s",
                str(args.tokens_per_s),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    procs += backends
    backend_urls = [f"http://127.0.0.1:{port}" for port in ports]
    backend_url = backend_urls[0]  # LiteLLM's
    relay = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "_relay.py"), "--port", str(relay_port),
         *(a for port in ports for a in ("--backend-port", str(port)))],
    )  # fmt: skip
    procs.append(relay)
    proxies: list[ProxyArm] = []
    litellm_url = None
    try:
        for url, backend in zip(backend_urls, backends, strict=True):
            wait_http(url + "/model_info", backend, 60)
        proxies = start_proxies(args, work, model, backend_urls)
        exe = None if args.no_litellm else ensure_litellm()
        if exe is not None:
            lite, litellm_url = start_litellm(exe, work, backend_url)
            procs.append(lite)
            wait_http(litellm_url + "/health/liveliness", lite, 180)
        client = Client(args.client, args.concurrency)
        try:
            for arm in proxies:
                arm.keys += await session_keys(client, arm.proxy, args.sessions)
            rows_before = sum(arm.rows() for arm in proxies)
            ps = psutil.Process
            ends = {"client": [ps()], "backend": [ps(b.pid) for b in backends]}
            lengths = sorted(set(args.tokens))
            arms: dict[int, list[tuple[str, Request, psutil.Process | None, str | None]]] = {}
            for n in lengths:
                arms[n] = [
                    ("direct", generate_arm(client, backend_urls, n), None, None),
                    ("relay", generate_arm(client, [f"http://127.0.0.1:{relay_port}"], n),
                     ps(relay.pid), "direct"),
                ]  # fmt: skip
                for arm in proxies:
                    assert arm.proxy.proc is not None
                    fn = chat_arm(client, arm.proxy.base_url, arm.keys, arm.proxy.model_name, n)
                    arms[n].append((arm.name, fn, ps(arm.proxy.proc.pid), "direct"))
                if litellm_url:
                    arms[n] += [
                        ("direct-openai", chat_arm(client, backend_url + "/v1", ["x"], "fake", n),
                         None, None),
                        ("litellm", chat_arm(client, litellm_url + "/v1", [LITELLM_KEY], "fake", n),
                         ps(procs[-1].pid), "direct-openai"),
                    ]  # fmt: skip
            results = {n: [ArmResult(a[0], a[3], n) for a in arms[n]] for n in lengths}
            for n in lengths:
                for _, fn, _, _ in arms[n]:
                    await run_load(fn, 20, 4)  # warm-up: connections, caches
            # Rounds interleave the arms and lengths, so a slow spell of the machine (this
            # is a VM) falls on every arm alike instead of on whichever ran at the time.
            for r in range(args.rounds):
                print(f"round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
                for n in lengths:
                    for result, (_, fn, p, _) in zip(results[n], arms[n], strict=True):
                        roles = {**ends, **({"middle": [p]} if p else {})}
                        records.append(await measure(result, fn, args, roles, r + 1, client))
        finally:
            await client.aclose()
        recorded = sum(arm.rows() for arm in proxies) - rows_before
    finally:
        for arm in proxies:
            arm.proxy.stop()
        for p in procs:
            p.terminate()
    per_round = (args.sequential + args.requests) * args.rounds + 20
    expected = per_round * len(lengths) * len(proxies)
    records.append(report(results, args, recorded, expected))
    out_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"raw results: {out_path}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--requests", type=int, default=1000, help="concurrent requests per round")
    p.add_argument("--sequential", type=int, default=100, help="sequential requests per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every arm once")
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument(
        "--tokens",
        type=int,
        action="append",
        help="streamed tokens per request; repeat for several lengths (default: 16 and 256)",
    )
    p.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM arm")
    p.add_argument(
        "--client",
        choices=["wire", "httpx"],
        default="wire",
        help="the load generator's HTTP client (see Client)",
    )
    p.add_argument("--ab", metavar="REF", help="add the arm proxima@REF: Proxima at that commit")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="add the arm 'proxima xN': the working tree's proxy as proxima serve --workers N, "
        "beside its one process (the arm 'proxima'); the run ends with their req/s side by side",
    )
    p.add_argument(
        "--backends",
        type=int,
        default=1,
        help="fake backend processes (one a core): direct and the relay take them in turn, "
        "Proxima routes over all of them. With several, a proxy process rather than the one "
        "backend is what bounds the throughput, so --workers shows what a worker adds",
    )
    p.add_argument(
        "--tokens-per-s",
        type=float,
        default=0.0,
        help="each stream's decode rate at the backend (0: as fast as it can). At a rate the "
        "proxy keeps up with, every token arrives in a read of its own, as a GPU's decode "
        "steps come: the CPU per token is then the cost of one event (throughput ratios "
        "mean little: the rate bounds every arm)",
    )
    p.add_argument("--jsonl", help="the raw results' file (default: bench/results/...)")
    args = p.parse_args()
    args.tokens = args.tokens or [16, 256]
    import uvloop  # the client's loop is the proxy's (uvloop), so neither is handicapped

    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
