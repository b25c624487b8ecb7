"""The trajectory inspector's page latencies on a store of 100k sessions.

Fills a SQLite store with ``--sessions`` sessions of ``--turns`` turns each (the synthetic
history of ``proxy/testing/inspector_store.py``, written straight into the tables), mounts the
``/ui`` router on an app with the real store and the tiny model's tokenizer, and times each
page through the ASGI interface (``--repeat`` times; the first call of each is a warm-up and
not counted). Prints the median and the slowest of each, in milliseconds::

    .venv/bin/python bench/inspector.py [--sessions 100000 --turns 3 --repeat 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from fastapi import FastAPI
from proxima.proxy.config import Settings
from proxima.proxy.inspector.auth import COOKIE, cookie_value
from proxima.proxy.inspector.routes import router
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.testing.app_state import install_test_state
from proxima.proxy.testing.inspector_store import fill_store
from proxima.proxy.testing.tiny_model import build_tiny_model
from pydantic import SecretStr

TOKEN = "bench-admin-token"


def pages(sessions: int) -> list[tuple[str, str]]:
    """(name, path) of every page measured; ids and times are the fill's."""
    middle = f"s{sessions // 2:08d}"
    return [
        ("list: newest 50", "/ui/sessions"),
        ("list: 200 a page", "/ui/sessions?limit=200"),
        ("list: deep keyset page", "/ui/sessions?after=2026-01-01T12:00:00%2B00:00~s00043200"),
        ("list: status=failed", "/ui/sessions?status=failed"),
        ("list: run + reward >= 1", "/ui/sessions?run=run1&reward_min=1"),
        ("list: group", "/ui/sessions?group=item1234@run0"),
        ("list: version 700", "/ui/sessions?version=700"),
        ("list: time window", "/ui/sessions?since=2026-01-01T10:00&until=2026-01-01T10:05"),
        ("list: by reward", "/ui/sessions?sort=reward"),
        ("list: adapter, oldest", "/ui/sessions?adapter=tenant-a&sort=old"),
        ("session page", f"/ui/sessions/{middle}"),
        ("run page: every session", "/ui/run"),
        ("run page: one run", "/ui/run?run=run1"),
    ]


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="inspector-bench-"))
    url = f"sqlite:///{work / 'store.db'}"
    await ensure_schema(url)
    store = await Store.open(url)
    started = time.perf_counter()
    filled = await fill_store(store.engine, args.sessions, turns=args.turns)
    print(
        f"filled {filled.sessions} sessions, {filled.completions} completions, "
        f"{filled.versions} versions in {time.perf_counter() - started:.1f} s ({url})"
    )
    model = build_tiny_model(work / "tiny-qwen2")
    app = FastAPI()
    app.include_router(router)
    install_test_state(
        app, settings=Settings(model=model, admin_token=SecretStr(TOKEN)), store=store
    )
    headers = {"cookie": f"{COOKIE}={cookie_value(TOKEN)}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://bench", headers=headers
    ) as client:
        print(f"{'page':28} {'median ms':>10} {'max ms':>8} {'bytes':>8}")
        for name, path in pages(args.sessions):
            times = []
            size = 0
            for k in range(args.repeat + 1):
                t0 = time.perf_counter()
                resp = await client.get(path)
                elapsed = (time.perf_counter() - t0) * 1000
                if resp.status_code != 200:
                    raise SystemExit(f"{path}: {resp.status_code} {resp.text[:300]}")
                size = len(resp.content)
                if k:
                    times.append(elapsed)
            print(f"{name:28} {statistics.median(times):10.1f} {max(times):8.1f} {size:8d}")
    await store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=20)
    asyncio.run(main(parser.parse_args()))
