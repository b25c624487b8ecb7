"""``/admin/weights/group`` and the ``broadcast`` form of ``POST /admin/weights``: refusals.

The routes run in-process on the real pool and a real store in front of the fake SGLang
app (every path it is sent is recorded). What is checked here is what must never reach a
backend: a broadcast push that names no open group is a 409 ``weight_group_stale`` before
anything pauses, and bodies that cannot be a broadcast push are 400s naming the field. The
pushes themselves run end to end in ``tests/proxy/test_weight_broadcast_live.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from proxima.proxy.store import Store
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from starlette.types import Receive, Scope, Send

from tests.proxy.api.admin_app import admin_app

BACKEND = "http://sglang"
BUCKET = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}


class Recorder:
    """ASGI wrapper: remembers every path the backend is sent."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.paths: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


@pytest.fixture
async def setup(
    tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Recorder, Store]]:
    backend = Recorder(create_fake_app(FakeBackend()))
    async with admin_app(tmp_path, tiny_model_dir, backend, backend_url=BACKEND) as (client, store):
        yield client, backend, store


def _push(**broadcast: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "path": "/w/v1",
        "broadcast": {"group_name": "g", "buckets": [BUCKET], **broadcast},
    }


async def test_a_push_over_no_open_group_is_refused_before_anything_pauses(
    setup: tuple[httpx.AsyncClient, Recorder, Store],
) -> None:
    client, backend, store = setup
    answer = await client.post("/admin/weights", json=_push())
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["code"] == "weight_group_stale"
    assert "no weight-update group 'g'" in error["message"]
    assert backend.paths == []  # nothing paused, nothing relayed
    assert await store.list_policy_versions() == []
    assert (await client.delete("/admin/weights/group")).json() == {"closed": None}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**_push(), "adapter": "tenant-a"}, "broadcast"),
        (_push(buckets=[{**BUCKET, "dtypes": []}]), "broadcast"),
        (_push(buckets=[{**BUCKET, "shapes": [[2, 3]], "names": ["a", "b"]}]), "broadcast"),
        (_push(buckets=[{**BUCKET, "shapes": [[-1]]}]), "broadcast"),
        (_push(buckets=[]), "broadcast"),
        (_push(load_format="safetensors"), "broadcast"),
        (_push(timeout_s=0), "broadcast"),
    ],
)
async def test_bodies_that_cannot_be_a_broadcast_push_are_400s(
    setup: tuple[httpx.AsyncClient, Recorder, Store], body: dict[str, Any], param: str
) -> None:
    client, backend, _ = setup
    answer = await client.post("/admin/weights", json=body)
    assert answer.status_code == 400, answer.text
    assert (answer.json()["error"]["param"] or "").startswith(param), answer.text
    assert backend.paths == []


@pytest.mark.parametrize(
    "change",
    [
        {"backend": "mpi"},
        {"master_port": 0},
        {"world_size": 1},
        {"group_name": ""},
        {"master_address": "a\u0000b"},
        {"extra": 1},
    ],
)
async def test_a_group_request_that_cannot_form_a_group_is_a_400(
    setup: tuple[httpx.AsyncClient, Recorder, Store], change: dict[str, Any]
) -> None:
    client, backend, _ = setup
    body = {
        "group_name": "g",
        "master_address": "127.0.0.1",
        "master_port": 29500,
        "backend": "gloo",
        "world_size": 2,
        **change,
    }
    answer = await client.post("/admin/weights/group", json=body)
    assert answer.status_code == 400, answer.text
    assert backend.paths == []
