"""What finding a generation route costs per request: FastAPI's router vs ``GenerationDispatch``.

The proxy's app (``create_app``) is built once; its middleware stack is built twice, as
FastAPI builds it (ending in the router) and as ``GenerationApp`` builds it (ending in
``GenerationDispatch``, which takes a generation route's POST straight to its handler).
Each arm serves the same requests in-process, through the whole stack: the proxy's
middlewares, the route's handler (body, caller, validation) and the error handler. The
request is a chat completion whose body fails validation (``temperature`` not a number):
everything up to the service, and nothing that needs a backend or a store. Arms alternate
over ``--rounds`` rounds of ``--requests`` requests; the figure is CPU time per request
(the process's, in microseconds), the median of the rounds, with the ratio of the two.

    .venv/bin/python bench/proxy_dispatch.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT.parent))

from fastapi import FastAPI  # noqa: E402
from proxima.proxy.app import create_app  # noqa: E402
from proxima.proxy.config import Settings  # noqa: E402
from proxima.proxy.testing.app_state import NoKeys, install_test_state  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_model  # noqa: E402
from proxy_overhead import git_commit, host_line  # noqa: E402
from pydantic import SecretStr  # noqa: E402

ADMIN = "bench-admin-token"
BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}'
PATH = "/v1/chat/completions"


def _scope(app: Any) -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
        (b"authorization", f"Bearer {ADMIN}".encode()),
    ]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": PATH, "raw_path": PATH.encode(), "root_path": "",
        "query_string": b"", "headers": headers, "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000), "state": {}, "app": app,  # as Starlette sets it
    }  # fmt: skip


async def _serve(app: Any, stack: Any, n: int) -> tuple[float, int]:
    """CPU seconds per request for ``n`` requests through ``stack``; and the status seen."""
    status = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    started = time.process_time()
    for _ in range(n):
        await stack(_scope(app), receive, send)
    return (time.process_time() - started) / n, status


async def main_async(args: argparse.Namespace) -> None:
    logging.getLogger("proxima").setLevel(logging.WARNING)  # no request log line per 400
    run = {"host": host_line(), "commit": git_commit(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(run["host"])
    work = Path(tempfile.mkdtemp(prefix="proxima-dispatch-"))
    model = build_tiny_model(work / "tiny")
    settings = Settings(model=model, backends=["http://127.0.0.1:9"], admin_token=SecretStr(ADMIN))
    app = create_app(settings)
    install_test_state(app, settings=settings, store=NoKeys())
    arms = {
        "router": FastAPI.build_middleware_stack(app),  # as FastAPI builds it
        "dispatch": app.build_middleware_stack(),  # GenerationApp's
    }
    for stack in arms.values():  # warm-up: caches, first-call imports
        await _serve(app, stack, 200)
    figures: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, stack in arms.items():
            per_request, status = await _serve(app, stack, args.requests)
            if status != 400:
                raise RuntimeError(f"{name}: expected the validation error's 400, got {status}")
            figures[name].append(per_request * 1e6)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} us" for k, v in figures.items()))
    router, dispatch = (statistics.median(figures[k]) for k in ("router", "dispatch"))
    summary = (
        f"proxy dispatch: router {router:.1f} us, dispatch {dispatch:.1f} us CPU per request "
        f"({dispatch / router:.2f}x; {router - dispatch:.1f} us less)"
    )
    print(summary)
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            f.write(json.dumps({**run, "args": vars(args), "rounds": figures}) + "\n")
            f.write(json.dumps({"summary": summary}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=2000, help="requests per arm per round")
    p.add_argument("--jsonl", help="write every round's figures here")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
