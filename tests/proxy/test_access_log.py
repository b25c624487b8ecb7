"""The request log: one line per request, on a live proxy (uvicorn on 127.0.0.1, the real
app and its lifespan, a SQLite store, the fake SGLang server as its backend).

A bad request's 400 is in the log with its route, status and message; a generation's line
has its session, policy and tokens; a stream that fails after its 200 notes the error;
neither a key nor a prompt ever appears, in the JSON format or the text one.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxima.proxy.app import create_app
from proxima.proxy.config import Settings
from proxima.proxy.logs import JsonFormatter, TextFormatter
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.store import ensure_schema
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from pydantic import SecretStr

ADMIN = "admin-token-for-the-log-test"
PROMPT = "the secret prompt text zq7"
MAX_INPUT = 150  # the fake backend refuses longer prompts (inside the stream, as SGLang does)


@pytest.fixture
def proxy(tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    import asyncio

    db = f"sqlite:///{tmp_path / 'store.db'}"
    asyncio.run(ensure_schema(db))
    with ThreadedServer(
        create_fake_app(FakeBackend(max_input_tokens=MAX_INPUT, tokens_per_s=400))
    ) as backend:
        settings = Settings(
            model=tiny_model_dir,
            db=db,
            backends=[backend.url],
            admin_token=SecretStr(ADMIN),
            max_body_bytes=4096,
        )
        with ThreadedServer(create_app(settings)) as server:
            yield server.url


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "proxima.access"]


def _one(records: list[logging.LogRecord], **want: Any) -> logging.LogRecord:
    found = [r for r in records if all(getattr(r, k, None) == v for k, v in want.items())]
    assert len(found) == 1, (want, [r.__dict__ for r in records])
    return found[0]


def test_every_request_has_its_line_and_no_secret(
    proxy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxima.access")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=proxy, timeout=60) as http:
        opened = http.post("/rl/sessions", json={"group_id": "g"}, headers=admin).json()
        key, sid = opened["api_key"], opened["session_id"]
        auth = {"Authorization": f"Bearer {key}"}
        messages = [{"role": "user", "content": PROMPT}]
        ok = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-qwen2", "messages": messages, "max_tokens": 5},
            headers=auth,
        )
        assert ok.status_code == 200, ok.text
        bad = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-qwen2", "messages": messages, "temperature": "hot"},
            headers=auth,
        )
        assert bad.status_code == 400
        long = [{"role": "user", "content": PROMPT * 20}]
        streamed = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-qwen2", "messages": long, "stream": True, "max_tokens": 5},
            headers=auth,
        )
        assert streamed.status_code == 200 and '"error"' in streamed.text
        assert http.post(f"/rl/sessions/{sid}/reward", json={"reward": 1.0}).status_code == 401
        assert http.get("/no/such/route").status_code == 404
        big = http.post("/v1/messages", content=b"x" * 5000, headers=auth)
        assert big.status_code == 413
        assert http.get("/health").status_code == 200
        slow = {"model": "tiny-qwen2", "messages": messages, "max_tokens": 2000}
        with pytest.raises(httpx.ReadTimeout):  # the client leaves during a 5 s generation
            http.post("/v1/chat/completions", json=slow, headers=auth, timeout=0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not [r for r in _lines(caplog) if r.status == 499]:
        time.sleep(0.05)
    records = _lines(caplog)

    created = _one(records, route="/rl/sessions", status=200)
    assert (created.session_id, created.policy, created.method) == (sid, "base", "POST")
    served = _one(records, route="/v1/chat/completions", status=200, outcome=None)
    assert served.session_id == sid and served.policy == "base"
    assert served.prompt_tokens > 0 and served.output_tokens == 5
    assert served.deployment == "training" and served.version == 0
    assert served.latency_ms > 0 and len(served.request_id) == 32
    refused = _one(records, route="/v1/chat/completions", status=400)
    assert refused.error.startswith("Invalid value for 'temperature'"), refused.error
    failed = _one(records, route="/v1/chat/completions", status=200, outcome="error")
    assert str(MAX_INPUT) in failed.error and failed.session_id == sid
    unauthorized = _one(records, route="/rl/sessions/{session_id}/reward", status=401)
    assert unauthorized.session_id == sid and unauthorized.error
    missing = _one(records, route="/no/such/route", status=404)
    assert missing.error == "Not Found"
    too_big = _one(records, route="/v1/messages", status=413)
    assert too_big.error == "Request body of 5000 bytes exceeds the limit of 4096."
    left = _one(records, route="/v1/chat/completions", status=499)
    assert left.session_id == sid and left.outcome == "cancelled" and left.output_tokens == 0
    assert not [r for r in records if r.route == "/health"]  # probes: debug level
    assert len(records) == 8

    for formatter in (JsonFormatter(), TextFormatter()):
        text = "\n".join(formatter.format(r) for r in records)
        assert key not in text and ADMIN not in text and "zq7" not in text
    as_json = [json.loads(JsonFormatter().format(r)) for r in records]
    assert {"method", "route", "status", "latency_ms", "request_id"} <= set(as_json[2])
    line = TextFormatter().format(refused)
    assert "proxima.access: POST /v1/chat/completions 400 " in line and "status=" not in line
    assert f"session_id={sid} policy=base" in line
    assert "error=\"Invalid value for 'temperature'" in line


async def test_the_log_can_be_turned_off(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="proxima.access")
    for on in (True, False):
        app = create_app(Settings(model=tiny_model_dir, access_log=on))
        transport = httpx.ASGITransport(app=app)  # no lifespan: a 404 needs no state
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            assert (await client.get("/nowhere")).status_code == 404
        assert len(_lines(caplog)) == 1  # the first app's line only
