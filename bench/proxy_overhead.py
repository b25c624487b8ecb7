"""Proxy overhead: the same load sent straight to a fast SGLang-protocol backend and through the proxy.

The backend is ``proxima.proxy.testing.fake_sglang`` (no model: tokens as fast as the
protocol allows), so the difference is the proxy: auth, prompt rendering,
routing, streaming re-encoding and recording every completion in SQLite.

Prints, side by side: per-request latency p50/p95 (direct vs proxy, and the
difference) for sequential requests (pure overhead) and under concurrency,
and recorded completions/s (counted in the store afterwards).

    .venv/bin/python bench/proxy_overhead.py --concurrency 200 --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proxima.proxy.serving import free_port  # noqa: E402
from proxima.proxy.testing.live import LiveProxy  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_model  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def stream_direct(http: httpx.AsyncClient, url: str, ids: list[int], n_tokens: int) -> float:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n_tokens, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    async with http.stream("POST", url + "/generate", json=body) as resp:
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                break
    return time.perf_counter() - t0


async def stream_proxy(
    http: httpx.AsyncClient, base: str, key: str, model: str, n_tokens: int
) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": n_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    async with http.stream(
        "POST", base + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"proxy answered {resp.status_code}: {await resp.aread()!r}")
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                break
    return time.perf_counter() - t0


async def run_load(fn, jobs: int, concurrency: int) -> tuple[list[float], float]:
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            latencies.append(await fn(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(jobs)))
    return latencies, time.perf_counter() - t0


async def main_async(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="proxima-bench-"))
    model = build_tiny_model(work / "tiny")
    port = free_port()
    backend = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxima.proxy.testing.fake_sglang",
            "--port",
            str(port),
            "--vocab-size",
            "250",
            "--chunk-tokens",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    backend_url = f"http://127.0.0.1:{port}"
    db = work / "store.db"
    proxy = LiveProxy(
        model,
        db_url=f"sqlite:///{db}",
        extra_args=["--backend", backend_url],
        log_path=work / "serve.log",
    )
    try:
        for _ in range(100):
            try:
                if httpx.get(backend_url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        proxy.start()
        limits = httpx.Limits(
            max_connections=args.concurrency + 10, max_keepalive_connections=args.concurrency + 10
        )
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            sessions = []
            for _ in range(args.sessions):
                r = await http.post(
                    proxy.url + "/rl/sessions", json={}, headers=proxy.admin_headers()
                )
                sessions.append(r.json()["api_key"])
            prompt_ids = list(range(20))
            direct = lambda i: stream_direct(http, backend_url, prompt_ids, args.tokens)  # noqa: E731

            def proxied(i):
                return stream_proxy(
                    http,
                    proxy.base_url,
                    sessions[i % len(sessions)],  # noqa: E731
                    proxy.model_name,
                    args.tokens,
                )

            # warm-up
            await run_load(direct, 20, 4)
            await run_load(proxied, 20, 4)
            rows_before = (
                sqlite3.connect(db).execute("select count(*) from completions").fetchone()[0]
            )

            seq_d, _ = await run_load(direct, args.sequential, 1)
            seq_p, _ = await run_load(proxied, args.sequential, 1)
            con_d, wall_d = await run_load(direct, args.requests, args.concurrency)
            con_p, wall_p = await run_load(proxied, args.requests, args.concurrency)
        rows = (
            sqlite3.connect(db).execute("select count(*) from completions").fetchone()[0]
            - rows_before
        )
    finally:
        proxy.stop()
        backend.terminate()

    print(
        f"\nproxy overhead: {args.tokens} streamed tokens per request, fake SGLang backend, "
        f"SQLite recording, {os.cpu_count()} cores"
    )
    print(
        f"{'load':<28}{'direct p50':>11}{'proxy p50':>11}{'added':>9}{'direct p95':>12}{'proxy p95':>11}{'added':>9}  (ms)"
    )
    for name, d, p in (
        ("sequential (1 at a time)", seq_d, seq_p),
        (f"{args.concurrency} concurrent streams", con_d, con_p),
    ):
        print(
            f"{name:<28}{pct(d, 0.5):>11.2f}{pct(p, 0.5):>11.2f}{pct(p, 0.5) - pct(d, 0.5):>9.2f}"
            f"{pct(d, 0.95):>12.2f}{pct(p, 0.95):>11.2f}{pct(p, 0.95) - pct(d, 0.95):>9.2f}"
        )
    print(
        f"throughput under load: direct {args.requests / wall_d:.0f} req/s, "
        f"proxy {args.requests / wall_p:.0f} req/s"
    )
    print(
        f"recorded completions: {rows} in the store, {rows / wall_p:.0f} recorded completions/s "
        f"(expected {args.sequential + args.requests})"
    )
    print(
        f"mean sequential latency: direct {statistics.mean(seq_d) * 1000:.2f} ms, "
        f"proxy {statistics.mean(seq_p) * 1000:.2f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--sequential", type=int, default=100)
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--tokens", type=int, default=16)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
