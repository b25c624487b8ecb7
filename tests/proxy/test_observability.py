"""Metrics, request ids and structured logs."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.app import create_app
from proxima.proxy.config import Settings
from proxima.proxy.logs import JsonFormatter, request_id_var, session_id_var
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.store import ensure_schema
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from proxima.proxy.testing.live import LiveProxy
from pydantic import SecretStr


def test_metrics_and_request_ids(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session()
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    raw = client.chat.completions.with_raw_response.create(
        model=live_proxy.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert raw.headers["x-proxima-session-id"] == s["session_id"]
    assert len(raw.headers["x-request-id"]) == 32
    echoed = httpx.get(live_proxy.url + "/health", headers={"X-Request-Id": "trace-42"})
    assert echoed.headers["x-request-id"] == "trace-42"
    text = httpx.get(live_proxy.url + "/metrics").text
    assert 'proxima_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert "proxima_policy_version " in text
    assert 'proxima_tokens_total{direction="completion"}' in text
    assert 'proxima_completions_recorded_total{kind="chat"}' in text
    assert 'proxima_sessions{kind="train",status="open"}' in text
    assert "proxima_backend_healthy{" in text


def test_json_logs_carry_ids_and_never_keys() -> None:
    record = logging.LogRecord(
        "proxima.proxy.test",
        logging.WARNING,
        __file__,
        1,
        "auth with %s failed",
        ("sk-proxima-s-abcdefghijklmnop",),
        None,
    )
    record.backend = "http://127.0.0.1:1"
    t1, t2 = request_id_var.set("req-1"), session_id_var.set("sess-1")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(t1)
        session_id_var.reset(t2)
    assert line["request_id"] == "req-1" and line["session_id"] == "sess-1"
    assert line["msg"] == "auth with sk-*** failed"
    assert line["backend"] == "http://127.0.0.1:1" and line["level"] == "warning"


@pytest.mark.parametrize("on", [False, True])
def test_fastapi_opentelemetry_spans_only_when_asked(
    on: bool, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a global OpenTelemetry provider configured (as ``opentelemetry-instrument``
    does), FastAPI's native telemetry makes the proxy's spans only with
    ``--opentelemetry`` (off by default: then no request looks for a provider). The fake
    backend, a FastAPI app in the same process, makes its own spans either way."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The global provider, without setting it for the rest of the test process.
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    db = f"sqlite:///{tmp_path / 'store.db'}"
    asyncio.run(ensure_schema(db))
    admin = "admin-token-for-the-telemetry-test"
    with ThreadedServer(create_fake_app(FakeBackend())) as backend:
        settings = Settings(
            model=tiny_model_dir,
            db=db,
            backends=[backend.url],
            admin_token=SecretStr(admin),
            opentelemetry=on,
        )
        with ThreadedServer(create_app(settings)) as server:
            headers = {"Authorization": f"Bearer {admin}"}
            s = httpx.post(server.url + "/rl/sessions", json={}, headers=headers).json()
            client = OpenAI(base_url=server.url + "/v1", api_key=s["api_key"])
            client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
            )
    names = {span.name for span in exporter.get_finished_spans()}
    assert "POST /generate" in names, names  # the backend's: the provider is in use
    proxy = {"POST /rl/sessions", "GET /v1/models", "POST /v1/chat/completions"}
    assert (names & proxy) == (proxy if on else set()), names


def test_log_lines_go_to_stderr_as_it_is_when_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler follows ``sys.stderr``: a stream swapped in later gets the lines, and one
    closed since (an earlier test's capture) is never written to."""
    import io
    import sys

    from proxima.proxy.logs import configure_logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # restored after the test
    monkeypatch.setattr(root, "level", root.level)
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info")
    first.close()
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logging.getLogger("proxima.test").info("after the swap")
    assert json.loads(later.getvalue())["msg"] == "after the swap"
