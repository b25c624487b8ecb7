"""Hops of one streamed turn: the calls that hand it on, from the route to the store.

The proxy runs in-process (``create_app`` with its lifespan, a SQLite store, the
fake SGLang server on loopback as its backend). After a warm-up turn, one
streamed turn per surface (Chat Completions, Responses, Messages) runs under
``sys.setprofile``, which records the stack of Proxima frames at each place the
turn reaches:

- ``translate``: the route down to the canonical messages (``chat.normalize_messages``);
- ``request``: the route down to the prompt's rendering (``ChatRenderer.build_prompt``);
- ``tokens``: the response body's iterator down to the backend's socket (``WirePool.post``);
- ``commit``: the driver's commit down to the hand-off to the store (``GroupCommit.commit``),
  on the shielded commit task (the driver's call that starts it counts as one hop);
- ``insert``: the group-commit task down to the row's insert, the queue between them
  counting as one hop.

A hop is one call from a Proxima frame to the next on those stacks (middleware
and the HTTP response's own frames left out). The script also lists what a
surface's turn called in another surface's folder (nothing, when no surface
goes through another's body).

    .venv/bin/python bench/turn_hops.py
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from proxima.proxy.app import create_app
from proxima.proxy.config import Settings
from proxima.proxy.serving import free_port
from proxima.proxy.store import ensure_schema
from proxima.proxy.testing.tiny_model import build_tiny_model

# Where a chain ends, and how many hops its start is from the turn's own frames.
ENDS = {
    "translate": ("proxima.proxy.rendering.chat_messages.normalize_messages", 0),
    "request": ("proxima.proxy.rendering.chat_template.ChatRenderer.build_prompt", 0),
    "tokens": ("proxima.proxy.backends.wire.WirePool.post", 0),
    "commit": ("proxima.proxy.store.group_commit.GroupCommit.commit", 1),
    "insert": ("proxima.proxy.store.completions.insert_completions_sqlite", 1),
}
# Frames that are not the turn's: middleware, the route class, the HTTP response.
OUTER = ("proxima.proxy.logs.", "proxima.proxy.metrics.", "proxima.proxy.api.middleware.")
OUTER += ("proxima.proxy.api.routing.", "proxima.proxy.api.event_stream.")
SURFACES = ("chat", "completions", "responses", "messages")


def _name(frame: FrameType) -> str:
    return f"{frame.f_globals.get('__name__', '')}.{frame.f_code.co_qualname}"


def _chain(frame: FrameType | None) -> list[str]:
    names = []
    while frame is not None:
        name = _name(frame)
        if name.startswith("proxima.") and not name.startswith(OUTER) and "<" not in name:
            names.append(name)
        frame = frame.f_back
    return names[::-1]


class Recorder:
    """The first stack at each chain's end, and the other surfaces' functions called."""

    def __init__(self, surface: str):
        self.surface = surface
        self.chains: dict[str, list[str]] = {}
        self.foreign: set[str] = set()
        self.ends = {end: kind for kind, (end, _) in ENDS.items()}

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = _name(frame)
        kind = self.ends.get(name)
        if kind is not None and kind not in self.chains:
            self.chains[kind] = _chain(frame)
        if name.startswith("proxima.proxy.surfaces."):
            folder = name.split(".")[3]
            if folder in SURFACES and folder != self.surface:
                self.foreign.add(name)


def _bodies(model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "chat": (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        ),
        "responses": ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 4}),
        "messages": (
            "/v1/messages",
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        ),
    }


async def _turns(model_dir: Path, backend: str, work: Path) -> dict[str, Recorder]:
    db = f"sqlite:///{work / 'store.db'}"
    await ensure_schema(db)
    settings = Settings(model=model_dir, db=db, backends=[backend], admin_token="bench-admin")
    app = create_app(settings)
    recorders = {}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            admin = {"Authorization": "Bearer bench-admin"}
            for surface, (path, body) in _bodies(settings.model_name).items():
                key = (await client.post("/rl/sessions", json={}, headers=admin)).json()
                auth = {"Authorization": f"Bearer {key['api_key']}"}
                warm = await client.post(path, json=body, headers=auth)
                assert warm.status_code == 200, warm.text
                recorder = recorders[surface] = Recorder(surface)
                sys.setprofile(recorder)
                threading.setprofile(recorder)
                try:
                    resp = await client.post(path, json={**body, "stream": True}, headers=auth)
                finally:
                    sys.setprofile(None)
                    threading.setprofile(None)  # type: ignore[arg-type]
                assert resp.status_code == 200, resp.text
    return recorders


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="turn-hops-"))
    model_dir = build_tiny_model(work / "tiny")
    port = free_port()
    fake = subprocess.Popen(
        [sys.executable, "-m", "proxima.proxy.testing.fake_sglang", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        recorders = asyncio.run(_turns(model_dir, f"http://127.0.0.1:{port}", work))
    finally:
        fake.kill()
    for surface, recorder in recorders.items():
        total = 0
        print(f"== {surface}: one streamed turn")
        for kind, (_, joined) in ENDS.items():
            chain = recorder.chains.get(kind, [])
            hops = max(len(chain) - 1, 0) + joined
            total += hops
            print(f"  {kind}: {hops} hops")
            for name in chain:
                print(f"      {name.removeprefix('proxima.proxy.')}")
        print(f"  total: {total} hops, route to store")
        foreign = sorted(recorder.foreign)
        print(f"  another surface's functions called: {len(foreign)} {foreign or ''}")


if __name__ == "__main__":
    main()
