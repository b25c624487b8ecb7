"""Load: N concurrent agent sessions of several turns each, through one proxy.

Every session is what a training rollout does: open a session (admin token),
hold a multi-turn chat with its key (each turn extends the last reply, so the
proxy reuses the session's tokens), then finish it. The backend is the fake
SGLang server (``proxima.proxy.testing.fake_sglang``) decoding at a fixed rate per
request, so the figures measure the proxy (auth, rendering, routing,
streaming, group-committed recording in SQLite), not a model. Everything
runs on 127.0.0.1 and the whole run is bounded by ``--time-limit``.

Prints one table: completions/s, generated tokens/s, completion latency
p50/p95/p99, errors (target 0), completions recorded in the store, and the
proxy's resident memory (VmRSS) before and after.

    .venv/bin/python bench/load.py                       # 1,000 sessions x 3 turns
    .venv/bin/python bench/load.py --sessions 200 --tokens-per-s 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proxima.proxy.serving import free_port  # noqa: E402
from proxima.proxy.testing.live import LiveProxy  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_model  # noqa: E402


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)  # seconds, one per completed turn
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    sessions_done: int = 0

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


async def chat_turn(
    http: httpx.AsyncClient,
    proxy: LiveProxy,
    key: str,
    messages: list[dict],
    max_tokens: int,
    stream: bool,
) -> tuple[str, int]:
    """One completion; returns the assistant's text and its token count."""
    body = {
        "model": proxy.model_name,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {key}"}
    if not stream:
        resp = await http.post(proxy.base_url + "/chat/completions", json=body, headers=headers)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}")
        data = resp.json()
        return data["choices"][0]["message"]["content"] or "", data["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    text, done, n_tokens = [], False, 0
    async with http.stream(
        "POST", proxy.base_url + "/chat/completions", json=body, headers=headers
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error {event['error'].get('type')}")
            for choice in event.get("choices", []):
                text.append(choice["delta"].get("content") or "")
            if event.get("usage"):
                n_tokens = event["usage"]["completion_tokens"]
    if not done:
        raise RuntimeError("stream cut")
    return "".join(text), n_tokens


async def run_session(
    i: int,
    http: httpx.AsyncClient,
    proxy: LiveProxy,
    args: argparse.Namespace,
    tally: Tally,
    start: asyncio.Event,
) -> None:
    await start.wait()
    step = "create"
    try:
        resp = await http.post(
            proxy.url + "/rl/sessions",
            json={"group_id": f"g{i % 64}"},
            headers=proxy.admin_headers(),
        )
        if resp.status_code != 200:
            tally.error(f"create session HTTP {resp.status_code}")
            return
        s = resp.json()
        messages: list[dict] = []
        for turn in range(args.turns):
            step = f"turn {turn}"
            messages.append({"role": "user", "content": f"Session {i}, turn {turn}: continue."})
            t0 = time.perf_counter()
            reply, n = await chat_turn(
                http, proxy, s["api_key"], messages, args.max_tokens, stream=turn % 2 == 1
            )
            tally.latencies.append(time.perf_counter() - t0)
            tally.tokens += n
            messages.append({"role": "assistant", "content": reply})
        step = "finish"
        resp = await http.post(
            f"{proxy.url}/rl/sessions/{s['session_id']}/finish",
            headers={"Authorization": f"Bearer {s['api_key']}"},
        )
        if resp.status_code != 200:
            tally.error(f"finish HTTP {resp.status_code}")
            return
        tally.sessions_done += 1
    except (httpx.HTTPError, RuntimeError) as exc:
        tally.error(
            f"{step}: " + (type(exc).__name__ if isinstance(exc, httpx.HTTPError) else str(exc))
        )


def start_fake(port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxima.proxy.testing.fake_sglang",
            "--port",
            str(port),
            "--tokens-per-s",
            str(args.tokens_per_s),
            "--chunk-tokens",
            str(args.chunk_tokens),
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("fake backend did not start")


async def drive(proxy: LiveProxy, args: argparse.Namespace) -> tuple[Tally, float, bool]:
    tally = Tally()
    limits = httpx.Limits(
        max_connections=args.sessions + 16,
        max_keepalive_connections=args.sessions + 16,
        keepalive_expiry=args.client_keepalive_s,
    )
    timeout = httpx.Timeout(args.time_limit, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        start = asyncio.Event()
        tasks = [
            asyncio.create_task(run_session(i, http, proxy, args, tally, start))
            for i in range(args.sessions)
        ]
        t0 = time.perf_counter()
        start.set()
        done, pending = await asyncio.wait(tasks, timeout=args.time_limit)
        elapsed = time.perf_counter() - t0
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return tally, elapsed, not pending


def recorded_completions(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM completions").fetchone()[0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=1000, help="concurrent sessions (default 1000)")
    p.add_argument("--turns", type=int, default=3, help="chat turns per session (default 3)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (default 32)")
    p.add_argument(
        "--tokens-per-s",
        type=float,
        default=200.0,
        help="fake backend decode rate per request (default 200; 0 = unthrottled)",
    )
    p.add_argument("--chunk-tokens", type=int, default=1, help="tokens per backend stream chunk")
    p.add_argument(
        "--client-keepalive-s",
        type=float,
        default=5.0,
        help="client keep-alive expiry (default 5, as httpx and the OpenAI SDK)",
    )
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole load")
    p.add_argument("--work-dir", type=Path, default=None, help="keep the store and logs here")
    args = p.parse_args()

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="proxima-load-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(work / "tiny-qwen2")
    fake_port = free_port()
    fake = start_fake(fake_port, args, work / "fake.log")
    db = work / "store.db"
    proxy = LiveProxy(
        model,
        db_url=f"sqlite:///{db}",
        log_path=work / "serve.log",
        extra_args=["--backend", f"http://127.0.0.1:{fake_port}"],
        env={"PROXIMA_MAX_OPEN_SESSIONS": str(max(1024, args.sessions))},
    )
    try:
        proxy.start()
        assert proxy.proc is not None
        rss_before = rss_kib(proxy.proc.pid)
        cpu_before = (cpu_s(proxy.proc.pid), cpu_s(fake.pid), time.process_time())
        tally, elapsed, finished = asyncio.run(drive(proxy, args))
        rss_after = rss_kib(proxy.proc.pid)
        cpu = [
            after - before
            for before, after in zip(
                cpu_before,
                (cpu_s(proxy.proc.pid), cpu_s(fake.pid), time.process_time()),
                strict=True,
            )
        ]
        stored = recorded_completions(db)
    finally:
        proxy.stop()
        fake.terminate()
        fake.wait(15)

    completions = len(tally.latencies)
    expected = args.sessions * args.turns
    errors = sum(tally.errors.values())
    rows = [
        (
            "sessions x turns",
            f"{args.sessions} x {args.turns} ({args.max_tokens} tokens each, "
            f"backend {args.tokens_per_s:g} tok/s/request)",
        ),
        (
            "wall time",
            f"{elapsed:.1f} s" + ("" if finished else f" (time limit hit: {args.time_limit:g} s)"),
        ),
        ("completions", f"{completions} / {expected}"),
        ("completions/s", f"{completions / elapsed:.1f}"),
        ("generated tokens/s", f"{tally.tokens / elapsed:.0f}"),
        (
            "latency p50 / p95 / p99",
            f"{pct(tally.latencies, 0.50):.0f} / {pct(tally.latencies, 0.95):.0f} / "
            f"{pct(tally.latencies, 0.99):.0f} ms",
        ),
        ("errors", f"{errors}" + (f" {tally.errors}" if errors else "")),
        ("sessions finished", f"{tally.sessions_done} / {args.sessions}"),
        ("completions in store", f"{stored}"),
        ("proxy RSS before / after", f"{rss_before / 1024:.0f} / {rss_after / 1024:.0f} MiB"),
        (
            "CPU s: proxy / backend / client",
            f"{cpu[0]:.1f} / {cpu[1]:.1f} / {cpu[2]:.1f} ({os.cpu_count()} cores)",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"\nbench/load.py  (work dir {work})")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    ok = finished and errors == 0 and completions == expected == stored
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
